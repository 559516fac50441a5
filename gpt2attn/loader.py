"""from_pretrained: a model class built around the weights of any source gpt2attn reads.

A source is a state dict (or a nanoGPT checkpoint dict), a local file or folder, or a hub name
(gpt2attn/hub.py). formats/ detects the format and reads a config and an HF-keyed state dict; here
the model is built on the meta device and the checked tensors are assigned into it, so weights are
materialised once (memory-mapped files stay mapped until a dtype or device change copies them;
a reader's read_later tensors are made as they are assigned). With quantize=, the matrices
quantize() packs are left out, and each is read (or widened, or dequantized) only as it is packed:
the fp32 model is never whole in memory. The class is given by the caller (model.py), so this
module never imports the models.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from copy import deepcopy
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from .config import GPT2Config
from .errors import CheckpointError, ShapeMismatchError, shorten
from .formats import detect_format, weights_file
from .formats.nanogpt import from_nanogpt
from .formats.state_dict import (BODY_PREFIXES, check_state_dict, infer_config, layer_indices, layer_of, materialize,
                                 normalize_keys, resolve_dtype)
from .generation.config import load_generation_config
from .hub import resolve
from .layers import init_weights
from .memory import release_file_pages
from .quantize import checked_mode, packed_layers
from .quantize import quantize as quantize_model


def from_pretrained(
    cls: type,
    src: Any,
    dtype: Any = None,
    device: Any = None,
    config: Any = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool = False,
    torch_dtype: Any = None,
    state_dict: dict[str, Tensor] | None = None,
    attn_implementation: str | None = None,
    output_loading_info: bool = False,
    ignore_mismatched_sizes: bool = False,
    quantize: str | None = None,
    **config_kwargs: Any,
):
    """Build `cls` (GPT2Model, GPT2LMHeadModel or a head) with the weights of `src`, in eval mode.

    dtype: None (as stored), a torch dtype, a name ('bf16', 'float16', ...) or 'auto' (the
    config's dtype). device: where the weights go. Both apply while loading. Other keywords
    override config fields, as in transformers (`num_labels=3`, `pad_token_id=50256`).
    src None with state_dict= (and config=) loads that state dict, as transformers does.

    Loading is strict: weights the model lacks, extra weights or wrong shapes raise CheckpointError
    naming them. output_loading_info=True asks for transformers' lenient load instead: what fits
    is loaded, the rest initialised (each with a warning), and (model, {"missing_keys",
    "unexpected_keys", "mismatched_keys", "error_msgs"}) returned. ignore_mismatched_sizes=True
    initialises weights of the wrong shape (a head with another number of labels) instead of
    refusing them.

    quantize: a gpt2attn.quantize mode ('fp32', 'fp16', 'bf16', 'int8', 'q4'), applied while
    loading: the matrices are read one at a time, each packed before the next is read, and what
    stays fp32 (embeddings, LayerNorms, biases) is loaded in fp32 whatever the checkpoint's dtype.
    It takes the CPU, and no dtype but float32 (or None, 'auto').
    """
    if torch.get_default_device().type == "meta":
        raise RuntimeError("You are using `from_pretrained` with a meta device context manager: the loaded weights "
                           "would be thrown away. Build the model with cls(config) under the context manager instead")
    dtype = dtype if dtype is not None else torch_dtype
    if quantize is not None:  # refused before anything is read
        check_quantize_request(quantize, dtype, device)
    if config is not None:  # the model gets its own, as in transformers: the caller's is left as it was
        config = deepcopy(config)
    if src is None:
        if state_dict is None:
            raise ValueError("from_pretrained(None) needs state_dict= (and config=): there is nothing to load")
        src = state_dict
    path = None
    if isinstance(src, dict) and not all(isinstance(t, Tensor) for t in src.values()):
        nanogpt_config, state = from_nanogpt(src, "state dict")  # a training checkpoint, not a state dict
        config, where = config or nanogpt_config, "state dict"
    elif isinstance(src, dict):
        state, where = check_state_dict(src, "state dict"), "state dict"
        config = config or infer_config(state)
    else:
        path = resolve(src, cache_dir=cache_dir, local_files_only=local_files_only)
        fmt = detect_format(path)
        stored_config, state, _tokenizer = fmt.read(path)
        config, where = config or stored_config, str(weights_file(fmt, path))
    if config_kwargs:  # set on a copy after it is read, so num_labels=3 replaces id2label, as in transformers
        config = GPT2Config.from_dict(config.to_dict())
        for key, value in config_kwargs.items():
            setattr(config, key, value)
        config.validate()
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    # A caller's state dict is copied, so the new model does not share storage with its source.
    copy = isinstance(src, dict)
    lenient = Leniency(missing=output_loading_info, mismatched=ignore_mismatched_sizes)
    dtype = torch.float32 if quantize is not None else resolve_dtype(dtype, config)
    model, info = build_model(cls, config, state, dtype, device, where, copy, lenient, quantize)
    model.config.dtype = model.dtype  # as transformers records it: what 'auto' loads (and save_pretrained writes)
    if path is not None and path.is_dir() and hasattr(cls, "generate"):
        load_generation_config(model, path)
    return (model, info) if output_loading_info else model


class Leniency(NamedTuple):
    """What a load forgives, as transformers does; gpt2attn refuses both by default."""

    missing: bool = False  # weights the checkpoint lacks are initialised, extra ones dropped
    mismatched: bool = False  # weights of the wrong shape are initialised


def check_quantize_request(mode: str, dtype: Any, device: Any) -> None:
    """quantize= with the other arguments: a known mode, on the CPU, in fp32."""
    checked_mode(mode)
    if device is not None and torch.device(device).type != "cpu":
        raise ValueError(f"quantize={mode!r} is for the CPU; device={device!r} cannot go with it")
    if dtype not in (None, "auto") and resolve_dtype(dtype, GPT2Config()) != torch.float32:
        raise ValueError(f"quantize={mode!r} sets the matrices' precision and keeps the rest in float32; "
                         f"dtype={dtype!r} cannot go with it (leave it out)")


def build_model(cls: type, config: Any, state: dict[str, Tensor], dtype, device, where: str, copy: bool,
                lenient: Leniency = Leniency(), quantize: str | None = None) -> tuple[nn.Module, dict[str, Any]]:
    """A `cls` on the meta device, then the checked tensors assigned into it (with quantize, the
    matrices read one by one as quantize() packs them). Returns the model and transformers'
    loading report (the keys initialised, dropped or of the wrong shape)."""
    check_layers(config, state, where)  # before n_layer blocks are built
    with torch.device("meta"), no_random_init():
        model = cls(config)
    expected = model.state_dict()  # meta tensors: names and shapes only
    state = normalize_keys(state, prefixed="transformer.wte.weight" in expected)
    tied = "lm_head.weight" in expected and (config.tie_word_embeddings or "lm_head.weight" not in state)
    if tied:
        state.pop("lm_head.weight", None)
    skip = {"lm_head.weight"} if tied else set()
    new_head = fit_head_keys(state, expected, skip, type(model).__name__, where)
    info = forgive(state, expected, skip | set(new_head), lenient, where)
    info["missing_keys"] |= set(new_head)  # a head the checkpoint lacks is reported too, as transformers does
    initialised = info["missing_keys"] | info["mismatched_keys"]
    check_state(state, expected, skip=skip | initialised, where=where)
    device = torch.device(device) if device is not None else None
    if dtype is None:  # a checkpoint mixing float dtypes is cast to its token embedding's, so the model runs
        stored = {t.dtype for t in state.values() if t.is_floating_point()}
        wte = state.get("transformer.wte.weight", state.get("wte.weight"))
        dtype = wte.dtype if len(stored) > 1 and wte is not None else None
    to_init = sorted(initialised)
    if to_init:
        stored = next((t.dtype for t in state.values() if t.is_floating_point()), None)
        init_new_head(model, to_init, config, device, dtype or stored)
    # with quantize, the matrices stay on the meta device until quantize() reads each to pack it
    matrices = {f"{name}.weight" for name in packed_layers(model)} if quantize is not None else set()
    later = {name: state.pop(name) for name in matrices & state.keys()}
    state = {name: cast(t, dtype, device, copy) for name, t in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if tied:  # by the config, or because the checkpoint has no head of its own
        model.lm_head.weight = model.transformer.wte.weight
    if quantize is not None:
        quantize_model(model, quantize, read=lambda name: cast(later.pop(name), dtype, device, copy))
    return model.eval(), info


# The loading report (weights dropped or newly initialised) goes where transformers logs its own:
# Python's logger "transformers.modeling_utils", at WARNING. So transformers' verbosity settings
# (transformers.logging.set_verbosity_error()) and tools that capture that logger see ours too, as
# code written for transformers expects; a logger is only a name, so transformers is not imported.
# With no logging set up at all, Python prints the warning to stderr.
LOAD_REPORT = logging.getLogger("transformers.modeling_utils")


def forgive(state: dict[str, Tensor], expected: dict[str, Tensor], skip: set[str], lenient: Leniency,
            where: str) -> dict[str, Any]:
    """transformers' loading report. The keys `lenient` forgives are taken out of `state` (to be
    initialised instead), each kind with one warning naming them; check_state refuses the rest."""
    mismatched = {k for k, t in state.items() if k in expected and tuple(t.shape) != tuple(expected[k].shape)}
    missing = {k for k in expected if k not in state and k not in skip}
    unexpected = {k for k in state if k not in expected}
    info: dict[str, Any] = {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    if lenient.mismatched and mismatched:
        state_shapes = {k: state[k].shape for k in mismatched}
        for key in mismatched:
            del state[key]
        info["mismatched_keys"] = mismatched
        shapes = [f"{k} (Reinit due to size mismatch - checkpoint {tuple(state_shapes[k])} vs model "
                  f"{tuple(expected[k].shape)})" for k in sorted(mismatched)]
        LOAD_REPORT.warning(f"{where}: weights of the wrong shape, newly initialised: {shorten(shapes)}")
    if lenient.missing:
        for key in unexpected:
            del state[key]
        info["unexpected_keys"] = unexpected
        info["missing_keys"] = missing
        if missing:
            LOAD_REPORT.warning(f"{where}: weights the checkpoint lacks, newly initialised: {shorten(sorted(missing))}")
    return info


@contextmanager
def no_random_init():
    """Make torch.nn.init's fills no-ops while a model is built on the meta device: the values
    would be thrown away, and the first meta normal_() of a process costs over a second."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "zeros_", "ones_", "constant_")
    saved = {name: getattr(nn.init, name) for name in names}
    for name in names:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def cast(t: Tensor, dtype: torch.dtype | None, device: torch.device | None, copy: bool) -> Tensor:
    """Make a read_later tensor, and move to device / dtype in one step (floating tensors only
    change dtype). A file's tensor copied (a 16-bit one widened, say) gives back its pages of the
    file's map at once: a map of the whole file (a pytorch_model.bin) would keep them to the end.
    copy: a caller's own tensor, left as it is."""
    t = materialize(t)
    target = dtype if dtype is not None and t.is_floating_point() else t.dtype
    moved = t.detach().to(device=device if device is not None else t.device, dtype=target, copy=copy)
    if not copy and moved.data_ptr() != t.data_ptr() and t.device.type == "cpu":
        release_file_pages(t)
    return moved


