"""A fuzzer for every file format gpt2attn reads: does a hostile file ever hang, blow up memory or
give an unclear error?

Each format has a small valid seed, made here from a tiny random model. A case is the seed with
one mutation, chosen by a generator seeded with (format, seed, index), so that a case is
reproduced from those three values alone:

- structure-aware: a header field, metadata value, JSON node, pickled object or TF index entry set
  to 0, 1, -1, 2^31-1, 2^63-1, NaN, a string, a list, an array nested 100000 deep, a 5000-digit
  integer, ...; a key removed or added;
- byte-level: a truncation, bit flips, inserted or deleted bytes, 8 bytes overwritten.

Every case runs in a worker process (a fresh interpreter, restarted after a hang or a crash) under
limits: CPU time (2 s), wall time (a hang is killed), peak RSS (1 GiB, measured per case through
/proc/self/clear_refs) and an address-space rlimit so that a runaway allocation fails instead of
taking the machine. The outcome of a case is one of

    loaded    the file loads, and the model runs a forward pass (a tokenizer encodes a text)
    ours      gpt2attn.CheckpointError naming a file of the case (FileNotFoundError for a file
              that is missing, e.g. a shard an index lists)
    other     any other exception (an unclear error): a failure
    slow      over the CPU or wall-time limit (a hang): a failure
    memory    peak RSS over the limit, or a MemoryError: a failure
    crash     the worker died (a segfault, an abort): a failure

tests/formats/test_fuzz.py runs a few hundred cases; `python -m scripts.fuzz_formats` runs thousands.
Run `python -m tests.fuzzing FORMAT SEED INDEX` from the checkout's root to replay one case in this
process and see its traceback.
"""

from __future__ import annotations

import json
import math
import os
import random
import resource
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

FORMATS = ("hf", "shards", "pytorch_bin", "llmc", "gguf", "nanogpt", "openai_tf", "tokenizer")
FAILURES = ("other", "slow", "memory", "crash")
CPU_LIMIT_S = 2.0
RSS_LIMIT = 1 << 30
REPO = Path(__file__).resolve().parents[1]  # the checkout: `python -m tests.fuzzing` runs from here

# --- values a mutation puts in a field ---------------------------------------------------------

DEEP, HUGE = "@@DEEP@@", "@@HUGE@@"  # replaced in JSON text: 100000 nested arrays, a 5000-digit integer
SPECIAL_INTS = [0, 1, -1, 2, 3, 2**31 - 1, -(2**31), 2**32, 2**63 - 1, -(2**63), 2**64 - 1, 10**6, 10**9, 2**40]
SPECIAL_JSON = SPECIAL_INTS + [math.nan, math.inf, -math.inf, 0.5, 1e308, -0.0, "x", "", None, True, False,
                               [], [1, 2], {}, {"a": 1}, DEEP, HUGE, "__dict__", "\u0000"]


def special_json(rng: random.Random):
    return rng.choice(SPECIAL_JSON)


def dump_json(value) -> bytes:
    text = json.dumps(value, allow_nan=True)
    text = text.replace(json.dumps(DEEP), "[" * 100_000 + "]" * 100_000).replace(json.dumps(HUGE), "9" * 5000)
    return text.encode()


