"""What a forward call is given, checked, and the masks every layer uses, built from it.

The model files call these before the data path starts (gpt2attn.model, gpt2attn.heads): each
argument is refused with a message naming it, never an IndexError deep inside a layer. Checks that
need a value (.item(), .all()) run in eager mode only and step aside while torch.compile /
torch.export trace the forward, so that it traces as one graph.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .attention import causal_mask, is_registered
from .config import GPT2Config, is_int


# The keywords transformers' forward methods take through **kwargs (its TransformersKwargs) beyond
# the named ones: those meaning nothing for GPT-2 are accepted and ignored, as transformers' GPT-2
# ignores them; flash-attention's cumulative lengths of packed sequences are refused, not ignored
# (packed sequences are given by their position_ids instead: see packed_causal_mask), unless a
# registered attention function takes them.
IGNORED_KWARGS = {"num_items_in_batch", "output_router_logits", "is_causal"}
PACKED_KWARGS = {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"}


def check_forward_kwargs(kwargs: dict[str, Any], attn_implementation: str | None = None) -> dict[str, Any]:
    """What forward's **kwargs hand down to the attention layers: all of them when the model runs a
    function registered in transformers' AttentionInterface (its kernel may read any of them, as
    in transformers), none with gpt2attn's own "sdpa" and "eager", which refuse what they cannot
    honour, naming the keyword."""
    if is_registered(attn_implementation):
        return kwargs
    for key in kwargs:
        if key in PACKED_KWARGS:
            raise ValueError(f"{key}: flash-attention's packing keywords are not supported; give packed "
                             f"sequences by their position_ids (restarting at 0), or pad the batch")
        if key not in IGNORED_KWARGS:
            raise TypeError(f"forward() got an unexpected keyword argument {key!r}")
    return {}


def as_int_tensor(name: str, value: Any, device: torch.device) -> Tensor:
    """An integer tensor as int64 (embeddings and losses index with it); a list of lists of ints
    becomes one. Floating, bool and complex tensors are refused."""
    if isinstance(value, (list, tuple)):
        try:
            value = torch.tensor(value, device=device)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(f"{name}: a list must be rectangular, [[id, ...], ...] of ints ({e})") from None
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a tensor or a list of lists of ints, got {type(value).__name__}")
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {value.dtype}")
    return value.long()


def check_inputs(
    cfg: GPT2Config, input_ids: Any, inputs_embeds: Tensor | None, dtype: torch.dtype, device: torch.device
) -> tuple[Tensor | None, Tensor | None]:
    """Exactly one of input_ids (B, T) / inputs_embeds (B, T, C), checked; ids made int64."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids and inputs_embeds (got both or neither)")
    if input_ids is not None:
        input_ids = as_int_tensor("input_ids", input_ids, device)
        if input_ids.dim() != 2 or input_ids.size(1) == 0:
            raise ValueError(f"input_ids must be [batch, seq_len] with seq_len > 0, got shape {tuple(input_ids.shape)}")
        return check_ids("input_ids", input_ids, *input_ids.shape, cfg.vocab_size, device), None
    if not isinstance(inputs_embeds, Tensor):
        raise TypeError(f"inputs_embeds must be a tensor, got {type(inputs_embeds).__name__}")
    if inputs_embeds.dim() != 3 or inputs_embeds.size(-1) != cfg.n_embd or inputs_embeds.size(1) == 0:
        raise ValueError(
            f"inputs_embeds must be [batch, seq_len, n_embd={cfg.n_embd}], got shape {tuple(inputs_embeds.shape)}"
        )
    if inputs_embeds.dtype != dtype and not torch.is_autocast_enabled(inputs_embeds.device.type):
        raise ValueError(f"inputs_embeds have dtype {inputs_embeds.dtype}, the model's weights {dtype}: cast them")
    return None, inputs_embeds


def check_ids(name: str, ids: Any, B: int, T: int, limit: int, device: torch.device) -> Tensor:
    """ids: integers in [0, limit) shaped (B, T) or (1, T); returned as int64."""
    ids = as_int_tensor(name, ids, device)
    if ids.dim() != 2 or ids.size(1) != T or ids.size(0) not in (1, B):
        raise ValueError(f"{name} has shape {tuple(ids.shape)}, expected ({B}, {T})")
    if not torch.compiler.is_compiling():
        lo, hi = ids.min().item(), ids.max().item()
        if lo < 0 or hi >= limit:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{name} holds {bad}, outside [0, {limit})")
    return ids


def positions(position_ids: Any, B: int, T: int, past_len: int, n_positions: int, device: torch.device) -> Tensor:
    """The new tokens' positions: (1, T) counting on from the past_len cached ones when position_ids
    is None, else position_ids checked to be (B|1, T) in [0, n_positions)."""
    if position_ids is not None:
        return check_ids("position_ids", position_ids, B, T, n_positions, device)
    if past_len + T > n_positions:
        raise ValueError(
            f"sequence too long: {past_len} cached + {T} new = {past_len + T} positions, "
            f"but the model has n_positions={n_positions}"
        )
    return torch.arange(past_len, past_len + T, device=device).unsqueeze(0)  # (1, T)


