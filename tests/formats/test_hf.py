"""formats/hf.py in detail: what a Hugging Face folder or weights file holds after gpt2attn writes
it, and what gpt2attn reads back or refuses. The expected values come from the safetensors layout
(read with the safetensors package), from transformers 5 (its size strings, its save_pretrained
folder and index), from the tensors written and from hf.py's stated rules, never from our reader.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from gpt2attn import CheckpointError, GPT2LMHeadModel, GPT2Model
from gpt2attn import formats
from gpt2attn.formats import hf
from gpt2attn.formats.state_dict import MAX_DIM_SIZE, MAX_DIMS
from tests.helpers import randomize, tiny_config

TOKENS = torch.tensor([[5, 17, 3, 88, 41, 2, 60]])


def lm(seed=0, **overrides) -> GPT2LMHeadModel:
    return randomize(GPT2LMHeadModel(tiny_config(**overrides)), seed).eval()


def raw_safetensors(path: Path, header, data: bytes = b"") -> Path:
    """A .safetensors file by hand: 8-byte little-endian header length, the JSON header, the data."""
    head = json.dumps(header).encode()
    path.write_bytes(len(head).to_bytes(8, "little") + head + data)
    return path


def pretty_json(data) -> str:
    """The JSON text transformers writes for config.json and shard indexes."""
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


# --- detect, weights_file, read -----------------------------------------------------------------


def test_detect_takes_hf_folders_and_weights_files_only(tmp_path):
    config_only = tmp_path / "config_only"
    config_only.mkdir()
    (config_only / "config.json").write_text("{}")
    weights_only = tmp_path / "weights_only"
    weights_only.mkdir()
    save_file({"x": torch.zeros(2)}, weights_only / "model.safetensors")
    empty = tmp_path / "empty"
    empty.mkdir()
    named_like_a_file = tmp_path / "folder.safetensors"  # a folder: its name's suffix does not count
    named_like_a_file.mkdir()
    assert hf.detect(config_only) and hf.detect(weights_only)
    assert not hf.detect(empty) and not hf.detect(named_like_a_file)
    for name in ("a.safetensors", "a.bin", "a.pth"):
        (tmp_path / name).write_bytes(b"x")
        assert hf.detect(tmp_path / name), name
    for name in ("a.pt", "a.gguf", "a.json", "safetensors"):
        (tmp_path / name).write_bytes(b"x")
        assert not hf.detect(tmp_path / name), name


@pytest.mark.parametrize("present, named", [
    (["model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json"],
     "model.safetensors"),
    (["model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json"], "model.safetensors.index.json"),
    (["pytorch_model.bin", "pytorch_model.bin.index.json"], "pytorch_model.bin"),
    (["pytorch_model.bin.index.json"], "pytorch_model.bin.index.json"),
    ([], None),
])
def test_weights_file_is_the_one_read_first(tmp_path, present, named):
    for name in present:
        (tmp_path / name).write_bytes(b"")
    assert hf.weights_file(tmp_path) == (tmp_path / named if named else tmp_path)
    (tmp_path / "lone.bin").write_bytes(b"")
    assert hf.weights_file(tmp_path / "lone.bin") == tmp_path / "lone.bin"


def test_a_lone_weights_file_uses_the_config_beside_it_or_infers_one_naming_the_file(tmp_path):
    model = lm(activation_function="gelu", n_inner=40)  # neither can be inferred from the shapes alone
    model.save_pretrained(tmp_path / "m")
    config, state, tokenizer = hf.read(tmp_path / "m" / "model.safetensors")
    assert tokenizer is None
    assert (config.activation_function, config.n_inner, config.n_head) == ("gelu", 40, 4)
    assert torch.equal(state["transformer.h.1.mlp.c_fc.weight"], model.transformer.h[1].mlp.c_fc.weight)

    (tmp_path / "lone").mkdir()
    lone = tmp_path / "lone" / "weights.safetensors"
    os.link(tmp_path / "m" / "model.safetensors", lone)
    with pytest.raises(CheckpointError) as err:  # width 32 is no OpenAI size: n_head cannot be told
        hf.read(lone)
    assert err.value.file == str(lone) and "cannot tell n_head for width 32" in str(err.value)

    (tmp_path / "wide").mkdir()
    wide = {"transformer.wte.weight": torch.randn(5, 768), "transformer.wpe.weight": torch.randn(3, 768),
            "transformer.h.0.ln_1.weight": torch.ones(768)}  # the shapes read, not a whole model
    save_file(wide, tmp_path / "wide" / "w.safetensors")
    config, state, _ = hf.read(tmp_path / "wide" / "w.safetensors")
    assert (config.n_embd, config.n_head, config.vocab_size, config.n_positions, config.n_layer) == (768, 12, 5, 3, 1)
    assert torch.equal(state["transformer.wpe.weight"], wide["transformer.wpe.weight"])


def test_a_config_with_an_unknown_activation_is_refused_naming_it_and_the_known_ones(tmp_path):
    from gpt2attn.layers import ACTIVATIONS

    lm().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "activation_function": "swish_of_mine"}))
    with pytest.raises(CheckpointError) as err:
        hf.read(tmp_path)
    message = str(err.value)
    assert err.value.file == str(tmp_path / "config.json")
    assert "activation_function is 'swish_of_mine'" in message
    assert message.endswith(", ".join(sorted(ACTIVATIONS)))


def test_a_folder_without_config_json_is_refused_naming_it(tmp_path):
    save_file({"transformer.wte.weight": torch.zeros(5, 768)}, tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="no config.json") as err:
        hf.read(tmp_path)
    assert str(tmp_path) in str(err.value)


def write_other(folder: Path, name: str, state: dict) -> None:
    if name.endswith(".safetensors"):
        save_file(state, folder / name)
    else:
        torch.save(state, folder / name)


@pytest.mark.parametrize("first, second", [
    ("model.safetensors", "pytorch_model.bin"),
    ("model.safetensors.index.json", "pytorch_model.bin"),
    ("pytorch_model.bin", "pytorch_model.bin.index.json"),
])
def test_the_weights_are_read_in_transformers_order(tmp_path, first, second):
    """transformers prefers model.safetensors, then its index, then pytorch_model.bin, then its
    index; a folder holding two of them is read from the first."""
    model, other = lm(seed=1), lm(seed=2)
    sharded = first.endswith(".index.json")
    model.save_pretrained(tmp_path, safe_serialization=first.startswith("model"),
                          max_shard_size="20KB" if sharded else None)
    assert (tmp_path / first).exists()
    if second.endswith(".index.json"):
        other.save_pretrained(tmp_path / "other", safe_serialization=False, max_shard_size="20KB")
        for file in (tmp_path / "other").iterdir():
            if file.name.startswith("pytorch_model"):
                os.replace(file, tmp_path / file.name)
    else:
        write_other(tmp_path, second, {k: v.clone() for k, v in other.state_dict().items()})
    _, state, _ = hf.read(tmp_path)
    for name, t in model.state_dict().items():
        if name != "lm_head.weight":
            assert torch.equal(state[name], t), name


# --- shard indexes ------------------------------------------------------------------------------


def sharded_folder(tmp_path, edit) -> Path:
    folder = tmp_path / "m"
    lm().save_pretrained(folder, max_shard_size="20KB")
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    edit(index["weight_map"])
    index_path.write_text(json.dumps(index))
    return index_path


@pytest.mark.parametrize("name", ["", "a\\b.safetensors", "model\0.safetensors", ".", "sub/model.safetensors"])
def test_shard_names_that_are_not_plain_file_names_are_refused(tmp_path, name):
    index_path = sharded_folder(tmp_path, lambda weight_map: weight_map.update({"transformer.wte.weight": name}))
    with pytest.raises(CheckpointError) as err:
        hf.read(index_path.parent)
    assert err.value.file == str(index_path)
    assert ("not a file name" if name == "" else "refused: shard") in str(err.value)


def test_a_shard_read_once_however_many_tensors_the_index_places_in_it(tmp_path, monkeypatch):
    index_path = sharded_folder(tmp_path, lambda weight_map: None)
    weight_map = json.loads(index_path.read_text())["weight_map"]
    reads = []
    real = hf.read_safetensors
    monkeypatch.setattr(hf, "read_safetensors", lambda path: reads.append(path.name) or real(path))
    _, state, _ = hf.read(index_path.parent)
    assert sorted(reads) == sorted(set(weight_map.values()))
    assert sorted(state) == sorted(weight_map)


def test_bin_shards_are_checked_against_their_index_too(tmp_path):
    folder = tmp_path / "m"
    lm().save_pretrained(folder, max_shard_size="20KB", safe_serialization=False)
    index_path = folder / "pytorch_model.bin.index.json"
    index = json.loads(index_path.read_text())
    names = sorted(set(index["weight_map"].values()))
    key = next(k for k, v in index["weight_map"].items() if v == names[0])
    index["weight_map"][key] = names[1]
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as err:
        hf.read(folder)
    assert err.value.file == str(index_path)
    assert f"shard {names[0]} holds tensors the index does not place there: {key}" in str(err.value)


# --- reading safetensors ------------------------------------------------------------------------


def test_the_smallest_files(tmp_path):
    seven = tmp_path / "seven.safetensors"
    seven.write_bytes(bytes(7))
    with pytest.raises(CheckpointError, match=r"truncated safetensors file \(7 bytes\)"):
        hf.read_safetensors(seven)
    eight = tmp_path / "eight.safetensors"  # a length of 0: a header of no bytes is no JSON
    eight.write_bytes(bytes(8))
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        hf.read_safetensors(eight)
    empty = raw_safetensors(tmp_path / "empty.safetensors", {})  # the header ends the file: no tensors
    assert load_file(empty) == {} and hf.read_safetensors(empty) == {}
    short = tmp_path / "short.safetensors"
    short.write_bytes((3).to_bytes(8, "little") + b"{}")  # one byte short of its stated header
    with pytest.raises(CheckpointError, match=r"corrupt or truncated safetensors file \(header of 3 bytes\)"):
        hf.read_safetensors(short)


def test_tensors_in_any_header_order_with_empty_ones_read_as_safetensors_reads_them(tmp_path):
    values = {"a": torch.arange(6, dtype=torch.int16).reshape(2, 3), "b": torch.tensor([1.5, -2.25]),
              "c": torch.tensor([7, -8], dtype=torch.int64)}
    data = b"".join(t.numpy().tobytes() for t in values.values())  # a at 0, b at 12, c at 20
    header = {  # listed out of order; the empty tensors start where others do (the ordering must use the end too)
        "c": {"dtype": "I64", "shape": [2], "data_offsets": [20, 36]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [12, 20]},
        "e": {"dtype": "I64", "shape": [0, 3], "data_offsets": [12, 12]},
        "a": {"dtype": "I16", "shape": [2, 3], "data_offsets": [0, 12]},
        "f": {"dtype": "BF16", "shape": [0], "data_offsets": [36, 36]},
        "__metadata__": {"format": "pt"},
    }
    path = raw_safetensors(tmp_path / "m.safetensors", header, data)
    theirs, ours = load_file(path), hf.read_safetensors(path)
    assert sorted(ours) == sorted(theirs) == ["a", "b", "c", "e", "f"]
    for name, t in theirs.items():
        assert ours[name].dtype == t.dtype and ours[name].shape == t.shape and torch.equal(ours[name], t), name
    assert torch.equal(ours["a"], values["a"]) and torch.equal(ours["c"], values["c"])


def test_a_tensor_changed_in_memory_leaves_the_file_as_it_was(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.arange(4.0), "b": torch.ones(3)}, path)
    before = path.read_bytes()
    state = hf.read_safetensors(path)
    state["a"].mul_(-1)
    state["b"].zero_()
    assert torch.equal(state["a"], -torch.arange(4.0))
    assert path.read_bytes() == before
    assert torch.equal(hf.read_safetensors(path)["b"], torch.ones(3))


def header_error(tmp_path, header, data: bytes) -> str:
    path = raw_safetensors(tmp_path / "m.safetensors", header, data)
    with pytest.raises(CheckpointError) as err:
        hf.read_safetensors(path)
    assert err.value.file == str(path)
    return str(err.value)


def test_shape_limits_are_the_stated_ones(tmp_path):
    # MAX_DIMS dimensions are allowed, one more is not
    ok = raw_safetensors(tmp_path / "ok.safetensors", {"x": {"dtype": "U8", "shape": [1] * MAX_DIMS, "data_offsets": [0, 1]}}, b"\x07")
    assert hf.read_safetensors(ok)["x"].shape == (1,) * MAX_DIMS
    message = header_error(tmp_path, {"x": {"dtype": "U8", "shape": [1] * (MAX_DIMS + 1), "data_offsets": [0, 1]}}, b"\x07")
    assert f"more than {MAX_DIMS} dimensions" in message
    # a dimension of MAX_DIM_SIZE passes the shape check (and fails on its data), one above it does not
    at_limit = header_error(tmp_path, {"x": {"dtype": "U8", "shape": [MAX_DIM_SIZE], "data_offsets": [0, 1]}}, b"\x07")
    assert f"span 1 bytes, its shape [{MAX_DIM_SIZE}] needs {MAX_DIM_SIZE}" in at_limit
    above = header_error(tmp_path, {"x": {"dtype": "U8", "shape": [MAX_DIM_SIZE + 1], "data_offsets": [0, 1]}}, b"\x07")
    assert f"one above {MAX_DIM_SIZE}" in above
    # a zero-length dimension is allowed
    zero = raw_safetensors(tmp_path / "zero.safetensors", {"x": {"dtype": "F16", "shape": [3, 0], "data_offsets": [0, 0]}})
    assert hf.read_safetensors(zero)["x"].shape == (3, 0)


@pytest.mark.parametrize("code", sorted(hf.SAFE_DTYPES))
def test_every_safetensors_dtype_reads_back(tmp_path, code):
    dtype = hf.SAFE_DTYPES[code]
    values = (torch.arange(6) % 2 == 1) if dtype == torch.bool else (torch.arange(6) - 2).to(dtype)
    path = tmp_path / "m.safetensors"
    save_file({"x": values.reshape(2, 3)}, path)
    with safe_open(path, "pt") as f:  # the code the reference writer stores for this dtype
        assert json.loads(path.read_bytes()[8:8 + int.from_bytes(path.read_bytes()[:8], "little")])["x"]["dtype"] == code
        assert f.get_tensor("x").dtype == dtype
    assert torch.equal(hf.read_safetensors(path)["x"], values.reshape(2, 3))
    hf.write_safetensors(tmp_path / "ours.safetensors", {"x": values.reshape(2, 3)})
    assert torch.equal(load_file(tmp_path / "ours.safetensors")["x"], values.reshape(2, 3))


def test_data_offsets_must_match_the_shape_exactly(tmp_path):
    message = header_error(tmp_path, {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 12]}}, bytes(12))
    assert "data_offsets [0, 12] span 12 bytes, its shape [2] needs 8" in message
    exact = raw_safetensors(tmp_path / "x.safetensors", {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(8))
    assert torch.equal(hf.read_safetensors(exact)["x"], torch.zeros(2))


def test_data_coverage_errors_say_how_many_bytes(tmp_path):
    header = {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    short = header_error(tmp_path, header, bytes(5))
    assert short.endswith("truncated: the tensors need 8 bytes of data, the file has 5")
    long = header_error(tmp_path, header, bytes(9))
    assert long.endswith("corrupt safetensors header: the tensors cover 8 bytes of data, the file has 9")


# --- writing ------------------------------------------------------------------------------------


def stored_header(path: Path) -> tuple[int, dict]:
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return n, json.loads(data[8:8 + n])


def test_write_safetensors_layout(tmp_path):
    state = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "e": torch.zeros(0, 4),
             "i": torch.tensor([3, -4], dtype=torch.int64), "h": torch.tensor([1.5], dtype=torch.float16)}
    sizes = []
    path = tmp_path / "m.safetensors"
    hf.write_safetensors(path, state, progress=sizes.append)
    n, header = stored_header(path)
    assert n % 8 == 0  # the data starts 8-byte aligned
    assert header.pop("__metadata__") == {"format": "pt"}
    offset, expected = 0, {}
    for name, t in state.items():
        size = t.numel() * t.element_size()
        expected[name] = {"dtype": {torch.float32: "F32", torch.int64: "I64", torch.float16: "F16"}[t.dtype],
                          "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    assert header == expected
    assert path.stat().st_size == 8 + n + offset
    assert sizes == [24, 0, 16, 2]
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt"}
    theirs = load_file(path)
    for name, t in state.items():
        assert torch.equal(theirs[name], t) and theirs[name].dtype == t.dtype, name


def test_write_puts_a_gpt2lmheadmodel_folder_in_the_requested_dtype(tmp_path):
    model = lm()
    state = dict(model.state_dict())
    state["extra.counts"] = torch.tensor([1, 2, 3])  # not floating: keeps its dtype
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "pytorch_model.bin").write_bytes(b"an old model's weights")
    hf.write(folder, state, model.config, dtype=torch.float16)
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors", "tokenizer_config.json"]
    stored = load_file(folder / "model.safetensors")
    assert "lm_head.weight" not in stored  # tied
    assert stored["extra.counts"].dtype == torch.int64 and torch.equal(stored["extra.counts"], state["extra.counts"])
    assert torch.equal(stored["transformer.h.0.attn.c_attn.weight"], state["transformer.h.0.attn.c_attn.weight"].half())
    config_text = (folder / "config.json").read_text()
    config = json.loads(config_text)
    assert config_text == pretty_json(config)
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["torch_dtype"] == config["dtype"] == "float16"
    assert config["n_embd"] == 32 and config["model_type"] == "gpt2"

    hf.write(folder, model.state_dict(), model.config)  # no dtype: as stored
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "float32"
    hf.write(folder, model.state_dict(), tiny_config(dtype="float16"))  # what is written, whatever the config says
    assert {json.loads((folder / "config.json").read_text())[key] for key in ("dtype", "torch_dtype")} == {"float32"}
    assert load_file(folder / "model.safetensors")["transformer.wte.weight"].dtype == torch.float32


@pytest.mark.parametrize("name, expected", [("bf16", torch.bfloat16), ("float16", torch.float16),
                                             ("torch.bfloat16", torch.bfloat16), ("fp32", torch.float32)])
def test_save_takes_a_dtype_name_as_the_other_writers_do(tmp_path, name, expected):
    model = lm()
    formats.save(model, tmp_path / "m", dtype=name)
    stored = load_file(tmp_path / "m" / "model.safetensors")
    assert stored["transformer.wte.weight"].dtype == expected
    assert torch.equal(stored["transformer.wte.weight"], model.transformer.wte.weight.detach().to(expected))
    assert json.loads((tmp_path / "m" / "config.json").read_text())["torch_dtype"] == str(expected).removeprefix("torch.")


@pytest.mark.parametrize("recorded, expected", [("float16", torch.float16), (None, torch.float32)])
def test_write_with_dtype_auto_uses_the_dtype_the_config_records(tmp_path, recorded, expected):
    """'auto' is the config's torch_dtype (as from_pretrained reads it); without one, as stored."""
    model = lm()
    config = tiny_config(**({"torch_dtype": recorded} if recorded else {}))
    hf.write(tmp_path / "m", model.state_dict(), config, dtype="auto")
    assert load_file(tmp_path / "m" / "model.safetensors")["transformer.wte.weight"].dtype == expected


