"""llm.c's GPT-2 model files (`gpt2_124M.bin`, written by its train_gpt2.py's write_model).

Layout: a header of 256 little-endian int32 (header[0] magic 20240326, header[1] version: 3 for
fp32 tensors, 5 for bf16; header[2..7] maxT, V, L, H, C, Vp), then every parameter in llm.c's
order: wte padded to Vp rows, wpe, then each per-layer tensor for all L layers in turn, ln_f.
Linear weights are stored (out, in), Conv1D's transpose; the head is wte (tied). llm.c's own
tokenizer is a separate file (gpt2_tokenizer.bin), so none is read or written here.

Reading memory-maps the file, one map per tensor (state_dict.mapped_bytes): tensors are views of
it (the linear weights transposed views) until a dtype or device change copies them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..config import LIMITS, GPT2Config
from ..errors import CheckpointError
from ..files import write_atomic
from ..memory import release_file_pages
from .state_dict import DTYPE_NAMES, mapped_bytes, normalize_keys

NAME = "llmc"
SUFFIXES = (".bin",)

MAGIC = 20240326
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
VERSIONS = {3: torch.float32, 5: torch.bfloat16}
VERSION_OF = {dtype: version for version, dtype in VERSIONS.items()}
SIZE_FIELDS = ("maxT", "V", "L", "H", "C", "Vp")  # header[2..7]
# Each size's largest value: GPT2Config's limit of the field it becomes (Vp: V's, rounded up).
SIZE_LIMITS = {"maxT": LIMITS["n_positions"], "V": LIMITS["vocab_size"], "L": LIMITS["n_layer"],
               "H": LIMITS["n_head"], "C": LIMITS["n_embd"], "Vp": LIMITS["vocab_size"] + 128}
VOCAB_MULTIPLE = 128  # llm.c's pad_vocab rounds V up to a multiple of this
# The per-layer tensors in llm.c's order (each for all L layers before the next).
LAYER_TENSORS = (
    "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight", "attn.c_proj.bias",
    "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias",
)
LINEARS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def detect(path: Path) -> bool:
    """A file that starts with llm.c's magic, or a .bin that is not PyTorch's (a zip or a pickle),
    so that a damaged llm.c header gets llm.c's errors."""
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        start = f.read(4)
    if start == MAGIC.to_bytes(4, "little"):
        return True
    return path.suffix == ".bin" and not start.startswith((b"PK", b"\x80"))


