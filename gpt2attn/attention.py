"""Attention math in one place: the causal mask and softmax(q kᵀ · scale + mask) · v.

`scaled_dot_product_attention` is the textbook formula and returns the weights; `Attention`
(layers.py) calls it whenever weights are wanted or a config needs it, and otherwise calls
PyTorch's fused `F.scaled_dot_product_attention`, which computes the same numbers.

An `attn_implementation` other than gpt2attn's own two ("sdpa", "eager") names a function registered
in transformers' AttentionInterface, as TGI, vLLM and users plug in their own kernels:
`registered_attention` finds it (importing transformers only then).

Masks are either boolean (True = may attend) or additive floats (0 = attend, very negative =
don't), shaped to broadcast against the scores (B, nh, T_q, T_k).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


def causal_mask(q_len: int, k_len: int, device: torch.device | str | None = None) -> Tensor:
    """(q_len, k_len) bool, True where query i may see key j.

    Counted from the lower-right corner: with k_len - q_len cached keys in front, query i
    sits at absolute position (k_len - q_len) + i and sees every key up to and including it.
    """
    past = k_len - q_len
    q_pos = torch.arange(q_len, device=device).unsqueeze(1) + past
    k_pos = torch.arange(k_len, device=device).unsqueeze(0)
    return k_pos <= q_pos


def packed_causal_mask(position_ids: Tensor) -> Tensor | None:
    """(B, 1, T, T) bool for several sequences packed into each row, told apart by their position ids
    restarting: query i sees key j when j <= i and no restart lies between them. None when no row
    holds more than one sequence (the plain causal mask then).

    A new sequence starts wherever a position is not its predecessor + 1, as transformers'
    mask creation finds packed sequences: [[0, 1, 2, 0, 1, 5]] packs three, of 3, 2 and 1 tokens.
    """
    step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    sequence = (step != 1).cumsum(-1)  # (B, T): which packed sequence each token belongs to
    if not torch.compiler.is_compiling() and not sequence[:, -1].any():
        return None
    T = position_ids.size(1)
    same = sequence[:, :, None] == sequence[:, None, :]  # (B, T, T)
    return (same & causal_mask(T, T, position_ids.device))[:, None]  # (B, 1, T, T)


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    head_mask: Tensor | None = None,
    upcast: bool = False,
) -> tuple[Tensor, Tensor]:
    """softmax(q kᵀ · scale + mask) · v, returning (output, weights).

    q: (B, nh, T_q, hs); k, v: (B, nh, T_k, hs); mask: bool or additive, broadcastable to
    (B, nh, T_q, T_k). scale defaults to 1/sqrt(hs). head_mask multiplies the probabilities
    (after dropout), broadcastable to (B, nh, 1, 1). upcast computes scores and softmax in
    float32 with autocast off (HF's reorder_and_upcast_attn), weights cast back to v's dtype.
    Returns output (B, nh, T_q, hs) and weights (B, nh, T_q, T_k).
    """
    if scale is None:
        scale = q.size(-1) ** -0.5
    if upcast:
        with torch.autocast(q.device.type, enabled=False):
            scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale
    else:
        scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # (B, nh, T_q, T_k)
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    weights = F.softmax(scores, dim=-1).to(v.dtype)
    if dropout_p > 0.0:
        weights = F.dropout(weights, p=dropout_p)
    if head_mask is not None:
        weights = weights * head_mask
    return torch.matmul(weights, v), weights


def padding_mask(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """The mask the textbook formula uses for `allowed` (bool, True = may attend, (B, 1, T_q, T_k)).

    As it is when every query may see some key. Otherwise additive, as transformers' eager
    attention builds it: 0 where allowed, else dtype's lowest value, which swamps the scores so
    that a query seeing no key (left padding, an encoder row of padding alone) spreads equal
    weights over all keys, with transformers' gradient there too.
    """
    if not torch.compiler.is_compiling() and allowed.any(dim=-1).all():
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


BUILT_IN = ("sdpa", "eager")  # gpt2attn's own backends; any other name is looked up in transformers' registry


def is_registered(name: str | None) -> bool:
    """Whether attn_implementation `name` asks for a registered function rather than gpt2attn's own
    backends (None: not chosen yet, which means "sdpa")."""
    return name is not None and name not in BUILT_IN


def registered_attention(name: str) -> tuple[Callable, bool]:
    """The attention function transformers' AttentionInterface holds under `name`, and whether a mask
    function is registered for it too (transformers' AttentionMaskInterface).

    The function is called as transformers' layers call it, fn(module, query, key, value, mask,
    dropout=, scaling=, **kwargs) -> (output (B, T, nh, hs), weights or None). Without a mask
    function transformers hands it no mask (the kernel sees the packing or padding through its own
    keywords), and gpt2attn does the same. transformers' own GPU and hub backends (flash, flex, paged,
    "org/kernel") are refused: gpt2attn's layers do not implement their contracts.
    """
    if name.startswith(("flash_attention", "flex_attention", "paged")) or "/" in name:
        raise ValueError(f'Specified `attn_implementation="{name}"` is not supported: gpt2attn runs "sdpa" or '
                         f'"eager" attention, or a function registered in transformers\' AttentionInterface')
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        ALL_ATTENTION_FUNCTIONS = ALL_MASK_ATTENTION_FUNCTIONS = {}
    if name not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(f'Specified `attn_implementation="{name}"` is not supported: gpt2attn runs "sdpa" or '
                         f'"eager" attention, or a function registered under that name with '
                         f'transformers.AttentionInterface.register (none is)')
    return ALL_ATTENTION_FUNCTIONS[name], name in ALL_MASK_ATTENTION_FUNCTIONS