def test_save_refuses_an_unknown_dtype_name_before_writing(tmp_path):
    with pytest.raises(ValueError, match="unknown dtype 'int3'"):
        formats.save(lm(), tmp_path / "m", dtype="int3")
    assert not (tmp_path / "m").exists()


def test_write_keeps_an_untied_head_and_adds_a_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models

    model = lm(tie_word_embeddings=False)
    tokenizer = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    hf.write(tmp_path / "m", model.state_dict(), model.config, tokenizer=tokenizer)
    assert torch.equal(load_file(tmp_path / "m" / "model.safetensors")["lm_head.weight"], model.lm_head.weight)
    assert json.loads((tmp_path / "m" / "tokenizer.json").read_text()) == json.loads(tokenizer.to_str())
    assert sorted(os.listdir(tmp_path / "m")) == ["config.json", "model.safetensors", "tokenizer.json"]


def test_save_pretrained_on_another_rank_writes_nothing(tmp_path):
    lm().save_pretrained(tmp_path / "m", is_main_process=False)
    assert not (tmp_path / "m").exists()
    lm().save_pretrained(tmp_path / "m")
    before = {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()}
    lm(seed=5).save_pretrained(tmp_path / "m", is_main_process=False)
    assert {p.name: p.read_bytes() for p in (tmp_path / "m").iterdir()} == before


