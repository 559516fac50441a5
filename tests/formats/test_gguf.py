"""GGUF (llama.cpp), gpt2attn/formats/gguf.py.

The details a user sees: how the reader parses each part of a file (value types, arrays, bounds,
alignment, tensor table) and names what is wrong, which metadata it takes for the config and
tokenizer, and what the writer puts in a file. Files here are built byte by byte by `gguf_bytes`
below, from the GGUF layout as llama.cpp's ggml/docs/gguf.md and gguf-py describe it
(little-endian; header: magic, version u32, tensor count u64, metadata count u64; each metadata
entry: key string, value type u32, value; each tensor entry: name string, n_dims u32, ne[n_dims]
u64 innermost first, GGML type u32, data offset u64; tensor data from the first multiple of
general.alignment (default 32) after the table), or written by gguf-py's own GGUFWriter, and what
the writer wrote is read back by gguf-py's GGUFReader: never by our reader alone.

Then (sections below) files made by llama.cpp's own converter, files of every GGML type we read,
transformers' own GGUF loader, and the rules a written file keeps (bounds, versions, metadata,
tensor types as llama.cpp's converter and gguf-py write them)."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gpt2attn import GPT2Config, GPT2LMHeadModel
from gpt2attn.cli import main as cli
from gpt2attn.formats import detect_format, gguf as ours, save
from tests.helpers import DATA as TEST_DATA, randomize, tiny_config

gguf = pytest.importorskip("gguf", reason="the gguf package (pip install 'gpt2attn[gguf]') reads GGUF")
transformers = pytest.importorskip("transformers")

# GGUF metadata value types (gguf.md: GGUFValueType) and their struct formats
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12
FORMATS = {U8: "B", I8: "b", U16: "H", I16: "h", U32: "I", I32: "i", F32: "f", BOOL: "?", U64: "Q", I64: "q",
           F64: "d"}
# GGML tensor type ids (ggml.h: enum ggml_type)
T_F32, T_F16, T_Q8_0, T_Q2_K, T_BF16 = 0, 1, 8, 10, 30


def string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def payload(kind: int, value) -> bytes:
    if kind == STR:
        return string(value)
    if kind == ARR:
        item, items = value
        return struct.pack("<IQ", item, len(items)) + b"".join(payload(item, v) for v in items)
    return struct.pack("<" + FORMATS[kind], value)


def gguf_bytes(fields=(), tensors=(), *, version: int = 3, alignment: int = 32, offsets=None) -> bytes:
    """A GGUF file: fields as (key, value type, value); tensors as (name, GGML type id, ne, raw bytes),
    their data laid out in order, each at the next multiple of `alignment` (or at `offsets`)."""
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(fields))
    for key, kind, value in fields:
        out += string(key) + struct.pack("<I", kind) + payload(kind, value)
    data, places = b"", []
    for i, (_, _, _, raw) in enumerate(tensors):
        place = len(data) + -len(data) % alignment if offsets is None else offsets[i]
        data += b"\0" * (place - len(data)) + raw
        places.append(place)
    for (name, type_id, ne, _), offset in zip(tensors, places):
        out += string(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
        out += struct.pack("<IQ", type_id, offset)
    return out + b"\0" * (-len(out) % alignment) + data if tensors else out  # no padding without tensors


def write_bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def f32(array) -> bytes:
    return np.ascontiguousarray(array, dtype="<f4").tobytes()


def model_of(**overrides) -> GPT2LMHeadModel:
    return randomize(GPT2LMHeadModel(tiny_config(**overrides)), std=0.1).eval()


LLAMA = {"wte": "token_embd", "wpe": "position_embd", "ln_f": "output_norm"}
BLOCKS = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",
          "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}


def model_tensors(model: GPT2LMHeadModel) -> list:
    """The model's tensors in llama.cpp's names and layouts, F32: (name, type, ne, bytes), with
    output.weight a copy of token_embd.weight (a tied head, as the converter writes it)."""
    out = []
    for key, value in model.state_dict().items():
        parts = key.split(".")
        if key == "lm_head.weight":
            continue
        value = value.detach().numpy()
        if parts[1] == "h":
            name = f"blk.{parts[2]}.{BLOCKS['.'.join(parts[3:-1])]}.{parts[-1]}"
            if value.ndim == 2:
                value = value.T  # Conv1D (in, out) -> Linear (out, in)
        else:
            name = f"{LLAMA[parts[1]]}.{parts[2]}"
        out.append((name, T_F32, tuple(reversed(value.shape)), f32(value)))
    wte = next(t for t in out if t[0] == "token_embd.weight")
    return out + [("output.weight",) + wte[1:]]


def config_fields(model: GPT2LMHeadModel) -> list:
    """The model's config as the gpt2.* metadata llama.cpp's converter writes."""
    c = model.config
    return [("general.architecture", STR, "gpt2"), ("gpt2.block_count", U32, c.n_layer),
            ("gpt2.context_length", U32, c.n_positions), ("gpt2.embedding_length", U32, c.n_embd),
            ("gpt2.feed_forward_length", U32, c.inner_dim), ("gpt2.attention.head_count", U32, c.n_head),
            ("gpt2.attention.layer_norm_epsilon", F32, c.layer_norm_epsilon)]


def model_file(path: Path, model: GPT2LMHeadModel, extra=(), tensors=None) -> Path:
    return write_bytes(path, gguf_bytes(config_fields(model) + list(extra),
                                        model_tensors(model) if tensors is None else tensors))


def assert_same_weights(a: GPT2LMHeadModel, b: GPT2LMHeadModel) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def refused(path: Path, *words: str, reader=None) -> str:
    """The CheckpointError (a ValueError) reading path raises; it names the file and each of words."""
    with pytest.raises(ValueError) as error:
        (reader or GPT2LMHeadModel.from_pretrained)(path)
    message = str(error.value)
    assert message.startswith(str(path)), message
    for word in words:
        assert word in message, (word, message)
    return message


# --- the builder itself, checked against gguf-py's reader ------------------------------------------------


def test_the_byte_builder_writes_what_gguf_py_reads(tmp_path):
    model = model_of()
    path = model_file(tmp_path / "m.gguf", model)
    reader = gguf.GGUFReader(str(path))
    assert reader.fields["gpt2.embedding_length"].contents() == 32
    assert reader.fields["general.architecture"].contents() == "gpt2"
    qkv = next(t for t in reader.tensors if t.name == "blk.1.attn_qkv.weight")
    assert np.array_equal(np.asarray(qkv.data), model.transformer.h[1].attn.c_attn.weight.detach().numpy().T)
    assert_same_weights(GPT2LMHeadModel.from_pretrained(path), model)


# --- the metadata values: every GGUF value type, arrays, nesting ------------------------------------------


def test_every_value_type_and_array_reads_back_as_written(tmp_path):
    fields = [
        ("u8", U8, 255), ("i8", I8, -128), ("u16", U16, 65535), ("i16", I16, -32768), ("u32", U32, 2**32 - 1),
        ("i32", I32, -(2**31)), ("f32", F32, 0.375), ("yes", BOOL, True), ("no", BOOL, False),
        ("u64", U64, 2**64 - 1), ("i64", I64, -(2**63)), ("f64", F64, 0.1), ("café", STR, "naïve ✓"),
        ("empty", STR, ""),
        ("a.u8", ARR, (U8, [0, 200, 255])), ("a.i8", ARR, (I8, [-1, 1])), ("a.u16", ARR, (U16, [65535])),
        ("a.i16", ARR, (I16, [-2, 3])), ("a.u32", ARR, (U32, [7, 2**32 - 1])), ("a.i32", ARR, (I32, [-5, 9])),
        ("a.f32", ARR, (F32, [0.5, -2.25])), ("a.u64", ARR, (U64, [2**63 + 1])), ("a.i64", ARR, (I64, [-3])),
        ("a.f64", ARR, (F64, [0.1, 1e300])), ("a.bool", ARR, (BOOL, [True, False, True])),
        ("a.str", ARR, (STR, ["x", "", "yz"])), ("a.none", ARR, (U32, [])), ("a.nostr", ARR, (STR, [])),
        ("a.a", ARR, (ARR, [(I32, [1, -2]), (STR, ["p", "q"]), (U8, [])])),
    ]
    path = write_bytes(tmp_path / "v.gguf", gguf_bytes(fields))
    file = ours.GGUFFile(path)
    expected = {key: value[1] if kind == ARR and value[0] != ARR else value for key, kind, value in fields}
    expected["a.a"] = [[1, -2], ["p", "q"], []]
    assert file.fields == expected
    assert type(file.fields["yes"]) is bool and [type(v) for v in file.fields["a.bool"]] == [bool] * 3
    assert file.tensors == {}
    theirs = gguf.GGUFReader(str(path))  # the builder agrees with gguf-py
    assert theirs.fields["a.str"].contents() == ["x", "", "yz"] and theirs.fields["i64"].contents() == -(2**63)


def test_a_file_of_exactly_its_entries_reads(tmp_path):
    """The header's fit check (13 bytes at least per metadata entry) lets through a file whose
    entries take exactly that: an empty key and a uint8 value."""
    data = gguf_bytes([("", U8, 9)])
    assert len(data) == 24 + 13
    file = ours.GGUFFile(write_bytes(tmp_path / "e.gguf", data))
    assert file.fields == {"": 9}
    two = gguf_bytes([("", U8, 1), ("", U8, 2)])  # the later entry of a repeated key wins
    assert ours.GGUFFile(write_bytes(tmp_path / "two.gguf", two)).fields == {"": 2}


HEADER = b"GGUF" + struct.pack("<I", 3)


@pytest.mark.parametrize("data, where", [
    (b"", "magic is b''"),
    (b"GGU", "magic is b'GGU'"),
    (b"GGML" + struct.pack("<IQQ", 3, 0, 0), "not a GGUF file: magic is b'GGML', expected b'GGUF'"),
    (b"GGUF", "version None"),
    (b"GGUF\x03\x00\x00", "version None"),
    (HEADER + struct.pack("<Q", 0), "cannot read the header at byte 16"),
    (HEADER, "cannot read the header at byte 8"),
    # two entries of 13 bytes at least in 24 bytes; one tensor entry of 28 at least in 27
    (HEADER + struct.pack("<QQ", 0, 2) + b"\0" * 24, "the header at byte 24 (0 tensors and 2 metadata entries do not fit in 48 bytes)"),
    (HEADER + struct.pack("<QQ", 1, 0) + b"\0" * 27, "the header at byte 24 (1 tensors and 0 metadata entries do not fit in 51 bytes)"),
    (HEADER + struct.pack("<QQ", 0, 2**62) + b"\0" * 24, "do not fit"),
    (HEADER + struct.pack("<QQ", 2**62, 0) + b"\0" * 24, "do not fit"),
])
def test_a_broken_header_is_named_with_the_byte(tmp_path, data, where):
    path = write_bytes(tmp_path / "h.gguf", data)
    refused(path, where, reader=ours.GGUFFile)


def test_counts_read_unsigned(tmp_path):
    """Every count, size, type and offset in GGUF is unsigned: the largest ones are refused as too
    large, not read as negative numbers."""
    top = 2**64 - 1
    for counts in [(top, 0), (0, top)]:
        refused(write_bytes(tmp_path / "c.gguf", HEADER + struct.pack("<QQ", *counts) + b"\0" * 64),
                f"{counts[0]} tensors and {counts[1]} metadata entries do not fit", reader=ours.GGUFFile)
    cases = [
        (entry_bytes("k", 2**32 - 1, b"\0" * 8), "unknown value type 4294967295"),
        (entry_bytes("k", ARR, struct.pack("<IQ", 2**32 - 1, 1) + b"\0" * 8), "unknown value type 4294967295"),
        (entry_bytes("k", ARR, struct.pack("<IQ", U8, top) + b"\0" * 8), f"an array of {top} values runs past the end"),
        (entry_bytes("k", ARR, struct.pack("<IQ", STR, top) + b"\0" * 8), f"an array of {top} values runs past the end"),
        (HEADER + struct.pack("<QQ", 1, 0) + string("t") + struct.pack("<I", 2**32 - 1) + b"\0" * 64,
         "n_dims is 4294967295, must be 1 to 4"),
    ]
    for data, words in cases:
        refused(write_bytes(tmp_path / "v.gguf", data), words, reader=ours.GGUFFile)
    for tensor, words in [(("t", T_F32, (top,), b""), f"has shape [{top}]"),
                          (("t", 2**32 - 1, (4,), b""), "tensor t has unknown GGML type id 4294967295")]:
        refused(write_bytes(tmp_path / "t.gguf", gguf_bytes([], [tensor])), words, reader=ours.GGUFFile)
    far = HEADER + struct.pack("<QQ", 1, 0) + string("t") + struct.pack("<IQIQ", 1, 2, T_F32, 2**64 - 32)
    far += b"\0" * (-len(far) % 32) + f32([1, 2])
    refused(write_bytes(tmp_path / "o.gguf", far), "tensor t (F32, [2]) needs bytes", reader=ours.GGUFFile)


def test_the_fit_check_counts_28_bytes_per_tensor_and_13_per_entry(tmp_path):
    """Counts that fit the check exactly go on to the table, where the damage is then named."""
    one_tensor = HEADER + struct.pack("<QQ", 1, 0) + b"\xff" * 28  # a tensor name of 2**64-1 bytes
    refused(write_bytes(tmp_path / "t.gguf", one_tensor), "cannot read a tensor name at byte 32",
            "runs past the end", reader=ours.GGUFFile)
    two_fields = HEADER + struct.pack("<QQ", 0, 2) + b"\xff" * 26
    refused(write_bytes(tmp_path / "f.gguf", two_fields), "cannot read a metadata key at byte 32",
            "a string of 18446744073709551615 bytes runs past the end", reader=ours.GGUFFile)


def entry_bytes(key: str, kind: int, rest: bytes) -> bytes:
    return HEADER + struct.pack("<QQ", 0, 1) + string(key) + struct.pack("<I", kind) + rest


@pytest.mark.parametrize("data, where", [
    (entry_bytes("k", 13, b"\0" * 8), "cannot read metadata k at byte 37 (unknown value type 13)"),
    (entry_bytes("k", U32, b"\0" * 3), "cannot read metadata k at byte 37"),
    (entry_bytes("k", STR, struct.pack("<Q", 5) + b"abcd"), "metadata k at byte 45 (a string of 5 bytes runs past the end)"),
    (entry_bytes("k", STR, struct.pack("<Q", 2) + b"\xff\xfe"), "cannot read metadata k at byte 45"),
    (HEADER + struct.pack("<QQ", 0, 1) + string(b"\xc3") + struct.pack("<I", U8) + b"\0", "cannot read a metadata key at byte 32"),
    (entry_bytes("k", ARR, struct.pack("<IQ", U32, 3) + b"\0" * 11), "metadata k at byte 49 (an array of 3 values runs past the end)"),
    (entry_bytes("k", ARR, struct.pack("<IQ", U64, 2**61) + b"\0" * 16), "an array of 2305843009213693952 values runs past the end"),
    (entry_bytes("k", ARR, struct.pack("<IQ", STR, 2) + string("a") + b"\0" * 6), "metadata k at byte 49 (an array of 2 values runs past the end)"),
    (entry_bytes("k", ARR, struct.pack("<IQ", BOOL, 3) + b"\1\0"), "metadata k at byte 49 (an array of 3 values runs past the end)"),
    (entry_bytes("k", ARR, struct.pack("<IQ", ARR, 2) + struct.pack("<IQ", U8, 0) + b"\0" * 11), "metadata k at byte 49 (an array of 2 values runs past the end)"),
    # items of an unknown type are counted 1 byte each before their type is looked at
    (entry_bytes("k", ARR, struct.pack("<IQ", 13, 8) + b"\0" * 8), "metadata k at byte 49 (unknown value type 13)"),
    (entry_bytes("k", ARR, struct.pack("<IQ", 13, 9) + b"\0" * 8), "metadata k at byte 49 (an array of 9 values runs past the end)"),
    (entry_bytes("k", ARR, struct.pack("<IQ", ARR, 1) + struct.pack("<IQ", ARR, 1) + struct.pack("<IQ", U8, 1) + b"\0"),
     "metadata k at byte 73 (arrays nested deeper than 2)"),
])
def test_a_damaged_metadata_value_is_named_with_its_key_and_byte(tmp_path, data, where):
    refused(write_bytes(tmp_path / "k.gguf", data), where, reader=ours.GGUFFile)


def test_arrays_whose_smallest_items_fill_the_file_exactly_read(tmp_path):
    """The bounds check before an array counts 8 bytes at least per string, 1 per bool and 12 per
    array: arrays whose items take exactly the bytes left read."""
    for key, value, expected in [("s", (STR, ["", ""]), ["", ""]), ("b", (BOOL, [True, False]), [True, False]),
                                 ("a", (ARR, [(U8, []), (U8, [])]), [[], []])]:
        file = ours.GGUFFile(write_bytes(tmp_path / f"{key}.gguf", gguf_bytes([(key, ARR, value)])))
        assert file.fields == {key: expected}


# --- alignment and the tensor table ------------------------------------------------------------------------


def small_tensors():
    """Three F32 tensors of odd byte lengths (12, 20, 8), so each is padded to the alignment."""
    return [("a", T_F32, (3,), f32([1, 2, 3])), ("b", T_F32, (5,), f32([4, 5, 6, 7, 8])),
            ("c", T_F32, (2,), f32([-1, 0.5]))]


@pytest.mark.parametrize("alignment", [8, 16, 64, 2**16])
def test_general_alignment_places_the_tensor_data(tmp_path, alignment):
    data = gguf_bytes([("general.alignment", U32, alignment)], small_tensors(), alignment=alignment)
    file = ours.GGUFFile(write_bytes(tmp_path / "a.gguf", data))
    assert [file.tensor(n).tolist() for n in "abc"] == [[1, 2, 3], [4, 5, 6, 7, 8], [-1, 0.5]]
    theirs = gguf.GGUFReader(str(tmp_path / "a.gguf"))
    assert [t.data_offset for t in theirs.tensors] == [file.tensors[n][2] for n in "abc"]
    assert [file.tensors[n][2] % alignment for n in "abc"] == [0, 0, 0]


def test_the_default_alignment_is_32(tmp_path):
    file = ours.GGUFFile(write_bytes(tmp_path / "a.gguf", gguf_bytes([], small_tensors())))
    # the table ends at byte 24 + 3 * 33 = 123: the data starts at 128; 12 and 20 bytes padded to 32
    assert [file.tensors[n][2] for n in "abc"] == [128, 160, 192]
    assert file.tensor("c").tolist() == [-1, 0.5]


@pytest.mark.parametrize("kind, alignment", [(U32, 0), (U32, 4), (U32, 12), (U32, 2**16 + 8), (U32, 2**17),
                                             (I32, -32), (STR, "32"), (BOOL, True), (F32, 32.0)])
def test_a_bad_alignment_is_refused_naming_it(tmp_path, kind, alignment):
    data = gguf_bytes([("general.alignment", kind, alignment)], small_tensors())
    refused(write_bytes(tmp_path / "a.gguf", data), f"general.alignment is {alignment!r}",
            "must be a multiple of 8 up to 65536", reader=ours.GGUFFile)


def test_a_tensor_offset_off_the_alignment_is_refused(tmp_path):
    data = gguf_bytes([], small_tensors(), offsets=[0, 32, 72])
    refused(write_bytes(tmp_path / "o.gguf", data), "tensor c (F32, [2]) needs bytes", reader=ours.GGUFFile)
    # the same offsets are whole under an alignment of 8
    data = gguf_bytes([("general.alignment", U32, 8)], small_tensors(), offsets=[0, 32, 72], alignment=8)
    assert ours.GGUFFile(write_bytes(tmp_path / "p.gguf", data)).tensor("c").tolist() == [-1, 0.5]


@pytest.mark.parametrize("n_dims", [1, 2, 3, 4])
def test_tensors_of_one_to_four_dimensions_read_in_numpy_order(tmp_path, n_dims):
    ne = (2, 3, 1, 2)[:n_dims]
    values = np.arange(np.prod(ne), dtype=np.float32).reshape(tuple(reversed(ne)))
    file = ours.GGUFFile(write_bytes(tmp_path / "d.gguf", gguf_bytes([], [("t", T_F32, ne, f32(values))])))
    table_end = 24 + 8 + 1 + 4 + 8 * n_dims + 4 + 8
    assert file.tensors["t"] == ("F32", ne, -(-table_end // 32) * 32, 4 * values.size)
    assert torch.equal(file.tensor("t"), torch.from_numpy(values))


@pytest.mark.parametrize("n_dims", [0, 5])
def test_a_tensor_of_zero_or_five_dimensions_is_refused(tmp_path, n_dims):
    head = HEADER + struct.pack("<QQ", 1, 0) + string("t") + struct.pack("<I", n_dims)
    data = head + struct.pack(f"<{n_dims}Q", *[1] * n_dims) + struct.pack("<IQ", T_F32, 0) + b"\0" * 64
    refused(write_bytes(tmp_path / "d.gguf", data), "cannot read tensor t's header at byte 37",
            f"n_dims is {n_dims}, must be 1 to 4", reader=ours.GGUFFile)


def test_a_tensor_header_cut_short_is_named(tmp_path):
    data = HEADER + struct.pack("<QQ", 1, 0) + string("tt") + struct.pack("<I", 2) + struct.pack("<QQ", 4, 4) + b"\0" * 5
    refused(write_bytes(tmp_path / "d.gguf", data), "cannot read tensor tt's header at byte 58", reader=ours.GGUFFile)
    data = HEADER + struct.pack("<QQ", 1, 0) + struct.pack("<Q", 2) + b"\xff\xfe" + b"\0" * 30
    refused(write_bytes(tmp_path / "n.gguf", data), "cannot read a tensor name at byte 32", reader=ours.GGUFFile)


@pytest.mark.parametrize("type_id, ne, words", [
    (4, (32,), "tensor t has unknown GGML type id 4"),  # Q4_2, removed from ggml
    (31, (32,), "tensor t has unknown GGML type id 31"),
    (T_F32, (0,), "tensor t (F32) has shape [0]: each size must be 1 to 1099511627776"),
    (T_F32, (2, 0), "tensor t (F32) has shape [2, 0]"),
    (T_F32, (2**40 + 1,), "has shape [1099511627777]"),
    (T_F32, (2**40,), "tensor t (F32, [1099511627776]) needs bytes 64..4398046511168"),  # the largest size: too long here
    (T_Q8_0, (48, 2), "tensor t (Q8_0) has shape [48, 2]: each size must be 1 to 1099511627776, the first a multiple of Q8_0's block of 32"),
    (T_Q2_K, (128,), "the first a multiple of Q2_K's block of 256"),
])
def test_a_bad_tensor_type_or_shape_is_refused_naming_the_tensor(tmp_path, type_id, ne, words):
    data = gguf_bytes([], [("t", type_id, ne, b"\0" * 4096)])
    refused(write_bytes(tmp_path / "t.gguf", data), words, reader=ours.GGUFFile)


# (GGML type id, ne, bytes it takes): ggml's block sizes (ggml.c's type_traits: blck_size, type_size)
SIZES = [(0, (8, 2), 64), (1, (8, 2), 32), (30, (8, 2), 32), (2, (64, 2), 72), (3, (64, 1), 40), (6, (32, 3), 66),
         (7, (32, 1), 24), (8, (64, 1), 68), (9, (32, 1), 36), (10, (256, 1), 84), (11, (256, 1), 110),
         (12, (256, 2), 288), (13, (256, 1), 176), (14, (256, 1), 210), (15, (256, 1), 292)]


@pytest.mark.parametrize("type_id, ne, size", SIZES)
def test_each_ggml_type_takes_its_block_bytes_and_no_more(tmp_path, type_id, ne, size):
    whole = gguf_bytes([], [("t", type_id, ne, bytes(range(256)) * 2)])[: 96 + size]  # the table: 65 bytes
    file = ours.GGUFFile(write_bytes(tmp_path / "t.gguf", whole))
    assert file.tensors["t"][1:] == (ne, 96, size)
    refused(write_bytes(tmp_path / "cut.gguf", whole[:-1]), f"tensor t ({file.tensors['t'][0]}, {list(ne)}) needs "
            f"bytes 96..{96 + size} (aligned to 32), the file has {96 + size - 1}", reader=ours.GGUFFile)


# --- the config from gpt2.* metadata ------------------------------------------------------------------------

EMBD = ("token_embd.weight", T_F32, (8, 11), f32(np.zeros((11, 8))))  # n_embd 8, vocab 11
GOOD = {"general.architecture": (STR, "gpt2"), "gpt2.block_count": (U32, 3), "gpt2.context_length": (U32, 20),
        "gpt2.embedding_length": (U32, 8), "gpt2.attention.head_count": (U32, 2)}


def config_of(tmp_path: Path, tensors=(EMBD,), **changes):
    """A file of GOOD's metadata with changes (key -> (type, value), or None to drop the key), and a
    reader of its config."""
    fields = dict(GOOD)
    for key, value in changes.items():
        if value is None:
            fields.pop(key)
        else:
            fields[key] = value
    path = write_bytes(tmp_path / "c.gguf", gguf_bytes([(k, t, v) for k, (t, v) in fields.items()], list(tensors)))
    return path, (lambda p: ours.read_config(ours.GGUFFile(p)))


def test_the_config_takes_each_key_and_llama_cpps_defaults(tmp_path):
    c = ours.read_config(ours.GGUFFile(config_of(tmp_path)[0]))
    assert (c.vocab_size, c.n_positions, c.n_embd, c.n_layer, c.n_head) == (11, 20, 8, 3, 2)
    assert c.n_inner is None and c.inner_dim == 32  # no feed_forward_length: 4 * n_embd
    assert c.layer_norm_epsilon == 1e-5 and c.bos_token_id == 50256 and c.eos_token_id == 50256
    assert c.activation_function == "gelu_new"
    path, read = config_of(tmp_path, **{"gpt2.feed_forward_length": (U32, 32), "tokenizer.ggml.bos_token_id": (U32, 1),
                                        "tokenizer.ggml.eos_token_id": (U64, 0),
                                        "gpt2.attention.layer_norm_epsilon": (F32, 1e-6)})
    c = read(path)
    assert c.n_inner is None and c.inner_dim == 32  # 4 * n_embd written out is still the default
    assert (c.bos_token_id, c.eos_token_id, c.layer_norm_epsilon) == (1, 0, 1e-6)
    for ff in (31, 33, 1):
        path, read = config_of(tmp_path, **{"gpt2.feed_forward_length": (I32, ff)})
        assert read(path).n_inner == ff
    path, read = config_of(tmp_path, **{"gpt2.attention.layer_norm_epsilon": (U8, 2)})
    assert read(path).layer_norm_epsilon == 2.0 and type(read(path).layer_norm_epsilon) is float
    path, read = config_of(tmp_path, **{"gpt2.attention.layer_norm_epsilon": (F64, 0.1)})
    assert read(path).layer_norm_epsilon == 0.1  # float32 in llama.cpp: its shortest decimal


@pytest.mark.parametrize("key, limit", [("gpt2.context_length", "n_positions"), ("gpt2.embedding_length", "n_embd"),
                                        ("gpt2.block_count", "n_layer"), ("gpt2.attention.head_count", "n_head"),
                                        ("gpt2.feed_forward_length", "n_inner")])
def test_each_size_is_an_integer_from_1_to_its_limit(tmp_path, key, limit):
    from gpt2attn.config import LIMITS
    high = LIMITS[limit]
    words = f"from 1 to {high} (gpt2attn's limit for {limit}; see docs/hostile-files.md)"
    for kind, value in [(U32, 0), (I32, -1), (U64, high + 1), (F32, 2.0), (BOOL, True), (STR, "8")]:
        path, read = config_of(tmp_path, **{key: (kind, value)})
        refused(path, f"GGUF metadata {key} is {value!r}: must be an integer {words}", reader=read)
    if key != "gpt2.feed_forward_length":
        path, read = config_of(tmp_path, **{key: None})
        refused(path, f"GGUF metadata has no {key}", reader=read)
    if limit in ("n_positions", "n_layer", "n_inner"):  # the limit itself is allowed
        path, read = config_of(tmp_path, **{key: (U64, high)})
        assert getattr(read(path), limit) == high


@pytest.mark.parametrize("key", ["tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"])
def test_a_token_id_is_an_integer_from_0(tmp_path, key):
    for kind, value in [(I32, -1), (F32, 1.0), (BOOL, False), (STR, "0")]:
        path, read = config_of(tmp_path, **{key: (kind, value)})
        message = refused(path, f"GGUF metadata {key} is {value!r}: must be an integer from 0 to {2**63 - 1}",
                          reader=read)
        assert "limit" not in message and message.endswith(f"from 0 to {2**63 - 1}")
    path, read = config_of(tmp_path, **{key: (U64, 2**63)})
    refused(path, f"{key} is {2**63}: must be", reader=read)
    path, read = config_of(tmp_path, **{key: (U64, 2**63 - 1)})
    assert getattr(read(path), key.split(".")[-1]) == 2**63 - 1


def test_layer_norm_epsilon_is_a_positive_finite_number(tmp_path):
    key = "gpt2.attention.layer_norm_epsilon"
    for kind, value in [(F32, 0.0), (F32, -1e-5), (F32, float("inf")), (F64, float("-inf")), (BOOL, True),
                        (STR, "1e-5"), (ARR, (F32, [1e-5]))]:
        path, read = config_of(tmp_path, **{key: (kind, value)})
        refused(path, f"GGUF metadata {key} is", "must be a positive finite number", reader=read)
    path, read = config_of(tmp_path, **{key: (F64, float("nan"))})
    refused(path, f"{key} is nan: must be a positive finite number", reader=read)


def test_the_architecture_and_token_embd_are_required(tmp_path):
    path, read = config_of(tmp_path, **{"general.architecture": None})
    refused(path, "GGUF metadata has no general.architecture", reader=read)
    path, read = config_of(tmp_path, **{"general.architecture": (STR, "gpt2 ")})
    refused(path, "general.architecture is 'gpt2 '; gpt2attn reads GPT-2 ('gpt2') GGUF files", reader=read)
    path, read = config_of(tmp_path, tensors=())
    assert refused(path, reader=read) == f"{path}: GGUF has no token_embd.weight tensor"
    for ne in [(88,), (8, 11, 1)]:
        path, read = config_of(tmp_path, tensors=[("token_embd.weight", T_F32, ne, f32(np.zeros(88)))])
        refused(path, f"tensor token_embd.weight has shape {list(ne)}, not (n_embd, vocab)", reader=read)


def test_a_config_gpt2config_refuses_is_named_as_the_metadatas(tmp_path):
    path, read = config_of(tmp_path, **{"gpt2.attention.head_count": (U32, 3)})  # 8 is not divisible by 3
    refused(path, "the config its gpt2.* metadata gives: n_embd (8) must be divisible by n_head (3)", reader=read)


# --- the tensors a model is read from -------------------------------------------------------------------


def test_a_model_file_built_byte_by_byte_loads_with_its_head_tied(tmp_path):
    model = model_of(n_inner=40, layer_norm_epsilon=1e-6)
    back = GPT2LMHeadModel.from_pretrained(model_file(tmp_path / "m.gguf", model))
    assert_same_weights(back, model)
    assert back.config.tie_word_embeddings is True and back.lm_head.weight is back.transformer.wte.weight
    assert (back.config.n_inner, back.config.layer_norm_epsilon) == (40, 1e-6)
    config, state, tokenizer = ours.read(tmp_path / "m.gguf")
    assert "lm_head.weight" not in state and tokenizer is None and config.tie_word_embeddings is True
    assert state["transformer.h.1.mlp.c_fc.weight"].shape == (32, 40)  # Conv1D's (in, out)


def test_a_tied_output_weight_anywhere_in_the_table_is_skipped_not_the_rest(tmp_path):
    """The converter's files need not end with output.weight: here it comes first."""
    model = model_of()
    tensors = model_tensors(model)
    tensors = [tensors[-1]] + tensors[:-1]
    assert tensors[0][0] == "output.weight"
    back = GPT2LMHeadModel.from_pretrained(model_file(tmp_path / "m.gguf", model, tensors=tensors))
    assert_same_weights(back, model)
    assert back.lm_head.weight is back.transformer.wte.weight


