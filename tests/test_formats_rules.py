"""The GGUF and llm.c rules a user sees, each pinned by what a written file holds or what a loaded
model is: GGUF's bounds, versions, metadata and tensor types as llama.cpp's converter and gguf-py
write them; llm.c's padded vocabulary; telling a pickled pytorch_model.bin from llm.c; the tie rule
for a checkpoint with no lm_head. The expected values come from gguf-py's own reader and constants,
llm.c's layout (formats/llmc.py's docstring) and the model written, never from our reader."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from gpt2attn import GPT2LMHeadModel
from gpt2attn.formats import detect_format, gguf as ours_gguf, hf, llmc, save
from tests.helpers import randomize, tiny_config

gguf = pytest.importorskip("gguf", reason="the gguf package (pip install 'gpt2attn[gguf]') reads GGUF")


def model_of(**overrides) -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return randomize(GPT2LMHeadModel(tiny_config(**overrides))).eval()


def assert_same_weights(a: GPT2LMHeadModel, b: GPT2LMHeadModel, atol: float = 0.0) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.allclose(sa[name], sb[name], atol=atol, rtol=0), name


def their_reader(path: Path):
    """gguf-py's own reader: the independent view of what our writer put in the file."""
    return gguf.GGUFReader(str(path))


def their_field(reader, key: str):
    return reader.fields[key].contents()


# --- GGUF -----------------------------------------------------------------------------------------


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


# --- llm.c ----------------------------------------------------------------------------------------


def header_ints(path: Path) -> list[int]:
    return np.fromfile(path, dtype="<i4", count=8).tolist()


@pytest.mark.parametrize("vocab_size, padded", [(256, 256), (128, 128), (200, 256), (129, 256)])
def test_llmc_pads_the_vocabulary_to_128_and_reads_v_equal_vp(tmp_path, vocab_size, padded):
    """Vp is V rounded up to a multiple of 128 (llm.c's pad_vocab): no extra rows when V already
    is one, and a file with V == Vp loads. The file holds exactly header + parameters."""
    path = tmp_path / "m.bin"
    model = model_of(vocab_size=vocab_size)
    save(model, path, dtype="fp32")
    c = model.config
    assert header_ints(path)[2:8] == [c.n_positions, vocab_size, c.n_layer, c.n_head, c.n_embd, padded]
    n_params = sum(p.numel() for p in model.parameters()) + (padded - vocab_size) * c.n_embd
    assert path.stat().st_size == 256 * 4 + 4 * n_params
    wte = torch.from_file(str(path), size=256 + padded * c.n_embd, dtype=torch.float32)[256:].view(padded, -1)
    assert torch.equal(wte[:vocab_size], model.transformer.wte.weight.detach())
    assert not wte[vocab_size:].any()
    back = GPT2LMHeadModel.from_pretrained(path)
    assert back.config.vocab_size == vocab_size
    assert_same_weights(back, model)


def test_a_legacy_pickled_pytorch_model_bin_is_not_llmc(tmp_path):
    """torch.save's pre-zip format (a pickle stream) in a pytorch_model.bin is read as HF's."""
    model = model_of()
    folder = tmp_path / "legacy"
    folder.mkdir()
    path = folder / "pytorch_model.bin"
    torch.save(model.state_dict(), path, _use_new_zipfile_serialization=False)
    assert not path.read_bytes().startswith(b"PK")
    assert not llmc.detect(path)
    assert detect_format(path) is hf
    model.config.save_pretrained(folder)
    assert_same_weights(GPT2LMHeadModel.from_pretrained(path), model)
    assert detect_format(folder) is hf
    assert_same_weights(GPT2LMHeadModel.from_pretrained(folder), model)


def test_an_llmc_file_with_another_suffix_is_still_llmc_by_its_magic(tmp_path):
    path = tmp_path / "weights.data"
    save(model_of(), tmp_path / "m.bin", dtype="fp32")
    path.write_bytes((tmp_path / "m.bin").read_bytes())
    assert llmc.detect(path) and detect_format(path) is llmc


# --- the tie rule ---------------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [True, False])
def test_a_checkpoint_without_lm_head_is_tied_to_wte_whatever_the_config_says(tmp_path, tie):
    """loader.build_model: the head is tied when the config says so or the checkpoint has none."""
    model = model_of(tie_word_embeddings=tie)
    state = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(model.config.to_dict()))
    back = GPT2LMHeadModel.from_pretrained(tmp_path)
    assert back.lm_head.weight is back.transformer.wte.weight
    assert torch.equal(back.lm_head.weight, model.transformer.wte.weight)


