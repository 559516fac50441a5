"""GPT2Model and GPT2LMHeadModel: ids -> embeddings -> blocks -> ln_f (-> lm_head).

State-dict keys and shapes equal `transformers`' GPT-2, so HF checkpoints load with
`load_state_dict` and the other way round.
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.graph import save_on_cpu
from torch.utils.checkpoint import checkpoint

from .attention import causal_mask, packed_causal_mask
from .cache import KVCache, as_cache, takes_past_key_values, write_back
from .config import GPT2Config, is_int
from .generation import GenerationMixin
from .layers import Block, LMHead, encoder_attention, init_weights
from .outputs import BaseModelOutput, CausalLMOutput
from .pretrained import GPT2PreTrainedModel


class GPT2Model(GPT2PreTrainedModel):
    def __init__(self, config: GPT2Config):
        super().__init__(config)
        if getattr(config, "pruned_heads", None):  # a transformers 4 key; its checkpoints have smaller shapes
            raise ValueError(f"pruned_heads={config.pruned_heads!r}: models with pruned attention heads are not supported")
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.drop = nn.Dropout(config.embd_pdrop)
        self.h = nn.ModuleList(Block(config, layer_idx=i) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        # see activation_checkpointing_enable; transformers 4's configs could switch it on
        self.gradient_checkpointing = bool(getattr(config, "gradient_checkpointing", False))
        self.gradient_checkpointing_kwargs = {"use_reentrant": False}
        self.checkpoint_every = 1
        self.checkpoint_offload = False
        init_weights(self, config)

    @takes_past_key_values
    def forward(
        self,
        input_ids: Tensor | list | None = None,
        cache: KVCache | tuple | None = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        head_mask: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        encoder_hidden_states: Tensor | None = None,
        encoder_attention_mask: Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> BaseModelOutput | tuple:
        """Arguments left at None take the config's value (use_cache, output_attentions,
        output_hidden_states, return_dict), as in transformers; return_dict=False gives the tuple.
        **kwargs: the extra keywords transformers' forward takes (see check_forward_kwargs)."""
        check_forward_kwargs(kwargs)
        cfg = self.config
        use_cache = cfg.use_cache if use_cache is None else use_cache
        output_attentions = cfg.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = cfg.output_hidden_states if output_hidden_states is None else output_hidden_states
        return_dict = cfg.return_dict if return_dict is None else return_dict
        if self.gradient_checkpointing and self.training and use_cache:
            warnings.warn("use_cache=True is incompatible with gradient checkpointing; setting use_cache=False")
            use_cache = False

        device = self.wte.weight.device
        input_ids, inputs_embeds = _check_inputs(cfg, input_ids, inputs_embeds, self.wte.weight.dtype, device)
        B, T = input_ids.shape if input_ids is not None else inputs_embeds.shape[:2]
        given, cache = cache, as_cache(cache, cfg, self.wte.weight.dtype)
        if cache is None and use_cache:
            cache = KVCache(cfg.n_layer)
        past_len = cache.length if cache is not None else 0
        if cache is not None and cache.batch_size not in (None, B):
            raise ValueError(f"past_key_values hold batch size {cache.batch_size}, input has batch size {B}")

        # Embeddings: tokens + positions (+ token types, which share wte as in HF).
        packed = None
        if position_ids is None:
            if past_len + T > cfg.n_positions:
                raise ValueError(
                    f"sequence too long: {past_len} cached + {T} new = {past_len + T} positions, "
                    f"but the model has n_positions={cfg.n_positions}"
                )
            position_ids = torch.arange(past_len, past_len + T, device=device).unsqueeze(0)  # (1, T)
        else:
            position_ids = _check_ids("position_ids", position_ids, B, T, cfg.n_positions, device)
            if attention_mask is None and cache is None:
                # Several sequences packed into a row (position ids restarting) attend each within its
                # own, as transformers' mask creation does without a padding mask or a cache.
                packed = packed_causal_mask(position_ids.expand(B, T))  # (B, 1, T, T) or None
        if inputs_embeds is None:
            inputs_embeds = self.wte(input_ids)  # (B, T, C)
        x = inputs_embeds + self.wpe(position_ids)
        if token_type_ids is not None:
            x = x + self.wte(_check_ids("token_type_ids", token_type_ids, B, T, cfg.vocab_size, device))
        x = self.drop(x)

        mask = packed if packed is not None else _build_mask(attention_mask, B, T, past_len, cfg.n_head)
        head_mask = _layer_head_masks(head_mask, cfg.n_layer, cfg.n_head, x.dtype)
        encoder_mask = encoder_attention(cfg, encoder_hidden_states, encoder_attention_mask, B)

        checkpointing = self.gradient_checkpointing and self.training
        if checkpointing and self.gradient_checkpointing_kwargs.get("use_reentrant") and not x.requires_grad:
            x.requires_grad_(True)  # reentrant checkpointing only backpropagates into blocks whose input needs grad
        all_hidden = [] if output_hidden_states else None
        all_weights = [] if output_attentions else None
        all_cross = [] if output_attentions else None
        for i, block in enumerate(self.h):
            if all_hidden is not None:
                all_hidden.append(x)
            layer_head_mask = head_mask[i] if head_mask is not None else None
            if checkpointing and i % self.checkpoint_every == 0:
                offload = self.checkpoint_offload  # what the block saves for backward goes to host memory
                with save_on_cpu(pin_memory=x.is_cuda, device_type=x.device.type) if offload else nullcontext():
                    x, weights, cross = checkpoint(block, x, None, mask, layer_head_mask, output_attentions,
                                                   encoder_hidden_states, encoder_mask, **self.gradient_checkpointing_kwargs)
            else:
                x, weights, cross = block(x, cache, mask, layer_head_mask, output_attentions,
                                          encoder_hidden_states, encoder_mask)
            if all_weights is not None:
                all_weights.append(weights)
                if cross is not None:
                    all_cross.append(cross)
        if cache is not None:
            cache.advance(T)
            cache = write_back(given, cache, past_len)  # a DynamicCache passed in grows, as in transformers
        x = self.ln_f(x)
        if all_hidden is not None:
            all_hidden.append(x)

        out = BaseModelOutput(
            last_hidden_state=x,
            cache=cache if use_cache else None,
            hidden_states=tuple(all_hidden) if all_hidden is not None else None,
            attentions=tuple(all_weights) if all_weights is not None else None,
            cross_attentions=tuple(all_cross) if all_cross is not None else None,  # () without encoder states
        )
        return out if return_dict else out.to_tuple()