@torch.no_grad()
def test_save_pretrained_writes_the_given_state_dict_and_drops_a_gathered_head_copy(tmp_path):
    model, other = lm(seed=0), lm(seed=7)
    gathered = {name: t.clone() for name, t in other.state_dict().items()}  # lm_head a copy, not wte itself
    assert gathered["lm_head.weight"].data_ptr() != gathered["transformer.wte.weight"].data_ptr()
    model.save_pretrained(tmp_path / "m", state_dict=gathered)
    stored = load_file(tmp_path / "m" / "model.safetensors")
    assert sorted(stored) == sorted(k for k in gathered if k != "lm_head.weight")
    assert all(torch.equal(stored[k], gathered[k]) for k in stored)
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "m")
    assert torch.equal(loaded(TOKENS).logits, other(TOKENS).logits)


@torch.no_grad()
def test_an_untied_model_keeps_its_head_unless_it_is_the_embedding_itself(tmp_path):
    model = lm(tie_word_embeddings=False)
    model.save_pretrained(tmp_path / "own")
    assert torch.equal(load_file(tmp_path / "own" / "model.safetensors")["lm_head.weight"], model.lm_head.weight)
    shared = dict(model.state_dict())
    shared["lm_head.weight"] = shared["transformer.wte.weight"]  # one tensor twice: safetensors cannot store that
    model.save_pretrained(tmp_path / "shared", state_dict=shared)
    assert "lm_head.weight" not in load_file(tmp_path / "shared" / "model.safetensors")


