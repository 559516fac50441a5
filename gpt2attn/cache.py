"""KV cache: every layer's keys and values, (B, nh, T, hs), in buffers written in place.

A cache filled by one forward pass is passed back as `cache` (transformers < 5.24:
`past_key_values`, which every forward still takes) to continue the
sequence. `generate()` preallocates the whole length up front, so decoding writes each new
token's keys/values into place and never concatenates. A cache made by a forward pass with no
room reserved grows by doubling. `cache[i]` is layer i's `(key, value)` as HF's legacy tuples.

With cross-attention the cache also holds each layer's keys and values over the encoder's
states (`cross_keys`, `cross_values`): computed by the first pass, reused by the later ones.

`as_cache` turns what a caller passes as the cache (ours, HF's legacy tuples, a
DynamicCache) into a KVCache checked against the model's shapes; the forward pass and
generate() both use it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree
from torch import Tensor

if TYPE_CHECKING:  # for the annotation only: at run time cache.py imports nothing of gpt2attn
    from .config import GPT2Config


class KVCache:
    def __init__(self, n_layer: int):
        self.keys: list[Tensor | None] = [None] * n_layer
        self.values: list[Tensor | None] = [None] * n_layer
        self.length = 0  # tokens cached; every layer holds this many
        self.cross_keys: list[Tensor | None] = [None] * n_layer  # (B, nh, T_enc, hs), cross-attention
        self.cross_values: list[Tensor | None] = [None] * n_layer
        # A preallocated cache keeps every layer's keys and values in one tensor,
        # (n_layer, 2, B, nh, capacity, hs), which keys[i] / values[i] view: reorder then moves a
        # row of all layers with one copy.
        self.block: Tensor | None = None

    @classmethod
    def preallocate(
        cls,
        n_layer: int,
        batch_size: int,
        n_head: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> "KVCache":
        """Room for max_len tokens per layer, so no update ever reallocates."""
        cache = cls(n_layer)
        cache.block = torch.zeros(n_layer, 2, batch_size, n_head, max_len, head_dim, dtype=dtype, device=device)
        for i in range(n_layer):
            cache.keys[i], cache.values[i] = cache.block[i, 0], cache.block[i, 1]  # (B, nh, max_len, hs) views
        return cache

    @classmethod
    def from_legacy(cls, past: Sequence[Sequence[Tensor]]) -> "KVCache":
        """From HF's tuple of per-layer (key, value) pairs. The tensors are used, never written."""
        cache = cls(len(past))
        for i, pair in enumerate(past):
            if len(pair) != 2:
                raise ValueError(f"past_key_values[{i}] must be a (key, value) pair, got {len(pair)} items")
            key, value = pair
            if key.dim() != 4 or key.shape != value.shape:
                raise ValueError(
                    f"past_key_values[{i}]: key and value must both be [B, n_head, T_past, head_dim], "
                    f"got {tuple(key.shape)} and {tuple(value.shape)}"
                )
            cache.keys[i], cache.values[i] = key, value
        lengths = [k.shape[2] for k in cache.keys]  # a list, not a set: symbolic sizes under export do not hash
        if any(n != lengths[0] for n in lengths):
            raise ValueError(f"past_key_values layers disagree on the cached length: {sorted(set(lengths))}")
        cache.length = lengths[0]
        return cache

    def update(self, layer: int, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Write (B, nh, T, hs) new keys/values after the cached ones; return all of them.

        The model calls `advance(T)` once every layer has written its T tokens.
        """
        start, end = self.length, self.length + key.size(2)
        buf_k, buf_v = self.keys[layer], self.values[layer]
        if buf_k is None and start == 0:
            # First write into an empty cache: keep the tensors themselves, copy nothing.
            self.keys[layer], self.values[layer] = key, value
            return key, value
        if buf_k is None:
            raise ValueError(f"cache layer {layer} is empty but the cache holds {start} tokens")
        if end > buf_k.size(2):
            buf_k, buf_v = self._grow(buf_k, end), self._grow(buf_v, end)
            self.keys[layer], self.values[layer] = buf_k, buf_v
            self.block = None  # this layer has left it
        buf_k[:, :, start:end] = key
        buf_v[:, :, start:end] = value
        return buf_k[:, :, :end], buf_v[:, :, :end]

    def set_cross(self, layer: int, key: Tensor, value: Tensor) -> None:
        """Keep a layer's cross-attention keys/values (B, nh, T_enc, hs) for the steps to come."""
        self.cross_keys[layer], self.cross_values[layer] = key, value

    def load(self, past: "KVCache") -> None:
        """Copy past's tokens into this (preallocated, empty) cache; past's rows may repeat here
        (beams): this cache's batch must be a multiple of past's."""
        rows = self.keys[0].size(0) // past.batch_size
        for i, (k, v) in enumerate(past):
            self.keys[i][:, :, : past.length] = k.repeat_interleave(rows, dim=0)
            self.values[i][:, :, : past.length] = v.repeat_interleave(rows, dim=0)
        self.length = past.length

    def reorder(self, rows: Tensor, start: Sequence[int] | None = None) -> None:
        """Row i takes the cached tokens of row rows[i] (beam search), in place in the same
        buffers. Only the rows that change are written, each copied once, straight from its
        source: a row is overwritten only after every row that reads it has been written.
        start[i], when given, says row i already holds its source's tokens before that position
        (beams that share their history up to where they parted): only the rest is copied."""
        pending = {dst: src for dst, src in enumerate(rows.tolist()) if dst != src}
        first = [0] * len(rows) if start is None else list(start)
        plan = []  # (dst, src, first position to copy) in an order that never overwrites a row still to be read
        while pending:
            free = [dst for dst in pending if dst not in pending.values()]
            if not free:  # a cycle (beams swapping places): gather the rest through a copy
                break
            for dst in free:
                plan.append((dst, pending.pop(dst), first[dst]))
        if pending:
            device = self.keys[0].device
            cycle_dst = torch.tensor(list(pending), device=device)
            cycle_src = torch.tensor(list(pending.values()), device=device)
            cycle_from = min(first[dst] for dst in pending)
        # The rows' dimension: 2 of the block, 0 of a layer's keys or values; positions are dim -2 in both.
        buffers, dim = ([self.block], 2) if self.block is not None else ([*self.keys, *self.values], 0)
        for buf in buffers:
            used = buf.narrow(-2, 0, self.length)
            for dst, src, begin in plan:
                used.select(dim, dst)[..., begin:, :].copy_(used.select(dim, src)[..., begin:, :])
            if pending:
                tail = used[..., cycle_from:, :]
                tail.index_copy_(dim, cycle_dst, tail.index_select(dim, cycle_src))

    def _grow(self, buf: Tensor, needed: int) -> Tensor:
        B, nh, capacity, hs = buf.shape
        # Doubling leaves room for the next tokens; a traced graph (export, compile) runs one step and
        # gets exactly what it needs, as max() over symbolic sizes would pin them.
        size = needed if torch.compiler.is_compiling() else max(needed, 2 * capacity)
        bigger = buf.new_empty(B, nh, size, hs)
        bigger[:, :, : self.length] = buf[:, :, : self.length]
        return bigger

    def advance(self, n_tokens: int) -> None:
        self.length += n_tokens

    def reset(self) -> None:
        """Empty the cache for a new request; its buffers stay, to be written over."""
        self.length = 0
        self.cross_keys = [None] * len(self)
        self.cross_values = [None] * len(self)

    def get_seq_length(self) -> int:
        return self.length

    @property
    def batch_size(self) -> int | None:
        return None if self.keys[0] is None else self.keys[0].size(0)

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, layer: int) -> tuple[Tensor, Tensor]:
        """Layer's (key, value), each (B, nh, length, hs)."""
        k, v = self.keys[layer], self.values[layer]
        if k is None:
            raise IndexError(f"cache layer {layer} holds nothing yet")
        return k[:, :, : self.length], v[:, :, : self.length]

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor]]:
        return (self[i] for i in range(len(self)))

    def to_legacy(self) -> tuple[tuple[Tensor, Tensor], ...]:
        return tuple(self)


