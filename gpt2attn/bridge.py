"""Zero-copy bridge to transformers: the same nn.Parameter objects seen through either library's classes.

`to_transformers(model)` builds transformers' class of the same name on the meta device and puts our
parameters into it; `from_transformers(hf_model)` does the reverse. Nothing is copied, so a change to a
weight (an optimizer step, `load_state_dict`, an in-place edit) made through one model is seen by the
other, and so are dtype and device. transformers is imported inside the functions that need it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .config import GPT2Config

# Class name (the same in both libraries) -> the gpt2attn module that defines ours. A task head slots
# in with one line once it exists on our side. Our classes call in here with themselves, so this
# module never imports them (pretrained.py imports this bridge, which sits below it beside config.py).
BRIDGED = {
    "GPT2Model": "gpt2attn.model",
    "GPT2LMHeadModel": "gpt2attn.model",
    "GPT2ForSequenceClassification": "gpt2attn.heads",
    "GPT2ForTokenClassification": "gpt2attn.heads",
    "GPT2ForQuestionAnswering": "gpt2attn.heads",
    "GPT2DoubleHeadsModel": "gpt2attn.heads",
}


def to_transformers(model: nn.Module, attn_implementation: str | None = None) -> Any:
    """transformers' model of the same class whose parameters ARE `model`'s (same objects, same storage)."""
    import transformers

    name = _bridged_name(model)
    hf_config = transformers.GPT2Config.from_dict(model.config.to_dict())
    if attn_implementation is not None:
        hf_config._attn_implementation = attn_implementation
    with torch.device("meta"):
        hf_model = getattr(transformers, name)(hf_config)
    _share_parameters(model, hf_model)
    if model.can_generate():  # generate's defaults too (a folder's generation_config.json, or as set)
        hf_model.generation_config = transformers.GenerationConfig.from_dict(model.generation_config.to_dict())
    return hf_model.train(model.training)


def from_transformers(cls: type, hf_model: nn.Module) -> nn.Module:
    """Our model of class `cls` (transformers' class name) whose parameters ARE `hf_model`'s."""
    name = _bridged_name(hf_model)
    if cls.__name__ != name:
        raise TypeError(f"{cls.__name__}.from_transformers got a transformers {name}; use gpt2attn's {name}")
    with torch.device("meta"):
        model = cls(GPT2Config.from_dict(hf_model.config.to_dict()))
    _share_parameters(hf_model, model)
    return model.train(hf_model.training)


def _bridged_name(model: nn.Module) -> str:
    name = type(model).__name__
    if name not in BRIDGED:
        raise TypeError(f"no bridge for {name}; bridged classes: {', '.join(BRIDGED)}")
    return name


def _share_parameters(src: nn.Module, dst: nn.Module) -> None:
    """Make every parameter of dst (built on meta) the very Parameter src holds under the same name."""
    params = dict(src.named_parameters(remove_duplicate=False))
    wanted = dict(dst.named_parameters(remove_duplicate=False))
    if params.keys() != wanted.keys():
        missing, extra = sorted(wanted.keys() - params.keys()), sorted(params.keys() - wanted.keys())
        raise ValueError(f"{type(src).__name__} -> {type(dst).__name__}: names differ (missing {missing}, extra {extra})")
    for name, param in params.items():
        if param.shape != wanted[name].shape:
            raise ValueError(f"{name}: shape {tuple(param.shape)}, expected {tuple(wanted[name].shape)}")
        module_name, _, leaf = name.rpartition(".")
        setattr(dst.get_submodule(module_name), leaf, param)
    for name, buf in dst.named_buffers():
        if buf.is_meta:
            raise ValueError(f"{type(dst).__name__} has a buffer {name} the bridge does not fill")
