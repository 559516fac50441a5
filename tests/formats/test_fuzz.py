"""Hostile files: every format gpt2attn reads, mutated, either loads a working model or raises
CheckpointError naming the file; never a hang, a memory blow-up or an unclear exception.

The fuzzer itself is tests/fuzzing.py (scripts/fuzz_formats.py runs thousands of cases for a
release); here it runs a few hundred, and the failures the fuzzer once found get one regression
case each, built by hand.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch

from gpt2attn import CheckpointError, GPT2LMHeadModel
from gpt2attn.formats import llmc
from gpt2attn.tokenizer import load_tokenizer
from tests import fuzzing
from tests.helpers import DATA, REPO, tiny_config

CASES_PER_FORMAT = 40


@pytest.mark.slow
def test_mutated_files_load_or_raise_our_error():
    seeds = [{"fmt": fmt, "seed": 0, "index": -1} for fmt in fuzzing.FORMATS]
    cases = [{"fmt": fmt, "seed": 0, "index": i} for i in range(CASES_PER_FORMAT) for fmt in fuzzing.FORMATS]
    results = fuzzing.run_cases(seeds + cases)
    # The unmutated seeds load and run, so that the 'ours' outcomes are the mutations' doing.
    assert [r["outcome"] for r in results[: len(seeds)]] == ["loaded"] * len(seeds), \
        "\n".join(map(fuzzing.reproducer, results[: len(seeds)]))
    failures = [r for r in results if r["outcome"] in fuzzing.FAILURES]
    assert not failures, fuzzing.summary(results) + "\n" + "\n".join(map(fuzzing.reproducer, failures))
    assert {r["outcome"] for r in results} == {"loaded", "ours"}, fuzzing.summary(results)  # the mutations bite


# --- one regression case per kind of failure the fuzzer found ----------------------------------


def hf_folder(tmp_path, **config_changes) -> Path:
    folder = tmp_path / "hf"
    fuzzing.tiny_model().save_pretrained(folder)
    if config_changes:
        config = json.loads((folder / "config.json").read_text())
        if "num_labels" in config_changes:  # as in a config that gives the count, not the labels
            del config["id2label"], config["label2id"]
        (folder / "config.json").write_bytes(fuzzing.dump_json({**config, **config_changes}))
    return folder


def config_field(tmp_path, **changes):
    folder = hf_folder(tmp_path, **changes)
    return lambda: GPT2LMHeadModel.from_pretrained(folder), folder / "config.json"


def json_file(tmp_path, name: str, text: bytes):
    """A model folder whose file `name` holds `text`."""
    folder = hf_folder(tmp_path)
    if name == "model.safetensors.index.json":
        shutil.rmtree(folder)
        fuzzing.tiny_model().save_pretrained(folder, max_shard_size="4KB")
    (folder / name).write_bytes(text)
    return lambda: GPT2LMHeadModel.from_pretrained(folder), folder / name


def safetensors_header(tmp_path, text: bytes):
    folder = hf_folder(tmp_path)
    path = folder / "model.safetensors"
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n:])
    return lambda: GPT2LMHeadModel.from_pretrained(folder), path


def tf_folder(tmp_path, hparams=None):
    folder = tmp_path / "tf"
    shutil.copytree(DATA / "openai-tf-tiny", folder)
    if hparams is not None:
        (folder / "hparams.json").write_bytes(hparams)
    return folder


def tf_hparams(tmp_path, text: bytes):
    folder = tf_folder(tmp_path, text)
    return lambda: GPT2LMHeadModel.from_pretrained(folder), folder / "hparams.json"


def tf_index(tmp_path, edit):
    """The TF folder with its index entries rewritten by edit(entries)."""
    from gpt2attn.formats.tf_checkpoint import read_sstable

    folder = tf_folder(tmp_path)
    index = folder / "model.ckpt.index"
    entries = read_sstable(index)
    edit(entries)
    fuzzing.write_sstable(index, entries)
    return lambda: GPT2LMHeadModel.from_pretrained(folder), index


def tf_shape(entries):
    from gpt2attn.formats.tf_checkpoint import parse_proto

    fields = parse_proto(entries[b"model/ln_f/g"])
    fields[2] = [fuzzing.encode_proto({2: [fuzzing.encode_proto({1: [5]})]})]  # 5 values, the data holds 32
    entries[b"model/ln_f/g"] = fuzzing.encode_proto(fields)


def tf_key(entries):
    entries[b"model/\xff\xfe"] = entries.pop(b"model/ln_f/g")


def gguf(tmp_path, edit=None, tensor_edit=None, **options):
    fields, tensors = fuzzing.gguf_seed()
    if edit:
        fields = [edit(f) or f for f in fields]
    if tensor_edit:
        tensors = [tensor_edit(t) or t for t in tensors]
    path = tmp_path / "model.gguf"
    path.write_bytes(fuzzing.gguf_bytes(fields, tensors, **options))
    return lambda: GPT2LMHeadModel.from_pretrained(path), path


def gguf_field(key, kind, value):
    return lambda f: (key, kind, value) if f[0] == key else None


def gguf_tensor(name, ne):
    return lambda t: [name, ne, t[2], t[3]] if t[0] == name else None


def llmc_header(tmp_path, index: int, value: int):
    model = fuzzing.tiny_model()
    path = tmp_path / "model.bin"
    llmc.write(path, model.state_dict(), model.config)
    data = bytearray(path.read_bytes())
    data[4 * index : 4 * index + 4] = struct.pack("<i", value)
    path.write_bytes(bytes(data))
    return lambda: GPT2LMHeadModel.from_pretrained(path), path


def nanogpt(tmp_path, bias=True, model_edit=None, **args):
    ckpt = fuzzing.nanogpt_seed(bias=bias)
    ckpt["model_args"].update(args)
    if model_edit:
        model_edit(ckpt["model"])
    path = tmp_path / "ckpt.pt"
    torch.save(ckpt, path)
    return lambda: GPT2LMHeadModel.from_pretrained(path), path


def state_dict_file(tmp_path, edit):
    folder = tmp_path / "bin"
    fuzzing.tiny_model().save_pretrained(folder, safe_serialization=False)
    path = folder / "pytorch_model.bin"
    state = torch.load(path, weights_only=True)
    edit(state)
    torch.save(state, path)
    return lambda: GPT2LMHeadModel.from_pretrained(folder), path


def tokenizer_json(tmp_path, edit):
    spec = json.loads(fuzzing.tiny_tokenizer().to_str())
    edit(spec)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec))
    return lambda: load_tokenizer(path), path


DEEP = b"[" * 100_000 + b"]" * 100_000
LONG = b'{"n_layer": ' + b"9" * 5000 + b"}"


def set_item(mapping, key, value):
    mapping[key] = value


REGRESSIONS = [
    # hangs: sizes held against limits before anything is built or looped over
    ("config n_layer", lambda t: config_field(t, n_layer=100_000), "n_layer is 100000, above gpt2attn's limit of 256"),
    ("config num_labels 2^31-1", lambda t: config_field(t, num_labels=2**31 - 1), "num_labels is 2147483647"),
    ("config num_labels 10^9", lambda t: config_field(t, num_labels=10**9), "num_labels is 1000000000"),
    ("config vocab 2^63", lambda t: config_field(t, vocab_size=2**63), "vocab_size is 9223372036854775808"),
    ("gguf block_count", lambda t: gguf(t, gguf_field("gpt2.block_count", 4, 100_000)), "gpt2.block_count is 100000"),
    ("hparams n_layer", lambda t: tf_hparams(t, b'{"n_vocab": 100, "n_ctx": 16, "n_embd": 32, "n_head": 4, '
                                               b'"n_layer": 100000}'), "n_layer is 100000"),
    ("nanogpt n_layer, no bias", lambda t: nanogpt(t, bias=False, n_layer=10**6), "n_layer is 1000000"),
    ("nanogpt n_embd 2^40, no bias", lambda t: nanogpt(t, bias=False, n_embd=2**40), "n_embd is 1099511627776"),
    ("nanogpt blocks the weights lack, no bias", lambda t: nanogpt(t, bias=False, n_layer=200),
     "model_args (n_layer 200, n_embd 16, vocab_size 64) do not fit the weights in 'model' (2 blocks"),
    ("llm.c L 2^31-1", lambda t: llmc_header(t, 4, 2**31 - 1), "L (header[4]) is 2147483647, above gpt2attn's limit"),
    ("layers the weights lack", lambda t: (config_field(t, n_layer=200)[0], t / "hf" / "model.safetensors"),
     "the config has n_layer = 200, the weights hold blocks 0..1"),
    # JSON: nesting and long integers, in every JSON file read
    ("config.json deep", lambda t: json_file(t, "config.json", DEEP), "nested 100000 deep"),
    ("config.json long int", lambda t: json_file(t, "config.json", LONG), "an integer of 5000 digits"),
    ("generation_config deep", lambda t: json_file(t, "generation_config.json", DEEP), "nested 100000 deep"),
    ("generation_config long int", lambda t: json_file(t, "generation_config.json", b'{"top_k": ' + b"9" * 5000 + b"}"),
     "an integer of 5000 digits"),
    ("generation_config bad value", lambda t: json_file(t, "generation_config.json", b'{"temperature": -1}'),
     "temperature must be a finite number > 0"),
    ("shard index deep", lambda t: json_file(t, "model.safetensors.index.json", DEEP), "nested 100000 deep"),
    ("shard index long int", lambda t: json_file(t, "model.safetensors.index.json", LONG), "5000 digits"),
    ("safetensors header deep", lambda t: safetensors_header(t, DEEP), "nested 100000 deep"),
    ("safetensors header long int", lambda t: safetensors_header(t, LONG), "5000 digits"),
    ("hparams deep", lambda t: tf_hparams(t, DEEP), "nested 100000 deep"),
    ("hparams long int", lambda t: tf_hparams(t, LONG), "5000 digits"),
    # fields that gave an exception from deep inside
    ("config activation", lambda t: config_field(t, activation_function="__dict__"),
     "activation_function is '__dict__'; gpt2attn knows gelu"),
    ("gguf magic", lambda t: gguf(t, version=2**32 - 1), "unsupported GGUF version 4294967295"),
    ("config key __dict__", lambda t: config_field(t, __dict__={"n_layer": 5}), "'__dict__' cannot be set"),
    ("gguf eps NaN", lambda t: gguf(t, gguf_field("gpt2.attention.layer_norm_epsilon", 6, math.nan)),
     "gpt2.attention.layer_norm_epsilon is nan"),
    ("gguf n_embd inf", lambda t: gguf(t, gguf_field("gpt2.embedding_length", 12, math.inf)),
     "gpt2.embedding_length is inf"),
    ("gguf head_count list", lambda t: gguf(t, gguf_field("gpt2.attention.head_count", 9, (4, [2, 2]))),
     "gpt2.attention.head_count is [2, 2]"),
    ("gguf alignment 0", lambda t: gguf(t, gguf_field("general.alignment", 4, 0)), "general.alignment is 0"),
    ("gguf zero dimension", lambda t: gguf(t, tensor_edit=gguf_tensor("output_norm.bias", [0])),
     "tensor output_norm.bias (F32) has shape [0]"),
    ("gguf n_dims 0", lambda t: gguf(t, tensor_edit=gguf_tensor("output_norm.bias", [])), "n_dims is 0"),
    ("gguf 1-D token_embd", lambda t: gguf(t, tensor_edit=gguf_tensor("token_embd.weight", [16 * 258])),
     "token_embd.weight has shape [4128], not (n_embd, vocab)"),
    ("gguf 3-D linear", lambda t: gguf(t, tensor_edit=gguf_tensor("blk.0.attn_qkv.weight", [16, 48, 1])),
     "blk.0.attn_qkv.weight has 3 dimensions"),
    ("gguf deep arrays", lambda t: gguf(t, gguf_field("gpt2.block_count", 9, (9, fuzzing.DEEP))), "arrays nested deeper"),
    ("gguf tokens of numbers", lambda t: gguf(t, gguf_field("tokenizer.ggml.tokens", 9, (4, list(range(258))))),
     "tokenizer.ggml.tokens must be an array of strings"),
    ("gguf merge without space", lambda t: gguf(t, gguf_field("tokenizer.ggml.merges", 9, (8, ["he"]))),
     "tokenizer.ggml.merges[0] is 'he'"),
    ("gguf token types of strings", lambda t: gguf(t, gguf_field("tokenizer.ggml.token_type", 9, (8, ["x"]))),
     "tokenizer.ggml.token_type must be an array of 258 integers"),
    ("tf shape against size", lambda t: tf_index(t, tf_shape), "model/ln_f/g: shape [5] of float32 does not match"),
    ("tf key not UTF-8", lambda t: tf_index(t, tf_key), "a tensor name is not UTF-8"),
    ("int weights", lambda t: state_dict_file(t, lambda s: set_item(s, "transformer.ln_f.weight",
                                                                   s["transformer.ln_f.weight"].long())),
     "transformer.ln_f.weight holds int64 values, not floating point"),
    ("bool weights", lambda t: state_dict_file(t, lambda s: set_item(s, "transformer.ln_f.bias",
                                                                    s["transformer.ln_f.bias"] > 0)),
     "transformer.ln_f.bias holds bool values"),
    ("non-string key", lambda t: state_dict_file(t, lambda s: set_item(s, 7, s.pop("transformer.ln_f.bias"))),
     "found the key 7"),
    ("tokenizer that panics", lambda t: tokenizer_json(t, lambda spec: spec["post_processor"].update(special_tokens={})),
     "fails on its first text"),
]


@pytest.mark.parametrize("build, fragment", [case[1:] for case in REGRESSIONS], ids=[case[0] for case in REGRESSIONS])
def test_hostile_file_gets_our_error(tmp_path, build, fragment):
    call, named = build(tmp_path)
    with pytest.raises(CheckpointError) as err:
        call()
    message = str(err.value)
    assert message.startswith(f"{named}: ") and err.value.file == str(named), message
    assert fragment in message, message


def test_gpt2_xl_sizes_pass_every_reader(tmp_path):
    """The limits leave gpt2-xl (and more) through: its config, an llm.c header and GGUF metadata."""
    from gpt2attn import GPT2Config
    from gpt2attn.config import GPT2_XL, LIMITS

    xl = GPT2Config.from_preset("gpt2-xl")
    assert (xl.n_layer, xl.n_embd, xl.n_head, xl.vocab_size, xl.n_positions) == (48, 1600, 25, 50257, 1024)
    for name, value in GPT2_XL.items():
        assert value * 4 <= LIMITS[name], name  # headroom: four times gpt2-xl at least
    header = torch.zeros(256, dtype=torch.int32)
    header[:8] = torch.tensor([llmc.MAGIC, 3, 1024, 50257, 48, 25, 1600, 50304])
    path = tmp_path / "xl.bin"
    path.write_bytes(header.numpy().tobytes())
    with pytest.raises(CheckpointError, match=r"truncated: the llm.c header's sizes .* need 6230746624 bytes"):
        llmc.read_header(path)  # every size accepted; only the missing tensors are refused


class RunsCode:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_pickles_never_run_code_even_when_the_environment_asks(tmp_path, monkeypatch, capsys):
    """torch lets TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 turn weights-only loading off where a caller
    does not ask for it; gpt2attn always asks, so the pickle is refused and nothing runs."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    call, path = state_dict_file(tmp_path, lambda s: set_item(s, "transformer.ln_f.bias", RunsCode()))
    with pytest.raises(CheckpointError, match="refused: holds objects that weights-only loading does not allow"):
        call()
    assert "this must never run" not in capsys.readouterr().out


