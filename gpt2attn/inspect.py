"""Look inside a running model: record or edit any activation of chosen layers, by name.

Names are "h.{layer}.{what}", with `what` one of NAMES, in the order the block computes them:

    resid_pre     block input                                   (B, T, C)
    ln_1          ln_1 output                                   (B, T, C)
    attn.q/k/v    queries, keys, values per head                (B, nh, T, hs)
    attn.weights  softmax probabilities (query rows, key cols)  (B, nh, T, T_k)
    attn.heads    each head's output, before c_proj             (B, nh, T, hs)
    attn.out      attention output after c_proj                 (B, T, C)
    resid_mid     residual stream after attention               (B, T, C)
    ln_2          ln_2 output                                   (B, T, C)
    mlp.hidden    MLP hidden, after the activation              (B, T, inner)
    mlp.out       MLP output                                    (B, T, C)
    resid_post    block output                                  (B, T, C)

    with capture(model, layers=[0, 2], names=["weights", "q"]) as acts:
        model(ids)
    acts["h.0.attn.weights"]            # (B, nh, T, T)

    with edit(model, "h.1.attn.weights", zero_head(3)):   # ablate head 3 of layer 1
        logits = model(ids).logits

Only the chosen layers are touched; the others stay on the fused SDPA path, and a chosen layer
leaves it only when its attention weights are asked for. Everything is undone when the
`with` ends. Nested contexts chain: an inner one sees what the outer ones produced.

    explore(model, tokenizer, "To be, or not to be").save("page.html")   # every layer and head,
                                                                          # one page (gpt2attn/explore)
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager

from torch import Tensor, nn

from .explore import Page, explore  # noqa: F401 (gpt2attn.inspect.explore, as docs/attention.md shows)
from .layers import Block

NAMES = (
    "resid_pre", "ln_1", "attn.q", "attn.k", "attn.v", "attn.weights", "attn.heads", "attn.out",
    "resid_mid", "ln_2", "mlp.hidden", "mlp.out", "resid_post",
)
_FULL_NAME = re.compile(r"h\.(\d+)\.(.+)")


def capture(
    model: nn.Module, layers: Iterable[int] | None = None, names: Iterable[str] | None = None, detach: bool = True
):
    """Context manager yielding a dict that fills with "h.{L}.{name}" -> tensor on each forward.

    layers: block indices (default all); names: entries of NAMES or their unique short forms
    ("weights", "q", "hidden"; default all). A later forward overwrites earlier entries.
    detach=False keeps the autograd graph (e.g. for gradients with respect to an activation).
    """
    blocks = _blocks(model)
    layers = range(len(blocks)) if layers is None else [_check_layer(i, len(blocks)) for i in layers]
    names = NAMES if names is None else [_full_name(n) for n in names]
    acts: dict[str, Tensor] = {}

    def record(key: str, x: Tensor) -> Tensor:
        acts[key] = x.detach() if detach else x
        return x

    return _tapped(blocks, {(i, name): record for i in layers for name in names}, acts)


def edit(model: nn.Module, edits: str | dict[str, Callable], fn: Callable[[Tensor], Tensor] | None = None):
    """Context manager that replaces activations: `edit(model, "h.1.attn.weights", fn)` or
    `edit(model, {name: fn, ...})`. fn gets a copy of the activation and returns the tensor the
    model goes on with (same shape). Yields None.
    """
    if isinstance(edits, str):
        if fn is None:
            raise ValueError("edit(model, name, fn) needs fn, a function from tensor to tensor")
        edits = {edits: fn}
    blocks = _blocks(model)
    taps = {}
    for key, f in edits.items():
        match = _FULL_NAME.fullmatch(key)
        if match is None:
            raise ValueError(f"activation name {key!r} is not of the form 'h.<layer>.<name>', e.g. 'h.0.attn.weights'")
        layer, name = _check_layer(int(match[1]), len(blocks)), _full_name(match[2])
        taps[(layer, name)] = _replacer(f"h.{layer}.{name}", f)
    return _tapped(blocks, taps, None)


def run_with_cache(model: nn.Module, *args, layers=None, names=None, **kwargs):
    """model(*args, **kwargs) while capturing; returns (output, activations)."""
    with capture(model, layers, names) as acts:
        out = model(*args, **kwargs)
    return out, acts


def zero_head(head: int) -> Callable[[Tensor], Tensor]:
    """An edit that zeroes one head of a per-head activation (B, nh, ...), e.g. attn.weights."""

    def ablate(x: Tensor) -> Tensor:
        if not 0 <= head < x.size(1):
            raise ValueError(f"head {head} is out of range for {x.size(1)} heads")
        x[:, head] = 0
        return x

    return ablate


def patch(replacement: Tensor) -> Callable[[Tensor], Tensor]:
    """An edit that puts `replacement` in place of the activation (e.g. a residual from another run)."""

    def replace(x: Tensor) -> Tensor:
        if replacement.shape != x.shape:
            shapes = f"{tuple(replacement.shape)} does not fit an activation of shape {tuple(x.shape)}"
            raise ValueError(f"patch of shape {shapes}")
        return replacement.to(x.device, x.dtype)

    return replace


def _replacer(key: str, fn: Callable[[Tensor], Tensor]) -> Callable[[str, Tensor], Tensor]:
    def replace(_: str, x: Tensor) -> Tensor:
        out = fn(x.clone())  # a copy: fn may edit in place, and a new tensor tells Attention it changed
        if not isinstance(out, Tensor) or out.shape != x.shape:
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(f"the edit of {key} must return a tensor of shape {tuple(x.shape)}, got {got}")
        return out

    return replace


@contextmanager
def _tapped(blocks: nn.ModuleList, taps: dict[tuple[int, str], Callable], result) -> Iterator:
    """Install taps {(layer, full name): fn(key, x) -> x} and remove them on exit."""
    per_module: dict[tuple[int, str], dict[str, Callable]] = {}
    for (layer, name), fn in taps.items():
        owner, _, short = name.rpartition(".")  # "attn.q" -> ("attn", "q"); "ln_1" -> ("", "ln_1")
        per_module.setdefault((layer, owner), {})[short] = fn
    with ExitStack() as undo:
        for (layer, owner), mine in per_module.items():
            module = getattr(blocks[layer], owner) if owner else blocks[layer]
            prefix = f"h.{layer}.{owner}." if owner else f"h.{layer}."
            if not hasattr(module, "tap"):
                raise ValueError(f"{prefix[:-1]} is a {type(module).__name__}, which has no {', '.join(mine)} to tap")
            undo.enter_context(_swap(module, "tap", _chain(module.tap, mine, prefix)))
            if owner == "attn" and "weights" in mine:
                undo.enter_context(_swap(module, "textbook", True))
        yield result


def _chain(inner: Callable, mine: dict[str, Callable], prefix: str) -> Callable[[str, Tensor], Tensor]:
    def tap(name: str, x: Tensor) -> Tensor:
        x = inner(name, x)
        fn = mine.get(name)
        return x if fn is None else fn(prefix + name, x)

    return tap


@contextmanager
def _swap(obj, attr: str, value):
    old = getattr(obj, attr)
    setattr(obj, attr, value)
    try:
        yield
    finally:
        setattr(obj, attr, old)


def _blocks(model: nn.Module) -> nn.ModuleList:
    blocks = getattr(getattr(model, "base_model", model), "h", None)
    if not isinstance(blocks, nn.ModuleList) or not all(isinstance(b, Block) for b in blocks):
        raise ValueError(f"{type(model).__name__} is not a gpt2attn GPT2Model or GPT2LMHeadModel")
    return blocks


def _check_layer(layer: int, n_layer: int) -> int:
    if not 0 <= layer < n_layer:
        raise ValueError(f"layer {layer} is out of range: the model has {n_layer} layers (0..{n_layer - 1})")
    return layer


def _full_name(name: str) -> str:
    """'weights' -> 'attn.weights'; full names pass; unknown or ambiguous names raise."""
    if name in NAMES:
        return name
    matches = [full for full in NAMES if full.endswith("." + name)]
    if len(matches) != 1:
        why = f"ambiguous ({' or '.join(matches)})" if matches else "unknown"
        raise ValueError(f"activation name {name!r} is {why}; choose from {', '.join(NAMES)}")
    return matches[0]