def replaced(model, name: str, new):
    return [new if t[0] == name else t for t in model_tensors(model)]


@pytest.mark.parametrize("name", ["blk.0.attn_k.weight", "blk.0.attn_norm.scale", "blk.x.attn_norm.weight",
                                  "blk.0.attn_norm.weight.", "output.bias", "blk.0.attn_norm", "blk.1234567890.ffn_up.bias"])
def test_a_tensor_gpt2_has_not_is_named(tmp_path, name):
    model = model_of()
    tensors = model_tensors(model) + [(name, T_F32, (4,), f32([0, 1, 2, 3]))]
    refused(model_file(tmp_path / "m.gguf", model, tensors=tensors), f"tensor {name} is not one of GPT-2's")


@pytest.mark.parametrize("name, ne, rank", [
    ("output_norm.weight", (32, 1), 1), ("blk.0.attn_norm.weight", (32, 1), 1), ("blk.1.ffn_norm.bias", (16, 2), 1),
    ("blk.0.attn_qkv.bias", (96, 1), 1), ("blk.0.attn_qkv.weight", (3072,), 2), ("position_embd.weight", (1024,), 2),
    ("blk.1.ffn_down.weight", (128, 32, 1), 2), ("output.weight", (32, 97, 1), 2),
])
def test_a_tensor_of_the_wrong_rank_is_named(tmp_path, name, ne, rank):
    model = model_of()
    data = f32(np.zeros(int(np.prod(ne))))
    tensors = replaced(model, name, (name, T_F32, ne, data))
    refused(model_file(tmp_path / "m.gguf", model, tensors=tensors),
                      f"tensor {name} has {len(ne)} dimensions ({list(ne)}), GPT-2's has {rank}")


