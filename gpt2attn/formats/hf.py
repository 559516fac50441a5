"""Hugging Face's format: a model folder (config.json + model.safetensors, sharded safetensors with
an index, or pytorch_model.bin), or a single .safetensors / .bin weights file.

Reading memory-maps safetensors files, one map per tensor: each is a view of the file until used,
and its pages leave memory with it. Writing
(save_pretrained, write) replaces the model files of a folder in one step (files.py's
replace_folder) and keeps the folder's other files (tokenizer, README).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..config import CONFIG_NAME, GPT2Config, is_int
from ..errors import CheckpointError, read_json, shorten
from ..files import replace_folder, write_atomic, write_text_atomic
from ..generation.config import save_generation_config
from ..layers import ACTIVATIONS
from ..memory import release_file_pages
from ..hub import BIN_INDEX, BIN_WEIGHTS, SAFE_INDEX, SAFE_WEIGHTS, has_weights
from .state_dict import MAX_DIMS, MAX_DIM_SIZE, check_state_dict, infer_config, mapped_bytes, read_bin, resolve_dtype

NAME = "hf"
SUFFIXES = ("",)  # a folder: convert writes one for any destination without another format's suffix
FILE_SUFFIXES = (".safetensors", ".bin", ".pth")  # .pth: a PyTorch state dict, as .bin

# safetensors dtype codes <-> torch dtypes.
SAFE_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
SAFE_CODES = {dtype: code for code, dtype in SAFE_DTYPES.items()}
# The files of a model that save_pretrained writes; anything else in the folder is kept.
MODEL_FILE = re.compile(r"config\.json|(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?")


def detect(path: Path) -> bool:
    """A folder with config.json or HF weights files, or a .safetensors / .bin file."""
    if path.is_dir():
        return (path / CONFIG_NAME).is_file() or has_weights(path)
    return path.suffix in FILE_SUFFIXES


def read(path: Path) -> tuple[GPT2Config, dict[str, Tensor], None]:
    """The config (config.json, or one inferred from the shapes of a lone weights file) and the
    state dict. Tokenizer files stay where they are, for gpt2attn.tokenizer."""
    state, config_file = read_weights(path)
    config = read_config(config_file) if config_file is not None else infer_config(state, weights_file(path))
    return config, state, None


def weights_file(path: Path) -> Path:
    """The file to name in errors about the tensors: the weights file, or the shard index."""
    if path.is_file():
        return path
    return next((path / name for name in (SAFE_WEIGHTS, SAFE_INDEX, BIN_WEIGHTS, BIN_INDEX) if (path / name).exists()), path)


def read_config(path: Path) -> GPT2Config:
    """config.json, checked (errors are CheckpointErrors naming the file), with an activation the
    model knows, so that building the model cannot fail on it."""
    config = GPT2Config.from_json_file(path)
    if config.activation_function not in ACTIVATIONS:
        raise CheckpointError(path, f"activation_function is {config.activation_function!r:.80}; gpt2attn knows "
                                    f"{', '.join(sorted(ACTIVATIONS))}")
    return config


def read_weights(path: Path) -> tuple[dict[str, Tensor], Path | None]:
    """The state dict of a folder or a single weights file, and the config.json beside it."""
    folder = path if path.is_dir() else path.parent
    config_file = folder / CONFIG_NAME
    if path.is_dir() and not config_file.exists():
        raise FileNotFoundError(f"{path}: no {CONFIG_NAME}")
    config_file = config_file if config_file.exists() else None
    weight_map = None
    if path.is_file():
        files = [path]
    elif (path / SAFE_WEIGHTS).exists():
        files = [path / SAFE_WEIGHTS]
    elif (path / SAFE_INDEX).exists():
        files, weight_map, where = shard_files(path / SAFE_INDEX)
    elif (path / BIN_WEIGHTS).exists():
        files = [path / BIN_WEIGHTS]
    elif (path / BIN_INDEX).exists():
        files, weight_map, where = shard_files(path / BIN_INDEX)
    else:
        raise FileNotFoundError(
            f"{path}: no weights found (expected {SAFE_WEIGHTS}, {SAFE_INDEX}, {BIN_WEIGHTS} or {BIN_INDEX})"
        )
    state: dict[str, Tensor] = {}
    for file in files:
        shard = read_safetensors(file) if file.suffix == ".safetensors" else check_state_dict(read_bin(file), file)
        if weight_map is not None:
            check_shard(where, file.name, shard, weight_map)
        state.update(shard)
    if weight_map is not None and (unlisted := [key for key in weight_map if key not in state]):
        raise CheckpointError(where, f"lists tensors that no shard holds: {shorten(unlisted)}")
    return state, config_file


def shard_files(index_path: Path) -> tuple[list[Path], dict[str, str], str]:
    """The shard files, weight_map (tensor name -> file name) and name of a shard index, checked:
    weight_map is an object of file names in the index's own folder (names leading elsewhere are
    refused), and every file exists."""
    index = read_json(index_path.read_bytes(), index_path, "not a valid shard index: not JSON")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        found = type(index).__name__ if not isinstance(index, dict) else f"a weight_map of type {type(weight_map).__name__}"
        raise CheckpointError(index_path, f"not a valid shard index: expected an object with a 'weight_map' object "
                                          f"(tensor name -> file name), found {found}")
    for key, name in weight_map.items():
        if not isinstance(name, str) or not name:
            raise CheckpointError(index_path, f"weight_map[{key!r}] is {shorten([repr(name)])}, not a file name")
        if name != os.path.basename(name) or name in (".", "..") or "\\" in name or "\0" in name:
            raise CheckpointError(index_path, f"refused: shard {name!r} is a path, not a file name in the index's folder")
    files = [index_path.parent / name for name in dict.fromkeys(weight_map.values())]
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"{index_path} lists shard {file.name}, which is missing")
    return files, weight_map, str(index_path)


def check_shard(where: str, name: str, shard: dict[str, Tensor], weight_map: dict[str, str]) -> None:
    """A shard holds exactly the tensors the index places in it (no shard of another save)."""
    stray = [key for key in shard if weight_map.get(key) != name]
    if stray:
        raise CheckpointError(where, f"shard {name} holds tensors the index does not place there: {shorten(stray)}")


def read_safetensors(path: Path) -> dict[str, Tensor]:
    """Tensors of a .safetensors file, each a view of its own (copy-on-write) memory map
    (state_dict.mapped_bytes): nothing is read until a tensor is used, and a tensor's pages go
    when it does. The header is checked as the format requires."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size < 8:
            raise CheckpointError(path, f"truncated safetensors file ({size} bytes)")
        header_len = int.from_bytes(f.read(8), "little")
        if header_len > size - 8:
            raise CheckpointError(path, f"corrupt or truncated safetensors file (header of {header_len} bytes)")
        header = read_json(f.read(header_len), path, "corrupt safetensors header")
        data_start = 8 + header_len
        entries = check_safetensors_header(path, header, size - data_start)
        return {name: mapped_bytes(f, data_start + begin, end - begin).view(dtype).view(shape)
                for name, dtype, shape, begin, end in entries}