@pytest.mark.parametrize("tie", [True, False])
def test_a_checkpoint_with_its_own_lm_head_is_untied_only_when_the_config_says(tmp_path, tie):
    model = model_of(tie_word_embeddings=False)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = state["lm_head.weight"] + 1.0  # differs from wte
    save_file(state, tmp_path / "model.safetensors")
    config = model.config.to_dict() | {"tie_word_embeddings": tie}
    (tmp_path / "config.json").write_text(json.dumps(config))
    back = GPT2LMHeadModel.from_pretrained(tmp_path)
    if tie:  # transformers' rule: the config's tie wins, the stored head is dropped
        assert back.lm_head.weight is back.transformer.wte.weight
        assert torch.equal(back.lm_head.weight, state["transformer.wte.weight"])
    else:
        assert back.lm_head.weight is not back.transformer.wte.weight
        assert torch.equal(back.lm_head.weight, state["lm_head.weight"])


def test_gguf_module_reads_its_own_suffix(tmp_path):
    path = tmp_path / "m.gguf"
    save(model_of(), path)
    assert ours_gguf.detect(path) and detect_format(path) is ours_gguf


# --- llm.c: what the writer accepts and refuses (found by mutation testing) -------------------------


def test_llmc_round_trips_one_layer_one_head_and_says_the_head_is_tied(tmp_path):
    model = model_of(n_layer=1, n_head=1)
    save(model, tmp_path / "m.bin", dtype="fp32")
    back = GPT2LMHeadModel.from_pretrained(tmp_path / "m.bin")
    assert (back.config.n_layer, back.config.n_head) == (1, 1)
    assert back.config.tie_word_embeddings is True and back.lm_head.weight is back.transformer.wte.weight
    assert_same_weights(back, model)


@pytest.mark.parametrize("change", [dict(activation_function="gelu_pytorch_tanh"), dict(n_inner=128)],
                         ids=["gelu_pytorch_tanh", "n_inner=4C"])
def test_llmc_writes_what_llmc_computes_alike(tmp_path, change):
    model = model_of(**change)  # n_embd 32: 4C = 128
    save(model, tmp_path / "m.bin", dtype="fp32")
    assert_same_weights(GPT2LMHeadModel.from_pretrained(tmp_path / "m.bin"), model)


@pytest.mark.parametrize("change, field", [
    (dict(n_inner=160), "n_inner 160"),
    (dict(scale_attn_weights=False), "scale_attn_weights"),
    (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    (dict(add_cross_attention=True), "add_cross_attention"),
])
def test_llmc_refuses_what_llmc_computes_otherwise_naming_file_and_field(tmp_path, change, field):
    with pytest.raises(ValueError) as error:
        save(model_of(**change), tmp_path / "m.bin", dtype="fp32")
    assert "m.bin" in str(error.value) and field in str(error.value)
    if "n_inner" in change:
        assert "128" in str(error.value)  # what llm.c's MLP is: 4 * n_embd
    assert not (tmp_path / "m.bin").exists()


def test_llmc_write_takes_a_state_dict_without_lm_head_and_names_what_is_missing(tmp_path):
    model = model_of()
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    llmc.write(tmp_path / "m.bin", state, model.config)
    assert_same_weights(GPT2LMHeadModel.from_pretrained(tmp_path / "m.bin"), model)
    del state["transformer.h.1.ln_2.bias"], state["transformer.wpe.weight"]
    with pytest.raises(ValueError) as error:
        llmc.write(tmp_path / "n.bin", state, model.config)
    assert "n.bin" in str(error.value)
    assert "transformer.wpe.weight, transformer.h.1.ln_2.bias" in str(error.value)


def test_llmc_write_names_a_tensor_of_the_wrong_shape_in_conv1d_orientation(tmp_path):
    model = model_of()
    state = dict(model.state_dict())
    state["transformer.h.0.attn.c_attn.weight"] = torch.zeros(32, 95)  # Conv1D (in, out) is (32, 96)
    with pytest.raises(ValueError) as error:
        llmc.write(tmp_path / "m.bin", state, model.config)
    message = str(error.value)
    assert "m.bin" in message and "transformer.h.0.attn.c_attn.weight" in message
    assert "(32, 95)" in message and "(32, 96)" in message
    state = dict(model.state_dict())
    state["transformer.ln_f.bias"] = torch.zeros(31)
    with pytest.raises(ValueError, match=r"transformer.ln_f.bias has shape \(31,\).*\(32,\)"):
        llmc.write(tmp_path / "m.bin", state, model.config)