def test_leading_zeros_in_a_block_number_name_the_same_block(tmp_path):
    model = model_of()
    tensors = [(t[0].replace("blk.1.", "blk.01."),) + t[1:] for t in model_tensors(model)]
    assert any(t[0].startswith("blk.01.") for t in tensors)
    assert_same_weights(GPT2LMHeadModel.from_pretrained(model_file(tmp_path / "m.gguf", model, tensors=tensors)), model)


def test_output_weight_is_tied_only_when_type_shape_and_bytes_equal_token_embd(tmp_path):
    model = model_of(n_embd=16, n_head=2)
    wte = model.transformer.wte.weight.detach().numpy()
    as_f16 = np.ascontiguousarray(wte, dtype="<f2").tobytes()
    base = [t for t in model_tensors(model) if t[0] not in ("token_embd.weight", "output.weight")]
    embd = ("token_embd.weight", T_F16, (16, 97), as_f16)
    # the same bytes read as BF16: another head
    path = model_file(tmp_path / "bf.gguf", model, tensors=base + [embd, ("output.weight", T_BF16, (16, 97), as_f16)])
    back = GPT2LMHeadModel.from_pretrained(path)
    assert back.config.tie_word_embeddings is False
    as_bf16 = torch.frombuffer(bytearray(as_f16), dtype=torch.bfloat16).float().view(97, 16)
    assert torch.equal(back.lm_head.weight, as_bf16)
    assert torch.equal(back.transformer.wte.weight, torch.from_numpy(wte).half().float())
    # the same bytes and type, the shape transposed: not the embedding (refused by its shape)
    path = model_file(tmp_path / "t.gguf", model, tensors=base + [embd, ("output.weight", T_F16, (97, 16), as_f16)])
    refused(path, "lm_head.weight")
    # the same type and shape, one value changed: another head
    other = bytearray(as_f16)
    other[-2:] = np.float16(7.0).tobytes()
    path = model_file(tmp_path / "o.gguf", model, tensors=base + [embd, ("output.weight", T_F16, (16, 97), bytes(other))])
    back = GPT2LMHeadModel.from_pretrained(path)
    assert back.config.tie_word_embeddings is False and back.lm_head.weight[-1, -1] == 7.0
    assert torch.equal(back.lm_head.weight[:-1], back.transformer.wte.weight[:-1])
    # written twice, alike: one tied head
    path = model_file(tmp_path / "s.gguf", model, tensors=base + [embd, ("output.weight", T_F16, (16, 97), as_f16)])
    back = GPT2LMHeadModel.from_pretrained(path)
    assert back.config.tie_word_embeddings is True and back.lm_head.weight is back.transformer.wte.weight