def fit_head_keys(
    state: dict[str, Tensor], expected: dict[str, Tensor], skip: set[str], cls: str, where: str
) -> list[str]:
    """A checkpoint of one head class loaded into another, as transformers does it: head weights
    the model has no place for are dropped, and head weights it lacks are to be newly initialised,
    each with a warning naming the keys. Removes the former from `state`; returns the latter."""
    def is_head(key: str) -> bool:
        return not key.startswith(("transformer.", *BODY_PREFIXES))

    dropped = [k for k in state if is_head(k) and k not in expected]
    new = [k for k in expected if is_head(k) and k not in state and k not in skip]
    for key in dropped:
        del state[key]
    if dropped:
        unused = ", ".join(dropped)
        LOAD_REPORT.warning(f"{where}: {cls} does not use these weights of the checkpoint: {unused}")
    if new:
        LOAD_REPORT.warning(f"{where}: {cls} has weights the checkpoint lacks, newly initialised (train them "
                            f"before use): {', '.join(new)}")
    return new


def init_new_head(model: nn.Module, names: list[str], config: GPT2Config, device, dtype) -> None:
    """Materialise the head modules that own `names` (built on meta) with transformers' init."""
    for owner in dict.fromkeys(name.rpartition(".")[0] for name in names):
        module = model.get_submodule(owner)
        module.to_empty(device=device or "cpu")
        init_weights(module, config)
        module.to(dtype)


