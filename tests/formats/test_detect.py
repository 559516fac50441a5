"""Format detection and the load/save entry points of gpt2attn.formats (found by mutation testing):
which module reads a file or folder, the errors for paths no format reads (each naming the path and
what was expected), which module writes a destination by its suffix, the file named in errors about
the tensors, and save() passing its dtype and tokenizer through. OpenAI's TF folder is told from an
HF folder by its files; a pickled pytorch_model.bin from llm.c, an llm.c file by its magic. Expected
values come from the formats' documented suffixes and the files written here, not from the detection
code."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from gpt2attn import CheckpointError, GPT2LMHeadModel
from gpt2attn.formats import (detect_format, format_for_suffix, gguf, hf, llmc, nanogpt, openai_tf,
                              save, weights_file)
from gpt2attn.tokenizer import char_tokenizer, load_tokenizer
from tests.helpers import DATA, randomize, tiny_config

TF_TINY = DATA / "openai-tf-tiny"
LLMC_FP32 = DATA / "llmc" / "tiny_fp32.bin"


def model_of(**overrides) -> GPT2LMHeadModel:
    return randomize(GPT2LMHeadModel(tiny_config(**overrides))).eval()


# --- detect_format: which module reads a path -------------------------------------------------------


def test_each_format_is_detected_by_its_files(tmp_path):
    model = model_of()
    save(model, tmp_path / "m.gguf")
    save(model, tmp_path / "m.bin", dtype="fp32")
    save(model, tmp_path / "hf")
    torch.save(model.state_dict(), tmp_path / "ckpt.pt")
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")  # a zip: PyTorch's, not llm.c's
    assert detect_format(tmp_path / "m.gguf") is gguf
    assert detect_format(tmp_path / "m.bin") is llmc
    assert detect_format(str(tmp_path / "m.bin")) is llmc  # a str path as well as a Path
    assert detect_format(tmp_path / "hf") is hf
    assert detect_format(tmp_path / "ckpt.pt") is nanogpt
    assert detect_format(tmp_path / "pytorch_model.bin") is hf
    assert detect_format(TF_TINY) is openai_tf


def test_a_gguf_file_named_bin_is_read_as_gguf_not_llmc(tmp_path):
    """GGUF is asked first: its magic wins over llm.c's claim on any other .bin."""
    model = model_of()
    save(model, tmp_path / "m.gguf", dtype="f32")
    shutil.copy(tmp_path / "m.gguf", tmp_path / "weights.bin")
    assert detect_format(tmp_path / "weights.bin") is gguf
    back = GPT2LMHeadModel.from_pretrained(tmp_path / "weights.bin")
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


def test_a_missing_path_is_file_not_found_naming_it(tmp_path):
    path = tmp_path / "nowhere" / "model.bin"
    with pytest.raises(FileNotFoundError) as err:
        detect_format(path)
    assert str(path) in str(err.value) and "no such file or folder" in str(err.value)


def test_a_folder_without_a_model_says_what_it_expected(tmp_path):
    (tmp_path / "notes.txt").write_text("no model here")
    with pytest.raises(FileNotFoundError) as err:
        detect_format(tmp_path)
    message = str(err.value)
    assert str(tmp_path) in message and "no model found" in message
    assert "config.json" in message and "hparams.json" in message and "model.ckpt.index" in message


@pytest.mark.parametrize("data", [b"NOTGGUF!and more bytes after the first eight", b"abc"], ids=["long", "short"])
def test_a_gguf_suffix_on_other_content_shows_the_first_bytes(tmp_path, data):
    path = tmp_path / "model.gguf"
    path.write_bytes(data)
    with pytest.raises(CheckpointError) as err:
        detect_format(path)
    message = str(err.value)
    assert err.value.file == str(path) and message.startswith(f"{path}: ")
    assert "not a gguf file, despite its suffix" in message
    assert f"it starts with {data[:8]!r} " in message  # at most the first 8 bytes, as Python writes them
    if len(data) > 8:
        assert repr(data[:9]) not in message


def test_a_file_of_an_unknown_suffix_lists_the_suffixes_gpt2attn_reads(tmp_path):
    path = tmp_path / "model.txt"
    path.write_text("hello")
    with pytest.raises(CheckpointError) as err:
        detect_format(path)
    message = str(err.value)
    assert err.value.file == str(path)
    assert "not a model file gpt2attn reads (suffix '.txt'" in message
    # The suffixes of the formats' docstrings: HF's .safetensors/.bin/.pth, llm.c's .bin, GGUF's .gguf,
    # nanoGPT's .pt/.ckpt; each once, sorted; a folder is the last item.
    assert "it reads .bin, .ckpt, .gguf, .pt, .pth, .safetensors files and model folders" in message