def test_f16_and_bf16_tensors_are_widened_exactly(tmp_path):
    values = np.array([[1.5, -2.0, 65504.0], [2**-24, 0.0, -0.099975586]], dtype=np.float32)
    halves = np.ascontiguousarray(values, dtype="<f2").tobytes()
    bf = torch.from_numpy(values).to(torch.bfloat16)
    bf_bytes = bf.view(torch.int16).numpy().astype("<i2").tobytes()
    data = gguf_bytes([], [("h", T_F16, (3, 2), halves), ("b", T_BF16, (3, 2), bf_bytes), ("f", T_F32, (3, 2), f32(values))])
    file = ours.GGUFFile(write_bytes(tmp_path / "w.gguf", data))
    for name, expected in [("h", values.astype(np.float16).astype(np.float32)), ("b", bf.float().numpy()), ("f", values)]:
        got = file.tensor(name)
        assert got.dtype == torch.float32 and got.shape == (2, 3)
        assert np.array_equal(got.numpy(), expected), name


def test_f32_f16_and_bf16_read_without_the_gguf_package(tmp_path, monkeypatch):
    """Only the quantized types need gguf's dequantizer; the float types are read by torch alone."""
    import sys
    values = np.array([[0.5, -1.25], [3.0, 0.0]], dtype=np.float32)
    bf_bytes = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy().astype("<i2").tobytes()
    q8 = np.zeros(34, dtype=np.uint8).tobytes()
    data = gguf_bytes([], [("f", T_F32, (2, 2), f32(values)), ("h", T_F16, (2, 2), values.astype("<f2").tobytes()),
                           ("b", T_BF16, (2, 2), bf_bytes), ("q", T_Q8_0, (32,), q8)])
    path = write_bytes(tmp_path / "w.gguf", data)
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now raises ImportError
    file = ours.GGUFFile(path)
    for name in "fhb":
        assert np.array_equal(file.tensor(name).numpy(), values), name
    with pytest.raises(ImportError, match="pip install 'gpt2attn\\[gguf\\]'"):
        file.tensor("q")


def test_a_type_the_reader_does_not_read_is_named_with_those_it_does(tmp_path):
    data = gguf_bytes([], [("q", 15, (256,), b"\0" * 292)])  # Q8_K: in the table, not read
    file = ours.GGUFFile(write_bytes(tmp_path / "k.gguf", data))
    with pytest.raises(ValueError) as error:
        file.tensor("q")
    assert str(error.value) == (f"{tmp_path / 'k.gguf'}: tensor q has GGML type Q8_K, which gpt2attn does not read "
                                "(it reads F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K)")


def test_a_quantized_tensor_of_several_rows_dequantizes_row_by_row(tmp_path):
    rng = np.random.default_rng(3)
    values = rng.standard_normal((3, 2, 64)).astype(np.float32)
    q = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
    data = gguf_bytes([], [("q", T_Q8_0, (64, 2, 3), q.tobytes())])
    got = ours.GGUFFile(write_bytes(tmp_path / "q.gguf", data)).tensor("q")
    expected = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)
    assert got.shape == (3, 2, 64) and np.array_equal(got.numpy(), expected)
    assert np.abs(got.numpy() - values).max() < 0.05


# --- the embedded tokenizer ---------------------------------------------------------------------------------

TOKENS = ["a", "b", "ab", "<|endoftext|>", "Ġ", "Ġab"]  # byte-level BPE: Ġ is the space


def tokenizer_file(tmp_path: Path, **changes) -> Path:
    fields = {"tokenizer.ggml.model": (STR, "gpt2"), "tokenizer.ggml.tokens": (ARR, (STR, TOKENS)),
              "tokenizer.ggml.token_type": (ARR, (I32, [1, 1, 1, 3, 1, 1])),
              "tokenizer.ggml.merges": (ARR, (STR, ["a b", "Ġ ab"]))}
    for key, value in changes.items():
        key = "tokenizer.ggml." + key
        if value is None:
            fields.pop(key)
        else:
            fields[key] = value
    return write_bytes(tmp_path / "t.gguf", gguf_bytes([(k, t, v) for k, (t, v) in fields.items()]))


def test_the_embedded_tokenizer_merges_and_keeps_control_tokens_whole(tmp_path):
    tok = ours.tokenizer_of(str(tokenizer_file(tmp_path)))  # a str path is taken too
    assert tok.encode("ab ab<|endoftext|>").ids == [2, 5, 3]
    assert tok.decode([2, 5, 3], skip_special_tokens=True) == "ab ab"
    assert tok.decode([2, 5, 3], skip_special_tokens=False) == "ab ab<|endoftext|>"
    # without merges each byte is a token; the model key may be absent (GPT-2's is the default)
    tok = ours.tokenizer_of(tokenizer_file(tmp_path, merges=None, model=None))
    assert tok.encode("ab").ids == [0, 1]