def test_parameters_that_require_grad_can_be_passed_as_the_state_dict(tmp_path):
    model = lm()
    params = dict(model.named_parameters())
    assert all(p.requires_grad for p in params.values())
    model.save_pretrained(tmp_path / "m", state_dict=params)
    stored = load_file(tmp_path / "m" / "model.safetensors")
    assert torch.equal(stored["transformer.ln_f.bias"], model.transformer.ln_f.bias.detach())


@torch.no_grad()
def test_a_base_model_folder_names_its_class_and_has_no_generation_config(tmp_path):
    base = randomize(GPT2Model(tiny_config()), 2).half()
    base.save_pretrained(tmp_path / "m")
    assert sorted(os.listdir(tmp_path / "m")) == ["config.json", "model.safetensors"]
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["architectures"] == ["GPT2Model"] and config["torch_dtype"] == "float16"
    stored = load_file(tmp_path / "m" / "model.safetensors")
    assert sorted(stored) == sorted(base.state_dict())
    assert stored["wte.weight"].dtype == torch.float16


@torch.no_grad()
@pytest.mark.parametrize("safe", [True, False])
def test_a_sharded_folder_and_its_index(tmp_path, safe):
    """transformers' layout: shards named STEM-0000i-of-0000n.EXT holding consecutive tensors of at
    most max_shard_size each, an index {"metadata": {"total_size"}, "weight_map"} written as
    transformers writes JSON, and every tensor in the shard its index names."""
    model = lm()
    sizes = []
    model.save_pretrained(tmp_path / "m", safe_serialization=safe, max_shard_size="20KB", progress=sizes.append)
    ext, stem = (".safetensors", "model") if safe else (".bin", "pytorch_model")
    index_path = tmp_path / "m" / f"{stem}{ext}.index.json"
    index = json.loads(index_path.read_text())
    assert index_path.read_text() == pretty_json(index)
    stored = {k: t for k, t in model.state_dict().items() if k != "lm_head.weight"}
    expected_shards, used = [[]], 0  # the docstring's rule, applied by hand
    for name, t in stored.items():
        size = t.numel() * t.element_size()
        if expected_shards[-1] and used + size > 20_000:
            expected_shards.append([])
            used = 0
        expected_shards[-1].append(name)
        used += size
    n = len(expected_shards)
    assert n > 2
    names = [f"{stem}-{i:05d}-of-{n:05d}{ext}" for i in range(1, n + 1)]
    assert index["weight_map"] == {key: names[i] for i, shard in enumerate(expected_shards) for key in shard}
    total = sum(t.numel() * t.element_size() for t in stored.values())
    assert index["metadata"] == {"total_size": total} and sum(sizes) == total
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == sorted(
        [*names, index_path.name, "config.json", "generation_config.json"])
    for name, t in stored.items():
        shard = tmp_path / "m" / index["weight_map"][name]
        held = load_file(shard) if safe else torch.load(shard, weights_only=True)
        assert torch.equal(held[name], t), name


