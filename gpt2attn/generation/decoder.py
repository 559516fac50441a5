"""Decoder: the model stepping a batch of rows forward on one preallocated KV cache.

The cache is sized for the whole request up front; every forward writes its keys/values in
place, `rollback()` forgets rejected draft tokens and `reorder()` moves beams in place. With left
padding the attention mask and the position ids (as transformers derives them) go along.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..cache import KVCache
from ..decode_step import DecodeStep, unfused_reason


class Decoder:
    def __init__(self, model, rows: int, capacity: int, device, mask: Tensor | None = None,
                 token_type_ids: Tensor | None = None, past: KVCache | None = None, record: dict | None = None,
                 positions: Tensor | None = None):
        """record: {"attentions": [], "hidden_states": []} (either key) to collect, per forward,
        the per-layer attention weights / hidden states generate() returns. positions (N, T): the
        prompt's position ids, when the caller gives them (later tokens count on from the last)."""
        cfg = model.config
        self.model = model
        self.cache = KVCache.preallocate(cfg.n_layer, rows, cfg.n_head, capacity, cfg.n_embd // cfg.n_head, model.dtype, device)
        if past is not None:
            self.cache.load(past)
        self.token_type_ids = token_type_ids  # (N, T) for the uncached prompt; new tokens repeat its last column
        # shared[i, j]: how many leading cached positions rows i and j hold identically, because
        # reorder copied them from one row (beams share their history up to where they parted).
        # New tokens go after every shared position, so only a rollback lowers it.
        self.shared = torch.zeros(rows, rows, dtype=torch.long)
        # a quantized model takes one new token per row in a single call (see gpt2attn.decode_step)
        self.record = record or {}
        fused = token_type_ids is None and not self.record and unfused_reason(model) is None
        self.step = DecodeStep(model) if fused else None
        self.mask = self.positions = None
        if mask is not None and not bool(mask.all()):
            self.mask = torch.ones(rows, capacity, dtype=torch.long, device=device)  # (N, capacity)
            self.mask[:, : mask.size(1)] = mask
            self.positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # (N, T_mask), as transformers
        if positions is not None:
            self.positions = positions

    @property
    def length(self) -> int:
        return self.cache.length

    @torch.no_grad()
    def forward(self, ids: Tensor | None = None, embeds: Tensor | None = None, all_positions: bool = False) -> Tensor:
        """Run ids (N, k) (or embeds (N, k, C)) after the cache; float32 logits of the last
        position (N, V), or of every position (N, k, V) with all_positions."""
        k = (ids if ids is not None else embeds).size(1)
        plain = self.mask is None and self.positions is None
        if self.step is not None and ids is not None and plain and self.step.usable(ids, self.cache):
            logits = self.step(ids, self.cache)  # (N, V)
            return logits[:, None] if all_positions else logits
        kwargs = {}
        if self.mask is not None:
            kwargs["attention_mask"] = self.mask[:, : self.length + k]
        if self.positions is not None:
            kwargs["position_ids"] = self._positions(k)
        if self.token_type_ids is not None:
            if self.token_type_ids.size(1) == k:
                kwargs["token_type_ids"] = self.token_type_ids
                self.token_type_ids = self.token_type_ids[:, -1:]  # carried forward, as transformers does
            else:
                kwargs["token_type_ids"] = self.token_type_ids.expand(-1, k)
        hidden = self.model.transformer(ids, inputs_embeds=embeds, cache=self.cache, use_cache=True, return_dict=True,
                                        output_attentions="attentions" in self.record,
                                        output_hidden_states="hidden_states" in self.record, **kwargs)
        for key in self.record:
            self.record[key].append(getattr(hidden, key))  # per layer: (N, nh, k, T_k) / (N, k, C)
        h = hidden.last_hidden_state
        return self.model.lm_head(h if all_positions else h[:, -1]).float()  # (N, [k,] V)

    def _positions(self, k: int) -> Tensor:
        """Position ids (N, k) of the next k tokens: the prompt's from its mask, then counting on."""
        start, n_prompt = self.length, self.positions.size(1)
        if start < n_prompt:
            return self.positions[:, start : start + k]
        offsets = torch.arange(start - n_prompt + 1, start - n_prompt + 1 + k, device=self.positions.device)
        return self.positions[:, -1:] + offsets  # (N, k)

    def rollback(self, length: int) -> None:
        """Forget every cached token from `length` on (drafts the model rejected)."""
        self.cache.length = length
        self.shared.clamp_(max=length)  # positions from here on will be each row's own

    def reorder(self, rows: Tensor) -> None:
        """Row i continues from row rows[i] (beam search), in place. Of each row that changes,
        only the positions after the history it shares with its new source are copied."""
        rows = rows.cpu()
        self.shared.fill_diagonal_(self.length)
        self.cache.reorder(rows, start=self.shared[torch.arange(rows.numel()), rows].tolist())
        self.shared = self.shared[rows][:, rows]  # rows i, j now share what their sources shared