def test_a_file_without_a_suffix_is_not_said_to_have_one(tmp_path):
    """A suffixless file is not an HF file "despite its suffix": HF folders have no suffix, files do."""
    path = tmp_path / "model"
    path.write_text("hello world")
    with pytest.raises(CheckpointError) as err:
        detect_format(path)
    assert str(err.value) == (f"{path}: not a model file gpt2attn reads (no suffix; it reads .bin, .ckpt, .gguf, "
                              ".pt, .pth, .safetensors files and model folders)")


# --- format_for_suffix and save: which module writes a destination --------------------------------


@pytest.mark.parametrize("name, fmt", [
    ("m.bin", llmc), ("m.gguf", gguf), ("folder", hf), ("out/model", hf), ("model.v2", hf),
])
def test_the_destination_suffix_picks_the_writer(tmp_path, name, fmt):
    assert format_for_suffix(tmp_path / name) is fmt
    assert format_for_suffix(str(tmp_path / name)) is fmt


@pytest.mark.parametrize("suffix", [".pt", ".ckpt"])
def test_a_read_only_suffix_is_refused_naming_the_writable_ones(tmp_path, suffix):
    path = tmp_path / f"model{suffix}"
    with pytest.raises(ValueError) as err:
        format_for_suffix(path)
    message = str(err.value)
    assert message.startswith(f"{path}: gpt2attn reads nanogpt files ({suffix}) but does not write them")
    # The writable formats' suffixes (GGUF's, llm.c's), in the registry's order, then a folder.
    assert message.endswith("; write .gguf, .bin or a folder (Hugging Face)")
    with pytest.raises(ValueError):
        save(model_of(), path)
    assert not path.exists()


def test_save_passes_dtype_and_tokenizer_to_the_writer(tmp_path):
    model = model_of()
    tokenizer = char_tokenizer("hello world")
    save(model, tmp_path / "hf", dtype=torch.float16, tokenizer=tokenizer)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "float16"
    back = GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    assert back.dtype == torch.float16
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor.to(torch.float16)), name
    loaded = load_tokenizer(tmp_path / "hf")
    assert loaded.get_vocab() == {ch: i for i, ch in enumerate(sorted(set("hello world")))}
    save(model, tmp_path / "m.bin", dtype="bf16")
    assert int.from_bytes((tmp_path / "m.bin").read_bytes()[4:8], "little") == 5  # llm.c's bf16 version
    assert GPT2LMHeadModel.from_pretrained(tmp_path / "m.bin").dtype == torch.bfloat16


def test_save_without_a_tokenizer_writes_none(tmp_path):
    save(model_of(), tmp_path / "hf")
    assert not (tmp_path / "hf" / "tokenizer.json").exists()


# --- weights_file: the file named in errors about the tensors --------------------------------------


def test_weights_file_is_the_formats_own_or_the_path(tmp_path):
    save(model_of(), tmp_path / "hf")
    assert weights_file(hf, tmp_path / "hf") == tmp_path / "hf" / "model.safetensors"
    assert weights_file(openai_tf, TF_TINY) == TF_TINY / "model.ckpt.index"
    assert weights_file(llmc, LLMC_FP32) == LLMC_FP32  # llm.c has no weights_file: the file itself


def test_a_tensor_error_in_a_tf_folder_names_its_index_file(tmp_path):
    folder = tmp_path / "tf"
    shutil.copytree(TF_TINY, folder)
    hparams = json.loads((folder / "hparams.json").read_text())
    (folder / "hparams.json").write_text(json.dumps({**hparams, "n_layer": hparams["n_layer"] - 1}))
    with pytest.raises(ValueError) as err:
        GPT2LMHeadModel.from_pretrained(folder)
    assert str(folder / "model.ckpt.index") in str(err.value)


# --- openai_tf.detect: OpenAI's folder, not an HF folder beside TF files -----------------------------


def test_openai_tf_is_a_folder_with_its_index_and_no_config_json(tmp_path):
    folder = tmp_path / "tf"
    shutil.copytree(TF_TINY, folder)
    assert openai_tf.detect(folder)
    assert not openai_tf.detect(folder / "model.ckpt.index")  # the index file itself is no model folder
    (folder / "config.json").write_text(json.dumps(tiny_config().to_dict()))
    assert not openai_tf.detect(folder)  # an HF folder that keeps TF files beside
    (folder / "config.json").unlink()
    (folder / "model.ckpt.index").rename(folder / "other.index")
    assert not openai_tf.detect(folder)


# ==================================================================================================
# Pickles and llm.c files told apart
#
# Telling a pickled pytorch_model.bin from llm.c, and an llm.c file by its magic whatever its suffix.
# ==================================================================================================


def assert_same_weights(a: GPT2LMHeadModel, b: GPT2LMHeadModel) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


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
