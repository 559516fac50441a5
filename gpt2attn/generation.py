"""Autoregressive decoding for GPT2LMHeadModel, in the manner of gpt-fast.

The KV cache is preallocated for prompt + new tokens and written in place; the prompt goes
through in one forward pass; each step computes logits for the last position only. Left-padded
batches take an attention_mask, from which position ids are derived as transformers does.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from .cache import KVCache

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "default_model"


def generate(
    model,
    input_ids: Tensor,
    max_new_tokens: int = 20,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float | None = None,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    attention_mask: Tensor | None = None,
    generator: torch.Generator | None = None,
    seed: int | None = None,
    stream: bool = False,
) -> Tensor | Iterator[Tensor]:
    """Continue input_ids [B, T]; return [B, T + new] (fewer new if every row hit eos).

    With stream=True, return an iterator yielding each step's tokens [B] as they are produced.
    """
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
    _check_request(model.config, input_ids, max_new_tokens, temperature, top_k, top_p, repetition_penalty, attention_mask)
    if seed is not None:
        generator = torch.Generator(device=input_ids.device).manual_seed(seed)
    if pad_token_id is None:
        pad_token_id = eos_token_id if eos_token_id is not None else 0
    sample = dict(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
    B, T = input_ids.shape
    out = input_ids.new_full((B, T + max_new_tokens), pad_token_id)  # prompt + every new token
    out[:, :T] = input_ids
    steps = _decode(model, out, T, attention_mask, sample, repetition_penalty, eos_token_id, pad_token_id)
    if stream:
        return steps
    n_new = sum(1 for _ in steps)
    return out[:, : T + n_new]


@torch.no_grad()
def _decode(model, out, T, attention_mask, sample, repetition_penalty, eos_token_id, pad_token_id) -> Iterator[Tensor]:
    """Fill out[:, T:] one position at a time, yielding each step's tokens (B,)."""
    cfg = model.config
    B, total = out.shape
    device = out.device
    cache = KVCache.preallocate(cfg.n_layer, B, cfg.n_head, total, cfg.n_embd // cfg.n_head, model.dtype, device)
    padded = attention_mask is not None and not bool(attention_mask.all())
    if padded:
        mask = torch.ones(B, total, dtype=torch.long, device=device)  # (B, T + new)
        mask[:, :T] = attention_mask
        positions = (mask[:, :T].cumsum(-1) - 1).masked_fill(mask[:, :T] == 0, 1)  # (B, T), as transformers
    unfinished = torch.ones(B, dtype=torch.bool, device=device)

    ids = out[:, :T]
    for t in range(T, total):
        kwargs = dict(attention_mask=mask[:, :t], position_ids=positions) if padded else {}
        hidden = model.transformer(ids, past_key_values=cache, use_cache=True, **kwargs).last_hidden_state
        logits = model.lm_head(hidden[:, -1])  # (B, V): the last position only
        if repetition_penalty is not None:
            logits = _penalize_repeats(logits, out[:, :t], repetition_penalty)
        tokens = _choose(logits, **sample)  # (B,)
        if eos_token_id is not None:
            tokens = tokens.masked_fill(~unfinished, pad_token_id)
            unfinished &= tokens != eos_token_id
        out[:, t] = tokens
        yield tokens
        if eos_token_id is not None and not unfinished.any():
            return
        ids = out[:, t : t + 1]
        if padded:
            positions = positions[:, -1:] + 1  # (B, 1)


def _penalize_repeats(logits: Tensor, seen: Tensor, penalty: float) -> Tensor:
    """CTRL's penalty: logits of tokens already in the sequence divided by penalty (times if < 0)."""
    scores = logits.gather(1, seen)
    scores = torch.where(scores < 0, scores * penalty, scores / penalty)
    return logits.scatter(1, seen, scores)


def _choose(logits: Tensor, do_sample: bool, temperature: float, top_k, top_p, generator) -> Tensor:
    """The next token of every row: argmax, or a sample from the filtered, tempered softmax."""
    if not do_sample:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # probability of the better tokens
        drop = mass_before > top_p  # the first token is always kept
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def _check_request(cfg, input_ids, max_new_tokens, temperature, top_k, top_p, repetition_penalty, attention_mask):
    if input_ids.dim() != 2 or input_ids.size(1) == 0 or input_ids.dtype not in (torch.long, torch.int32, torch.int64):
        raise ValueError(f"input_ids must be a non-empty integer tensor [B, T], got {input_ids.dtype} {tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    total = input_ids.size(1) + max_new_tokens
    if total > cfg.n_positions:
        raise ValueError(
            f"prompt of {input_ids.size(1)} tokens + max_new_tokens={max_new_tokens} = {total} positions, "
            f"but the model has n_positions={cfg.n_positions}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if repetition_penalty is not None and repetition_penalty <= 0:
        raise ValueError(f"repetition_penalty must be > 0, got {repetition_penalty}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {tuple(input_ids.shape)}")