@pytest.mark.parametrize("size", ["20KB", "1MiB", "2GB", "10KiB", "3GiB", "5MB", 123456, "1gib", "4 GB"])
def test_size_strings_mean_what_transformers_means(size):
    from transformers.utils.hub import convert_file_size_to_int

    assert hf.parse_size(size) == convert_file_size_to_int(size)


def test_size_strings_transformers_does_not_take():
    assert hf.parse_size(None) is None
    assert hf.parse_size("100") == 100 and hf.parse_size("100B") == 100 and hf.parse_size(" 2 KB ") == 2000
    assert hf.parse_size("1.5MB") == 1_500_000 and hf.parse_size("0.5KiB") == 512
    for bad in ("", "MB", "-5MB", "5XB", "5 M B", "five MB"):
        with pytest.raises(ValueError, match="max_shard_size"):
            hf.parse_size(bad)


def test_shards_fill_up_to_the_limit_and_a_large_tensor_gets_its_own():
    t = {name: torch.zeros(n, dtype=torch.uint8) for name, n in [("a", 10), ("b", 10), ("c", 25), ("d", 5), ("e", 5)]}
    names = lambda shards: [list(s) for s in shards]  # noqa: E731
    assert names(hf.split_shards(t, None)) == [["a", "b", "c", "d", "e"]]
    assert names(hf.split_shards(t, 20)) == [["a", "b"], ["c"], ["d", "e"]]  # exactly 20 fits
    assert names(hf.split_shards(t, 19)) == [["a"], ["b"], ["c"], ["d", "e"]]
    assert names(hf.split_shards({"c": t["c"], "d": t["d"]}, 20)) == [["c"], ["d"]]  # no empty first shard
    assert names(hf.split_shards(t, 100)) == [["a", "b", "c", "d", "e"]]