def test_a_merge_splits_at_its_first_space(tmp_path):
    """A merge is "left right": the right part keeps any further space (a token may hold one)."""
    path = tokenizer_file(tmp_path, tokens=(ARR, (STR, ["x", "y z", "xy z"])), token_type=None,
                          merges=(ARR, (STR, ["x y z"])))
    spec = json.loads(ours.tokenizer_of(path).to_str())
    assert spec["model"]["merges"] == [["x", "y z"]] and spec["model"]["vocab"] == {"x": 0, "y z": 1, "xy z": 2}
    path = tokenizer_file(tmp_path, tokens=(ARR, (STR, ["x", " y", "x y"])), token_type=None,
                          merges=(ARR, (STR, ["x  y"])))  # split at the first of two spaces: "x" and " y"
    assert json.loads(ours.tokenizer_of(path).to_str())["model"]["merges"] == [["x", " y"]]


def test_without_token_types_no_token_is_a_control_token(tmp_path):
    tok = ours.tokenizer_of(tokenizer_file(tmp_path, token_type=None))
    assert tok.decode([2, 3], skip_special_tokens=True) == "ab<|endoftext|>"  # not special: kept
    tok = ours.tokenizer_of(tokenizer_file(tmp_path, token_type=(ARR, (U8, [1, 1, 1, 4, 1, 1]))))  # USER_DEFINED
    assert tok.decode([2, 3], skip_special_tokens=True) == "ab<|endoftext|>"


def test_a_file_without_tokens_has_no_tokenizer(tmp_path):
    assert ours.tokenizer_of(tokenizer_file(tmp_path, tokens=None)) is None
    assert ours.read_tokenizer(ours.GGUFFile(tokenizer_file(tmp_path, tokens=None, model=(STR, "llama")))) is None


@pytest.mark.parametrize("change, words", [
    (dict(model=(STR, "llama")), "tokenizer.ggml.model is 'llama'; gpt2attn reads GPT-2's BPE ('gpt2')"),
    (dict(tokens=(ARR, (I32, [1, 2]))), "tokenizer.ggml.tokens must be an array of strings, found [1, 2]"),
    (dict(tokens=(STR, "ab")), "tokenizer.ggml.tokens must be an array of strings, found 'ab'"),
    (dict(merges=(ARR, (U8, [7]))),
     "tokenizer.ggml.merges must be an array of strings, found [7]"),
    (dict(merges=(ARR, (STR, ["a b", "Ġab", "x y"]))), "tokenizer.ggml.merges[1] is 'Ġab', not two tokens separated by a space"),
    (dict(token_type=(ARR, (I32, [1, 1, 1, 3, 1]))), "tokenizer.ggml.token_type must be an array of 6 integers, one per token, found [1, 1, 1, 3, 1]"),
    (dict(token_type=(ARR, (F32, [1, 1, 1, 3, 1, 1]))), "tokenizer.ggml.token_type must be an array of 6 integers"),
    (dict(token_type=(ARR, (BOOL, [True] * 6))), "tokenizer.ggml.token_type must be an array of 6 integers"),
    (dict(token_type=(U32, 1)), "tokenizer.ggml.token_type must be an array of 6 integers, one per token, found 1"),
])
def test_a_bad_tokenizer_key_is_named(tmp_path, change, words):
    refused(tokenizer_file(tmp_path, **change), words, reader=ours.tokenizer_of)


def test_the_tokenizer_size_limit(tmp_path, monkeypatch):
    """tokenizer.ggml.tokens holds at most LIMITS['vocab_size'] tokens (checked here with a limit of 6)."""
    from gpt2attn.config import LIMITS
    monkeypatch.setitem(LIMITS, "vocab_size", 6)
    assert ours.tokenizer_of(tokenizer_file(tmp_path)).get_vocab_size() == 6
    monkeypatch.setitem(LIMITS, "vocab_size", 5)
    refused(tokenizer_file(tmp_path), "tokenizer.ggml.tokens has 6 tokens, above gpt2attn's limit of 5",
            reader=ours.tokenizer_of)


def test_a_model_file_gives_its_tokenizer_with_the_model(tmp_path):
    model = model_of(vocab_size=6)
    extra = [("tokenizer.ggml.tokens", ARR, (STR, TOKENS)), ("tokenizer.ggml.merges", ARR, (STR, ["a b", "Ġ ab"]))]
    config, state, tok = ours.read(model_file(tmp_path / "m.gguf", model, extra=extra))
    assert config.vocab_size == 6 and tok.encode("ab ab").ids == [2, 5]


# --- what the writer writes, read back by gguf-py -----------------------------------------------------------


def their_fields(path: Path) -> dict:
    reader = gguf.GGUFReader(str(path))
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def their_tensors(path: Path) -> list:
    return [(t.name, t.tensor_type.name) for t in gguf.GGUFReader(str(path)).tensors]