# --- the limits at their bounds, as docs/hostile-files.md states them -----------------------------------------

HOSTILE_PAGE = REPO / "docs" / "hostile-files.md"


def documented_bounds() -> dict[str, int]:
    """The upper bound of each row of the page's limits table ("1 – 65,536", "≤ 64 levels"), by the
    row's first `name`: read from the page, so that the code is held to what users are told."""
    bounds = {}
    for line in HOSTILE_PAGE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        match = re.search(r"(?:–|≤)\s*([\d,]+)", cells[1]) if len(cells) > 2 else None
        if match and cells[0].startswith(("`", "JSON nesting", "JSON integers")):
            name = {"JSON nesting": "json_depth", "JSON integers": "json_digits"}.get(cells[0].split(",")[0])
            bounds[name or cells[0].split("`")[1]] = int(match.group(1).replace(",", ""))
    return bounds


def test_a_json_document_at_the_documented_depth_loads_and_one_deeper_does_not(tmp_path):
    from gpt2attn import GPT2Config

    depth = documented_bounds()["json_depth"]
    fields = tiny_config().to_dict()
    for levels, loads in ((depth, True), (depth + 1, False)):
        path = tmp_path / f"config-{levels}.json"  # the object itself is one level; the note's lists the rest
        path.write_text(json.dumps(fields)[:-1] + ', "my_note": ' + "[" * (levels - 1) + "]" * (levels - 1) + "}")
        if loads:
            with pytest.warns(UserWarning, match="kept as attributes: my_note"):
                assert GPT2Config.from_json_file(path).n_layer == fields["n_layer"]
        else:
            with pytest.raises(CheckpointError, match=rf"nested {levels} deep \(at most {depth} are read\)"):
                GPT2Config.from_json_file(path)


