"""GGUF, the model file of llama.cpp, Ollama and LM Studio, for GPT-2 (`general.architecture = gpt2`).

A GGUF file holds key-value metadata (the config under `gpt2.*`, the BPE tokenizer under
`tokenizer.ggml.*`) and named tensors, each of a GGML type: F32, F16, BF16 or a block-quantized
one (Q8_0, Q4_0, ..., Q6_K). Names and layouts are llama.cpp's (`blk.{i}.attn_qkv.weight`, ...):
its four linear weights are stored as Linear's (out, in) and come back here as Conv1D's (in, out).
The file is parsed here (GGUFFile) and memory-mapped; every tensor is read as float32 (llama.cpp
computes in F32 too): F32 ones stay views of the file; F16/BF16 are widened, and the quantized
types dequantized by the reference code of the `gguf` package (the extra `gpt2attn[gguf]`), each
only when the loader uses it (state_dict.read_later). The package also writes (Q4_K, which it
cannot write, by gpt2attn.q4_k: dtype 'q4').

Written as llama.cpp's convert_hf_to_gguf.py writes a GPT-2: the same keys and tensor names,
1-D tensors and position embeddings in F32, `output.weight` beside `token_embd.weight`, and the
tokenizer embedded when it is GPT-2's byte-level BPE, or a character vocabulary of ASCII characters
(char_tokenizer's): each character is then one byte, written as a byte-level token with no merges,
and read back as the character tokenizer it was.
"""

from __future__ import annotations

import functools
import json
import math
import mmap
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..config import LIMITS, GPT2Config, inner_dim, is_int
from ..errors import CheckpointError
from ..files import write_atomic
from ..memory import release_file_pages
from ..q4_k import keeps_8_bits, quantize_rows
from ..tokenizer import EOS_TOKEN, _byte_level_alphabet, byte_level_bpe, characters, is_characters
from .state_dict import MAX_DIM_SIZE, mapped_bytes, normalize_keys, read_later

NAME = "gguf"
SUFFIXES = (".gguf",)
MAGIC = b"GGUF"

# llama.cpp's tensor names -> ours; blk.{i}.NAME -> transformer.h.{i}.NAME
GLOBAL_NAMES = {
    "token_embd.weight": "transformer.wte.weight",
    "position_embd.weight": "transformer.wpe.weight",
    "output_norm.weight": "transformer.ln_f.weight",
    "output_norm.bias": "transformer.ln_f.bias",
    "output.weight": "lm_head.weight",
}
BLOCK_NAMES = {
    "attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj",
    "ffn_norm": "ln_2", "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj",
}
LINEARS = ("attn_qkv.weight", "attn_output.weight", "ffn_up.weight", "ffn_down.weight")  # (out, in) in GGUF
READ_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
# ggml's type ids and (values per block, bytes per block), for the table of tensors (ggml.h)
GGML_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K",
              11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 30: "BF16"}