def small_bpe(special: bool = True, eos: bool = True):
    """A byte-level BPE built with tokenizers itself: ids 0..5, <|endoftext|> (or <|x|>) at id 6."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    vocab = {"a": 0, "b": 1, "ab": 2, "Ġ": 3, "Ġab": 4, "c": 5}
    tok = Tokenizer(models.BPE(vocab, [("a", "b"), ("Ġ", "ab")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    name = "<|endoftext|>" if eos else "<|x|>"
    (tok.add_special_tokens if special else tok.add_tokens)([AddedToken(name, special=special)])
    return tok


def test_the_written_metadata_is_the_converters(tmp_path):
    model = model_of(n_inner=40, layer_norm_epsilon=1e-6, n_positions=24)
    save(model, tmp_path / "My Model.gguf", dtype="float32")
    fields = their_fields(tmp_path / "My Model.gguf")
    assert fields == {
        "general.architecture": "gpt2", "general.type": "model", "general.name": "My Model",
        "gpt2.block_count": 2, "gpt2.context_length": 24, "gpt2.embedding_length": 32,
        "gpt2.feed_forward_length": 40, "gpt2.attention.head_count": 4,
        "gpt2.attention.layer_norm_epsilon": pytest.approx(1e-6, rel=1e-7), "general.file_type": 0,
        "general.quantization_version": 2,
    }


@pytest.mark.parametrize("dtype, kind, file_type", [(None, "F16", 1), ("f16", "F16", 1), ("FLOAT16", "F16", 1),
                                                    ("float32", "F32", 0), ("F32", "F32", 0), ("BF16", "BF16", 32),
                                                    ("Q8_0", "Q8_0", 7)])
def test_each_dtype_name_writes_its_type(tmp_path, dtype, kind, file_type):
    save(model_of(), tmp_path / "m.gguf", dtype=dtype)
    tensors = dict(their_tensors(tmp_path / "m.gguf"))
    assert tensors["blk.0.attn_qkv.weight"] == kind and tensors["token_embd.weight"] == kind
    assert tensors["blk.0.attn_qkv.bias"] == "F32" and tensors["position_embd.weight"] == "F32"
    assert their_fields(tmp_path / "m.gguf")["general.file_type"] == file_type


@pytest.mark.parametrize("dtype", ["q4_0", "float64", "fp16", torch.float16])
def test_another_dtype_is_refused_naming_the_file_and_the_choices(tmp_path, dtype):
    with pytest.raises(ValueError) as error:
        ours.write(tmp_path / "m.gguf", model_of().state_dict(), model_of().config, dtype=dtype)
    assert str(error.value) == f"{tmp_path / 'm.gguf'}: GGUF is written as f32, f16, bf16, q8_0, q4, not {dtype}"
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize("change", [dict(activation_function="gelu"), dict(activation_function="relu"),
                                    dict(add_cross_attention=True), dict(scale_attn_weights=False),
                                    dict(scale_attn_by_inverse_layer_idx=True)])
def test_a_model_llama_cpp_computes_otherwise_is_refused(tmp_path, change):
    model = GPT2LMHeadModel(tiny_config(**change))
    with pytest.raises(ValueError) as error:
        ours.write(tmp_path / "m.gguf", model.state_dict(), model.config)
    message = str(error.value)
    assert message.startswith(f"{tmp_path / 'm.gguf'}: llama.cpp's GPT-2 is GELU (tanh)")
    assert "activation_function, cross-attention or attention scaling" in message
    assert not (tmp_path / "m.gguf").exists()


def test_gelu_pytorch_tanh_is_written_as_llama_cpps_gelu(tmp_path):
    model = model_of(activation_function="gelu_pytorch_tanh")
    save(model, tmp_path / "m.gguf", dtype="f32")
    assert_same_weights(GPT2LMHeadModel.from_pretrained(tmp_path / "m.gguf"), model)


def test_the_writer_takes_parameters_that_need_grad_any_float_dtype_and_prefixes(tmp_path):
    model = model_of()
    params = {"module." + k: v for k, v in model.named_parameters()}  # DDP's prefix, tensors needing grad
    assert all(v.requires_grad for v in params.values())
    ours.write(tmp_path / "m.gguf", params, model.config, dtype="f32")
    back = GPT2LMHeadModel.from_pretrained(tmp_path / "m.gguf")
    assert_same_weights(back, model)
    assert back.config.tie_word_embeddings is True
    half = {k: v.to(torch.bfloat16) for k, v in model.transformer.state_dict().items()}  # GPT2Model's keys, bf16
    ours.write(tmp_path / "h.gguf", half, model.config, dtype="f32")
    back = GPT2LMHeadModel.from_pretrained(tmp_path / "h.gguf")
    for name, value in half.items():
        assert torch.equal(back.transformer.state_dict()[name], value.float()), name
    assert dict(their_tensors(tmp_path / "h.gguf"))["output.weight"] == "F32"


def test_an_untied_head_is_written_as_output_weight(tmp_path):
    model = model_of(tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(-2)
    save(model, tmp_path / "m.gguf", dtype="f32")
    reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    output = next(t for t in reader.tensors if t.name == "output.weight")
    assert np.array_equal(np.asarray(output.data), model.lm_head.weight.detach().numpy())
    back = GPT2LMHeadModel.from_pretrained(tmp_path / "m.gguf")
    assert back.config.tie_word_embeddings is False and torch.equal(back.lm_head.weight, model.lm_head.weight)


def test_a_state_dict_missing_tensors_is_refused_naming_them_in_gguf_names(tmp_path):
    model = model_of()
    state = {k: v for k, v in model.state_dict().items()
             if k not in ("transformer.wpe.weight", "transformer.h.1.ln_2.bias", "transformer.ln_f.weight")}
    with pytest.raises(ValueError) as error:
        ours.write(tmp_path / "m.gguf", state, model.config)
    assert str(error.value) == (f"{tmp_path / 'm.gguf'}: cannot write GGUF: the state dict lacks position_embd.weight, "
                                "blk.1.ffn_norm.bias, output_norm.weight")
    assert not (tmp_path / "m.gguf").exists()


def test_the_vocabulary_written_pads_unused_ids_as_the_converter_does(tmp_path):
    """llama.cpp's converter (get_vocab_base): every id up to vocab_size, unused ones as [PAD{i}] of type
    UNUSED (5), special added tokens CONTROL (3), the rest NORMAL (1); <|endoftext|> is bos, eos and unk."""
    save(model_of(vocab_size=10), tmp_path / "m.gguf", dtype="f32", tokenizer=small_bpe())
    fields = their_fields(tmp_path / "m.gguf")
    assert fields["tokenizer.ggml.tokens"] == ["a", "b", "ab", "Ġ", "Ġab", "c", "<|endoftext|>", "[PAD7]", "[PAD8]", "[PAD9]"]
    assert fields["tokenizer.ggml.token_type"] == [1, 1, 1, 1, 1, 1, 3, 5, 5, 5]
    assert fields["tokenizer.ggml.merges"] == ["a b", "Ġ ab"]
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "gpt-2"
    assert [fields[f"tokenizer.ggml.{k}_token_id"] for k in ("bos", "eos", "unknown")] == [6, 6, 6]
    back = ours.tokenizer_of(tmp_path / "m.gguf")
    assert back.encode("ab ab<|endoftext|>c").ids == [2, 4, 6, 5]


def test_the_vocabulary_without_endoftext_has_no_bos_eos_unk(tmp_path):
    save(model_of(vocab_size=7), tmp_path / "m.gguf", dtype="f32", tokenizer=small_bpe(special=False, eos=False))
    fields = their_fields(tmp_path / "m.gguf")
    # an added token that is not marked special but reads <|...|> is a control token, as llama.cpp's
    # converter writes it (convert_hf_to_gguf.py, does_token_look_special)
    assert fields["tokenizer.ggml.tokens"][6] == "<|x|>" and fields["tokenizer.ggml.token_type"][6] == 3
    assert not {"tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id"} & set(fields)


def test_added_tokens_are_user_defined_or_control_as_the_converter_writes_them(tmp_path):
    from tokenizers import AddedToken
    tok = small_bpe()  # <|endoftext|> special at id 6
    tok.add_tokens([AddedToken("hello world", special=False)])  # id 7: user-defined
    tok.add_tokens([AddedToken("<mine>", special=True)])  # id 8: special, so control
    tok.add_tokens([AddedToken("<|half", special=False), AddedToken("half|>", special=False)])  # 9, 10: user-defined
    save(model_of(vocab_size=12), tmp_path / "m.gguf", dtype="f32", tokenizer=tok)
    fields = their_fields(tmp_path / "m.gguf")
    assert fields["tokenizer.ggml.tokens"] == ["a", "b", "ab", "Ġ", "Ġab", "c", "<|endoftext|>", "hello world",
                                               "<mine>", "<|half", "half|>", "[PAD11]"]
    assert fields["tokenizer.ggml.token_type"] == [1, 1, 1, 1, 1, 1, 3, 4, 3, 4, 4, 5]


def test_a_tokenizer_the_model_cannot_hold_or_not_bpe_is_refused(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    with pytest.raises(ValueError, match=r"m\.gguf: the tokenizer has 7 tokens, the model's vocabulary 6"):
        save(model_of(vocab_size=6), tmp_path / "m.gguf", tokenizer=small_bpe())
    words = Tokenizer(models.WordLevel({"hello": 0, "world": 1}, unk_token=None))  # words, not characters
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    assert ours.why_not_embedded(small_bpe()) is None
    with pytest.raises(ValueError) as error:
        save(model_of(), tmp_path / "m.gguf", tokenizer=words)
    assert str(error.value) == (f"{tmp_path / 'm.gguf'}: GGUF embeds GPT-2's byte-level BPE tokenizer; this tokenizer is WordLevel "
                                "(write the model without it, or to an HF folder)")
    assert not (tmp_path / "m.gguf").exists()


def test_a_character_vocabulary_of_ascii_is_embedded_and_read_back_as_characters(tmp_path):
    from gpt2attn.tokenizer import CharTokenizer, char_tokenizer, encode

    text = "To be, or not to be:\nthat is the question!"
    chars, n = char_tokenizer(text), len(set(text))
    save(model_of(vocab_size=n + 2), tmp_path / "m.gguf", dtype="f32", tokenizer=chars)  # two unused ids
    fields = their_fields(tmp_path / "m.gguf")  # gguf-py's reading: GPT-2's byte-level spelling, no merges
    spelled = {" ": "Ġ", "\n": "Ċ"}
    assert fields["tokenizer.ggml.tokens"] == [spelled.get(c, c) for c in sorted(set(text))] + [f"[PAD{n}]", f"[PAD{n + 1}]"]
    assert fields["tokenizer.ggml.token_type"] == [1] * n + [5, 5]
    assert fields.get("tokenizer.ggml.merges", []) == []
    back = ours.tokenizer_of(tmp_path / "m.gguf")
    assert isinstance(back, CharTokenizer)
    assert encode(back, text) == encode(chars, text) and back.decode(encode(back, text)) == text
    with pytest.raises(ValueError, match=r"'#' \(U\+0023\)"):  # a missing character is named, not dropped
        encode(back, "to be #")


def test_a_character_vocabulary_beyond_ascii_is_refused_by_name(tmp_path):
    from gpt2attn.tokenizer import char_tokenizer

    chars = char_tokenizer("café naïve")
    reason = ours.why_not_embedded(chars)
    assert reason == ("GGUF's GPT-2 tokenizer holds a character vocabulary only when every character is one byte "
                      "(ASCII); this one has 'é' (U+00E9), 'ï' (U+00EF)")
    with pytest.raises(ValueError, match="this one has 'é'"):
        save(model_of(), tmp_path / "m.gguf", tokenizer=chars)
    assert not (tmp_path / "m.gguf").exists()


# --- the module's edges: detection, the optional gguf package, the tokenizer's own refusal ------------------


def test_detect_reads_the_magic_of_files_only(tmp_path):
    assert ours.detect(write_bytes(tmp_path / "a.gguf", b"GGUF")) is True
    assert ours.detect(write_bytes(tmp_path / "b.bin", b"GGUF\3\0\0\0")) is True  # by magic, not suffix
    assert ours.detect(write_bytes(tmp_path / "c.gguf", b"GGU")) is False
    assert ours.detect(write_bytes(tmp_path / "d.gguf", b"GGML")) is False
    (tmp_path / "folder.gguf").mkdir()
    assert ours.detect(tmp_path / "folder.gguf") is False
    assert ours.detect(tmp_path / "absent.gguf") is False


def test_without_the_gguf_package_writing_says_what_to_install(tmp_path, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf now raises ImportError
    with pytest.raises(ImportError) as error:
        save(model_of(), tmp_path / "m.gguf", dtype="f32")
    assert str(error.value) == "reading and writing GGUF files needs the gguf package: pip install 'gpt2attn[gguf]'"
    assert error.value.__cause__ is None and error.value.__suppress_context__
    assert not (tmp_path / "m.gguf").exists()


def test_merges_the_bpe_cannot_take_are_refused_naming_the_file(tmp_path):
    path = tokenizer_file(tmp_path, merges=(ARR, (STR, ["a b", "x y"])))  # x and y are not tokens
    refused(path, "not a readable BPE vocabulary and merges", reader=ours.tokenizer_of)


def test_a_two_dimensional_norm_weight_is_written_f32_as_norms_are(tmp_path):
    """The converter keeps norms in F32 whatever their shape: a (1, C) LayerNorm gain is not quantized."""
    model = model_of()
    state = dict(model.state_dict())
    state["transformer.ln_f.weight"] = state["transformer.ln_f.weight"][None]
    state["transformer.h.0.ln_1.weight"] = state["transformer.h.0.ln_1.weight"][None]
    ours.write(tmp_path / "m.gguf", state, model.config, dtype="f16")
    tensors = dict(their_tensors(tmp_path / "m.gguf"))
    assert tensors["output_norm.weight"] == "F32" and tensors["blk.0.attn_norm.weight"] == "F32"
    assert tensors["blk.0.attn_qkv.weight"] == "F16"


def test_a_one_dimensional_weight_is_written_f32_as_every_1d_tensor(tmp_path):
    """The converter's rule is by dimensions: a 1-D tensor stays F32, whatever its name."""
    model = model_of()
    state = dict(model.state_dict())
    state["transformer.h.0.attn.c_attn.weight"] = state["transformer.h.0.attn.c_attn.weight"].flatten()
    ours.write(tmp_path / "m.gguf", state, model.config, dtype="f16")
    tensors = dict(their_tensors(tmp_path / "m.gguf"))
    assert tensors["blk.0.attn_qkv.weight"] == "F32" and tensors["blk.1.attn_qkv.weight"] == "F16"


def test_an_empty_bpe_vocabulary_is_written_as_unused_ids(tmp_path):
    from tokenizers import Tokenizer, models
    save(model_of(vocab_size=1), tmp_path / "m.gguf", dtype="f32", tokenizer=Tokenizer(models.BPE({}, [])))
    fields = their_fields(tmp_path / "m.gguf")
    assert fields["tokenizer.ggml.tokens"] == ["[PAD0]"] and fields["tokenizer.ggml.token_type"] == [5]
    assert "tokenizer.ggml.eos_token_id" not in fields


def test_merges_serialized_as_strings_are_written_as_they_are(tmp_path):
    """Older tokenizers releases serialize a BPE's merges as "left right" strings, newer ones as
    pairs: both are written as llama.cpp's "left right"."""
    tok = small_bpe()

    class OldSerialization:  # the same tokenizer, its JSON as older tokenizers releases wrote it
        def to_str(self):
            spec = json.loads(tok.to_str())
            spec["model"]["merges"] = [" ".join(pair) for pair in spec["model"]["merges"]]
            return json.dumps(spec)

        def get_vocab(self, with_added_tokens=True):
            return tok.get_vocab(with_added_tokens=with_added_tokens)

    assert json.loads(OldSerialization().to_str())["model"]["merges"] == ["a b", "Ġ ab"]
    save(model_of(vocab_size=7), tmp_path / "m.gguf", dtype="f32", tokenizer=OldSerialization())
    assert their_fields(tmp_path / "m.gguf")["tokenizer.ggml.merges"] == ["a b", "Ġ ab"]


# ==================================================================================================
# Files from llama.cpp's converter and gguf-py's writer
#
# Files made by llama.cpp's own converter (tests/data/gguf/README.md), files of
# every GGML type we read written with the gguf package's writer, and our writer checked against the
# converter's keys and names and against transformers' own GGUF loader.
# ==================================================================================================

