"""nanoGPT's training checkpoints (`out/ckpt.pt`: {'model', 'model_args', 'iter_num', ...}), and
.pt / .ckpt files that hold a bare GPT-2 state dict. Read only.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..config import GPT2Config, inner_dim
from ..errors import CheckpointError
from ..memory import release_file_pages
from .state_dict import (check_state_dict, config_from_hparams, infer_config, layer_indices, normalize_keys, read_bin,
                         read_later)

NAME = "nanogpt"
SUFFIXES = (".pt", ".ckpt")

# nanoGPT's nn.Linear weights are (out, in); GPT-2's Conv1D stores (in, out).
NANOGPT_LINEARS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
BIASES = ("ln_1.bias", "attn.c_attn.bias", "attn.c_proj.bias", "ln_2.bias", "mlp.c_fc.bias", "mlp.c_proj.bias")


def detect(path: Path) -> bool:
    return path.is_file() and path.suffix in SUFFIXES


def contiguous_transpose(weight: Tensor) -> Tensor:
    """nn.Linear's (out, in) weight as Conv1D's (in, out), in memory of its own; the source's pages
    of a file's map (torch.load maps the whole checkpoint) are given back once copied."""
    copy = weight.t().contiguous()
    release_file_pages(weight)
    return copy


def read(path: Path) -> tuple[GPT2Config, dict[str, Tensor], None]:
    """A nanoGPT checkpoint's config and state dict, or a bare state dict and a config from its shapes."""
    checkpoint = read_bin(path)
    if all(isinstance(t, Tensor) for t in checkpoint.values()):
        state = check_state_dict(checkpoint, path)
        return infer_config(state, path), state, None
    config, state = from_nanogpt(checkpoint, str(path))
    return config, state, None


def from_nanogpt(checkpoint: dict[str, Any], where: str) -> tuple[GPT2Config, dict[str, Tensor]]:
    """Config and GPT-2 state dict of a nanoGPT training checkpoint ({'model', 'model_args', ...}),
    so that the model computes what nanoGPT's does: its MLP uses the exact GELU (nn.GELU()), and a
    model trained with bias=False gets zero biases. Linear weights are transposed."""
    missing = [key for key in ("model", "model_args") if key not in checkpoint]
    if missing:
        raise CheckpointError(where, f"not a state dict (not every value is a tensor), and not a nanoGPT "
                                     f"checkpoint: no {' or '.join(map(repr, missing))} field")
    model, args = checkpoint["model"], checkpoint["model_args"]
    if not isinstance(model, dict) or not all(isinstance(t, Tensor) for t in model.values()):
        raise CheckpointError(where, "the nanoGPT checkpoint's 'model' is not a state dict of tensors")
    check_state_dict(model, where)
    if not isinstance(args, dict):
        raise CheckpointError(where, f"the nanoGPT checkpoint's 'model_args' is a {type(args).__name__}, not a dict")
    dropout = args.get("dropout", 0.0)
    names = {"vocab_size": "vocab_size", "n_positions": "block_size", "n_embd": "n_embd", "n_layer": "n_layer",
             "n_head": "n_head"}
    config = config_from_hparams(args, names, where, "model_args", activation_function="gelu",
                                 resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout)
    state = {}
    for name, t in normalize_keys(model, prefixed=True).items():
        if name.endswith(NANOGPT_LINEARS) and t.dim() != 2:
            raise CheckpointError(where, f"'model' {name} has shape {tuple(t.shape)}, not (out, in)")
        transposed = functools.partial(contiguous_transpose, t)  # made as the loader uses it (read_later)
        state[name] = read_later(t.shape[::-1], t.dtype, transposed) if name.endswith(NANOGPT_LINEARS) else t
    if not args.get("bias", True):
        # Zero biases are made for the blocks the weights hold, after checking that they hold n_layer
        # blocks of width n_embd: model_args alone must not decide how much memory is filled.
        held, wte = layer_indices(state), state.get("transformer.wte.weight")
        if held != set(range(config.n_layer)) or wte is None or tuple(wte.shape) != (config.vocab_size, config.n_embd):
            raise CheckpointError(where, f"model_args (n_layer {config.n_layer}, n_embd {config.n_embd}, vocab_size "
                                         f"{config.vocab_size}) do not fit the weights in 'model' ({len(held)} blocks, "
                                         f"wte {tuple(wte.shape) if wte is not None else 'missing'})")
        C = config.n_embd
        widths = {"attn.c_attn.bias": 3 * C, "mlp.c_fc.bias": inner_dim(config)}
        for i in range(config.n_layer):
            for bias in BIASES:
                state.setdefault(f"transformer.h.{i}.{bias}", torch.zeros(widths.get(bias, C)))
        state.setdefault("transformer.ln_f.bias", torch.zeros(C))
    return config, state