def cached_length(past: Any) -> int:
    """Tokens held by past_key_values of any accepted kind (0 for None or an empty cache)."""
    if past is None:
        return 0
    if isinstance(past, KVCache) or hasattr(past, "get_seq_length"):
        return past.get_seq_length()
    return past[0][0].size(2) if len(past) > 0 else 0


def as_cache(past: Any, cfg: GPT2Config, dtype: torch.dtype) -> KVCache | None:
    """None, our KVCache, HF's legacy tuple of (key, value) pairs, or an HF DynamicCache; its
    layers, heads, head size and dtype must be the model's."""
    if past is None or isinstance(past, KVCache):
        cache = past
    elif isinstance(past, (tuple, list)):
        cache = KVCache.from_legacy(past) if len(past) > 0 else None
    elif hasattr(past, "layers"):  # transformers' DynamicCache; an empty one (no layers yet, or
        # layers not yet written, with config=) starts a loop, as no cache does
        written = [layer for layer in past.layers if getattr(layer, "keys", None) is not None]
        if written and len(written) != len(past.layers):
            raise ValueError(f"past_key_values: the DynamicCache holds keys in {len(written)} of its "
                             f"{len(past.layers)} layers")
        cache = KVCache.from_legacy([(layer.keys, layer.values) for layer in past.layers]) if written else None
    else:
        raise ValueError(
            f"past_key_values must be a KVCache, a tuple of (key, value) pairs or a transformers "
            f"DynamicCache, got {type(past).__name__}"
        )
    if cache is None:
        return None
    if len(cache) != cfg.n_layer:
        raise ValueError(f"past_key_values have {len(cache)} layers, the model has {cfg.n_layer}")
    key = next((k for k in cache.keys if k is not None), None)  # (B, nh, T, hs)
    if key is not None:
        if key.size(1) != cfg.n_head or key.size(3) != cfg.n_embd // cfg.n_head:
            raise ValueError(
                f"past_key_values hold {key.size(1)} heads of size {key.size(3)}, "
                f"the model has n_head={cfg.n_head} of size {cfg.n_embd // cfg.n_head}"
            )
        if key.dtype != dtype and not torch.is_autocast_enabled(key.device.type):
            raise ValueError(f"past_key_values have dtype {key.dtype}, the model's weights {dtype}")
    return cache