DATA = TEST_DATA / "gguf"
FIXTURES = {"f16": DATA / "tiny-f16.gguf", "q8_0": DATA / "tiny-q8_0.gguf"}
Q = gguf.GGMLQuantizationType


def transformers_gguf(path: Path, config: GPT2Config):
    """transformers' own load of a GGUF (it dequantizes with gguf), given the config: it would set
    n_positions to 1024 whatever the file's gpt2.context_length says."""
    hf_config = transformers.GPT2Config(vocab_size=config.vocab_size, n_positions=config.n_positions,
                                        n_embd=config.n_embd, n_layer=config.n_layer, n_head=config.n_head,
                                        tie_word_embeddings=config.tie_word_embeddings)
    return transformers.GPT2LMHeadModel.from_pretrained(str(path.parent), gguf_file=path.name, config=hf_config).eval()


def ids_for(config: GPT2Config, T: int = 12) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (2, T), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def assert_logits_equal_transformers(path: Path, atol: float = 1e-5) -> GPT2LMHeadModel:
    model = GPT2LMHeadModel.from_pretrained(path)
    x = ids_for(model.config)
    theirs = transformers_gguf(path, model.config)(x).logits
    assert (model(x).logits - theirs).abs().max() <= atol
    return model


@pytest.mark.parametrize("kind", list(FIXTURES))
def test_llama_cpp_converter_files_give_transformers_logits(kind):
    model = assert_logits_equal_transformers(FIXTURES[kind])
    assert model.config.n_positions == 128  # gpt2.context_length, not transformers' 1024
    assert model.lm_head.weight is model.transformer.wte.weight  # the converter's output.weight is wte again
    assert detect_format(FIXTURES[kind]) is ours


def test_embedded_tokenizer_is_gpt2s(tmp_path):
    tokenizer = ours.tokenizer_of(FIXTURES["f16"])
    theirs = transformers.AutoTokenizer.from_pretrained(str(DATA), gguf_file=FIXTURES["f16"].name)
    for text in ("Hello world", " café\n\n  naïve—tokens 12345 <|endoftext|>", "ROMEO:\nBut soft!"):
        assert tokenizer.encode(text).ids == theirs(text)["input_ids"], text
        assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text


# --- every GGML type we read, in files written by the gguf package itself ---------------------------

K_BLOCK_SCALES = {  # byte offsets of each K-quant block's f16 scales (d, dmin), as ggml lays them out
    Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
}


def quantized(array: np.ndarray, kind) -> np.ndarray:
    """array in GGML type `kind`: gguf's own quantizer where it has one; for the K-quants (which
    gguf-py only dequantizes) random blocks with sane f16 scales, so the file holds real K-quant data."""
    if kind not in K_BLOCK_SCALES:
        return gguf.quants.quantize(array, kind)
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rows, cols = array.shape
    raw = np.random.default_rng(0).integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for offset in K_BLOCK_SCALES[kind]:
        raw[:, :, offset : offset + 2] = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
    return raw.reshape(rows, -1)


def write_with_gguf_package(path: Path, model: GPT2LMHeadModel, kind, output: str = "tied") -> None:
    """A GPT-2 GGUF written tensor by tensor with gguf.GGUFWriter, in llama.cpp's names and layouts:
    2-D weights in `kind`, the rest F32; output.weight as wte ('tied'), absent, or the model's head."""
    cfg = model.config
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_block_count(cfg.n_layer)
    writer.add_context_length(cfg.n_positions)
    writer.add_embedding_length(cfg.n_embd)
    writer.add_feed_forward_length(4 * cfg.n_embd)
    writer.add_head_count(cfg.n_head)
    writer.add_layer_norm_eps(cfg.layer_norm_epsilon)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    names = {"wte": "token_embd", "wpe": "position_embd", "ln_f": "output_norm"}
    blocks = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",
              "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
    tensors = {}
    for key, value in state.items():
        parts = key.split(".")
        if key == "lm_head.weight":
            continue
        if parts[1] == "h":
            module = ".".join(parts[3:-1])
            name = f"blk.{parts[2]}.{blocks[module]}.{parts[-1]}"
            if parts[-1] == "weight" and value.ndim == 2:
                value = value.T  # Conv1D (in, out) -> llama.cpp's (out, in)
        else:
            name = f"{names[parts[1]]}.{parts[2]}"
        tensors[name] = np.ascontiguousarray(value)
    if output == "tied":
        tensors["output.weight"] = tensors["token_embd.weight"]
    elif output == "own":
        tensors["output.weight"] = np.ascontiguousarray(state["lm_head.weight"])
    for name, value in tensors.items():
        if value.ndim == 2 and name != "position_embd.weight":
            writer.add_tensor(name, quantized(value, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, value.astype(np.float32), raw_dtype=Q.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


READ_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.fixture(scope="module")
def wide_model():
    """n_embd 256: every row a whole number of K-quant blocks (256 values)."""
    return randomize(GPT2LMHeadModel(tiny_config(vocab_size=64, n_embd=256, n_head=4, n_layer=1)), std=0.05).eval()


@pytest.mark.parametrize("kind", READ_TYPES, ids=lambda k: k.name)
def test_every_type_gives_transformers_logits(tmp_path, wide_model, kind):
    path = tmp_path / f"{kind.name}.gguf"
    write_with_gguf_package(path, wide_model, kind)
    model = assert_logits_equal_transformers(path)
    reader = gguf.GGUFReader(path)
    qkv = next(t for t in reader.tensors if t.name == "blk.0.attn_qkv.weight")
    assert qkv.tensor_type == kind
    expected = gguf.quants.dequantize(qkv.data, kind).reshape(768, 256).T  # back to Conv1D's (in, out)
    assert np.array_equal(model.transformer.h[0].attn.c_attn.weight.detach().numpy(), expected)


@pytest.mark.parametrize("output", ["absent", "own"])
def test_head_tied_without_output_weight_untied_when_it_differs(tmp_path, output):
    model = randomize(GPT2LMHeadModel(tiny_config(tie_word_embeddings=False)))
    path = tmp_path / "m.gguf"
    write_with_gguf_package(path, model, Q.F32, output=output)
    back = GPT2LMHeadModel.from_pretrained(path)
    if output == "absent":
        assert back.config.tie_word_embeddings and back.lm_head.weight is back.transformer.wte.weight
    else:
        assert not back.config.tie_word_embeddings
        assert torch.equal(back.lm_head.weight, model.lm_head.weight)
        assert not torch.equal(back.lm_head.weight, back.transformer.wte.weight)
        assert_logits_equal_transformers(path)


# --- writing -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bpe_model():
    """A random model with GPT-2's own tokenizer, as the converter needs it (vocab 50257)."""
    tokenizer = ours.tokenizer_of(FIXTURES["f16"])
    model = randomize(GPT2LMHeadModel(tiny_config(vocab_size=50257, n_embd=32, n_head=2, n_positions=64)), std=0.1)
    return model.eval(), tokenizer


def test_written_file_has_the_converters_keys_names_and_tokenizer(tmp_path, bpe_model):
    model, tokenizer = bpe_model
    save(model, tmp_path / "m.gguf", dtype="q8_0", tokenizer=tokenizer)
    mine, theirs = gguf.GGUFReader(tmp_path / "m.gguf"), gguf.GGUFReader(FIXTURES["q8_0"])
    skip = {"general.name", "general.size_label"}  # the converter's naming of its source folder
    assert set(mine.fields) - skip == set(theirs.fields) - skip
    for key in set(theirs.fields) - skip:
        if key.startswith(("tokenizer.", "general.file_type", "general.architecture", "general.type")):
            assert mine.fields[key].contents() == theirs.fields[key].contents(), key
    assert sorted((t.name, t.tensor_type) for t in mine.tensors) == sorted((t.name, t.tensor_type) for t in theirs.tensors)
    assert ours.tokenizer_of(tmp_path / "m.gguf").encode(" Hello").ids == tokenizer.encode(" Hello").ids


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "q8_0"])
def test_round_trip_exact_for_f32_within_the_types_rounding_otherwise(tmp_path, bpe_model, dtype):
    model, tokenizer = bpe_model
    path = tmp_path / f"m-{dtype}.gguf"
    save(model, path, dtype=dtype)
    back = GPT2LMHeadModel.from_pretrained(path)
    kind = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}[dtype]
    for name, tensor in model.state_dict().items():
        got = back.state_dict()[name]
        if dtype == "f32" or tensor.dim() == 1 or name.endswith("wpe.weight"):  # kept F32, as the converter does
            assert torch.equal(got, tensor), name
        else:
            array = tensor.detach().numpy()
            array = array if name.endswith(("wte.weight", "lm_head.weight")) else array.T
            rounded = gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(array), kind), kind)
            rounded = rounded if name.endswith(("wte.weight", "lm_head.weight")) else rounded.T
            assert np.array_equal(got.numpy(), rounded), name
    assert_logits_equal_transformers(path)


def test_cli_generate_convert_and_parity_take_gguf(tmp_path, capsys):
    fixture = FIXTURES["f16"]
    assert cli(["generate", "--model", str(fixture), "Hello", "--max-new-tokens", "4", "--greedy"]) == 0
    said = capsys.readouterr().out
    model, tokenizer = GPT2LMHeadModel.from_pretrained(fixture), ours.tokenizer_of(fixture)
    prompt = torch.tensor([tokenizer.encode("Hello").ids])
    expected = tokenizer.decode(model.generate(prompt, max_new_tokens=4, do_sample=False)[0].tolist())
    assert said.strip() == expected.strip()

    assert cli(["convert", str(fixture), str(tmp_path / "q.gguf"), "--dtype", "q8_0"]) == 0
    assert all(t.tensor_type in (Q.Q8_0, Q.F32) for t in gguf.GGUFReader(tmp_path / "q.gguf").tensors)
    assert cli(["convert", str(fixture), str(tmp_path / "folder")]) == 0
    assert (tmp_path / "folder" / "tokenizer.json").is_file()  # the GGUF's tokenizer, written out
    capsys.readouterr()
    assert cli(["parity", str(fixture), str(tmp_path / "q.gguf")]) == 1  # q8_0 departs beyond fp32's tolerance
    assert "layer 1" in capsys.readouterr().out


