"""OpenAI's TensorFlow GPT-2 checkpoints, read without TensorFlow.

A TF "tensor bundle" is two kinds of files:
- `model.ckpt.index`: an SSTable (LevelDB's table format) whose keys are variable names and
  whose values are BundleEntryProto messages (dtype, shape, shard, offset, size, crc32c);
  the empty key holds a BundleHeaderProto (number of shards, endianness).
- `model.ckpt.data-0000k-of-0000n`: the raw little-endian tensor bytes, read here with numpy
  through a memory map; each tensor's masked crc32c is checked (and the pages the check read
  unmapped again: gpt2attn.memory.release_file_pages).
"""

from __future__ import annotations

import math
import mmap
import os
import re
from pathlib import Path

import numpy as np
import torch

from ..config import GPT2Config
from ..errors import CheckpointError, read_json_file
from ..memory import release_file_pages
from .state_dict import config_from_hparams

TABLE_MAGIC = 0xDB4775248B80FB57
FOOTER_SIZE = 48
# TF DataType enum -> numpy dtype (the ones a GPT-2 checkpoint can hold).
TF_DTYPES = {1: np.float32, 2: np.float64, 3: np.int32, 9: np.int64, 19: np.float16}
TF_BFLOAT16 = 14
MAX_SHARDS = 1024


# --- crc32c (Castagnoli), vectorised with numpy ---------------------------------------------


def _crc_table() -> np.ndarray:
    table = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        table = np.where(table & 1, (table >> 1) ^ np.uint32(0x82F63B78), table >> 1).astype(np.uint32)
    return table


CRC_TABLE = _crc_table()


def _crc_update(crc: np.ndarray, data: np.ndarray) -> np.ndarray:
    """Advance CRC registers `crc` (lanes,) over `data` (steps, lanes), one byte row at a time."""
    for row in data:
        crc = CRC_TABLE[(crc ^ row) & 0xFF] ^ (crc >> 8)
    return crc


def _zeros_operator(n_bytes: int) -> list[np.ndarray]:
    """The register map of n zero bytes (linear over GF(2)) as four 256-entry byte tables."""
    basis = np.uint32(1) << np.arange(32, dtype=np.uint32)  # the register's 32 unit vectors
    images = _crc_update(basis, np.zeros((n_bytes, 32), dtype=np.uint8))
    tables = []
    for byte in range(4):
        values = np.arange(256, dtype=np.uint32)
        table = np.zeros(256, dtype=np.uint32)
        for bit in range(8):
            table ^= np.where(values >> bit & 1, images[8 * byte + bit], 0).astype(np.uint32)
        tables.append(table)
    return tables


