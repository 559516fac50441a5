"""Checkpoint files: load GPT-2 weights from wherever they live, save Hugging Face folders.

Sources `from_pretrained` accepts: an HF model folder (`model.safetensors`, sharded safetensors
with an index, or `pytorch_model.bin`), a single weights file, a state dict, a hub name found
through `huggingface_hub`'s cache, or OpenAI's TensorFlow release (see tf_checkpoint.py).

The model is built on the meta device and the loaded tensors are assigned into it, so weights
are materialised once: safetensors files are memory-mapped and their tensors used in place.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import pickle
import re
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .config import GPT2Config
from .files import replace_folder, write_atomic, write_text_atomic

CONFIG_NAME = "config.json"
SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
BIN_WEIGHTS = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
TF_INDEX = "model.ckpt.index"

# safetensors dtype codes <-> torch dtypes.
SAFE_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
SAFE_CODES = {dtype: code for code, dtype in SAFE_DTYPES.items()}
DTYPE_NAMES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
# Old HF checkpoints stored the causal mask as buffers; we build it on the fly.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".crossattention.bias", ".crossattention.masked_bias")
# The GPT-2 body's keys (GPT2Model's, or under "transformer."); every other key is a head's:
# lm_head, score, classifier, qa_outputs, multiple_choice_head.
BODY_PREFIXES = ("wte.", "wpe.", "h.", "ln_f.")
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
# n_head for OpenAI's sizes, used when a bare state dict comes without a config.
N_HEAD_BY_WIDTH = {768: 12, 1024: 16, 1280: 20, 1600: 25}


# --- loading --------------------------------------------------------------------------------


def from_pretrained(
    cls: type,
    src: Any,
    dtype: Any = None,
    device: Any = None,
    config: GPT2Config | None = None,
    cache_dir: str | os.PathLike | None = None,
    local_files_only: bool = False,
    torch_dtype: Any = None,
    **config_kwargs: Any,
):
    """Build `cls` (GPT2Model, GPT2LMHeadModel or a head) with the weights of `src`, in eval mode.

    dtype: None (as stored), a torch dtype, a name ('bf16', 'float16', ...) or 'auto' (the
    config's torch_dtype). device: where the weights go. Both apply while loading. Other keywords
    override config fields, as in transformers (`num_labels=3`, `pad_token_id=50256`).
    """
    dtype = dtype if dtype is not None else torch_dtype
    where = "state dict"
    if not isinstance(src, dict):
        path = resolve(src, cache_dir=cache_dir, local_files_only=local_files_only)
        if path.is_file() and path.suffix in (".pt", ".ckpt"):  # e.g. nanoGPT's out/ckpt.pt
            src, where = read_bin(path), str(path)
    if isinstance(src, dict) and not all(isinstance(t, Tensor) for t in src.values()):
        nanogpt_config, state = from_nanogpt(src, where)  # a training checkpoint, not a state dict
        config = config or nanogpt_config
    elif isinstance(src, dict):
        state = src
        config = config or infer_config(state)
    else:
        if path.is_dir() and (path / TF_INDEX).exists() and not (path / CONFIG_NAME).exists():
            from .tf_checkpoint import load_tf_checkpoint

            tf_config, state = load_tf_checkpoint(path)
            config, where = config or tf_config, str(path / TF_INDEX)
        else:
            state, config_file, where = read_weights(path)
            if config is None:
                config = read_config(config_file) if config_file is not None else infer_config(state)
    if config_kwargs:  # set on a copy after it is read, so num_labels=3 replaces id2label, as in transformers
        config = GPT2Config.from_dict(config.to_dict())
        for key, value in config_kwargs.items():
            setattr(config, key, value)
        config.validate()
    # A caller's state dict is copied, so the new model does not share storage with its source.
    copy = isinstance(src, dict)
    model = build_model(cls, config, state, resolve_dtype(dtype, config), device, where, copy)
    if not isinstance(src, dict) and path.is_dir() and hasattr(cls, "generate"):
        from .generation.config import load_generation_config

        load_generation_config(model, path)
    return model


def build_model(cls: type, config: GPT2Config, state: dict[str, Tensor], dtype, device, where: str, copy: bool):
    """A `cls` on the meta device, then the checked tensors assigned into it."""
    with torch.device("meta"), no_random_init():
        model = cls(config)
    expected = model.state_dict()  # meta tensors: names and shapes only
    state = normalize_keys(state, prefixed="transformer.wte.weight" in expected)
    tied = "lm_head.weight" in expected and (config.tie_word_embeddings or "lm_head.weight" not in state)
    if tied:
        state.pop("lm_head.weight", None)
    skip = {"lm_head.weight"} if tied else set()
    new_head = fit_head_keys(state, expected, skip, type(model).__name__, where)
    check_state(state, expected, skip=skip | set(new_head), where=where)
    device = torch.device(device) if device is not None else None
    if new_head:
        stored = next((t.dtype for t in state.values() if t.is_floating_point()), None)
        init_new_head(model, new_head, config, device, dtype or stored)
    state = {name: cast(t, dtype, device, copy) for name, t in state.items()}
    model.load_state_dict(state, strict=False, assign=True)
    if tied:  # by the config, or because the checkpoint has no head of its own
        model.lm_head.weight = model.transformer.wte.weight
    return model.eval()


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
    """Move to device / dtype in one step (floating tensors only change dtype)."""
    target = dtype if dtype is not None and t.is_floating_point() else t.dtype
    return t.detach().to(device=device if device is not None else t.device, dtype=target, copy=copy)


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
        warnings.warn(f"{where}: {cls} does not use these weights of the checkpoint: {unused}", stacklevel=5)
    if new:
        warnings.warn(
            f"{where}: {cls} has weights the checkpoint lacks, newly initialised (train them before use): "
            f"{', '.join(new)}", stacklevel=5,
        )
    return new


def init_new_head(model: nn.Module, names: list[str], config: GPT2Config, device, dtype) -> None:
    """Materialise the head modules that own `names` (built on meta) with transformers' init."""
    from .layers import init_weights

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
        problems.append(f"missing keys: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {', '.join(unexpected)}")
    for name, tensor in state.items():
        if name in expected and tuple(tensor.shape) != tuple(expected[name].shape):
            problems.append(
                f"shape mismatch for {name}: expected {tuple(expected[name].shape)}, found {tuple(tensor.shape)}"
            )
    if problems:
        raise ValueError(f"{where}: checkpoint does not fit the model; " + "; ".join(problems))


def resolve_dtype(dtype: Any, config: GPT2Config) -> torch.dtype | None:
    """None, a torch dtype, a name, or 'auto' (config.json's torch_dtype / dtype, if any)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        name = config.extra.get("torch_dtype") or config.extra.get("dtype")
        return DTYPE_NAMES[name] if name in DTYPE_NAMES else None
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_NAMES)} or 'auto'")
    return DTYPE_NAMES[name]


def read_config(path: Path) -> GPT2Config:
    try:
        return GPT2Config.from_json_file(path)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path}: {e}") from None


# nanoGPT's nn.Linear weights are (out, in); GPT-2's Conv1D stores (in, out).
NANOGPT_LINEARS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
BIASES = ("ln_1.bias", "attn.c_attn.bias", "attn.c_proj.bias", "ln_2.bias", "mlp.c_fc.bias", "mlp.c_proj.bias")


def from_nanogpt(checkpoint: dict[str, Any], where: str) -> tuple[GPT2Config, dict[str, Tensor]]:
    """Config and GPT-2 state dict of a nanoGPT training checkpoint ({'model', 'model_args', ...}),
    so that the model computes what nanoGPT's does: its MLP uses the exact GELU (nn.GELU()), and a
    model trained with bias=False gets zero biases. Linear weights are transposed."""
    missing = [key for key in ("model", "model_args") if key not in checkpoint]
    if missing:
        raise ValueError(f"{where}: not a state dict (not every value is a tensor), and not a nanoGPT "
                         f"checkpoint: no {' or '.join(map(repr, missing))} field")
    model, args = checkpoint["model"], checkpoint["model_args"]
    if not isinstance(model, dict) or not all(isinstance(t, Tensor) for t in model.values()):
        raise ValueError(f"{where}: the nanoGPT checkpoint's 'model' is not a state dict of tensors")
    if not isinstance(args, dict):
        raise ValueError(f"{where}: the nanoGPT checkpoint's 'model_args' is a {type(args).__name__}, not a dict")
    missing = [key for key in ("vocab_size", "block_size", "n_embd", "n_layer", "n_head") if key not in args]
    if missing:
        raise ValueError(f"{where}: the nanoGPT checkpoint's 'model_args' has no {', '.join(missing)}")
    dropout = args.get("dropout", 0.0)
    try:
        config = GPT2Config(
            vocab_size=args["vocab_size"],
            n_positions=args["block_size"],
            n_embd=args["n_embd"],
            n_layer=args["n_layer"],
            n_head=args["n_head"],
            activation_function="gelu",
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: model_args: {e}") from None
    state = {}
    for name, t in normalize_keys(model, prefixed=True).items():
        state[name] = t.t().contiguous() if name.endswith(NANOGPT_LINEARS) else t
    if not args.get("bias", True):
        C = config.n_embd
        widths = {"attn.c_attn.bias": 3 * C, "mlp.c_fc.bias": config.inner_dim}
        for i in range(config.n_layer):
            for bias in BIASES:
                state.setdefault(f"transformer.h.{i}.{bias}", torch.zeros(widths.get(bias, C)))
        state.setdefault("transformer.ln_f.bias", torch.zeros(C))
    return config, state


def infer_config(state: dict[str, Tensor]) -> GPT2Config:
    """A config from a bare state dict's shapes (n_head from OpenAI's sizes)."""
    state = normalize_keys(state, prefixed=False)
    if "wte.weight" not in state or "wpe.weight" not in state:
        raise ValueError("state dict has no wte.weight / wpe.weight: is it a GPT-2 state dict?")
    vocab_size, n_embd = state["wte.weight"].shape
    layers = {int(m.group(1)) for k in state if (m := re.match(r"h\.(\d+)\.", k))}
    if n_embd not in N_HEAD_BY_WIDTH:
        raise ValueError(f"cannot tell n_head for width {n_embd}: pass config=GPT2Config(...) with the state dict")
    return GPT2Config(
        vocab_size=vocab_size,
        n_positions=state["wpe.weight"].shape[0],
        n_embd=n_embd,
        n_layer=len(layers),
        n_head=N_HEAD_BY_WIDTH[n_embd],
        n_inner=state["h.0.mlp.c_fc.weight"].shape[1] if "h.0.mlp.c_fc.weight" in state else None,
    )


def read_weights(path: Path) -> tuple[dict[str, Tensor], Path | None, str]:
    """The state dict of a folder or a single weights file, the config.json beside it, and
    the weights file (or shard index) to name in errors."""
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
        shard = read_safetensors(file) if file.suffix == ".safetensors" else read_bin(file)
        if weight_map is not None:
            check_shard(where, file.name, shard, weight_map)
        state.update(shard)
    if weight_map is not None and (unlisted := [key for key in weight_map if key not in state]):
        raise ValueError(f"{where}: lists tensors that no shard holds: {', '.join(unlisted)}")
    return state, config_file, str(files[0] if len(files) == 1 else where)


def shard_files(index_path: Path) -> tuple[list[Path], dict[str, str], str]:
    """The shard files, weight_map (tensor name -> file name) and name of a shard index, checked:
    weight_map is an object of file names in the index's own folder (names leading elsewhere are
    refused), and every file exists."""
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{index_path}: not a valid shard index: not JSON ({e})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        found = type(index).__name__ if not isinstance(index, dict) else f"a weight_map of type {type(weight_map).__name__}"
        raise ValueError(f"{index_path}: not a valid shard index: expected an object with a 'weight_map' object "
                         f"(tensor name -> file name), found {found}")
    for key, name in weight_map.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"{index_path}: weight_map[{key!r}] is {name!r}, not a file name")
        if name != os.path.basename(name) or name in (".", "..") or "\\" in name:
            raise ValueError(f"{index_path}: refused: shard {name!r} is a path, not a file name in the index's folder")
    files = [index_path.parent / name for name in dict.fromkeys(weight_map.values())]
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"{index_path} lists shard {file.name}, which is missing")
    return files, weight_map, str(index_path)


def check_shard(where: str, name: str, shard: dict[str, Tensor], weight_map: dict[str, str]) -> None:
    """A shard holds exactly the tensors the index places in it (no shard of another save)."""
    stray = [key for key in shard if weight_map.get(key) != name]
    if stray:
        raise ValueError(f"{where}: shard {name} holds tensors the index does not place there: {', '.join(stray)}")


def read_bin(path: Path) -> dict[str, Tensor]:
    state = torch_load(path)
    if not isinstance(state, dict):
        raise ValueError(f"{path}: holds a {type(state).__name__}, not a state dict")
    return state


def torch_load(path: Path) -> Any:
    """torch.load with weights_only=True (memory-mapped when the file is in the zip format);
    errors name the file and say whether it was refused or could not be read."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
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
        raise ValueError(f"{path}: cannot read this PyTorch checkpoint (truncated or corrupt?): {e}") from None


