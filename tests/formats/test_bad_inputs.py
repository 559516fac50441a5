"""Bad checkpoint and tokenizer files: each case gets an exception of the right type whose message
names the file and the problem (never a raw IndexError/KeyError from deep inside a library).

Each row: a builder that writes the bad input under tmp_path and returns (call, file), the
exception type, and a fragment of the message; the message must also name `file`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from gpt2attn import CheckpointError, GPT2LMHeadModel
from gpt2attn.tokenizer import char_tokenizer, encode, load_tokenizer
from gpt2attn.training.loop import read_training_state
from tests.helpers import DATA, randomize, tiny_config

TF_TINY = DATA / "openai-tf-tiny"
# Two float32 tensors, 16 bytes each: a valid header to spoil one field at a time.
GOOD = {"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}}


def safetensors(tmp_path, header=None, data=bytes(32), raw: bytes | None = None, **changes):
    """A .safetensors file whose header is GOOD with `changes` ({tensor: {field: value}}) applied."""
    header = json.loads(json.dumps(GOOD)) if header is None else header
    for name, fields in changes.items():
        header.setdefault(name, {}).update(fields)
    head = raw if raw is not None else json.dumps(header).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(len(head).to_bytes(8, "little") + head + data)
    return lambda: GPT2LMHeadModel.from_pretrained(path), path


def saved_model(tmp_path, **options) -> Path:
    folder = tmp_path / "model"
    randomize(GPT2LMHeadModel(tiny_config())).save_pretrained(folder, **options)
    return folder


def sharded(tmp_path, edit):
    """A sharded folder whose index JSON is edit(index) (edit returns the new JSON value)."""
    folder = saved_model(tmp_path, max_shard_size="20KB")
    index_path = folder / "model.safetensors.index.json"
    index = edit(json.loads(index_path.read_text()))
    index_path.write_text(index if isinstance(index, str) else json.dumps(index))
    return lambda: GPT2LMHeadModel.from_pretrained(folder), index_path


def first_tensor_elsewhere(index):
    key, name = next(iter(index["weight_map"].items()))
    index["weight_map"][key] = next(n for n in index["weight_map"].values() if n != name)
    return index


def with_unlisted_tensor(index):
    index["weight_map"]["transformer.h.9.ln_1.weight"] = next(iter(index["weight_map"].values()))
    return index


def tf_checkpoint(tmp_path, hparams: bytes):
    folder = tmp_path / "tf"
    shutil.copytree(TF_TINY, folder)
    (folder / "hparams.json").write_bytes(hparams)
    return lambda: GPT2LMHeadModel.from_pretrained(folder), folder / "hparams.json"


def nanogpt(tmp_path, drop=(), **replace):
    model = GPT2LMHeadModel(tiny_config())
    ckpt = {"model": model.state_dict(), "model_args": dict(n_layer=2, n_head=4, n_embd=32, block_size=32,
                                                            bias=True, vocab_size=97, dropout=0.0), "iter_num": 0}
    for key in drop:
        del (ckpt if key in ckpt else ckpt["model_args"])[key]
    ckpt.update(replace)
    path = tmp_path / "ckpt.pt"
    torch.save(ckpt, path)
    return lambda: GPT2LMHeadModel.from_pretrained(path), path


class Evil:
    def __reduce__(self):
        return (os.system, ("echo this should never run",))


def pickle_file(tmp_path, obj, name="pytorch_model.bin", truncate=False):
    folder = saved_model(tmp_path, safe_serialization=False)
    path = folder / name
    torch.save(obj, path)
    if truncate:
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    return (lambda: GPT2LMHeadModel.from_pretrained(folder)), path


def training_state(tmp_path, obj, truncate=False):
    path = tmp_path / "training_state.pt"
    torch.save(obj, path)
    if truncate:
        path.write_bytes(path.read_bytes()[:100])
    return lambda: read_training_state(tmp_path), path


def tokenizer_file(tmp_path, files: dict[str, str | bytes], named: str):
    for name, content in files.items():
        (tmp_path / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return lambda: load_tokenizer(tmp_path), tmp_path / named


def short_file(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\x02\x00")
    return lambda: GPT2LMHeadModel.from_pretrained(path), path


def huge_header_length(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes((10**9).to_bytes(8, "little") + b"{}")
    return lambda: GPT2LMHeadModel.from_pretrained(path), path


def extra_block(tmp_path):
    """A 2-layer model's folder whose weights also hold a block 7 (a copy of block 1's tensors)."""
    from safetensors.torch import save_file

    folder = saved_model(tmp_path)
    state = GPT2LMHeadModel.from_pretrained(folder).state_dict()
    state.update({k.replace(".h.1.", ".h.7."): v.clone() for k, v in state.items() if k.startswith("transformer.h.1.")})
    save_file({k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"}, folder / "model.safetensors")
    return lambda: GPT2LMHeadModel.from_pretrained(folder), folder


VOCAB = json.dumps({"a": 0, "b": 1, "ab": 2})
MERGES = "#version: 0.2\na b\n"

CASES = [
    # safetensors headers
    (lambda t: safetensors(t, raw=b"[1, 2, 3]"), ValueError, "a JSON list, not an object"),
    (lambda t: safetensors(t, raw=b"{not json"), ValueError, "corrupt safetensors header"),
    (lambda t: safetensors(t, raw=b'{"a": 1'), ValueError, "corrupt safetensors header"),
    (lambda t: safetensors(t, header={**GOOD, "__metadata__": ["x"]}), ValueError,
     "__metadata__ must be an object of strings"),
    (lambda t: safetensors(t, __metadata__={"format": 1}), ValueError, "__metadata__ must be an object of strings"),
    (lambda t: safetensors(t, a={"dtype": "F7"}), ValueError, "tensor a has unsupported dtype 'F7'"),
    (lambda t: safetensors(t, a={"dtype": None}), ValueError, "unsupported dtype None"),
    (lambda t: safetensors(t, header={**GOOD, "a": [0, 16]}), ValueError, "tensor a: [0, 16] is not an object"),
    (lambda t: safetensors(t, a={"shape": [-2, -2]}), ValueError, "shape [-2, -2] is not a list of non-negative integers"),
    (lambda t: safetensors(t, a={"shape": [2.0, 2]}), ValueError, "is not a list of non-negative integers"),
    (lambda t: safetensors(t, a={"shape": "2x2"}), ValueError, "shape '2x2' is not a list"),
    (lambda t: safetensors(t, a={"data_offsets": [0]}), ValueError, "data_offsets [0] is not a pair of integers"),
    (lambda t: safetensors(t, a={"data_offsets": [0.0, 16.0]}), ValueError, "is not a pair of integers"),
    (lambda t: safetensors(t, a={"data_offsets": [True, 16]}), ValueError, "is not a pair of integers"),
    (lambda t: safetensors(t, a={"data_offsets": [0, 12]}), ValueError, "span 12 bytes, its shape [2, 2] needs 16"),
    (lambda t: safetensors(t, a={"data_offsets": [-16, 0]}), ValueError, "data_offsets [-16, 0]"),
    (lambda t: safetensors(t, a={"data_offsets": [16, 0]}), ValueError, "data_offsets [16, 0]"),
    (lambda t: safetensors(t, b={"data_offsets": [8, 24]}), ValueError, "tensor b starts at byte 8 of the data and overlaps"),
    (lambda t: safetensors(t, b={"data_offsets": [0, 16]}), ValueError, "overlaps the tensor before it"),
    (lambda t: safetensors(t, b={"data_offsets": [24, 40]}, data=bytes(40)), ValueError, "leaves a gap of 8 bytes"),
    (lambda t: safetensors(t, a={"data_offsets": [8, 24]}, b={"data_offsets": [24, 40]}, data=bytes(40)), ValueError,
     "tensor a starts at byte 8 of the data and leaves a gap"),
    (lambda t: safetensors(t, data=bytes(40)), ValueError, "the tensors cover 32 bytes of data, the file has 40"),
    (lambda t: safetensors(t, data=bytes(20)), ValueError, "truncated: the tensors need 32 bytes of data, the file has 20"),
    (lambda t: short_file(t), ValueError, "truncated safetensors file (2 bytes)"),
    (lambda t: huge_header_length(t), ValueError, "corrupt or truncated safetensors file (header of 1000000000 bytes)"),
    # shard indexes
    (lambda t: sharded(t, lambda index: {**index, "weight_map": ["model-00001-of-00009.safetensors"]}), ValueError,
     "found a weight_map of type list"),
    (lambda t: sharded(t, lambda index: [index]), ValueError, "found list"),
    (lambda t: sharded(t, lambda index: {"metadata": {}}), ValueError, "found a weight_map of type NoneType"),
    (lambda t: sharded(t, lambda index: "{oops"), ValueError, "not a valid shard index: not JSON"),
    (lambda t: sharded(t, lambda index: {"weight_map": {"transformer.wte.weight": "../other/model.safetensors"}}),
     ValueError, "refused: shard '../other/model.safetensors' is a path, not a file name in the index's folder"),
    (lambda t: sharded(t, lambda index: {"weight_map": {"transformer.wte.weight": "/etc/model.safetensors"}}),
     ValueError, "refused: shard '/etc/model.safetensors' is a path"),
    (lambda t: sharded(t, lambda index: {"weight_map": {"transformer.wte.weight": ".."}}), ValueError, "refused"),
    (lambda t: sharded(t, lambda index: {"weight_map": {"transformer.wte.weight": 3}}), ValueError,
     "weight_map['transformer.wte.weight'] is 3, not a file name"),
    (lambda t: sharded(t, lambda index: {"weight_map": {"transformer.wte.weight": "gone.safetensors"}}),
     FileNotFoundError, "lists shard gone.safetensors, which is missing"),
    (lambda t: sharded(t, first_tensor_elsewhere), ValueError, "holds tensors the index does not place there"),
    (lambda t: sharded(t, with_unlisted_tensor), ValueError, "lists tensors that no shard holds: transformer.h.9.ln_1.weight"),
    (lambda t: extra_block(t), ValueError, "the config has n_layer = 2 (blocks 0..1); unexpected keys: "
     "transformer.h.7.attn.c_attn.bias, transformer.h.7.attn.c_attn.weight, transformer.h.7.attn.c_proj.bias"),
    # OpenAI TF hparams.json
    (lambda t: tf_checkpoint(t, b"\x00\xffgarbage"), ValueError, "not valid JSON"),
    (lambda t: tf_checkpoint(t, b"[768, 12]"), ValueError, "expected a JSON object of hyperparameters, found a list"),
    (lambda t: tf_checkpoint(t, b'{"n_vocab": 100, "n_ctx": 16, "n_embd": 32, "n_layer": 2}'), ValueError, "hparams.json has no n_head"),
    (lambda t: tf_checkpoint(t, b'{"n_vocab": 100, "n_ctx": 16, "n_embd": "32", "n_head": 4, "n_layer": 2}'), ValueError,
     "n_embd"),
    # nanoGPT checkpoints
    (lambda t: nanogpt(t, drop=["model_args"]), ValueError, "not a nanoGPT checkpoint: no 'model_args' field"),
    (lambda t: nanogpt(t, drop=["model"]), ValueError, "not a nanoGPT checkpoint: no 'model' field"),
    (lambda t: nanogpt(t, model_args=[2, 4, 32]), ValueError, "'model_args' is a list, not a dict"),
    (lambda t: nanogpt(t, drop=["n_head", "block_size"]), ValueError, "model_args has no block_size, n_head"),
    (lambda t: nanogpt(t, model={"wte": [1, 2]}), ValueError, "'model' is not a state dict of tensors"),
    (lambda t: nanogpt(t, model_args=dict(n_layer=2, n_head=4, n_embd=32, block_size=32, vocab_size=-1)), ValueError,
     "model_args: GPT2Config.vocab_size"),
    # pickles
    (lambda t: pickle_file(t, {"transformer.wte.weight": Evil()}), ValueError,
     "refused: holds objects that weights-only loading does not allow (GLOBAL posix.system)"),
    (lambda t: pickle_file(t, {"a": torch.zeros(100)}, truncate=True), ValueError, "truncated or corrupt"),
    (lambda t: pickle_file(t, [torch.zeros(3)]), ValueError, "holds a list, not a state dict"),
    (lambda t: training_state(t, {"step": 1, "optimizer": Evil()}), ValueError,
     "refused: holds objects that weights-only loading does not allow"),
    (lambda t: training_state(t, {"step": 1}, truncate=True), ValueError, "truncated or corrupt"),
    (lambda t: training_state(t, [1, 2]), ValueError, "not a gpt2attn training state (no step, optimizer"),
    # tokenizer files
    (lambda t: tokenizer_file(t, {"tokenizer.json": b"\xff\xfe garbage"}, "tokenizer.json"), ValueError,
     "not a readable tokenizer.json"),
    (lambda t: tokenizer_file(t, {"tokenizer.json": "[1, 2]"}, "tokenizer.json"), ValueError, "not a readable tokenizer.json"),
    (lambda t: tokenizer_file(t, {"vocab.json": "{oops", "merges.txt": MERGES}, "vocab.json"), ValueError,
     "not a readable vocabulary: not JSON"),
    (lambda t: tokenizer_file(t, {"vocab.json": "[1, 2]", "merges.txt": MERGES}, "vocab.json"), ValueError,
     "expected a JSON object of token -> id"),
    (lambda t: tokenizer_file(t, {"encoder.json": b"\x80\x81", "vocab.bpe": MERGES}, "encoder.json"), ValueError,
     "not a readable vocabulary"),
    (lambda t: tokenizer_file(t, {"vocab.json": VOCAB, "merges.txt": "#version: 0.2\nx y\n"}, "merges.txt"), ValueError,
     "not readable merges for vocab.json"),
    (lambda t: (lambda: encode(char_tokenizer("abc "), "a café 中 🙂"), None), ValueError,
     "'é' (U+00E9), '中' (U+4E2D), '🙂' (U+1F642)"),
    (lambda t: (lambda: encode(char_tokenizer("abc"), "abcd"), None), ValueError,
     "the text has characters that the tokenizer's vocabulary (3 tokens) does not hold: 'd' (U+0064)"),
]


@pytest.mark.parametrize("build, error, fragment", CASES, ids=[f"{i:02d}-{c[2][:40]}" for i, c in enumerate(CASES)])
def test_bad_input_gets_an_error_naming_it(tmp_path, build, error, fragment):
    call, named = build(tmp_path)
    with pytest.raises(error) as err:
        call()
    message = str(err.value)
    # A bad file is our CheckpointError (a ValueError), never a library's exception such as JSONDecodeError;
    # bad text for a tokenizer is a plain ValueError.
    expected = CheckpointError if error is ValueError and named is not None else error
    assert type(err.value) is expected, message
    assert fragment in message
    if named is not None:
        assert str(named) in message


def test_a_long_list_in_a_message_shows_ten_and_counts_the_rest():
    from gpt2attn.errors import shorten

    keys = [f"key{i}" for i in range(12)]
    assert shorten(keys) == ", ".join(keys[:10]) + ", and 2 more"
    assert shorten(keys[:10]) == ", ".join(keys[:10])
    assert shorten(["x" * 121, "y" * 120]) == "x" * 117 + "..., " + "y" * 120  # each item cut to 120 characters