class GPT2LMHeadModel(GPT2PreTrainedModel, GenerationMixin):
    def __init__(self, config: GPT2Config):
        super().__init__(config)
        self.transformer = GPT2Model(config)
        self.lm_head = LMHead(config.n_embd, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.tie_weights()
        else:
            init_weights(self.lm_head, config)

    accepts_loss_kwargs = True  # transformers' Trainer passes num_items_in_batch to forward
    output_modalities = ("text",)
    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}  # target: source, as transformers 5

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.lm_head = new_embeddings

    @takes_past_key_values
    def forward(
        self,
        input_ids: Tensor | list | None = None,
        cache: KVCache | tuple | None = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        head_mask: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        encoder_hidden_states: Tensor | None = None,
        encoder_attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        num_items_in_batch: int | Tensor | None = None,
        logits_to_keep: int | Tensor = 0,
        **kwargs: Any,
    ) -> CausalLMOutput | tuple:
        """logits_to_keep, as in transformers: an int N computes the logits of the last N positions
        only (0: all of them), a 1-D tensor those of the positions it lists, a 2-D one per row
        (integer: positions (B, K); bool (B, T): the True positions, flattened to (K, V)).
        shift_labels (B, T), a keyword: targets already aligned with the logits (position t's target at
        t), as sequence-parallel trainers pass them; the loss then uses them instead of shifting
        labels. (A keyword, not a parameter, as in transformers: Trainer takes every parameter whose
        name holds "label" for a label column the batch must carry.)"""
        shift_labels = kwargs.pop("shift_labels", None)
        check_forward_kwargs(kwargs)
        out = self.transformer(
            input_ids,
            cache=cache,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            head_mask=head_mask,
            inputs_embeds=inputs_embeds,
            encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=encoder_attention_mask,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
        )
        logits = self.lm_head(kept_positions(out.last_hidden_state, logits_to_keep))  # (B, T, vocab), T as kept
        loss = None
        if shift_labels is not None:
            loss = lm_loss(logits, shift_labels, self.config.vocab_size, num_items_in_batch, shifted=True)
        elif labels is not None:
            loss = lm_loss(logits, labels, self.config.vocab_size, num_items_in_batch)
        out = CausalLMOutput(loss, logits, out.cache, out.hidden_states, out.attentions, out.cross_attentions)
        return_dict = self.config.return_dict if return_dict is None else return_dict
        return out if return_dict else out.to_tuple()


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