def test_the_shipped_character_model_goes_to_gguf_with_its_tokenizer(tmp_path, capsys):
    """The README's tour: `convert` the character model to a .gguf, then `generate --model` it."""
    from gpt2attn.shipped import DEFAULT_MODEL_DIR

    assert cli(["convert", str(DEFAULT_MODEL_DIR), str(tmp_path / "m.gguf"), "--dtype", "f32"]) == 0
    assert capsys.readouterr().err == ""  # no "written without the tokenizer" note
    said = []
    for model in (DEFAULT_MODEL_DIR, tmp_path / "m.gguf"):
        assert cli(["generate", "--model", str(model), "ROMEO:", "--max-new-tokens", "30", "--greedy"]) == 0
        said.append(capsys.readouterr().out)
    assert said[1] == said[0] and len(said[0]) > len("ROMEO:\n")


def test_import_gpt2attn_does_not_import_gguf():
    code = "import sys, gpt2attn, gpt2attn.formats; print('gguf' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


# --- bad input -------------------------------------------------------------------------------------------


def damaged(tmp_path: Path, name: str) -> Path:
    data = bytearray(FIXTURES["q8_0"].read_bytes())
    path = tmp_path / f"{name}.gguf"
    if name == "truncated":
        data = data[: len(data) // 2]
    elif name == "header only":
        data = data[:20]
    elif name == "magic":
        data[:4] = b"GGML"
    elif name == "version":
        data[4:8] = (7).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("name, field", [("truncated", "truncated"), ("header only", "truncated"),
                                         ("version", "version 7")])
def test_damaged_files_get_one_error_naming_the_file_and_field(tmp_path, name, field):
    path = damaged(tmp_path, name)
    with pytest.raises(ValueError, match=field) as error:
        GPT2LMHeadModel.from_pretrained(path)
    assert str(path) in str(error.value)


def test_a_wrong_magic_is_not_read_as_gguf(tmp_path):
    path = damaged(tmp_path, "magic")
    assert not ours.detect(path)
    with pytest.raises(ValueError, match="magic") as error:
        ours.read(path)
    assert str(path) in str(error.value)


def test_another_architecture_and_an_unread_type_are_named(tmp_path):
    def write(path: Path, arch: str, raw_dtype, data: np.ndarray) -> Path:
        writer = gguf.GGUFWriter(path, arch)
        for key, value in [("block_count", 1), ("context_length", 32), ("embedding_length", 256),
                           ("attention.head_count", 4)]:
            writer.add_uint32(f"{arch}.{key}", value)
        writer.add_tensor("token_embd.weight", data, raw_dtype=raw_dtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    llama = write(tmp_path / "llama.gguf", "llama", Q.F32, np.zeros((64, 256), dtype=np.float32))
    with pytest.raises(ValueError, match="general.architecture is 'llama'") as error:
        GPT2LMHeadModel.from_pretrained(llama)
    assert str(llama) in str(error.value)
    q2_k = write(tmp_path / "q2k.gguf", "gpt2", Q.Q2_K, np.zeros((64, gguf.GGML_QUANT_SIZES[Q.Q2_K][1]), dtype=np.uint8))
    with pytest.raises(ValueError, match="token_embd.weight has GGML type Q2_K") as error:
        GPT2LMHeadModel.from_pretrained(q2_k)
    assert str(q2_k) in str(error.value)


def test_failures_write_nothing(tmp_path, bpe_model):
    model, tokenizer = bpe_model
    target = tmp_path / "m.gguf"
    with pytest.raises(ValueError, match="q4_0"):
        save(model, target, dtype="q4_0")
    assert not target.exists()
    save(model, target, dtype="f16", tokenizer=tokenizer)
    before = target.read_bytes()
    bad = GPT2LMHeadModel(tiny_config(activation_function="relu"))
    with pytest.raises(ValueError, match="GELU"):
        save(bad, target)
    assert target.read_bytes() == before
    assert cli(["convert", str(damaged(tmp_path, "truncated")), str(tmp_path / "out")]) == 2  # a one-line error
    assert not (tmp_path / "out").exists()


# ==================================================================================================
# The rules a written file keeps
#
# The rules a user sees, each pinned by what a written file holds or what a loaded model is: GGUF's
# bounds, versions, metadata and tensor types as llama.cpp's converter and gguf-py write them. The
# expected values come from gguf-py's own reader and constants and the model written, never from our
# reader.
# ==================================================================================================


def their_reader(path: Path):
    """gguf-py's own reader: the independent view of what our writer put in the file."""
    return gguf.GGUFReader(str(path))


def their_field(reader, key: str):
    return reader.fields[key].contents()


def test_gguf_cut_inside_its_last_tensor_is_refused_naming_file_and_tensor(tmp_path):
    path = tmp_path / "m.gguf"
    save(model_of(), path, dtype="f32")
    reader = their_reader(path)
    last = max(reader.tensors, key=lambda t: t.data_offset)
    end = last.data_offset + last.n_bytes  # where the last tensor's data ends
    data = path.read_bytes()
    assert end <= len(data)

    exact = tmp_path / "exact.gguf"  # only alignment padding dropped: still whole
    exact.write_bytes(data[:end])
    assert_same_weights(GPT2LMHeadModel.from_pretrained(exact), GPT2LMHeadModel.from_pretrained(path))

    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: end - 1])
    with pytest.raises(ValueError) as error:
        GPT2LMHeadModel.from_pretrained(cut)
    assert "cut.gguf" in str(error.value) and last.name in str(error.value)


@pytest.mark.parametrize("version, readable", [(1, False), (2, True), (3, True), (4, False)])
def test_gguf_versions_2_and_3_load_the_same_model(tmp_path, version, readable):
    """Version 2 has version 3's layout (gguf-py reads both: READER_SUPPORTED_VERSIONS)."""
    path = tmp_path / "m.gguf"
    save(model_of(), path, dtype="f32")
    data = bytearray(path.read_bytes())
    assert int.from_bytes(data[4:8], "little") == gguf.GGUF_VERSION == 3
    data[4:8] = version.to_bytes(4, "little")
    other = tmp_path / f"v{version}.gguf"
    other.write_bytes(bytes(data))
    if readable:
        assert_same_weights(GPT2LMHeadModel.from_pretrained(other), GPT2LMHeadModel.from_pretrained(path))
    else:
        with pytest.raises(ValueError, match=f"v{version}.gguf.*version"):
            GPT2LMHeadModel.from_pretrained(other)


@pytest.mark.parametrize("eps", [1e-5, 1e-6, 3e-7])
def test_gguf_layer_norm_epsilon_round_trips(tmp_path, eps):
    path = tmp_path / "m.gguf"
    save(model_of(layer_norm_epsilon=eps), path, dtype="f32")
    stored = their_field(their_reader(path), "gpt2.attention.layer_norm_epsilon")
    assert stored == pytest.approx(eps, rel=1e-7)  # float32 in the file
    assert GPT2LMHeadModel.from_pretrained(path).config.layer_norm_epsilon == eps


@pytest.mark.parametrize("dtype, file_type", [("f32", "ALL_F32"), ("f16", "MOSTLY_F16"), ("bf16", "MOSTLY_BF16"),
                                              ("q8_0", "MOSTLY_Q8_0")])
def test_gguf_general_file_type_is_llama_cpps_file_type(tmp_path, dtype, file_type):
    """general.file_type is llama.cpp's LlamaFileType (MOSTLY_BF16 = 32), not GGML's tensor type id."""
    path = tmp_path / "m.gguf"
    save(model_of(), path, dtype=dtype)
    assert their_field(their_reader(path), "general.file_type") == gguf.LlamaFileType[file_type].value


def test_gguf_q8_0_rows_not_a_multiple_of_32_fall_back_to_f16(tmp_path):
    """As llama.cpp's converter writes a q8_0 file: 1-D tensors, norms, biases and position
    embeddings F32; a 2-D weight Q8_0 when its rows (ne[0]) are a multiple of Q8_0's block of 32,
    else F16. n_inner = 48 gives ffn_down rows of 48."""
    path = tmp_path / "m.gguf"
    model = model_of(n_inner=48)
    save(model, path, dtype="q8_0")
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0]
    seen = {}
    for t in their_reader(path).tensors:
        if len(t.shape) == 1 or not t.name.endswith(".weight") or t.name.endswith("_norm.weight") \
                or t.name == "position_embd.weight":
            expected = "F32"
        else:
            expected = "Q8_0" if int(t.shape[0]) % block == 0 else "F16"
        assert t.tensor_type.name == expected, t.name
        seen[t.tensor_type.name] = seen.get(t.tensor_type.name, 0) + 1
    assert seen.keys() == {"F32", "F16", "Q8_0"}
    back = GPT2LMHeadModel.from_pretrained(path)
    f16 = model.transformer.h[0].mlp.c_proj.weight.detach()
    assert torch.equal(back.transformer.h[0].mlp.c_proj.weight, f16.half().float())


@pytest.mark.parametrize("n_inner", [None, 96, 48])
def test_gguf_feed_forward_length_is_n_inner_and_round_trips(tmp_path, n_inner):
    path = tmp_path / "m.gguf"
    model = model_of(n_inner=n_inner)
    save(model, path, dtype="f32")
    expected = n_inner or 4 * model.config.n_embd
    assert their_field(their_reader(path), "gpt2.feed_forward_length") == expected
    back = GPT2LMHeadModel.from_pretrained(path)
    assert back.config.inner_dim == expected and back.config.n_inner == n_inner
    assert_same_weights(back, model)
    ids = torch.arange(10)[None]
    with torch.no_grad():
        assert torch.allclose(back(ids).logits, model(ids).logits, atol=1e-5, rtol=0)


def test_gguf_metadata_is_the_models_config(tmp_path):
    """Every gpt2.* key gguf-py reads back is the written model's config field."""
    path = tmp_path / "m.gguf"
    model = model_of(n_positions=24, n_layer=3, n_head=8, n_embd=64)
    save(model, path, dtype="f16")
    reader, c = their_reader(path), model.config
    assert their_field(reader, "general.architecture") == "gpt2"
    assert their_field(reader, "gpt2.context_length") == c.n_positions
    assert their_field(reader, "gpt2.embedding_length") == c.n_embd
    assert their_field(reader, "gpt2.block_count") == c.n_layer
    assert their_field(reader, "gpt2.attention.head_count") == c.n_head
    assert their_field(reader, "general.name") == "m"
    back = GPT2LMHeadModel.from_pretrained(path).config
    for field in ("n_positions", "n_embd", "n_layer", "n_head", "vocab_size"):
        assert getattr(back, field) == getattr(c, field), field


def test_gguf_module_reads_its_own_suffix(tmp_path):
    path = tmp_path / "m.gguf"
    save(model_of(), path)
    assert ours.detect(path) and detect_format(path) is ours