def self_attention_mask(
    attention_mask: Tensor | None, B: int, T: int, past_len: int, n_head: int
) -> Tensor | None:
    """The mask every layer uses: None for plain causal attention, else (B, 1, T, T_k).

    A 2-D padding mask (1 = token, 0 = padding) over all T_k = past_len + T positions is
    combined with the causal mask into a bool mask; a query that may see no key at all (padding at
    the left edge) gets what transformers' backend of the same name gives it (see
    layers.Attention.forward). A 4-D mask (bool or additive) is used as it is, except that a query
    it lets see nothing (a row of False or -inf) sees every key instead, so its softmax stays
    finite on both attention paths; nothing real attends to it.
    """
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, Tensor):
        raise TypeError(f"attention_mask must be a tensor, got {type(attention_mask).__name__}")
    T_k = past_len + T
    if attention_mask.dim() == 2:
        if tuple(attention_mask.shape) != (B, T_k):
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)}, expected ({B}, {T_k}) "
                f"= (batch, cached {past_len} + new {T} positions)"
            )
        keep = attention_mask.bool()
        if not torch.compiler.is_compiling() and keep.all():
            return None
        return causal_mask(T, T_k, attention_mask.device) & keep[:, None, None, :]  # (B, 1, T, T_k)
    if attention_mask.dim() == 4:
        b, h, q, k = attention_mask.shape
        if b not in (1, B) or h not in (1, n_head) or q != T or k != T_k:
            raise ValueError(
                f"4-D attention_mask has shape {tuple(attention_mask.shape)}, expected "
                f"({B} or 1, 1 or {n_head}, {T}, {T_k})"
            )
        if attention_mask.dtype == torch.bool:
            return attention_mask | ~attention_mask.any(dim=-1, keepdim=True)
        if not attention_mask.dtype.is_floating_point:
            raise ValueError(
                f"4-D attention_mask must be bool (True = attend) or floating (added to the scores), "
                f"got {attention_mask.dtype}"
            )
        nothing_seen = (attention_mask == float("-inf")).all(dim=-1, keepdim=True)
        return attention_mask.masked_fill(nothing_seen, 0.0)
    raise ValueError(f"attention_mask must be 2-D [batch, seq] or 4-D, got shape {tuple(attention_mask.shape)}")


def layer_head_masks(head_mask: Tensor | None, n_layer: int, n_head: int, dtype: torch.dtype) -> Tensor | None:
    """[n_head] or [n_layer, n_head] multipliers -> (n_layer, 1, nh, 1, 1)."""
    if head_mask is None:
        return None
    if head_mask.dim() == 1 and head_mask.size(0) == n_head:
        head_mask = head_mask.expand(n_layer, n_head)
    if tuple(head_mask.shape) != (n_layer, n_head):
        raise ValueError(f"head_mask has shape {tuple(head_mask.shape)}, expected ({n_head},) or ({n_layer}, {n_head})")
    return head_mask.to(dtype)[:, None, :, None, None]


def encoder_attention(
    config: GPT2Config, encoder_hidden_states: Tensor | None, mask: Tensor | None, B: int
) -> Tensor | None:
    """Check the encoder's states (B, T_enc, n_embd) and return the mask cross-attention uses.

    A 2-D (B, T_enc) padding mask (1 = token, 0 = padding) becomes a bool (B, 1, 1, T_enc) (a row
    of padding alone: see Attention.forward); a 4-D one is used as it is; None lets every query see
    every encoder position.
    """
    if encoder_hidden_states is None:
        if mask is not None:
            raise ValueError("encoder_attention_mask was given without encoder_hidden_states")
        return None
    if not config.add_cross_attention:
        raise ValueError(
            "encoder_hidden_states need cross-attention layers: build the model with add_cross_attention=True"
        )
    shape = tuple(encoder_hidden_states.shape)
    if len(shape) != 3 or shape[0] != B or shape[2] != config.n_embd:
        raise ValueError(
            f"encoder_hidden_states have shape {shape}, expected ({B}, encoder positions, {config.n_embd})"
        )
    if mask is None or mask.dim() == 4:
        return mask
    if tuple(mask.shape) != shape[:2]:
        raise ValueError(
            f"encoder_attention_mask has shape {tuple(mask.shape)}, expected {shape[:2]} = "
            f"(batch, encoder positions) or a 4-D mask"
        )
    return mask.bool()[:, None, None, :]  # (B, 1, 1, T_enc)


def kept_positions(hidden: Tensor, logits_to_keep: int | Tensor) -> Tensor:
    """The hidden states (B, T, C) whose logits are wanted (see GPT2LMHeadModel.forward)."""
    if isinstance(logits_to_keep, Tensor):
        if logits_to_keep.dim() == 2 and logits_to_keep.dtype == torch.bool:
            return hidden[logits_to_keep]  # (K, C)
        if logits_to_keep.dim() == 2:
            return torch.take_along_dim(hidden, logits_to_keep[..., None], dim=1)  # (B, K, C)
        if logits_to_keep.dim() != 1:
            raise ValueError(f"logits_to_keep must be an int or a 1-D or 2-D tensor, got shape {tuple(logits_to_keep.shape)}")
        return hidden[:, logits_to_keep]  # (B, K, C)
    if not is_int(logits_to_keep) or logits_to_keep < 0:
        raise ValueError(f"logits_to_keep must be an int >= 0 or a tensor of positions, got {logits_to_keep!r}")
    return hidden[:, -logits_to_keep:] if logits_to_keep else hidden  # (B, N, C)
