"""What the formats share: GPT-2 state dicts with Hugging Face's keys, and PyTorch's pickle files.

normalize_keys fits a state dict's names to a model class, infer_config reads a config from its
shapes, torch_load is torch.load restricted to weights (errors name the file), mapped_bytes
memory-maps one tensor of a file, and read_later stands for a tensor that is only made (widened,
dequantized, transposed) when the loader uses it.
"""

from __future__ import annotations

import mmap
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import Tensor

from ..config import GPT2Config
from ..errors import CheckpointError

# Old HF checkpoints stored the causal mask as buffers; we build it on the fly.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".crossattention.bias", ".crossattention.masked_bias")
# The GPT-2 body's keys (GPT2Model's, or under "transformer."); every other key is a head's:
# lm_head, score, classifier, qa_outputs, multiple_choice_head.
BODY_PREFIXES = ("wte.", "wpe.", "h.", "ln_f.")
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
# n_head for OpenAI's sizes, used when a bare state dict comes without a config.
N_HEAD_BY_WIDTH = {768: 12, 1024: 16, 1280: 20, 1600: 25}
# No tensor of a GPT-2 within gpt2attn's limits (config.LIMITS) has more dimensions or a longer one.
MAX_DIMS = 4
MAX_DIM_SIZE = 2**40
DTYPE_NAMES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def normalize_keys(state: dict[str, Tensor], prefixed: bool) -> dict[str, Tensor]:
    """Strip DDP / torch.compile prefixes, drop old mask buffers, and fit the body's
    `transformer.` prefix to the target class (head keys are left as they are)."""
    out = {}
    for name, tensor in state.items():
        while name.startswith(WRAPPER_PREFIXES):
            name = name.split(".", 1)[1]
        if name.endswith(IGNORED_SUFFIXES):
            continue
        if name.startswith(("transformer.", *BODY_PREFIXES)):
            body = name.removeprefix("transformer.")
            name = "transformer." + body if prefixed else body
        out[name] = tensor
    return out


def check_state_dict(state: Any, where: str | Path) -> dict[str, Tensor]:
    """state, after checking it is a dict of name -> tensor (a file's tensors come from here)."""
    if not isinstance(state, dict):
        raise CheckpointError(where, f"holds a {type(state).__name__}, not a state dict")
    for name, tensor in state.items():
        if not isinstance(name, str):
            raise CheckpointError(where, f"a state dict's keys are tensor names, found the key {name!r:.80}")
        if not isinstance(tensor, Tensor):
            raise CheckpointError(where, f"{name} holds a {type(tensor).__name__}, not a tensor")
    return state


def layer_of(key: str) -> int | None:
    """The block number i of an h.{i}. key (with or without `transformer.`); None for other keys."""
    m = re.match(r"(?:transformer\.)?h\.(\d{1,9})\.", key)
    return int(m.group(1)) if m else None


def layer_indices(state: dict[str, Tensor]) -> set[int]:
    """The block numbers i of a state dict's h.{i}. keys (with or without `transformer.`)."""
    return {i for key in state if (i := layer_of(key)) is not None}


def config_from_hparams(hparams: dict, names: dict[str, str], where: str | Path, field: str,
                        **fixed: Any) -> GPT2Config:
    """GPT2Config from another project's hyperparameters (the dict `field` of the file `where`): our
    field F takes hparams[names[F]], `fixed` sets others. A key it lacks or a value GPT2Config refuses
    is a CheckpointError naming the file and the field."""
    missing = sorted(theirs for theirs in names.values() if theirs not in hparams)
    if missing:
        raise CheckpointError(where, f"{field} has no {', '.join(missing)}")
    try:
        return GPT2Config(**{ours: hparams[theirs] for ours, theirs in names.items()}, **fixed)
    except (TypeError, ValueError) as e:
        raise CheckpointError(where, f"{field}: {e}") from None


def infer_config(state: dict[str, Tensor], where: str | Path = "state dict") -> GPT2Config:
    """A config from a bare state dict's shapes (n_head from OpenAI's sizes)."""
    state = normalize_keys(state, prefixed=False)
    if "wte.weight" not in state or "wpe.weight" not in state:
        raise CheckpointError(where, "state dict has no wte.weight / wpe.weight: is it a GPT-2 state dict?")
    for name in ("wte.weight", "wpe.weight", "h.0.mlp.c_fc.weight"):
        if name in state and state[name].dim() != 2:
            raise CheckpointError(where, f"{name} has shape {tuple(state[name].shape)}, not (rows, columns)")
    vocab_size, n_embd = state["wte.weight"].shape
    if n_embd not in N_HEAD_BY_WIDTH:
        raise CheckpointError(where, f"cannot tell n_head for width {n_embd}: pass config=GPT2Config(...) "
                                     f"with the state dict")
    try:
        return GPT2Config(
            vocab_size=vocab_size,
            n_positions=state["wpe.weight"].shape[0],
            n_embd=n_embd,
            n_layer=len(layer_indices(state)),
            n_head=N_HEAD_BY_WIDTH[n_embd],
            n_inner=state["h.0.mlp.c_fc.weight"].shape[1] if "h.0.mlp.c_fc.weight" in state else None,
        )
    except ValueError as e:
        raise CheckpointError(where, f"the config its shapes give: {e}") from None