def refused(path: Path, error: Exception) -> ValueError:
    """The error for a pickle that weights-only loading refuses (it would run or build objects)."""
    message = str(error)
    if "Weights only load failed" not in message:
        return ValueError(f"{path}: cannot read this PyTorch checkpoint (truncated or corrupt?): {message}")
    what = re.search(r"GLOBAL [\w.]+", message)
    return ValueError(f"{path}: refused: holds objects that weights-only loading does not allow"
                      + (f" ({what.group(0)})" if what else ""))


def read_safetensors(path: Path) -> dict[str, Tensor]:
    """Tensors of a .safetensors file as views of a (copy-on-write) memory map: nothing is
    copied until a tensor is used or converted. The header is checked as the format requires."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size < 8:
            raise ValueError(f"{path}: truncated safetensors file ({size} bytes)")
        header_len = int.from_bytes(f.read(8), "little")
        if header_len > size - 8:
            raise ValueError(f"{path}: corrupt or truncated safetensors file (header of {header_len} bytes)")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: corrupt safetensors header ({e})") from None
        data_start = 8 + header_len
        entries = check_safetensors_header(path, header, size - data_start)
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size > data_start else b""
    state = {}
    for name, dtype, shape, begin, end in entries:
        if end == begin:
            state[name] = torch.empty(shape, dtype=dtype)
        else:
            flat = torch.frombuffer(buffer, dtype=torch.uint8, count=end - begin, offset=data_start + begin)
            state[name] = flat.view(dtype).view(shape)
    return state


def check_safetensors_header(path: Path, header: Any, data_size: int) -> list[tuple]:
    """(name, dtype, shape, begin, end) of each tensor, after the checks the format asks for: an
    object; `__metadata__` an object of strings; a known dtype; a shape of non-negative ints;
    data_offsets a pair of ints whose span is the shape's size; tensors that tile the data region
    exactly, in order, without gaps or overlaps."""
    def bad(message: str) -> ValueError:
        return ValueError(f"{path}: corrupt safetensors header: {message}")

    if not isinstance(header, dict):
        raise bad(f"a JSON {type(header).__name__}, not an object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise bad(f"__metadata__ must be an object of strings, found {metadata!r}")
    entries = []
    for name, info in header.items():
        if not isinstance(info, dict):
            raise bad(f"tensor {name}: {info!r} is not an object")
        dtype = SAFE_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise bad(f"tensor {name} has unsupported dtype {info.get('dtype')!r}")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not isinstance(shape, list) or not all(is_int(n) and n >= 0 for n in shape):
            raise bad(f"tensor {name}: shape {shape!r} is not a list of non-negative integers")
        if not isinstance(offsets, list) or len(offsets) != 2 or not all(is_int(n) for n in offsets):
            raise bad(f"tensor {name}: data_offsets {offsets!r} is not a pair of integers")
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
        raise ValueError(f"{path}: truncated: the tensors need {covered} bytes of data, the file has {data_size}")
    if covered < data_size:
        raise bad(f"the tensors cover {covered} bytes of data, the file has {data_size}")
    return entries


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def resolve(src: str | os.PathLike, cache_dir=None, local_files_only: bool = False) -> Path:
    """A local path as it is; otherwise a hub name, looked up through huggingface_hub."""
    path = Path(src).expanduser()
    if path.exists():
        return path
    name = str(src)
    if name.startswith((".", "/", "~")) or name.count("/") > 1 or not re.fullmatch(r"[\w.\-/]+", name):
        raise FileNotFoundError(f"{src}: no such file or folder")
    return download(name, cache_dir, local_files_only)


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def download(repo_id: str, cache_dir=None, local_files_only: bool = False) -> Path:
    """The snapshot folder of a hub model (config + one weights format), cached by huggingface_hub."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    offline = local_files_only or hub_offline()
    # 'gpt2' now lives at 'openai-community/gpt2'; a cache may hold either name.
    names = [repo_id] if "/" in repo_id else [repo_id, f"openai-community/{repo_id}"]
    for name in names:
        try:
            folder = Path(
                snapshot_download(name, cache_dir=cache_dir, local_files_only=True, allow_patterns=["*.json"])
            )
            if has_weights(folder):
                return folder
        except LocalEntryNotFoundError:
            pass
    if offline:
        raise FileNotFoundError(
            f"{repo_id!r} is not a local path and is not in the Hugging Face cache, and downloads are off "
            f"(HF_HUB_OFFLINE=1 or local_files_only). Download it once with network access "
            f"(`hf download {names[-1]}`), or pass a local folder."
        )
    try:
        patterns = ["*.json", "*.txt", "*.safetensors"]  # config, tokenizer, weights
        folder = Path(snapshot_download(names[-1], cache_dir=cache_dir, allow_patterns=patterns))
    except Exception as e:  # network errors, missing repos, gated repos: all say why
        raise FileNotFoundError(f"could not download {names[-1]!r} from the Hugging Face hub: {e}") from None
    return folder


def has_weights(folder: Path) -> bool:
    return any((folder / name).exists() for name in (SAFE_WEIGHTS, SAFE_INDEX, BIN_WEIGHTS, BIN_INDEX))


# --- saving ---------------------------------------------------------------------------------

# The files of a model that save_pretrained writes; anything else in the folder is kept.
MODEL_FILE = re.compile(r"config\.json|(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?")


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
    config["torch_dtype"] = str(model.dtype).removeprefix("torch.")
    write_json(folder / CONFIG_NAME, config)
    if hasattr(model, "generate"):
        from .generation.config import save_generation_config

        save_generation_config(model, folder)


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
    return head is not None and head.weight is model.get_input_embeddings().weight


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
    """The safetensors format: 8-byte header length, JSON header, then the tensors' bytes."""
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
            if progress:
                progress(t.numel() * t.element_size())

    write_atomic(path, write)


def write_bin(path: Path, state: dict[str, Tensor], progress: Callable[[int], None] | None = None) -> None:
    write_atomic(path, lambda f: torch.save(state, f))
    if progress:
        progress(sum(t.numel() * t.element_size() for t in state.values()))


def write_json(path: Path, data: dict[str, Any]) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