GGML_BLOCKS = {"F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22),
               "Q5_1": (32, 24), "Q8_0": (32, 34), "Q8_1": (32, 36), "Q2_K": (256, 84), "Q3_K": (256, 110),
               "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210), "Q8_K": (256, 292)}
WRITE_TYPES = {"f32": ("F32", 0), "f16": ("F16", 1), "bf16": ("BF16", 32), "q8_0": ("Q8_0", 7),
               "q4": ("Q4_K", 15)}  # (type, file_type); q4: quantize()'s mode q4, Q4_K and Q8_0 (below)


def _gguf():
    try:
        import gguf
    except ImportError:
        raise ImportError("reading and writing GGUF files needs the gguf package: pip install 'gpt2attn[gguf]'") from None
    return gguf


def detect(path: Path) -> bool:
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == MAGIC


class GGUFFile:
    """A GGUF file's metadata (`fields`, key -> value) and tensor table (`tensors`, name ->
    (GGML type name, shape ne innermost first, byte offset, byte length)), parsed here: the `gguf`
    package's reader builds a numpy view per string, seconds for GPT-2's 100k tokenizer strings.
    The tensor data stays on disk, memory-mapped (copy-on-write) when a tensor is asked for."""

    VALUE_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
    STRING, ARRAY = 8, 9

    MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
    MAX_NESTING = 2  # arrays of arrays at most (GPT-2's metadata has arrays of scalars and strings)

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            self.buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if path.stat().st_size else b""
        head = bytes(self.buffer[:8])
        if head[:4] != MAGIC:
            raise CheckpointError(path, f"not a GGUF file: magic is {head[:4]!r}, expected {MAGIC!r}")
        version = int.from_bytes(head[4:8], "little") if len(head) == 8 else None
        if version not in (2, 3):
            raise CheckpointError(path, f"unsupported GGUF version {version}: gpt2attn reads versions 2 and 3")
        self.pos, self.where = 8, "the header"
        try:
            n_tensors, n_fields = self.take("Q"), self.take("Q")
            # Each metadata entry takes at least 13 bytes, each tensor entry 28: counts the file
            # cannot hold are refused before any loop runs over them.
            if 13 * n_fields + 28 * n_tensors > len(self.buffer) - self.pos:
                raise struct.error(f"{n_tensors} tensors and {n_fields} metadata entries do not fit in "
                                   f"{len(self.buffer)} bytes")
            self.fields: dict[str, Any] = {}
            for _ in range(n_fields):
                self.where = "a metadata key"
                key = self.string()
                self.where = f"metadata {key}"
                self.fields[key] = self.value(self.take("I"))
            infos = []
            for _ in range(n_tensors):
                self.where = "a tensor name"
                name = self.string()
                self.where = f"tensor {name}'s header"
                n_dims = self.take("I")
                if not 1 <= n_dims <= self.MAX_DIMS:
                    raise struct.error(f"n_dims is {n_dims}, must be 1 to {self.MAX_DIMS}")
                ne = tuple(self.take("Q") for _ in range(n_dims))
                infos.append((name, self.take("I"), ne, self.take("Q")))
        except (struct.error, UnicodeDecodeError) as e:
            raise CheckpointError(path, f"truncated or damaged GGUF file: cannot read {self.where} at byte "
                                        f"{self.pos} ({e})") from None
        alignment = self.field("general.alignment", 32)
        if not is_int(alignment) or alignment < 8 or alignment % 8 or alignment > 2**16:
            raise CheckpointError(path, f"GGUF metadata general.alignment is {alignment!r}: must be a multiple of 8 "
                                        f"up to {2**16}")
        data_start = -(-self.pos // alignment) * alignment
        self.tensors = {}
        for name, type_id, ne, offset in infos:
            kind = GGML_TYPES.get(type_id)
            if kind is None:
                raise CheckpointError(path, f"tensor {name} has unknown GGML type id {type_id}")
            block, size = GGML_BLOCKS[kind]
            if any(not 1 <= n <= MAX_DIM_SIZE for n in ne) or ne[0] % block:
                raise CheckpointError(path, f"tensor {name} ({kind}) has shape {list(ne)}: each size must be 1 to "
                                            f"{MAX_DIM_SIZE}, the first a multiple of {kind}'s block of {block}")
            start, length = data_start + offset, math.prod(ne) // block * size
            if offset % alignment or start + length > len(self.buffer):
                raise CheckpointError(path, f"truncated or damaged GGUF file: tensor {name} ({kind}, {list(ne)}) "
                                            f"needs bytes {start}..{start + length} (aligned to {alignment}), the file "
                                            f"has {len(self.buffer)}")
            self.tensors[name] = (kind, ne, start, length)

    def take(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > len(self.buffer):
            raise struct.error(f"a string of {n} bytes runs past the end")
        text = bytes(self.buffer[self.pos : self.pos + n]).decode("utf-8")
        self.pos += n
        return text

    def value(self, kind: int, depth: int = 0) -> Any:
        if kind == self.STRING:
            return self.string()
        if kind == self.ARRAY:
            item, n = self.take("I"), self.take("Q")
            if depth >= self.MAX_NESTING:
                raise struct.error(f"arrays nested deeper than {self.MAX_NESTING}")
            if item in self.VALUE_FORMATS and item != 7:  # numbers: one numpy read
                dtype = np.dtype("<" + self.VALUE_FORMATS[item])
                if self.pos + n * dtype.itemsize > len(self.buffer):
                    raise struct.error(f"an array of {n} values runs past the end")
                values = np.frombuffer(self.buffer, dtype=dtype, count=n, offset=self.pos).tolist()
                self.pos += n * dtype.itemsize
                return values
            smallest = {7: 1, self.STRING: 8, self.ARRAY: 12}.get(item, 1)  # bytes per item, at least
            if self.pos + n * smallest > len(self.buffer):
                raise struct.error(f"an array of {n} values runs past the end")
            return [self.value(item, depth + 1) for _ in range(n)]
        if kind not in self.VALUE_FORMATS:
            raise struct.error(f"unknown value type {kind}")
        return self.take(self.VALUE_FORMATS[kind])

    def field(self, key: str, default: Any = ...) -> Any:
        if key not in self.fields:
            if default is ...:
                raise CheckpointError(self.path, f"GGUF metadata has no {key}")
            return default
        return self.fields[key]

    def integer(self, key: str, default: Any = ..., limit: str | None = None) -> int:
        """An integer field, >= 1 and within GPT2Config.LIMITS[limit] when limit names a size
        (else >= 0: a token id)."""
        value = self.field(key, default)
        low, high = (1, LIMITS[limit]) if limit else (0, 2**63 - 1)
        if not is_int(value) or not low <= value <= high:
            why = f" (gpt2attn's limit for {limit}; see docs/hostile-files.md)" if limit else ""
            raise CheckpointError(self.path, f"GGUF metadata {key} is {value!r:.80}: must be an integer "
                                             f"from {low} to {high}{why}")
        return value

    def number(self, key: str, default: float) -> float:
        value = self.field(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise CheckpointError(self.path, f"GGUF metadata {key} is {value!r:.80}: must be a positive finite number")
        return float(value)

    def strings(self, key: str, default: Any = ...) -> list[str]:
        value = self.field(key, default)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise CheckpointError(self.path, f"GGUF metadata {key} must be an array of strings, found {value!r:.80}")
        return value

    def same(self, a: str, b: str) -> bool:
        """Whether two tensors are stored alike: type, shape and bytes."""
        (kind_a, ne_a, start_a, length_a), (kind_b, ne_b, start_b, length_b) = self.tensors[a], self.tensors[b]
        return (kind_a, ne_a, length_a) == (kind_b, ne_b, length_b) and \
            self.buffer[start_a : start_a + length_a] == self.buffer[start_b : start_b + length_b]

    def tensor(self, name: str) -> Tensor:
        """A tensor as float32 in its numpy shape (rows = ne[1]): see read_tensor."""
        check_readable(self.path, name, self.tensors[name][0])
        return read_tensor(self.path, self.tensors[name])


def check_readable(path: Path, name: str, kind: str) -> None:
    """Refuse a type gpt2attn does not read, and a quantized one without the gguf package."""
    if kind not in READ_TYPES:
        raise CheckpointError(path, f"tensor {name} has GGML type {kind}, which gpt2attn does not read "
                                    f"(it reads {', '.join(READ_TYPES)})")
    if kind not in ("F32", "F16", "BF16"):
        _gguf()


def read_tensor(path: Path, entry: tuple, transpose: bool = False) -> Tensor:
    """The tensor `entry` (kind, ne, start, length) of the GGUF file at `path` as float32 in its
    numpy shape (rows = ne[1]; transposed if asked), through a map of its own, so the file's pages
    leave with it: F32 a view of the file, F16 and BF16 widened, quantized types dequantized by the
    gguf package's reference code. Its kind was checked by the caller (check_readable)."""
    kind, ne, start, length = entry
    shape = tuple(reversed(ne))
    with open(path, "rb") as f:
        raw = mapped_bytes(f, start, length)
    if kind == "F32":
        data = raw.view(torch.float32).view(shape)
    elif kind in ("F16", "BF16"):
        data = raw.view(torch.float16 if kind == "F16" else torch.bfloat16).view(shape).float()
    else:
        gguf = _gguf()
        blocks = raw.numpy().reshape(*shape[:-1], -1)  # each row's blocks, as gguf's dequantize takes them
        data = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind])).view(shape)
    return data.t() if transpose else data


def read_config(file: GGUFFile) -> GPT2Config:
    arch = file.field("general.architecture")
    if arch != "gpt2":
        raise CheckpointError(file.path, f"general.architecture is {arch!r:.80}; gpt2attn reads GPT-2 ('gpt2') GGUF files")
    if "token_embd.weight" not in file.tensors:
        raise CheckpointError(file.path, "GGUF has no token_embd.weight tensor")
    embedding = file.tensors["token_embd.weight"][1]
    if len(embedding) != 2:
        raise CheckpointError(file.path, f"tensor token_embd.weight has shape {list(embedding)}, not (n_embd, vocab)")
    n_embd = file.integer("gpt2.embedding_length", limit="n_embd")
    ff = file.integer("gpt2.feed_forward_length", 4 * n_embd, limit="n_inner")
    try:
        return GPT2Config(
            vocab_size=embedding[1],  # ne = (n_embd, vocab)
            n_positions=file.integer("gpt2.context_length", limit="n_positions"),
            n_embd=n_embd,
            n_layer=file.integer("gpt2.block_count", limit="n_layer"),
            n_head=file.integer("gpt2.attention.head_count", limit="n_head"),
            n_inner=None if ff == 4 * n_embd else ff,
            layer_norm_epsilon=_shortest_float32(file.number("gpt2.attention.layer_norm_epsilon", 1e-5)),
            bos_token_id=file.integer("tokenizer.ggml.bos_token_id", 50256),
            eos_token_id=file.integer("tokenizer.ggml.eos_token_id", 50256),
            activation_function="gelu_new",
        )
    except ValueError as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(file.path, f"the config its gpt2.* metadata gives: {e}") from None


def _shortest_float32(value: float) -> float:
    """A float32 field as the shortest decimal that rounds to it: 1e-06 as written, not 9.99999997e-07."""
    return float(str(np.float32(value)))


def our_name(name: str) -> str | None:
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    match = re.fullmatch(r"blk\.(\d{1,9})\.(\w+)\.(weight|bias)", name)
    if match and match.group(2) in BLOCK_NAMES:
        return f"transformer.h.{int(match.group(1))}.{BLOCK_NAMES[match.group(2)]}.{match.group(3)}"
    return None


def read(path: Path) -> tuple[GPT2Config, dict[str, Tensor], Any]:
    """The config from the gpt2.* metadata, the HF-keyed state dict in float32 (linear weights back to
    Conv1D's (in, out); lm_head only when it differs from wte, else tied; tensors of other types
    than F32 as read_later placeholders) and the embedded tokenizer."""
    file = GGUFFile(path)
    config = read_config(file)
    tied = "output.weight" not in file.tensors or file.same("output.weight", "token_embd.weight")
    state = {}
    for name, (kind, ne, _, _) in file.tensors.items():
        ours = our_name(name)
        if ours is None:
            raise CheckpointError(path, f"tensor {name} is not one of GPT-2's")
        rank = 2 if name.endswith(".weight") and not name.endswith("norm.weight") else 1
        if len(ne) != rank:
            raise CheckpointError(path, f"tensor {name} has {len(ne)} dimensions ({list(ne)}), GPT-2's has {rank}")
        if name == "output.weight" and tied:
            continue  # llama.cpp's converter writes the tied head twice
        check_readable(path, name, kind)
        # F32 tensors are views of the file, read as used; the others are made in fp32 only when
        # the loader uses them (read_later), so quantize= never holds every one of them at once
        transpose = name.endswith(LINEARS)
        read_it = functools.partial(read_tensor, path, file.tensors[name], transpose)
        shape = tuple(ne) if transpose else tuple(reversed(ne))
        state[ours] = read_it() if kind == "F32" else read_later(shape, torch.float32, read_it)
    config.tie_word_embeddings = tied
    return config, state, read_tokenizer(file)


def read_tokenizer(file: GGUFFile):
    """The embedded GPT-2 BPE (tokenizer.ggml.tokens / merges) as a tokenizers.Tokenizer, or None."""
    if "tokenizer.ggml.tokens" not in file.fields:
        return None
    model = file.field("tokenizer.ggml.model", "gpt2")
    if model != "gpt2":
        raise CheckpointError(file.path, f"tokenizer.ggml.model is {model!r:.80}; gpt2attn reads GPT-2's BPE ('gpt2')")
    tokens = file.strings("tokenizer.ggml.tokens")
    merges = file.strings("tokenizer.ggml.merges", [])
    types = file.field("tokenizer.ggml.token_type", [1] * len(tokens))
    if len(tokens) > LIMITS["vocab_size"]:
        raise CheckpointError(file.path, f"tokenizer.ggml.tokens has {len(tokens)} tokens, above gpt2attn's limit "
                                         f"of {LIMITS['vocab_size']}")
    if not isinstance(types, list) or len(types) != len(tokens) or not all(is_int(t) for t in types):
        raise CheckpointError(file.path, f"tokenizer.ggml.token_type must be an array of {len(tokens)} integers, "
                                         f"one per token, found {types!r:.80}")
    bad = next((i for i, m in enumerate(merges) if " " not in m), None)
    if bad is not None:
        raise CheckpointError(file.path, f"tokenizer.ggml.merges[{bad}] is {merges[bad]!r:.80}, not two tokens "
                                         f"separated by a space")
    special = [t for t, kind in zip(tokens, types) if kind == 3]  # CONTROL
    byte_of = _byte_level_alphabet()
    used = {token: i for i, (token, kind) in enumerate(zip(tokens, types)) if kind != 5}  # 5: UNUSED ([PADi])
    if not merges and not special and all(len(t) == 1 and byte_of.get(t, 128) < 128 for t in used):
        # ASCII bytes and nothing to merge: a character vocabulary, as gguf_vocabulary writes one
        return characters({chr(byte_of[token]): i for token, i in used.items()})
    merges = [tuple(m.split(" ", 1)) for m in merges]
    return byte_level_bpe({token: i for i, token in enumerate(tokens)}, merges, special, file=file.path)


def tokenizer_of(path: Path):
    """The tokenizer embedded in the GGUF file at path (None if it holds none)."""
    return read_tokenizer(GGUFFile(Path(path)))


def write(path: Path, state_dict: dict[str, Tensor], config: GPT2Config, *, dtype: Any = None,
          tokenizer: Any = None) -> None:
    """A GGUF file of a GPT2LMHeadModel's state dict, as llama.cpp's converter writes one; dtype
    'f32', 'f16' (default), 'bf16', 'q8_0' or 'q4' (quantize()'s mode: Q4_K blocks, Q8_0 for the
    matrices it keeps in 8 bits) for the 2-D weights. Written atomically, and tensor by tensor: each
    is converted just before it is written, so no converted copy of the model is held, and a tensor
    read from a mapped file is unmapped once written (memory.release_file_pages)."""
    gguf = _gguf()
    path = Path(path)
    kind = "f16" if dtype is None else str(dtype).lower().replace("float32", "f32").replace("float16", "f16")
    if kind not in WRITE_TYPES:
        raise ValueError(f"{path}: GGUF is written as {', '.join(WRITE_TYPES)}, not {dtype}")
    qtype, file_type = gguf.GGMLQuantizationType[WRITE_TYPES[kind][0]], WRITE_TYPES[kind][1]
    if config.activation_function not in ("gelu_new", "gelu_pytorch_tanh") or config.add_cross_attention \
            or not config.scale_attn_weights or config.scale_attn_by_inverse_layer_idx:
        raise ValueError(f"{path}: llama.cpp's GPT-2 is GELU (tanh), self-attention scaled by 1/sqrt(head size): "
                         f"this model's config differs (activation_function, cross-attention or attention scaling)")
    state = normalize_keys(state_dict, prefixed=True)
    state.setdefault("lm_head.weight", state["transformer.wte.weight"])
    ours_to_gguf = {ours: theirs for theirs, ours in GLOBAL_NAMES.items()}
    for i in range(config.n_layer):
        for theirs, ours in BLOCK_NAMES.items():
            for part in ("weight", "bias"):
                ours_to_gguf[f"transformer.h.{i}.{ours}.{part}"] = f"blk.{i}.{theirs}.{part}"
    order = ["token_embd.weight", "position_embd.weight"] + [f"blk.{i}.{n}.{p}" for i in range(config.n_layer)
             for n in BLOCK_NAMES for p in ("weight", "bias")] + ["output_norm.weight", "output_norm.bias", "output.weight"]
    by_gguf = {ours_to_gguf[k]: v for k, v in state.items() if k in ours_to_gguf}
    missing = [name for name in order if name not in by_gguf]
    if missing:
        raise ValueError(f"{path}: cannot write GGUF: the state dict lacks {', '.join(missing)}")
    gguf_to_ours = {theirs: ours for ours, theirs in ours_to_gguf.items()}
    ggml_types = {name: stored_type(gguf, name, by_gguf[name], qtype, gguf_to_ours[name], config.n_layer)
                  for name in order}

    vocabulary = gguf_vocabulary(path, tokenizer, config) if tokenizer is not None else None

    def write_file(f) -> None:
        from gguf.gguf_writer import WriterState

        writer = gguf.GGUFWriter(path=None, arch="gpt2")
        writer.add_type("model")
        writer.add_name(path.stem)
        writer.add_block_count(config.n_layer)
        writer.add_context_length(config.n_positions)
        writer.add_embedding_length(config.n_embd)
        writer.add_feed_forward_length(inner_dim(config))
        writer.add_head_count(config.n_head)
        writer.add_layer_norm_eps(config.layer_norm_epsilon)
        writer.add_file_type(file_type)
        if vocabulary is not None:
            tokens, types, merges, eos = vocabulary
            writer.add_tokenizer_model("gpt2")
            writer.add_tokenizer_pre("gpt-2")
            writer.add_token_list(tokens)
            writer.add_token_types(types)
            writer.add_token_merges(merges)
            if eos is not None:  # GPT-2's <|endoftext|> is its bos, eos and unk, as the converter writes
                writer.add_bos_token_id(eos)
                writer.add_eos_token_id(eos)
                writer.add_unk_token_id(eos)
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for name in order:  # the table of tensors first: names, shapes, types and sizes
            shape = gguf_shape(name, by_gguf[name])
            block, block_bytes = gguf.GGML_QUANT_SIZES[ggml_types[name]]
            writer.add_tensor_info(name, shape, np.float32, math.prod(shape) // block * block_bytes,
                                   raw_dtype=ggml_types[name])
        writer.fout, writer.state = [f], WriterState.EMPTY  # our file: write_atomic's temporary one
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for name in order:  # then the data, each tensor converted just before it is written
            writer.write_tensor_data(stored_data(gguf, name, by_gguf[name], ggml_types[name]))
            release_file_pages(by_gguf[name])  # a tensor read from a mapped file: its pages, once written

    write_atomic(path, write_file)


def gguf_shape(name: str, tensor: Tensor) -> tuple[int, ...]:
    """A tensor's numpy shape in the file: linear weights as Linear's (out, in)."""
    return tuple(tensor.shape[::-1]) if name.endswith(LINEARS) else tuple(tensor.shape)


def stored_type(gguf, name: str, tensor: Tensor, qtype, ours: str, n_layer: int):
    """The GGML type `tensor` (ours: its name in our state dict) is written in, as llama.cpp's
    converter chooses: F32 for 1-D tensors, norms and position embeddings; qtype for the other
    weights, or F16 where their rows are not a multiple of qtype's block. Q4_K (quantize()'s 'q4')
    keeps the matrices that mode holds in 8 bits as Q8_0 (token_embd: the tied head's)."""
    if tensor.dim() <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight") \
            or name == "position_embd.weight":
        return gguf.GGMLQuantizationType.F32
    if qtype == gguf.GGMLQuantizationType.Q4_K:
        matrix = "lm_head" if name == "token_embd.weight" else ours.removesuffix(".weight")
        if keeps_8_bits(matrix, gguf_shape(name, tensor)[-1], n_layer):
            qtype = gguf.GGMLQuantizationType.Q8_0
    if gguf_shape(name, tensor)[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        return gguf.GGMLQuantizationType.F16
    return qtype


def stored_data(gguf, name: str, tensor: Tensor, kind) -> np.ndarray:
    """`tensor` as its bytes in the file: float32 on the CPU, laid out as GGUF's, then converted."""
    data = tensor.detach().to("cpu", torch.float32)
    data = data.t() if name.endswith(LINEARS) else data  # Conv1D (in, out) -> Linear (out, in)
    if kind == gguf.GGMLQuantizationType.Q4_K:  # the blocks quantize("q4") holds (our own scale search)
        return quantize_rows(data.contiguous()).numpy()
    return gguf.quants.quantize(data.contiguous().numpy(), kind)


def why_not_embedded(tokenizer) -> str | None:
    """Why a GGUF file cannot carry this tokenizer; None when it can (GPT-2's byte-level BPE, or a
    character vocabulary whose characters are all ASCII, one byte each)."""
    spec = json.loads(tokenizer.to_str())
    if spec["model"]["type"] == "BPE":
        return None
    if not is_characters(spec):
        return f"GGUF embeds GPT-2's byte-level BPE tokenizer; this tokenizer is {spec['model']['type']}"
    wide = sorted(c for c in spec["model"]["vocab"] if not c.isascii())
    if not wide:
        return None
    shown = ", ".join(f"{c!r} (U+{ord(c):04X})" for c in wide[:10]) + (f" and {len(wide) - 10} more" if len(wide) > 10 else "")
    return (f"GGUF's GPT-2 tokenizer holds a character vocabulary only when every character is one byte (ASCII); "
            f"this one has {shown}")


def gguf_vocabulary(path: Path, tokenizer, config: GPT2Config) -> tuple[list[str], list[int], list[str], int | None]:
    """GPT-2's byte-level BPE as llama.cpp's converter embeds it: every id's token (unused ids as
    [PADi]) and its type, the merges, and <|endoftext|>'s id. Types: 1 normal (the BPE's own
    tokens), 3 control (added tokens marked special or written <|...|>), 4 user-defined (other
    added tokens), 5 unused."""
    reason = why_not_embedded(tokenizer)
    if reason is not None:
        raise ValueError(f"{path}: {reason} (write the model without it, or to an HF folder)")
    spec = json.loads(tokenizer.to_str())
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    if is_characters(spec):  # one byte each: GPT-2's byte-level spelling of it, nothing to merge
        char_of = {byte: ch for ch, byte in _byte_level_alphabet().items()}
        vocab, spec["model"]["merges"] = {char_of[ord(c)]: i for c, i in vocab.items()}, []
    if max(vocab.values(), default=-1) >= config.vocab_size:
        raise ValueError(f"{path}: the tokenizer has {len(vocab)} tokens, the model's vocabulary {config.vocab_size}")
    tokens = [f"[PAD{i}]" for i in range(config.vocab_size)]
    types = [5] * config.vocab_size
    added = {t["content"]: t["special"] for t in spec["added_tokens"]}  # tokenizers always writes both keys
    for token, i in vocab.items():
        if token not in added:
            kind = 1
        elif added[token] or (token.startswith("<|") and token.endswith("|>")):
            kind = 3
        else:
            kind = 4
        tokens[i], types[i] = token, kind
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return tokens, types, merges, vocab.get(EOS_TOKEN)