def mapped_bytes(f: BinaryIO, start: int, length: int) -> Tensor:
    """`length` bytes of the open file f from byte `start`, as a uint8 tensor over a private
    (copy-on-write) memory map of their own. Nothing is read until a page is used, and the pages
    leave this process's memory when the last tensor viewing them is freed: one map per tensor,
    so that a model whose fp32 weights are replaced one by one (quantize) gives each back as it
    goes, where one map of the whole file would keep every page it ever read."""
    if length == 0:
        return torch.empty(0, dtype=torch.uint8)
    base = start - start % mmap.ALLOCATIONGRANULARITY  # a map starts on a page
    buffer = mmap.mmap(f.fileno(), start + length - base, access=mmap.ACCESS_COPY, offset=base)
    return torch.frombuffer(buffer, dtype=torch.uint8, count=length, offset=start - base)


def read_later(shape: tuple[int, ...], dtype: torch.dtype, read: Callable[[], Tensor]) -> Tensor:
    """The tensor of `shape` and `dtype` that `read()` makes when `materialize` asks for it: until
    then a tensor on the meta device carrying `read`, whose shape and dtype the loader checks with the
    rest. A reader returns these for tensors it would otherwise make in full at once (a GGUF's F16
    or Q8_0 weights widened to fp32, say), so that from_pretrained(quantize=) makes each matrix
    only when it is packed, and a plain load one tensor at a time as it assigns them."""
    placeholder = torch.empty(shape, dtype=dtype, device="meta")
    placeholder.read_later = read
    return placeholder


def materialize(t: Tensor) -> Tensor:
    """The tensor a read_later placeholder stands for, made now; any other tensor as it is."""
    return t.read_later() if t.is_meta and hasattr(t, "read_later") else t


def read_bin(path: Path) -> dict[str, Any]:
    state = torch_load(path)
    if not isinstance(state, dict):
        raise CheckpointError(path, f"holds a {type(state).__name__}, not a state dict")
    return state


def torch_load(path: Path) -> Any:
    """torch.load with weights_only=True (memory-mapped when the file is in the zip format);
    errors name the file and say whether it was refused or could not be read."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    with open(path, "rb") as f:
        head = f.read(4)
    # torch.save writes a zip archive, or (before torch 1.6) a pickle that opens with a PROTO opcode.
    # Anything else (an HTML error page saved under the name, an empty file) is not a refusal.
    if head != b"PK\x03\x04" and head[:1] != b"\x80":
        raise CheckpointError(path, f"not a PyTorch checkpoint: starts with {head!r}, "
                                    "neither a zip archive nor a pickle (a failed download?)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        raise refused(path, e) from None
    except Exception:  # RuntimeError, EOFError, ...: maybe the pre-zip format, which cannot be mapped
        pass
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise refused(path, e) from None
    except Exception as e:
        raise CheckpointError(path, f"cannot read this PyTorch checkpoint (truncated or corrupt?): {e}") from None


def refused(path: Path, error: Exception) -> CheckpointError:
    """The error for a pickle that weights-only loading refuses (it would run or build objects)."""
    message = str(error)
    if "Weights only load failed" not in message:
        return CheckpointError(path, f"cannot read this PyTorch checkpoint (truncated or corrupt?): {message}")
    what = re.search(r"GLOBAL [\w.]+", message)
    return CheckpointError(path, "refused: holds objects that weights-only loading does not allow"
                           + (f" ({what.group(0)})" if what else ""))


def resolve_dtype(dtype: Any, config: GPT2Config) -> torch.dtype | None:
    """None, a torch dtype, a name, or 'auto' (config.json's torch_dtype / dtype, if any)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        name = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        name = str(name).removeprefix("torch.") if name is not None else None
        return DTYPE_NAMES[name] if name in DTYPE_NAMES else None
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_NAMES)} or 'auto'")
    return DTYPE_NAMES[name]