def write_back(given: Any, cache: KVCache, start: int) -> Any:
    """Extend a transformers DynamicCache that was passed in with what `cache` holds past `start`
    (the tokens this forward pass added), as transformers' models extend theirs in place; returns it.
    Anything else that was passed in (ours, legacy tuples, None) is left alone and `cache` returned."""
    if given is None or isinstance(given, (KVCache, tuple, list)):
        return cache
    for i, (key, value) in enumerate(zip(cache.keys, cache.values)):
        given.update(key[:, :, start : cache.length], value[:, :, start : cache.length], i)
    return given


# A pytree node, so torch.compile / torch.export see the tensors inside a cache.
def _flatten_cache(cache: KVCache) -> tuple[list[Tensor | None], tuple[int, bool]]:
    cross = any(k is not None for k in cache.cross_keys)  # cross-attention's keys/values, when held
    tensors = [*cache.keys, *cache.values] + ([*cache.cross_keys, *cache.cross_values] if cross else [])
    return tensors, (cache.length, cross)


def _unflatten_cache(tensors: list[Tensor | None], context: tuple[int, bool]) -> KVCache:
    length, cross = context
    n_layer = len(tensors) // (4 if cross else 2)
    cache = KVCache(n_layer)
    cache.keys, cache.values = list(tensors[:n_layer]), list(tensors[n_layer : 2 * n_layer])
    if cross:
        cache.cross_keys, cache.cross_values = list(tensors[2 * n_layer : 3 * n_layer]), list(tensors[3 * n_layer :])
    cache.length = length
    return cache


pytree.register_pytree_node(KVCache, _flatten_cache, _unflatten_cache, serialized_type_name="gpt2attn.cache.KVCache")


def takes_past_key_values(method: Callable) -> Callable:
    """Let `method(..., cache=...)` also be called as `method(..., past_key_values=...)`.

    transformers 5.24 renamed its models' cache argument and output field from `past_key_values`
    to `cache`; code written for either spelling runs on ours.
    """

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, past_key_values: Any = None, **kwargs: Any) -> Any:
        if past_key_values is not None:
            if kwargs.get("cache") is not None:
                raise ValueError("pass the cache once, as cache= (or its old name past_key_values=), not both")
            kwargs["cache"] = past_key_values
        return method(self, *args, **kwargs)

    return wrapper