def test_bin_progress_counts_every_byte_and_the_file_loads(tmp_path):
    state = {"a": torch.ones(3), "b": torch.zeros(2, 2, dtype=torch.float64)}
    sizes = []
    hf.write_bin(tmp_path / "w.bin", state, progress=sizes.append)
    assert sum(sizes) == 3 * 4 + 4 * 8
    loaded = torch.load(tmp_path / "w.bin", weights_only=True)
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    hf.write_bin(tmp_path / "quiet.bin", state)  # no progress callback: fine


def test_model_file_names_are_the_ones_save_pretrained_writes():
    for name in ("config.json", "model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
                 "pytorch_model.bin.index.json", "model-00001-of-00003.safetensors", "pytorch_model-00012-of-00020.bin",
                 "pytorch_model-00001-of-00002.bin.index.json"):
        assert hf.MODEL_FILE.fullmatch(name), name
    for name in ("tokenizer.json", "model.gguf", "model-1-of-3.safetensors", "xconfig.json", "model.safetensors.bak",
                 "generation_config.json", "vocab.json", "model-00001-of-0003.safetensors"):
        assert not hf.MODEL_FILE.fullmatch(name), name


# --- details that earlier tests left open (each found by a surviving mutant) ---------------------


def test_header_errors_show_the_value_at_fault(tmp_path):
    unhashable = header_error(tmp_path, {"x": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}, bytes(4))
    assert "tensor x has unsupported dtype ['F32']" in unhashable
    metadata = header_error(tmp_path, {"__metadata__": {"format": 1}}, b"")
    assert "__metadata__ must be an object of strings, found {'format': 1}" in metadata
    later = header_error(tmp_path, {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                                    "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 16]}}, bytes(16))
    assert "tensor b: data_offsets [4, 16] span 12 bytes, its shape [2] needs 8" in later


def test_the_header_is_compact_json_padded_with_the_fewest_spaces(tmp_path):
    """As the reference writer does: compact JSON, then 0 to 7 spaces so the data starts at a
    multiple of 8. Names of 1 to 8 letters give every header length modulo 8."""
    residues = set()
    for k in range(1, 9):
        path = tmp_path / f"{k}.safetensors"
        hf.write_safetensors(path, {"x" * k: torch.tensor([1.0, 2.0])})
        n, header = stored_header(path)
        text = path.read_bytes()[8:8 + n]
        compact = json.dumps(header, separators=(",", ":")).encode()
        assert text.rstrip(b" ") == compact and n % 8 == 0 and n - len(compact) < 8, k
        residues.add(len(compact) % 8)
        assert torch.equal(load_file(path)["x" * k], torch.tensor([1.0, 2.0]))
    assert residues == set(range(8))


def test_shards_count_the_bytes_since_the_last_split():
    t = {name: torch.zeros(8, dtype=torch.uint8) for name in "abc"}
    assert [list(s) for s in hf.split_shards(t, 20)] == [["a", "b"], ["c"]]  # 8 + 8 + 8 > 20
    t = {"x": torch.zeros(15, dtype=torch.uint8), "y": torch.zeros(10, dtype=torch.uint8),
         "z": torch.zeros(10, dtype=torch.uint8)}
    assert [list(s) for s in hf.split_shards(t, 20)] == [["x"], ["y", "z"]]  # y + z is exactly 20


@torch.no_grad()
def test_exactly_two_shards_get_an_index(tmp_path):
    model = lm()
    stored = {k: t for k, t in model.state_dict().items() if k != "lm_head.weight"}
    sizes = [t.numel() * t.element_size() for t in stored.values()]
    model.save_pretrained(tmp_path / "m", max_shard_size=sum(sizes) - sizes[-1])  # all but the last tensor fit
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    last = list(stored)[-1]
    assert index["weight_map"] == {k: "model-00002-of-00002.safetensors" if k == last else "model-00001-of-00002.safetensors"
                                   for k in stored}
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "m")
    assert torch.equal(loaded(TOKENS).logits, model(TOKENS).logits)


def test_write_model_writes_safetensors_unless_told(tmp_path):
    """training/loop.py publishes its model with write_model(model, folder): safetensors by default."""
    model = lm()
    (tmp_path / "m").mkdir()
    hf.write_model(model, tmp_path / "m")
    assert sorted(os.listdir(tmp_path / "m")) == ["config.json", "generation_config.json", "model.safetensors"]


def test_a_state_read_from_a_folder_writes_back_as_it_was(tmp_path):
    """read() gives a tied model's state without lm_head; write() takes it back."""
    model = lm()
    model.save_pretrained(tmp_path / "a")
    config, state, _ = hf.read(tmp_path / "a")
    assert "lm_head.weight" not in state
    hf.write(tmp_path / "b", state, config)
    again = load_file(tmp_path / "b" / "model.safetensors")
    assert sorted(again) == sorted(state) and all(torch.equal(again[k], state[k]) for k in state)


@torch.no_grad()
def test_a_model_without_a_head_keeps_a_given_head(tmp_path):
    """Nothing of a GPT2Model is tied to a head: a head in the state dict it is given is saved."""
    state = {k: t.clone() for k, t in lm().state_dict().items()}
    GPT2Model(tiny_config()).save_pretrained(tmp_path / "m", state_dict=state)
    stored = load_file(tmp_path / "m" / "model.safetensors")
    assert sorted(stored) == sorted(state) and torch.equal(stored["lm_head.weight"], state["lm_head.weight"])