def check_state(state: dict[str, Tensor], expected: dict[str, Tensor], skip: set[str], where: str) -> None:
    """Raise ValueError naming the source and the keys: missing, unexpected, wrong shape."""
    missing = [k for k in expected if k not in state and k not in skip]
    unexpected = [k for k in state if k not in expected]
    problems = []
    if missing:
        problems.append(f"missing keys: {shorten(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {shorten(unexpected)}")
    for name, tensor in state.items():
        if name in expected and tuple(tensor.shape) != tuple(expected[name].shape):
            problems.append(
                f"shape mismatch for {name}: expected {tuple(expected[name].shape)}, found {tuple(tensor.shape)}"
            )
        elif name in expected and not tensor.is_floating_point():
            problems.append(f"{name} holds {str(tensor.dtype).removeprefix('torch.')} values, not floating point")
    if problems:
        message = "checkpoint does not fit the model; " + shorten(problems, 8, 400, sep="; ")
        shapes = any(p.startswith("shape mismatch") for p in problems)
        raise (ShapeMismatchError if shapes else CheckpointError)(where, message)


def check_layers(config: GPT2Config, state: dict[str, Tensor], where: str) -> None:
    """The config's n_layer against the blocks the weights hold, before a model is built: a header
    saying 100000 layers over a file of 2 is refused here, not after building 100000 blocks."""
    held = layer_indices(state)
    extra = [key for key in state if (layer_of(key) or 0) >= config.n_layer]
    if extra:  # named, as transformers names unexpected keys
        raise CheckpointError(where, f"checkpoint does not fit the model: the config has n_layer = {config.n_layer} "
                                     f"(blocks 0..{config.n_layer - 1}); unexpected keys: {shorten(extra)}")
    if held and held != set(range(config.n_layer)):
        found = f"blocks {min(held)}..{max(held)} ({len(held)} of them)"
        raise CheckpointError(where, f"checkpoint does not fit the model: the config has n_layer = {config.n_layer}, "
                                     f"the weights hold {found}")