def layout(maxT: int, V: int, L: int, H: int, C: int, Vp: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(HF name, shape as stored) of every tensor, in file order."""
    shapes = {
        "ln_1.weight": (C,), "ln_1.bias": (C,), "attn.c_attn.weight": (3 * C, C), "attn.c_attn.bias": (3 * C,),
        "attn.c_proj.weight": (C, C), "attn.c_proj.bias": (C,), "ln_2.weight": (C,), "ln_2.bias": (C,),
        "mlp.c_fc.weight": (4 * C, C), "mlp.c_fc.bias": (4 * C,), "mlp.c_proj.weight": (C, 4 * C),
        "mlp.c_proj.bias": (C,),
    }
    yield "transformer.wte.weight", (Vp, C)
    yield "transformer.wpe.weight", (maxT, C)
    for tensor in LAYER_TENSORS:
        for i in range(L):
            yield f"transformer.h.{i}.{tensor}", shapes[tensor]
    yield "transformer.ln_f.weight", (C,)
    yield "transformer.ln_f.bias", (C,)


def read_header(path: Path) -> tuple[torch.dtype, dict[str, int]]:
    """The tensors' dtype and the sizes (maxT, V, L, H, C, Vp), after llm.c's checks (magic,
    version) and ours: positive sizes, C a multiple of H, V <= Vp, and a file exactly as long as
    the sizes say."""
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise CheckpointError(path, f"truncated llm.c model file: {size} bytes, the header alone is {HEADER_BYTES}")
    with open(path, "rb") as f:
        header = [int.from_bytes(f.read(4), "little", signed=True) for _ in range(8)]
    if header[0] != MAGIC:
        raise CheckpointError(path, f"not an llm.c model file: magic (header[0]) is {header[0]}, expected {MAGIC}")
    if header[1] not in VERSIONS:
        raise CheckpointError(path, f"unsupported llm.c version (header[1]) {header[1]}: "
                                    f"gpt2attn reads 3 (fp32) and 5 (bf16)")
    sizes = dict(zip(SIZE_FIELDS, header[2:8]))
    for i, (field, value) in enumerate(sizes.items(), start=2):
        if value <= 0:
            raise CheckpointError(path, f"llm.c header field {field} (header[{i}]) is {value}, must be positive")
        if value > SIZE_LIMITS[field]:
            raise CheckpointError(path, f"llm.c header field {field} (header[{i}]) is {value}, above gpt2attn's "
                                        f"limit of {SIZE_LIMITS[field]} (see docs/hostile-files.md)")
    if sizes["C"] % sizes["H"]:
        raise CheckpointError(path, f"llm.c header fields C (header[6]) = {sizes['C']} and H (header[5]) = "
                                    f"{sizes['H']}: C must be a multiple of H")
    if sizes["V"] > sizes["Vp"]:
        raise CheckpointError(path, f"llm.c header field V (header[3]) = {sizes['V']} is larger than the padded "
                                    f"vocabulary Vp (header[7]) = {sizes['Vp']}")
    dtype = VERSIONS[header[1]]
    needed = HEADER_BYTES + parameter_count(**sizes) * dtype.itemsize
    if size != needed:
        described = ", ".join(f"{k}={v}" for k, v in sizes.items())
        problem = "truncated: " if size < needed else ""
        raise CheckpointError(path, f"{problem}the llm.c header's sizes ({described}, version {header[1]}) need "
                                    f"{needed} bytes, the file has {size}")
    return dtype, sizes


def parameter_count(maxT: int, V: int, L: int, H: int, C: int, Vp: int) -> int:
    """The number of values layout() lists, by arithmetic (no walk over L layers): wte, wpe,
    per layer 12 C^2 (c_attn 3, c_proj 1, c_fc 4, mlp c_proj 4) and 13 C (biases and norms), ln_f."""
    return Vp * C + maxT * C + L * (12 * C * C + 13 * C) + 2 * C


def read(path: Path) -> tuple[GPT2Config, dict[str, Tensor], None]:
    """The config from the header and the state dict: memory-mapped views, wte cut back to V rows,
    linear weights transposed to Conv1D's (in, out); no lm_head (tied)."""
    dtype, sizes = read_header(path)
    state, offset = {}, HEADER_BYTES
    with open(path, "rb") as f:
        for name, shape in layout(**sizes):
            nbytes = math.prod(shape) * dtype.itemsize
            tensor = mapped_bytes(f, offset, nbytes).view(dtype).view(shape)
            offset += nbytes
            state[name] = tensor.t() if name.endswith(LINEARS) else tensor
    state["transformer.wte.weight"] = state["transformer.wte.weight"][: sizes["V"]]  # (V, C)
    config = GPT2Config(vocab_size=sizes["V"], n_positions=sizes["maxT"], n_embd=sizes["C"], n_layer=sizes["L"],
                        n_head=sizes["H"], activation_function="gelu_new", tie_word_embeddings=True)
    return config, state, None


def write(path: Path, state_dict: dict[str, Tensor], config: GPT2Config, *, dtype: Any = None,
          tokenizer: Any = None) -> None:
    """An llm.c model file of a GPT2LMHeadModel's state dict: fp32 (version 3) or bf16 (version 5;
    dtype=None keeps bf16 weights bf16, anything else is written fp32), wte padded with zero rows
    to a multiple of 128, written atomically and tensor by tensor (each converted just before it
    is written, and unmapped once written where it was read from a mapped file:
    memory.release_file_pages). A model llm.c cannot run is refused, naming the field.
    The tokenizer is not stored (llm.c keeps it in its own file)."""
    path = Path(path)
    state = normalize_keys(state_dict, prefixed=True)
    V, C = config.vocab_size, config.n_embd
    sizes = dict(maxT=config.n_positions, V=V, L=config.n_layer, H=config.n_head, C=C,
                 Vp=-(-V // VOCAB_MULTIPLE) * VOCAB_MULTIPLE)
    missing = [name for name, _ in layout(**sizes) if name not in state]
    if missing:
        raise ValueError(f"{path}: cannot write an llm.c file: the state dict has no {', '.join(missing)}")
    if dtype is None:
        dtype = torch.bfloat16 if state["transformer.wte.weight"].dtype == torch.bfloat16 else torch.float32
    stored = dtype if isinstance(dtype, torch.dtype) else DTYPE_NAMES.get(str(dtype))
    if stored not in VERSION_OF:
        raise ValueError(f"{path}: llm.c stores fp32 or bf16 tensors, not {dtype}")
    check_writable(path, state, config)
    for name, shape in layout(**sizes):
        if tuple(state[name].shape) != stored_shape(name, shape, V):
            raise ValueError(f"{path}: cannot write an llm.c file: {name} has shape {tuple(state[name].shape)}, "
                             f"the config asks for {stored_shape(name, shape, V)}")
    header = torch.zeros(HEADER_INTS, dtype=torch.int32)
    header[0], header[1] = MAGIC, VERSION_OF[stored]
    header[2:8] = torch.tensor(list(sizes.values()), dtype=torch.int32)

    def write_file(f) -> None:  # tensor by tensor, each converted just before it is written
        f.write(header.numpy().tobytes())
        for name, _ in layout(**sizes):
            f.write(stored_data(name, state[name], stored).numpy().data)
            release_file_pages(state[name])  # a tensor read from a mapped file: its pages, once written
            if name == "transformer.wte.weight":  # padded to Vp rows with zeros
                f.write(bytes((sizes["Vp"] - V) * C * stored.itemsize))

    write_atomic(path, write_file)


def stored_data(name: str, tensor: Tensor, stored: torch.dtype) -> Tensor:
    """`tensor` as its bytes in the file (uint8): in `stored` on the CPU, linear weights as (out, in)."""
    tensor = tensor.detach().to("cpu", stored)
    tensor = tensor.t() if name.endswith(LINEARS) else tensor
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def stored_shape(name: str, shape: tuple[int, ...], V: int) -> tuple[int, ...]:
    """The shape the state dict must hold for a tensor llm.c stores as `shape`: Conv1D's (in, out)
    for llm.c's (out, in), wte unpadded (V rows)."""
    if name == "transformer.wte.weight":
        return (V, shape[1])
    return shape[::-1] if name.endswith(LINEARS) else shape


def check_writable(path: Path, state: dict[str, Tensor], config: GPT2Config) -> None:
    """llm.c runs one architecture: GELU (tanh), a 4C MLP, LayerNorm eps 1e-5, attention scaled by
    1/sqrt(head size) only, and the head tied to wte. Anything else would compute differently there."""
    problems = []
    if config.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
        problems.append(f"activation_function {config.activation_function!r} (llm.c uses GELU's tanh form, gelu_new)")
    if config.n_inner not in (None, 4 * config.n_embd):
        problems.append(f"n_inner {config.n_inner} (llm.c's MLP is 4 * n_embd = {4 * config.n_embd})")
    if config.layer_norm_epsilon != 1e-5:
        problems.append(f"layer_norm_epsilon {config.layer_norm_epsilon} (llm.c uses 1e-5)")
    if not config.scale_attn_weights or config.scale_attn_by_inverse_layer_idx:
        problems.append("scale_attn_weights / scale_attn_by_inverse_layer_idx (llm.c scales by 1/sqrt(head size) only)")
    if config.add_cross_attention:
        problems.append("add_cross_attention (llm.c has no cross-attention)")
    head, wte = state.get("lm_head.weight"), state["transformer.wte.weight"]
    if head is not None and head.data_ptr() != wte.data_ptr() and not torch.equal(head, wte):
        problems.append("lm_head.weight differs from wte (llm.c ties the head to the token embedding)")
    if problems:
        raise ValueError(f"{path}: cannot write an llm.c file of this model: " + "; ".join(problems))