# The keywords transformers' forward methods take through **kwargs (its TransformersKwargs) beyond
# the named ones: those meaning nothing for GPT-2 are accepted and ignored, as transformers' GPT-2
# ignores them; flash-attention's cumulative lengths of packed sequences are refused, not ignored
# (packed sequences are given by their position_ids instead: see packed_causal_mask).
IGNORED_KWARGS = {"num_items_in_batch", "output_router_logits", "is_causal"}
PACKED_KWARGS = {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx"}


def check_forward_kwargs(kwargs: dict[str, Any]) -> None:
    """Refuse what forward's **kwargs cannot honour, naming the keyword."""
    for key in kwargs:
        if key in PACKED_KWARGS:
            raise ValueError(f"{key}: flash-attention's packing keywords are not supported; give packed "
                             f"sequences by their position_ids (restarting at 0), or pad the batch")
        if key not in IGNORED_KWARGS:
            raise TypeError(f"forward() got an unexpected keyword argument {key!r}")


def lm_loss(logits: Tensor, labels: Tensor, vocab_size: int, num_items_in_batch: int | Tensor | None = None,
            shifted: bool = False) -> Tensor:
    """Next-token cross-entropy: position t predicts labels[t+1] (labels[t] when they come
    `shifted` already); label -100 is ignored.

    num_items_in_batch (transformers' Trainer passes it): divide the summed loss by this count
    instead of averaging, so gradient accumulation weighs every token alike, as transformers does."""
    labels = _as_int_tensor("labels", labels, logits.device)
    if labels.shape != logits.shape[:2]:
        raise ValueError(f"labels have shape {tuple(labels.shape)}, expected {tuple(logits.shape[:2])}")
    if not torch.compiler.is_compiling():
        bad = (labels != -100) & ((labels < 0) | (labels >= vocab_size))
        if bad.any():
            raise ValueError(f"labels hold {labels[bad][0].item()}: labels must be -100 or in [0, {vocab_size})")
    shift_logits = (logits if shifted else logits[:, :-1]).reshape(-1, logits.size(-1)).float()
    shift_labels = (labels if shifted else labels[:, 1:]).reshape(-1)
    if num_items_in_batch is None:
        return F.cross_entropy(shift_logits, shift_labels, ignore_index=-100)
    return F.cross_entropy(shift_logits, shift_labels, ignore_index=-100, reduction="sum") / num_items_in_batch


# --- input checks and masks ------------------------------------------------------------
# Checks that need a value (.item(), .all()) run in eager mode only and step aside while
# torch.compile / torch.export trace the forward, so that it traces as one graph.


def _as_int_tensor(name: str, value: Any, device: torch.device) -> Tensor:
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


def _check_inputs(
    cfg: GPT2Config, input_ids: Any, inputs_embeds: Tensor | None, dtype: torch.dtype, device: torch.device
) -> tuple[Tensor | None, Tensor | None]:
    """Exactly one of input_ids (B, T) / inputs_embeds (B, T, C), checked; ids made int64."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids and inputs_embeds (got both or neither)")
    if input_ids is not None:
        input_ids = _as_int_tensor("input_ids", input_ids, device)
        if input_ids.dim() != 2 or input_ids.size(1) == 0:
            raise ValueError(f"input_ids must be [batch, seq_len] with seq_len > 0, got shape {tuple(input_ids.shape)}")
        return _check_ids("input_ids", input_ids, *input_ids.shape, cfg.vocab_size, device), None
    if not isinstance(inputs_embeds, Tensor):
        raise TypeError(f"inputs_embeds must be a tensor, got {type(inputs_embeds).__name__}")
    if inputs_embeds.dim() != 3 or inputs_embeds.size(-1) != cfg.n_embd or inputs_embeds.size(1) == 0:
        raise ValueError(
            f"inputs_embeds must be [batch, seq_len, n_embd={cfg.n_embd}], got shape {tuple(inputs_embeds.shape)}"
        )
    if inputs_embeds.dtype != dtype and not torch.is_autocast_enabled(inputs_embeds.device.type):
        raise ValueError(f"inputs_embeds have dtype {inputs_embeds.dtype}, the model's weights {dtype}: cast them")
    return None, inputs_embeds


def _check_ids(name: str, ids: Any, B: int, T: int, limit: int, device: torch.device) -> Tensor:
    """ids: integers in [0, limit) shaped (B, T) or (1, T); returned as int64."""
    ids = _as_int_tensor(name, ids, device)
    if ids.dim() != 2 or ids.size(1) != T or ids.size(0) not in (1, B):
        raise ValueError(f"{name} has shape {tuple(ids.shape)}, expected ({B}, {T})")
    if not torch.compiler.is_compiling():
        lo, hi = ids.min().item(), ids.max().item()
        if lo < 0 or hi >= limit:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{name} holds {bad}, outside [0, {limit})")
    return ids


def _build_mask(
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


def _layer_head_masks(head_mask: Tensor | None, n_layer: int, n_head: int, dtype: torch.dtype) -> Tensor | None:
    """[n_head] or [n_layer, n_head] multipliers -> (n_layer, 1, nh, 1, 1)."""
    if head_mask is None:
        return None
    if head_mask.dim() == 1 and head_mask.size(0) == n_head:
        head_mask = head_mask.expand(n_layer, n_head)
    if tuple(head_mask.shape) != (n_layer, n_head):
        raise ValueError(f"head_mask has shape {tuple(head_mask.shape)}, expected ({n_head},) or ({n_layer}, {n_head})")
    return head_mask.to(dtype)[:, None, :, None, None]