def json_nodes(value, path=()):
    """Every (path, value) of a JSON document, containers and leaves, depth first."""
    yield path, value
    if isinstance(value, dict):
        for k, v in value.items():
            yield from json_nodes(v, path + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from json_nodes(v, path + (i,))


def mutate_json(doc, rng: random.Random, keys: tuple[str, ...] = ()) -> tuple[object, str]:
    """One structure-aware change of a JSON document: a node set to a special value, removed, or
    (for an object) given a new key; `keys` are top-level names worth trying more often."""
    doc = json.loads(json.dumps(doc))
    value = special_json(rng)
    if keys and isinstance(doc, dict) and rng.random() < 0.4:
        key = rng.choice(keys)
        doc[key] = value
        return doc, f"[{key!r}] = {value!r:.40}"
    if rng.random() < 0.03:
        return value, f"document = {value!r:.40}"
    nodes = [p for p, _ in json_nodes(doc) if p]
    if not nodes:
        return value, f"document = {value!r:.40}"
    path = rng.choice(nodes)
    parent = doc
    for step in path[:-1]:
        parent = parent[step]
    if rng.random() < 0.15:
        del parent[path[-1]]
        return doc, f"del {list(path)}"
    if isinstance(parent, dict) and rng.random() < 0.1:
        parent[rng.choice(["__dict__", "__class__", "", "n_layer", "num_labels", "weight_map"])] = value
        return doc, f"{list(path[:-1])} + new key = {value!r:.40}"
    parent[path[-1]] = value
    return doc, f"{list(path)} = {value!r:.40}"


def mutate_bytes(data: bytes, rng: random.Random, head: int = 4096) -> tuple[bytes, str]:
    """One byte-level change; positions fall in the first `head` bytes half of the time."""
    if not data:
        return bytes(rng.randrange(256) for _ in range(8)), "empty -> 8 random bytes"

    def position() -> int:
        return rng.randrange(min(len(data), head)) if rng.random() < 0.5 else rng.randrange(len(data))

    kind = rng.choice(["truncate", "flip", "flip", "insert", "delete", "overwrite"])
    if kind == "truncate":
        n = position()
        return data[:n], f"truncated to {n} bytes"
    if kind == "flip":
        out = bytearray(data)
        spots = [position() for _ in range(rng.randint(1, 8))]
        for i in spots:
            out[i] ^= 1 << rng.randrange(8)
        return bytes(out), f"bits flipped at {spots}"
    if kind == "insert":
        i, n = position(), rng.randint(1, 64)
        return data[:i] + bytes(rng.randrange(256) for _ in range(n)) + data[i:], f"{n} bytes inserted at {i}"
    if kind == "delete":
        i, n = position(), rng.randint(1, 64)
        return data[:i] + data[i + n:], f"{n} bytes deleted at {i}"
    i = position()
    value = rng.choice([2**31 - 1, 2**63 - 1, 2**64 - 1, 0, 1, 2**32, 0x7FF8000000000000])
    return data[:i] + value.to_bytes(8, "little") + data[i + 8:], f"8 bytes at {i} = {value:#x}"


def mutate_file(path: Path, rng: random.Random) -> str:
    data, what = mutate_bytes(path.read_bytes(), rng)
    path.write_bytes(data)
    return f"{path.name}: {what}"


def mutate_json_file(path: Path, rng: random.Random, keys: tuple[str, ...] = ()) -> str:
    doc, what = mutate_json(json.loads(path.read_text()), rng, keys)
    path.write_bytes(dump_json(doc))
    return f"{path.name}: {what}"


# --- seeds: small valid files of each format ----------------------------------------------------

CONFIG_KEYS = ("n_layer", "n_embd", "n_head", "n_positions", "vocab_size", "n_inner", "num_labels", "id2label",
               "layer_norm_epsilon", "eos_token_id", "bos_token_id", "tie_word_embeddings", "model_type",
               "activation_function", "__dict__", "n_ctx", "max_position_embeddings", "resid_pdrop")
GENERATION_KEYS = ("max_length", "max_new_tokens", "num_beams", "temperature", "top_k", "top_p", "eos_token_id",
                   "bad_words_ids", "stop_strings", "num_return_sequences", "do_sample")
NANOGPT_ARGS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size", "dropout")
HPARAMS = ("n_vocab", "n_ctx", "n_embd", "n_head", "n_layer")


def tiny_model(vocab_size: int = 64):
    import torch

    from gpt2attn import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab_size, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config).eval()