def check_safetensors_header(path: Path, header: Any, data_size: int) -> list[tuple]:
    """(name, dtype, shape, begin, end) of each tensor, after the checks the format asks for: an
    object; `__metadata__` an object of strings; a known dtype; a shape of non-negative ints;
    data_offsets a pair of ints whose span is the shape's size; tensors that tile the data region
    exactly, in order, without gaps or overlaps."""
    def bad(message: str) -> CheckpointError:
        return CheckpointError(path, f"corrupt safetensors header: {message}")

    if not isinstance(header, dict):
        raise bad(f"a JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise bad(f"__metadata__ must be an object of strings, found {shorten([repr(metadata)])}")
    entries = []
    for name, info in header.items():
        if not isinstance(info, dict):
            raise bad(f"tensor {name}: {shorten([repr(info)])} is not an object")
        kind = info.get("dtype")
        dtype = SAFE_DTYPES.get(kind) if isinstance(kind, str) else None
        if dtype is None:
            raise bad(f"tensor {name} has unsupported dtype {shorten([repr(kind)])}")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not isinstance(shape, list) or not all(is_int(n) and n >= 0 for n in shape):
            raise bad(f"tensor {name}: shape {shorten([repr(shape)])} is not a list of non-negative integers")
        if len(shape) > MAX_DIMS or any(n > MAX_DIM_SIZE for n in shape):
            raise bad(f"tensor {name}: shape {shape} has more than {MAX_DIMS} dimensions or one above {MAX_DIM_SIZE}")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(is_int(n) for n in offsets):
            raise bad(f"tensor {name}: data_offsets {shorten([repr(offsets)])} is not a pair of integers")
        begin, end = offsets
        nbytes = math.prod(shape) * dtype.itemsize
        if not 0 <= begin <= end or end - begin != nbytes:
            raise bad(f"tensor {name}: data_offsets {offsets} span {end - begin} bytes, its shape {shape} needs {nbytes}")
        entries.append((name, dtype, shape, begin, end))
    entries.sort(key=lambda e: (e[3], e[4]))
    covered = 0
    for name, _, _, begin, end in entries:
        if begin != covered:
            kind = "overlaps the tensor before it" if begin < covered else f"leaves a gap of {begin - covered} bytes"
            raise bad(f"tensor {name} starts at byte {begin} of the data and {kind}")
        covered = end
    if covered > data_size:
        raise CheckpointError(path, f"truncated: the tensors need {covered} bytes of data, the file has {data_size}")
    if covered < data_size:
        raise bad(f"the tensors cover {covered} bytes of data, the file has {data_size}")
    return entries


# --- writing --------------------------------------------------------------------------------


def write(path: Path, state_dict: dict[str, Tensor], config: GPT2Config, *, dtype: Any = None,
          tokenizer: Any = None) -> None:
    """An HF folder of a GPT2LMHeadModel's state dict (tied head left out), swapped in whole;
    a `tokenizers.Tokenizer` goes beside it as tokenizer.json. dtype: None (as stored), a torch
    dtype or a name ('bf16', 'float16', ...)."""
    dtype = resolve_dtype(dtype, config)
    state = {name: t.detach().to("cpu", dtype if dtype is not None and t.is_floating_point() else t.dtype).contiguous()
             for name, t in state_dict.items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    config_dict = config.to_dict()
    config_dict["architectures"] = ["GPT2LMHeadModel"]
    record_dtype(config_dict, state)
    with replace_folder(path, keep=lambda name: not MODEL_FILE.fullmatch(name)) as folder:
        write_safetensors(folder / SAFE_WEIGHTS, state)
        write_json(folder / CONFIG_NAME, config_dict)
        if tokenizer is not None:
            write_text_atomic(folder / "tokenizer.json", tokenizer.to_str())


def save_pretrained(
    model,
    save_directory: str | os.PathLike,
    safe_serialization: bool = True,
    max_shard_size: int | str | None = None,
    progress: Callable[[int], None] | None = None,
    state_dict: dict[str, Tensor] | None = None,
    is_main_process: bool = True,
) -> None:
    """Write an HF folder: config.json and the weights (sharded with an index when larger than
    max_shard_size). A model already there is replaced as a whole, in one step (files.py's
    replace_folder): killed or failing at any moment, the folder holds the old model or the new
    one. Other files in it (tokenizer files, a README) are kept.
    progress(n) is called with each n bytes of tensor data written. As in transformers,
    state_dict replaces model.state_dict() (e.g. one gathered from FSDP shards), and the other
    ranks of a distributed run pass is_main_process=False and write nothing."""
    if not is_main_process:
        return
    with replace_folder(save_directory, keep=lambda name: not MODEL_FILE.fullmatch(name)) as folder:
        write_model(model, folder, safe_serialization, max_shard_size, progress, state_dict)


def write_model(
    model,
    folder: Path,
    safe_serialization: bool = True,
    max_shard_size: int | str | None = None,
    progress: Callable[[int], None] | None = None,
    state_dict: dict[str, Tensor] | None = None,
) -> None:
    """The files of save_pretrained, written into `folder` (a new folder from replace_folder)."""
    state = tensors_to_save(model, state_dict)
    ext, stem = (".safetensors", "model") if safe_serialization else (".bin", "pytorch_model")
    shards = split_shards(state, parse_size(max_shard_size))
    if len(shards) == 1:
        names = [stem + ext]
    else:
        names = [f"{stem}-{i + 1:05d}-of-{len(shards):05d}{ext}" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        if safe_serialization:
            write_safetensors(folder / name, shard, progress)
        else:
            write_bin(folder / name, shard, progress)
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
            "weight_map": {key: name for name, shard in zip(names, shards) for key in shard},
        }
        write_json(folder / (SAFE_INDEX if safe_serialization else BIN_INDEX), index)
    config = model.config.to_dict()
    config["architectures"] = [type(model).__name__]
    record_dtype(config, state)
    write_json(folder / CONFIG_NAME, config)
    if hasattr(model, "generate"):
        save_generation_config(model, folder)


def record_dtype(config: dict[str, Any], state: dict[str, Tensor]) -> None:
    """config.json's dtype: the written weights' (their first floating tensor's), under both names,
    transformers 5's `dtype` (which it reads first) and 4's `torch_dtype`, so that 'auto' loads
    what was written whatever dtype the model was loaded with."""
    dtype = next((t.dtype for t in state.values() if t.is_floating_point()), None)
    if dtype is not None:
        config["dtype"] = config["torch_dtype"] = str(dtype).removeprefix("torch.")


def tensors_to_save(model, state_dict: dict[str, Tensor] | None = None) -> dict[str, Tensor]:
    """The state dict (model's own unless one is given) on the CPU, contiguous, with a tied
    lm_head.weight left out (as HF does: it is wte's tensor, and safetensors refuses to store one
    tensor twice; a gathered state dict may hold two copies of it, and from_pretrained ties them)."""
    state = model.state_dict() if state_dict is None else dict(state_dict)
    head, wte = state.get("lm_head.weight"), state.get("transformer.wte.weight")
    if head is not None and wte is not None and (head.data_ptr() == wte.data_ptr() or _is_tied(model)):
        del state["lm_head.weight"]
    return {name: t.detach().to("cpu").contiguous() for name, t in state.items()}


def _is_tied(model) -> bool:
    head = model.get_output_embeddings()
    return head is not None and getattr(head, "weight", None) is model.get_input_embeddings().weight  # quantize()'s heads hold none


def parse_size(size: int | str | None) -> int | None:
    """Bytes from an int or a string such as '500MB', '2GB', '10KiB'."""
    if size is None or isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", str(size), re.IGNORECASE)
    if m is None:
        raise ValueError(f"max_shard_size {size!r}: use bytes (int) or a string such as '500MB' or '2GB'")
    units = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    return int(float(m.group(1)) * units[(m.group(2) or "B").upper()])


def split_shards(state: dict[str, Tensor], max_bytes: int | None) -> list[dict[str, Tensor]]:
    """Consecutive groups of tensors of at most max_bytes each (a larger tensor gets its own)."""
    shards: list[dict[str, Tensor]] = [{}]
    used = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if max_bytes is not None and shards[-1] and used + nbytes > max_bytes:
            shards.append({})
            used = 0
        shards[-1][name] = t
        used += nbytes
    return shards


def write_safetensors(path: Path, state: dict[str, Tensor], progress: Callable[[int], None] | None = None) -> None:
    """The safetensors format: 8-byte header length, JSON header, then the tensors' bytes, each
    tensor read from a mapped file unmapped once written (memory.release_file_pages)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": SAFE_CODES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned

    def write(f) -> None:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for t in state.values():
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy().data)
                release_file_pages(t)  # a tensor read from a mapped file: its pages, once written
            if progress:
                progress(t.numel() * t.element_size())

    write_atomic(path, write)


def write_bin(path: Path, state: dict[str, Tensor], progress: Callable[[int], None] | None = None) -> None:
    write_atomic(path, lambda f: torch.save(state, f))
    if progress:
        progress(sum(t.numel() * t.element_size() for t in state.values()))


def write_json(path: Path, data: dict[str, Any]) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