def test_brackets_inside_json_strings_are_not_nesting():
    from gpt2attn.errors import json_depth, read_json

    deep = "[" * 500 + "{" * 500
    assert json_depth(json.dumps({"a": deep}).encode()) == 1
    # an escaped quote does not end a string: the brackets after it are still inside it
    text = json.dumps({"a": 'say \\"' + deep, "b": [["x"]]}).encode()
    assert json_depth(text) == 3 and read_json(text, "f.json")["b"] == [["x"]]
    assert json_depth(b'{"a": "\\\\", "b": [[1]]}') == 3  # an escaped backslash ends before the quote
    assert json_depth(b'[[1], [[2]]]') == 3 and json_depth(b"[]") == 1 and json_depth(b"1") == 0


SIZES = ["n_layer", "n_embd", "n_head", "n_inner", "vocab_size", "n_positions"]


@pytest.mark.parametrize("name", SIZES + ["num_labels"])
def test_each_size_is_held_to_its_own_documented_bound(name):
    """At the bound a config is made (nothing is allocated); one past it is refused, naming the field.
    The other sizes stay small, so only this field's own bound can be the one that refuses it."""
    from gpt2attn import GPT2Config

    bound = documented_bounds()[name]
    def config(value):
        sizes = {"n_embd": 64, "n_head": 1}
        if name == "n_head":
            sizes["n_embd"] = value  # a multiple of n_head
        if name == "num_labels":
            return GPT2Config(**sizes, num_labels=value)
        return GPT2Config(**{**sizes, name: value})

    made = config(bound)
    assert (made.num_labels if name == "num_labels" else getattr(made, name)) == bound
    with pytest.raises(ValueError, match=rf"GPT2Config\.{name} is {bound + 1}, above gpt2attn's limit of {bound} "):
        config(bound + 1)


def test_json_text_reads_as_its_bytes_and_what_it_cannot_read_is_our_error():
    from gpt2attn.errors import read_json

    assert read_json('{"a": [1, "é"]}', "f.json") == {"a": [1, "é"]}  # text as well as bytes
    assert read_json('{"a": "\ud800"}', "f.json") == {"a": "\ud800"}  # a lone surrogate, as json.loads takes it
    with pytest.raises(CheckpointError) as err:
        read_json(b"{oops", "f.json")
    assert str(err.value).startswith("f.json: not valid JSON (")  # the default `what`, then the parser's words


def test_json_integers_of_the_documented_digits_load_and_one_more_does_not(tmp_path):
    from gpt2attn.errors import read_json_file

    digits = documented_bounds()["json_digits"]
    path = tmp_path / "n.json"
    path.write_text(f'{{"n": -{"9" * digits}}}')  # the sign is not a digit
    assert read_json_file(path) == {"n": -int("9" * digits)}
    path.write_text(f'{{"n": {"9" * (digits + 1)}}}')
    with pytest.raises(CheckpointError) as err:
        read_json_file(path)
    assert str(err.value) == (f"{path}: not valid JSON: an integer of {digits + 1} digits "
                              f"(at most {digits} are read)")