def tiny_tokenizer():
    """A byte-level BPE of 256 bytes, one merge and <|endoftext|>, with a post-processor."""
    from tokenizers import processors

    from gpt2attn.tokenizer import _byte_level_alphabet, byte_level_bpe

    vocab = {ch: i for i, ch in enumerate(sorted(_byte_level_alphabet(), key=ord))}
    vocab["he"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    tok = byte_level_bpe(vocab, [("h", "e")])
    tok.post_processor = processors.TemplateProcessing(single="$A <|endoftext|>",
                                                       special_tokens=[("<|endoftext|>", vocab["<|endoftext|>"])])
    return tok


def make_seeds(root: Path) -> dict[str, Path]:
    """One valid file or folder per format under root; returns format -> the path to load."""
    import torch

    from gpt2attn.formats import llmc

    model = tiny_model()
    seeds = {}
    seeds["hf"] = root / "hf"
    model.generation_config.max_new_tokens = 5
    model.save_pretrained(seeds["hf"])
    seeds["shards"] = root / "shards"
    model.save_pretrained(seeds["shards"], max_shard_size="4KB")
    seeds["pytorch_bin"] = root / "pytorch_bin"
    model.save_pretrained(seeds["pytorch_bin"], safe_serialization=False)
    seeds["llmc"] = root / "llmc" / "model.bin"
    llmc.write(seeds["llmc"], model.state_dict(), model.config)
    seeds["gguf"] = root / "gguf" / "model.gguf"
    seeds["gguf"].parent.mkdir()
    seeds["gguf"].write_bytes(gguf_bytes(*gguf_seed()))
    seeds["nanogpt"] = root / "nanogpt" / "ckpt.pt"
    seeds["nanogpt"].parent.mkdir()
    torch.save(nanogpt_seed(), seeds["nanogpt"])
    seeds["openai_tf"] = root / "openai_tf"
    shutil.copytree(REPO / "tests" / "data" / "openai-tf-tiny", seeds["openai_tf"],
                    ignore=shutil.ignore_patterns("expected.npz", "README.md"))
    seeds["tokenizer"] = root / "tokenizer"
    seeds["tokenizer"].mkdir()
    tiny_tokenizer().save(str(seeds["tokenizer"] / "tokenizer.json"))
    return seeds


def nanogpt_seed(bias: bool = True) -> dict:
    """nanoGPT's checkpoint layout: Linear weights (out, in), model_args, training fields."""
    from gpt2attn.formats.nanogpt import NANOGPT_LINEARS

    model = tiny_model()
    state = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" or (not bias and name.endswith(".bias")):
            continue
        state["_orig_mod." + name] = t.t().contiguous() if name.endswith(NANOGPT_LINEARS) else t
    args = dict(n_layer=2, n_head=2, n_embd=16, block_size=16, bias=bias, vocab_size=64, dropout=0.0)
    return {"model": state, "model_args": args, "iter_num": 10, "best_val_loss": 1.5, "config": {}}


# GGUF, written here field by field, so that any field can be given any type and value.
GGUF_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9


def gguf_seed():
    """(metadata [(key, type, value)], tensors [(name, ne, ggml type, bytes)]) of a tiny GPT-2 in F32,
    with its tokenizer; an array value is (item type, [values])."""
    import torch

    from gpt2attn.formats.gguf import BLOCK_NAMES, GLOBAL_NAMES, LINEARS

    tok = tiny_tokenizer()
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    model = tiny_model(vocab_size=len(tokens))
    c = model.config
    fields = [
        ("general.architecture", STRING, "gpt2"), ("general.alignment", 4, 32),
        ("gpt2.context_length", 4, c.n_positions), ("gpt2.embedding_length", 4, c.n_embd),
        ("gpt2.feed_forward_length", 4, 4 * c.n_embd), ("gpt2.block_count", 4, c.n_layer),
        ("gpt2.attention.head_count", 4, c.n_head), ("gpt2.attention.layer_norm_epsilon", 6, 1e-5),
        ("tokenizer.ggml.model", STRING, "gpt2"), ("tokenizer.ggml.tokens", ARRAY, (STRING, tokens)),
        ("tokenizer.ggml.token_type", ARRAY, (5, [3 if t == "<|endoftext|>" else 1 for t in tokens])),
        ("tokenizer.ggml.merges", ARRAY, (STRING, ["h e"])),
        ("tokenizer.ggml.bos_token_id", 4, vocab["<|endoftext|>"]), ("tokenizer.ggml.eos_token_id", 4, vocab["<|endoftext|>"]),
    ]
    theirs = {ours: name for name, ours in GLOBAL_NAMES.items()}
    for i in range(c.n_layer):
        for name, ours in BLOCK_NAMES.items():
            for part in ("weight", "bias"):
                theirs[f"transformer.h.{i}.{ours}.{part}"] = f"blk.{i}.{name}.{part}"
    tensors = []
    for ours, t in model.state_dict().items():
        if ours == "lm_head.weight":
            continue
        name = theirs[ours]
        array = (t.t() if name.endswith(LINEARS) else t).contiguous().to(torch.float32)
        tensors.append([name, list(reversed(array.shape)), 0, array.numpy().tobytes()])
    return fields, tensors


def gguf_value(kind: int, value, depth: int = 0) -> bytes:
    if kind == STRING:
        data = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else bytes(value)
        return struct.pack("<Q", len(data)) + data
    if kind == ARRAY:
        item, values = value
        if values == DEEP:  # arrays of arrays, 10000 deep
            return (struct.pack("<IQ", ARRAY, 1)) * 10_000 + struct.pack("<IQ", 4, 0)
        return struct.pack("<IQ", item, len(values)) + b"".join(gguf_value(item, v, depth + 1) for v in values)
    return struct.pack("<" + GGUF_FORMATS[kind], value)


def gguf_bytes(fields, tensors, alignment: int = 32, version: int = 3, counts=None) -> bytes:
    out = [b"GGUF", struct.pack("<I", version)]
    n_tensors, n_fields = counts or (len(tensors), len(fields))
    out.append(struct.pack("<QQ", n_tensors, n_fields))
    for key, kind, value in fields:
        out += [gguf_value(STRING, key), struct.pack("<I", kind), gguf_value(kind, value)]
    offset = 0
    for name, ne, kind, data in tensors:
        out += [gguf_value(STRING, name), struct.pack("<I", len(ne)), *(struct.pack("<Q", n) for n in ne),
                struct.pack("<IQ", kind, offset)]
        offset += -(-len(data) // alignment) * alignment
    head = b"".join(out)
    body = b"".join(data + bytes(-len(data) % alignment) for *_, data in tensors)
    return head + bytes(-len(head) % alignment) + body


def gguf_special(rng: random.Random) -> tuple[int, object]:
    """A (type, value) pair for a metadata field: numbers at the edges, NaN, a string, arrays."""
    choice = rng.randrange(8)
    if choice < 3:
        value = rng.choice(SPECIAL_INTS)
        kind = 11 if value < 0 else 10
        if -(2**31) <= value < 2**31:
            kind = rng.choice([kind, 5 if value < 0 else 4])
        return kind, value if kind != 10 else value % 2**64
    if choice == 3:
        return rng.choice([6, 12]), rng.choice([math.nan, math.inf, -math.inf, 0.0, -1.0, 1e30])
    if choice == 4:
        return STRING, rng.choice(["", "gpt2", "llama", "x" * 100, "\udcff"])
    if choice == 5:
        return ARRAY, (rng.choice([4, STRING, 6]), [1, 2] if rng.random() < 0.5 else [])
    if choice == 6:
        return ARRAY, (ARRAY, DEEP)
    return 7, rng.choice([True, False])


def mutate_gguf(path: Path, rng: random.Random) -> str:
    fields, tensors = gguf_seed()
    kind = rng.randrange(6)
    alignment, version, counts = 32, 3, None
    if kind <= 1:  # a metadata value
        i = rng.randrange(len(fields))
        key, value_kind, value = fields[i]
        if key.startswith("tokenizer.ggml.") and value_kind == ARRAY and rng.random() < 0.5:
            item, values = value
            values = list(values)
            j = rng.randrange(len(values))
            if item == STRING:
                values[j] = rng.choice(["", "no-space", "he", "<|endoftext|>", "\udcff"])
            else:
                values[j] = rng.choice([-1, 99, 2**31 - 1])
            fields[i] = (key, ARRAY, (item, values))
            what = f"{key}[{j}] = {values[j]!r:.30}"
        else:
            new_kind, new_value = gguf_special(rng)
            fields[i] = (key, new_kind, new_value)
            what = f"{key} = {new_value!r:.40} (type {new_kind})"
            if key == "general.alignment" and new_kind in (4, 10) and new_value and new_value < 2**16:
                alignment = new_value
    elif kind == 2:  # a tensor's table entry
        i = rng.randrange(len(tensors))
        name, ne, ggml, data = tensors[i]
        part = rng.choice(["dims", "ne", "type", "name"])
        if part == "dims":
            ne = rng.choice([[], [1, 1, 1, 1, 1], ne + [1], ne[:1], [0] + ne[1:]])
        elif part == "ne":
            j = rng.randrange(len(ne))
            ne = ne[:j] + [rng.choice([0, 1, 2**31 - 1, 2**63 - 1, 2**64 - 1, 100000])] + ne[j + 1:]
        elif part == "type":
            ggml = rng.choice([1, 2, 8, 10, 30, 31, 99, 2**32 - 1])
        else:
            name = rng.choice(["blk.0.attn_qkv.weight", "blk.99999.ffn_up.weight", "blk.1.bogus.weight", "x" * 300,
                               "blk." + "9" * 50 + ".attn_qkv.weight", "output.weight", "token_embd.weight"])
        tensors[i] = [name, ne, ggml, data]
        what = f"tensor {i} {part}: {name[:40]} ne={ne} type={ggml}"
    elif kind == 3:  # counts and version
        part = rng.choice(["n_tensors", "n_fields", "version"])
        value = rng.choice([0, 1, 2**31 - 1, 2**63 - 1, 2**64 - 1, len(tensors) + 1])
        if part == "version":
            version = rng.choice([0, 1, 2, 4, 2**32 - 1])
            what = f"version = {version}"
        else:
            counts = (value, len(fields)) if part == "n_tensors" else (len(tensors), value)
            what = f"{part} = {value}"
    elif kind == 4:  # a field added or removed
        if rng.random() < 0.5:
            i = rng.randrange(len(fields))
            what = f"metadata {fields[i][0]} removed"
            del fields[i]
        else:
            key = rng.choice(["gpt2.block_count", "general.alignment", "tokenizer.ggml.token_type", "x" * 1000])
            new_kind, new_value = gguf_special(rng)
            fields.append((key, new_kind, new_value))
            what = f"metadata {key[:40]} added = {new_value!r:.40} (type {new_kind})"
    else:
        return mutate_file(path, rng)
    try:
        path.write_bytes(gguf_bytes(fields, tensors, alignment if alignment % 8 == 0 else 32, version, counts))
    except (struct.error, UnicodeEncodeError, OverflowError, TypeError):  # a value the type cannot hold
        path.write_bytes(gguf_bytes(fields[:-1] if kind == 4 else gguf_seed()[0], tensors))
        what += " (unwritable: written without it)"
    return f"{path.name}: {what}"


# OpenAI TF: the index is an SSTable of BundleEntryProto messages, rewritten here entry by entry.

def _varint(n: int) -> bytes:
    out = bytearray()
    n &= 2**70 - 1
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not out[-1] & 0x80:
            return bytes(out)


def encode_proto(fields: dict[int, list]) -> bytes:
    out = b""
    for number, values in fields.items():
        for v in values:
            if isinstance(v, bytes):
                out += _varint(number << 3 | 2) + _varint(len(v)) + v
            elif number == 6:  # crc32c: fixed32
                out += _varint(number << 3 | 5) + struct.pack("<I", v & 0xFFFFFFFF)
            else:
                out += _varint(number << 3) + _varint(v)
    return out


def write_sstable(path: Path, entries: dict[bytes, bytes]) -> None:
    from gpt2attn.formats.tf_checkpoint import TABLE_MAGIC, masked_crc32c

    def block(pairs) -> bytes:
        body = b"".join(_varint(0) + _varint(len(k)) + _varint(len(v)) + k + v for k, v in pairs)
        return body + struct.pack("<II", 0, 1)

    def trailer(contents: bytes) -> bytes:
        return contents + b"\x00" + struct.pack("<I", masked_crc32c(contents + b"\x00"))

    data = block(sorted(entries.items()))
    index = block([(max(entries, default=b""), _varint(0) + _varint(len(data)))])
    table = trailer(data) + trailer(index)
    handles = _varint(0) + _varint(0) + _varint(len(data) + 5) + _varint(len(index))
    path.write_bytes(table + handles + bytes(40 - len(handles)) + struct.pack("<Q", TABLE_MAGIC))


def mutate_tf_index(path: Path, rng: random.Random) -> str:
    from gpt2attn.formats.tf_checkpoint import parse_proto, read_sstable

    entries = read_sstable(path)
    key = rng.choice(sorted(entries))
    if rng.random() < 0.1:
        new_key = rng.choice([b"\xff\xfe", b"model/h9/attn/c_attn/w", b""])
        entries[new_key] = entries.pop(key)
        write_sstable(path, entries)
        return f"{path.name}: key {key!r} renamed {new_key!r}"
    fields = parse_proto(entries[key])
    number = rng.choice([1, 1, 2, 3, 4, 5, 6] if key else [1, 2, 3])
    value = rng.choice([0, 1, 3, 14, 2**31 - 1, 2**63 - 1, 2**64 - 1, 10**6])
    if number == 2 and key:  # a dimension of the shape
        dims = [parse_proto(d) for d in parse_proto(fields[2][0]).get(2, [])] if 2 in fields else []
        if dims and rng.random() < 0.7:
            rng.choice(dims)[1] = [value]
        else:
            dims.append({1: [value]})
        fields[2] = [encode_proto({2: [encode_proto(d) for d in dims]})]
        what = f"shape dim = {value}"
    elif rng.random() < 0.1:
        fields[number] = [b"\x08\x01"]  # a message where a number belongs
        what = f"field {number} = a message"
    else:
        fields[number] = [value]
        what = f"field {number} = {value}"
    entries[key] = encode_proto(fields)
    write_sstable(path, entries)
    return f"{path.name}: entry {key.decode(errors='replace')!r}: {what}"


# --- one case -----------------------------------------------------------------------------------


def make_case(fmt: str, seed: int, index: int, seeds: dict[str, Path], work: Path) -> tuple[Path, str]:
    """Copy the format's seed into `work` and apply the mutation (format, seed, index) picks;
    index -1 is the seed unchanged. Returns the path to load and what was changed."""
    import torch

    rng = random.Random(f"{fmt}:{seed}:{index}")
    source = seeds[fmt]
    folder = work / fmt
    shutil.copytree(source if source.is_dir() else source.parent, folder)
    target = folder if source.is_dir() else folder / source.name
    if index < 0:
        return target, "the seed, unchanged"
    structured = rng.random() < 0.6
    if fmt == "hf":
        if structured:
            name = rng.choice(["config.json", "config.json", "model.safetensors", "generation_config.json"])
            if name == "model.safetensors":
                return target, mutate_safetensors_header(folder / name, rng)
            return target, mutate_json_file(folder / name, rng, CONFIG_KEYS if name == "config.json" else GENERATION_KEYS)
        return target, mutate_file(folder / rng.choice(["model.safetensors", "config.json", "generation_config.json"]), rng)
    if fmt == "shards":
        shards = sorted(p.name for p in folder.glob("model-*.safetensors"))
        if structured:
            if rng.random() < 0.5:
                return target, mutate_json_file(folder / "model.safetensors.index.json", rng, ("weight_map", "metadata"))
            return target, mutate_safetensors_header(folder / rng.choice(shards), rng)
        return target, mutate_file(folder / rng.choice(shards + ["model.safetensors.index.json"]), rng)
    if fmt == "pytorch_bin":
        if structured:
            return target, mutate_state_dict(folder / "pytorch_model.bin", rng)
        return target, mutate_file(folder / "pytorch_model.bin", rng)
    if fmt == "llmc":
        if structured:
            data = bytearray(target.read_bytes())
            i = rng.randrange(8)
            value = rng.choice(SPECIAL_INTS[:8] + [rng.randrange(-(2**31), 2**31)])
            data[4 * i: 4 * i + 4] = struct.pack("<i", value if -(2**31) <= value < 2**31 else -1)
            target.write_bytes(bytes(data))
            return target, f"{target.name}: header[{i}] = {value}"
        return target, mutate_file(target, rng)
    if fmt == "gguf":
        return target, mutate_gguf(target, rng) if structured else mutate_file(target, rng)
    if fmt == "nanogpt":
        if structured:
            ckpt = nanogpt_seed(bias=rng.random() < 0.5)
            what = f"bias={ckpt['model_args']['bias']}: "
            if rng.random() < 0.7:
                key = rng.choice(NANOGPT_ARGS)
                value = rng.choice([0, 1, -1, 2**31 - 1, 2**63 - 1, 10**6, 2**40, math.nan, "16", [16], None, True, 3])
                ckpt["model_args"][key] = value
                what += f"model_args[{key!r}] = {value!r}"
            else:
                what += mutate_state_dict_object(ckpt["model"], rng)
            torch.save(ckpt, target)
            return target, f"{target.name}: {what}"
        return target, mutate_file(target, rng)
    if fmt == "openai_tf":
        if structured:
            if rng.random() < 0.5:
                return target, mutate_json_file(folder / "hparams.json", rng, HPARAMS)
            return target, mutate_tf_index(folder / "model.ckpt.index", rng)
        return target, mutate_file(folder / rng.choice(["model.ckpt.index", "model.ckpt.index",
                                                        "model.ckpt.data-00000-of-00001", "hparams.json"]), rng)
    if fmt == "tokenizer":
        if structured:
            return target, mutate_json_file(folder / "tokenizer.json", rng)
        return target, mutate_file(folder / "tokenizer.json", rng)
    raise ValueError(f"unknown format {fmt!r}")


def mutate_safetensors_header(path: Path, rng: random.Random) -> str:
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header, rest = json.loads(data[8:8 + n]), data[8 + n:]
    header, what = mutate_json(header, rng)
    head = dump_json(header)
    path.write_bytes(len(head).to_bytes(8, "little") + head + rest)
    return f"{path.name} header: {what}"


def mutate_state_dict_object(state: dict, rng: random.Random) -> str:
    import torch

    key = rng.choice(sorted(state))
    t = state[key]
    choice = rng.randrange(9)
    if choice == 0:
        state[key] = t.to(torch.int64)
    elif choice == 1:
        state[key] = t > 0
    elif choice == 2:
        state[key] = t.reshape(-1)
    elif choice == 3:
        state[key] = t.reshape(1, *t.shape)
    elif choice == 4:
        state[key] = rng.choice([3, "x", [1, 2], None, {"a": t}])
    elif choice == 5:
        state[rng.choice([7, ("a",), None, 2.5])] = state.pop(key)
    elif choice == 6:
        del state[key]
    elif choice == 7:
        state[key] = torch.empty(0)
    else:
        state[key] = t.to(rng.choice([torch.float16, torch.bfloat16, torch.float64]))
    return f"{key}: change {choice}"


def mutate_state_dict(path: Path, rng: random.Random) -> str:
    import torch

    state = torch.load(path, weights_only=True)
    what = mutate_state_dict_object(state, rng)
    torch.save(state, path)
    return f"{path.name}: {what}"


def load(fmt: str, target: Path) -> None:
    """Load what the case holds and use it: a model runs a forward pass, a tokenizer encodes."""
    import torch

    from gpt2attn import GPT2LMHeadModel
    from gpt2attn.tokenizer import load_tokenizer

    if fmt == "tokenizer":
        tok = load_tokenizer(target)
        try:
            tok.encode("Hello world <|endoftext|>")
        except ValueError:
            pass  # a vocabulary without some of the text's characters says so: the tokenizer works
        return
    model = GPT2LMHeadModel.from_pretrained(target)
    n = min(2, model.config.n_positions)
    with torch.no_grad():
        logits = model(torch.zeros(1, n, dtype=torch.long)).logits
    assert logits.shape == (1, n, model.config.vocab_size)
    if fmt == "gguf":
        from gpt2attn.formats.gguf import tokenizer_of

        tok = tokenizer_of(target)
        if tok is not None:
            tok.encode("Hello world")


def classify(error: BaseException, work: Path) -> str:
    from gpt2attn import CheckpointError

    if isinstance(error, (CheckpointError, FileNotFoundError)) and str(work) in str(error):
        return "ours"
    if isinstance(error, MemoryError):
        return "memory"
    return "other"


# --- the worker process and the driver ----------------------------------------------------------


def peak_rss_reset() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker() -> None:
    """Read cases (JSON lines) on stdin, answer each with one `@@ {...}` line on stdout."""
    import warnings

    import torch

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="gpt2attn-fuzz-"))
    try:
        seeds = make_seeds(root / "seeds")
        with open("/proc/self/status") as f:
            size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (size + 2 * RSS_LIMIT, resource.RLIM_INFINITY))
        print("@@ " + json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            case = json.loads(line)
            work = root / f"case-{case['index']}"
            work.mkdir()
            result = {"outcome": "loaded", "detail": ""}
            peak_rss_reset()
            cpu = time.process_time()
            try:
                target, result["mutation"] = make_case(case["fmt"], case["seed"], case["index"], seeds, work)
                cpu = time.process_time()
                load(case["fmt"], target)
            except BaseException as e:  # noqa: BLE001 - every outcome is recorded
                if isinstance(e, (KeyboardInterrupt, SystemExit)):
                    raise
                result["outcome"] = classify(e, work)
                result["detail"] = f"{type(e).__name__}: {e}"[:600]
                if result["outcome"] != "ours":
                    result["detail"] += "\n" + "".join(traceback.format_exc(limit=-4))[-1500:]
            result["cpu"] = time.process_time() - cpu
            result["rss"] = peak_rss()
            shutil.rmtree(work, ignore_errors=True)
            print("@@ " + json.dumps(result), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


class Worker:
    """A worker process fed one case at a time; killed and replaced after a hang or a crash."""

    def __init__(self):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               "RUST_BACKTRACE": "0", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.fuzzing", "--worker"], cwd=REPO, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.buffer = b""
        if self.read(120) is None:
            raise RuntimeError("the fuzz worker did not start")

    def read(self, timeout: float) -> dict | None:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            if not chunk:
                return {"outcome": "crash", "detail": f"the worker died (exit {self.proc.wait()})"}
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        if not line.startswith(b"@@ "):
            return self.read(max(0.0, deadline - time.monotonic()))
        return json.loads(line[3:])

    def run(self, case: dict, wall_limit: float) -> dict:
        try:
            self.proc.stdin.write((json.dumps(case) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            return {"outcome": "crash", "detail": "the worker had died"}
        start = time.monotonic()
        result = self.read(wall_limit)
        if result is None:
            self.close()
            return {"outcome": "slow", "detail": f"no answer within {wall_limit} s (killed)", "wall": wall_limit}
        result["wall"] = time.monotonic() - start
        if result.get("cpu", 0) > CPU_LIMIT_S:
            result["outcome"], result["detail"] = "slow", f"{result['cpu']:.2f} s of CPU time. " + result["detail"]
        if result.get("rss", 0) > RSS_LIMIT:
            result["outcome"], result["detail"] = "memory", f"peak RSS {result['rss'] >> 20} MiB. " + result["detail"]
        return result

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        try:
            self.proc.stdin.close()
        except BrokenPipeError:  # bytes a dead worker never read: gone with it
            pass
        self.proc.stdout.close()


def run_cases(cases: list[dict], wall_limit: float = 10.0, progress=None) -> list[dict]:
    """Run each case ({'fmt', 'seed', 'index'}) in a worker; returns them with their results."""
    results = []
    worker = None
    try:
        for case in cases:
            if worker is None or not worker.alive():
                if worker is not None:
                    worker.close()  # a crashed one: its pipes
                worker = Worker()
            result = {**case, **worker.run(case, wall_limit)}
            results.append(result)
            if progress:
                progress(result)
    finally:
        if worker is not None:
            worker.close()
    return results


def reproducer(result: dict) -> str:
    return (f"{result['outcome']}: format={result['fmt']} seed={result['seed']} index={result['index']} "
            f"mutation={result.get('mutation', '?')}\n  replay: python -m tests.fuzzing {result['fmt']} "
            f"{result['seed']} {result['index']}\n  {result.get('detail', '')}")


def summary(results: list[dict]) -> str:
    counts = Counter((r["fmt"], r["outcome"]) for r in results)
    outcomes = ("loaded", "ours", *FAILURES)
    lines = [f"{'format':12} " + " ".join(f"{o:>7}" for o in outcomes) + f" {'total':>7}"]
    for fmt in FORMATS:
        row = [counts[fmt, o] for o in outcomes]
        if sum(row):
            lines.append(f"{fmt:12} " + " ".join(f"{n:7d}" for n in row) + f" {sum(row):7d}")
    total = [sum(counts[f, o] for f in FORMATS) for o in outcomes]
    lines.append(f"{'all':12} " + " ".join(f"{n:7d}" for n in total) + f" {sum(total):7d}")
    cpu = max((r.get("cpu", 0) for r in results), default=0)
    wall = max((r.get("wall", 0) for r in results), default=0)
    rss = max((r.get("rss", 0) for r in results), default=0)
    lines.append(f"slowest case: {cpu:.2f} s CPU, {wall:.2f} s wall; highest peak RSS: {rss / 2**20:.0f} MiB")
    return "\n".join(lines)


def replay(fmt: str, seed: int, index: int) -> None:
    """Run one case in this process, printing the mutation and the full traceback."""
    with tempfile.TemporaryDirectory() as tmp:
        seeds = make_seeds(Path(tmp) / "seeds")
        work = Path(tmp) / "case"
        work.mkdir()
        target, mutation = make_case(fmt, seed, index, seeds, work)
        print(f"mutation: {mutation}")
        load(fmt, target)
        print("loaded")


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        worker()
    else:
        replay(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