def crc32c(data: bytes | np.ndarray, lanes: int = 4096) -> int:
    """crc32c of `data`. The bytes are split into `lanes` equal chunks whose CRCs are computed
    side by side, then chained: crc(A + B) = zeros_op(len B)(crc(A)) ^ crc_from_zero(B)."""
    data = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.reshape(-1)
    lanes = max(1, min(lanes, len(data) // 64))
    chunk = len(data) // lanes
    crc = 0xFFFFFFFF
    if chunk:
        body = data[: lanes * chunk].reshape(lanes, chunk).T  # (chunk, lanes)
        partial = _crc_update(np.zeros(lanes, dtype=np.uint32), np.ascontiguousarray(body))
        t0, t1, t2, t3 = _zeros_operator(chunk)
        for part in partial.tolist():
            crc = int(t0[crc & 0xFF] ^ t1[crc >> 8 & 0xFF] ^ t2[crc >> 16 & 0xFF] ^ t3[crc >> 24]) ^ part
    tail = data[lanes * chunk :]
    crc = int(_crc_update(np.array([crc], dtype=np.uint32), tail.reshape(-1, 1))[0])
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes | np.ndarray) -> int:
    """The form TF and LevelDB store: rotated right by 15 bits plus a constant."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


# --- protobuf wire format and the SSTable ---------------------------------------------------


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        if shift > 63:
            raise ValueError("a varint longer than 10 bytes")
        byte = buf[pos]
        value |= (byte & 0x7F) << shift
        pos += 1
        if byte < 0x80:
            return value, pos
        shift += 7


def parse_proto(buf: bytes) -> dict[int, list]:
    """field number -> list of values (ints for varint/fixed fields, bytes for messages)."""
    fields: dict[int, list] = {}
    pos = 0
    while pos < len(buf):
        tag, pos = _varint(buf, pos)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = int.from_bytes(buf[pos : pos + 8], "little"), pos + 8
        elif wire == 2:
            n, pos = _varint(buf, pos)
            value, pos = bytes(buf[pos : pos + n]), pos + n
        elif wire == 5:
            value, pos = int.from_bytes(buf[pos : pos + 4], "little"), pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        fields.setdefault(number, []).append(value)
    if pos != len(buf):
        raise ValueError("truncated protobuf message")
    return fields


def _number(fields: dict[int, list], n: int, default: int = 0) -> int:
    """The last value of integer field n (protobuf's rule for a repeated scalar)."""
    value = fields.get(n, [default])[-1]
    if not isinstance(value, int):
        raise ValueError(f"field {n} is a message, expected a number")
    return value


def _messages(fields: dict[int, list], n: int) -> list[bytes]:
    values = fields.get(n, [])
    if not all(isinstance(v, bytes) for v in values):
        raise ValueError(f"field {n} is a number, expected a message")
    return values


def _block(table: bytes, handle: bytes, path: Path) -> bytes:
    """The contents of the block a BlockHandle (offset, size varints) points at, crc-checked."""
    try:
        offset, pos = _varint(handle, 0)
        size, _ = _varint(handle, pos)
    except ValueError as e:
        raise CheckpointError(path, f"corrupt: a block handle cannot be read ({e})") from None
    if offset + size + 5 > len(table):
        raise CheckpointError(path, "truncated: a block ends past the end of the file")
    contents, kind = table[offset : offset + size], table[offset + size]
    stored = int.from_bytes(table[offset + size + 1 : offset + size + 5], "little")
    if masked_crc32c(table[offset : offset + size + 1]) != stored:
        raise CheckpointError(path, f"corrupt: block at byte {offset} fails its crc32c check")
    if kind != 0:
        raise CheckpointError(path, f"compressed blocks (type {kind}) are not supported")
    return contents


def _block_entries(block: bytes, path: Path) -> list[tuple[bytes, bytes]]:
    """Key/value pairs of a block (keys are prefix-compressed against the previous key)."""
    n_restarts = int.from_bytes(block[-4:], "little")
    end = len(block) - 4 * (n_restarts + 1)
    entries, key, pos = [], b"", 0
    while pos < end:
        try:
            shared, pos = _varint(block, pos)
            unshared, pos = _varint(block, pos)
            n_value, pos = _varint(block, pos)
        except ValueError as e:
            raise CheckpointError(path, f"corrupt: entry {len(entries)} of a block cannot be read ({e})") from None
        if shared > len(key) or pos + unshared + n_value > end:
            raise CheckpointError(path, f"corrupt: entry {len(entries)} of a block runs past the block's end")
        key = key[:shared] + block[pos : pos + unshared]
        pos += unshared
        entries.append((key, block[pos : pos + n_value]))
        pos += n_value
    return entries


def read_sstable(path: Path) -> dict[bytes, bytes]:
    table = path.read_bytes()
    if len(table) < FOOTER_SIZE or int.from_bytes(table[-8:], "little") != TABLE_MAGIC:
        raise CheckpointError(path, "not a TF checkpoint index (no SSTable footer; truncated?)")
    footer = table[-FOOTER_SIZE:]
    try:
        _, pos = _varint(footer, 0)  # skip the metaindex handle
        _, pos = _varint(footer, pos)
    except ValueError as e:
        raise CheckpointError(path, f"corrupt: the footer cannot be read ({e})") from None
    index = _block_entries(_block(table, footer[pos:], path), path)
    return {key: value for _, handle in index for key, value in _block_entries(_block(table, handle, path), path)}


# --- the bundle -----------------------------------------------------------------------------


def read_bundle(prefix: Path) -> dict[str, np.ndarray]:
    """Every tensor of the bundle `prefix` (e.g. folder/model.ckpt), as numpy arrays over a
    memory map of the data shards, each checked against its crc32c."""
    index_path = Path(f"{prefix}.index")
    entries = read_sstable(index_path)
    try:
        header = parse_proto(entries.pop(b"", b""))
        n_shards, big_endian = _number(header, 1, 1), _number(header, 2)
    except ValueError as e:
        raise CheckpointError(index_path, f"corrupt: the bundle header cannot be read ({e})") from None
    if big_endian != 0:
        raise CheckpointError(index_path, "big-endian checkpoints are not supported")
    if not 1 <= n_shards <= MAX_SHARDS:
        raise CheckpointError(index_path, f"the bundle header says {n_shards} data shards (at most {MAX_SHARDS} are read)")
    shards: dict[int, mmap.mmap] = {}
    tensors = {}
    for key, value in entries.items():
        try:
            name = key.decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(index_path, f"a tensor name is not UTF-8: {bytes(key)[:80]!r}") from None
        try:
            entry = parse_proto(value)
            dtype_code = _number(entry, 1)
            shape_proto = parse_proto(_messages(entry, 2)[-1]) if 2 in entry else {}
            shape = [_number(parse_proto(d), 1) for d in _messages(shape_proto, 2)]
            shard_id, offset, size = (_number(entry, n) for n in (3, 4, 5))
            crc = _number(entry, 6) if 6 in entry else None
        except ValueError as e:
            raise CheckpointError(index_path, f"corrupt: the entry of tensor {name} cannot be read ({e})") from None
        if dtype_code not in TF_DTYPES:
            raise CheckpointError(index_path, f"tensor {name} has unsupported TF dtype {dtype_code}")
        itemsize = np.dtype(TF_DTYPES[dtype_code]).itemsize
        if len(shape) > 4 or any(not 0 <= n <= 2**40 for n in shape) or math.prod(shape) * itemsize != size:
            raise CheckpointError(index_path, f"tensor {name}: shape {shape} of {TF_DTYPES[dtype_code].__name__} "
                                              f"does not match its size of {size} bytes")
        if shard_id >= n_shards:
            raise CheckpointError(index_path, f"tensor {name} is in data shard {shard_id}, the bundle has {n_shards}")
        shard_path = Path(f"{prefix}.data-{shard_id:05d}-of-{n_shards:05d}")
        if shard_id not in shards:
            if not shard_path.exists():
                raise FileNotFoundError(f"{index_path} needs data shard {shard_path.name}, which is missing")
            with open(shard_path, "rb") as f:
                shards[shard_id] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if os.fstat(f.fileno()).st_size else b""
        data = shards[shard_id]
        if offset + size > len(data):
            raise CheckpointError(shard_path, f"truncated: tensor {name} ends at byte {offset + size}, "
                                              f"the file has {len(data)}")
        raw = np.frombuffer(data, dtype=np.uint8, count=size, offset=offset)
        if crc is not None:
            if masked_crc32c(raw) != crc:
                raise CheckpointError(shard_path, f"corrupt: tensor {name} fails its crc32c check")
            if size:  # the check read every page; each is mapped back when used
                release_file_pages(torch.from_numpy(raw))
        tensors[name] = raw.view(TF_DTYPES[dtype_code]).reshape(shape)
    return tensors


def gpt2_name(tf_name: str) -> str:
    """'model/h3/attn/c_attn/w' -> 'transformer.h.3.attn.c_attn.weight'; other names unchanged."""
    m = re.fullmatch(r"model/(.+)/(w|b|g)", tf_name)
    if m is None:
        return {"model/wte": "transformer.wte.weight", "model/wpe": "transformer.wpe.weight"}.get(tf_name, tf_name)
    module = re.sub(r"^h(\d+)/", r"h.\1/", m.group(1)).replace("/", ".")
    return f"transformer.{module}.{'bias' if m.group(2) == 'b' else 'weight'}"


def load_tf_checkpoint(folder: Path) -> tuple[GPT2Config, dict[str, torch.Tensor]]:
    """The config (from hparams.json) and an HF-named state dict of an OpenAI GPT-2 folder."""
    folder = Path(folder)
    hparams_path = folder / "hparams.json"
    if not hparams_path.exists():
        raise FileNotFoundError(f"{folder}: no hparams.json beside the TF checkpoint")
    hp = read_json_file(hparams_path)
    if not isinstance(hp, dict):
        raise CheckpointError(hparams_path, f"expected a JSON object of hyperparameters, found a {type(hp).__name__}")
    names = {"vocab_size": "n_vocab", "n_positions": "n_ctx", "n_embd": "n_embd", "n_head": "n_head", "n_layer": "n_layer"}
    config = config_from_hparams(hp, names, hparams_path, "hparams.json")
    config.bos_token_id = config.eos_token_id = config.vocab_size - 1  # <|endoftext|> is the last id
    prefix = "model.ckpt"
    if (folder / "checkpoint").exists():  # 'model_checkpoint_path: "model.ckpt"'
        m = re.search(r'model_checkpoint_path:\s*"([^"]+)"', (folder / "checkpoint").read_text(errors="replace"))
        prefix = Path(m.group(1)).name if m else prefix  # the files beside it, wherever it was written
    state = {}
    for name, array in read_bundle(folder / prefix).items():
        tensor = torch.from_numpy(array)
        if name.endswith("/w") and tensor.dim() == 3 and len(tensor) == 1:  # conv weights [1, nx, nf] -> [nx, nf]
            tensor = tensor[0]
        state[gpt2_name(name)] = tensor
    return config, state
