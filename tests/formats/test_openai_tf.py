"""OpenAI's TF checkpoint format, read without TensorFlow, against the logits OpenAI's code made.

tests/data/openai-tf-tiny is a copy of ../shared/data/openai-tf-tiny (see its README.md): a
TF-written checkpoint with random weights and expected.npz from OpenAI's own model code.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from gpt2attn import GPT2LMHeadModel, GPT2Model
from gpt2attn.formats.tf_checkpoint import crc32c, gpt2_name, masked_crc32c, parse_proto, read_bundle, read_sstable
from tests import fuzzing
from tests.helpers import DATA

TF_TINY = DATA / "openai-tf-tiny"


@pytest.fixture(scope="module")
def expected():
    return dict(np.load(TF_TINY / "expected.npz"))


def bitwise_crc32c(data: bytes) -> int:
    """The textbook one-bit-at-a-time CRC-32C (reflected polynomial 0x82F63B78)."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def test_crc32c_matches_the_textbook_definition():
    assert crc32c(b"123456789") == 0xE3069283  # the standard check value of CRC-32C
    rng = np.random.default_rng(0)
    for n in (0, 1, 63, 64, 1000, 70001):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert crc32c(data) == bitwise_crc32c(data), n


def test_bundle_entries_have_openai_names_and_shapes():
    tensors = read_bundle(TF_TINY / "model.ckpt")
    assert tensors["model/wte"].shape == (100, 32)
    assert tensors["model/h1/attn/c_attn/w"].shape == (1, 32, 96)
    assert tensors["model/h0/mlp/c_proj/b"].shape == (32,)
    assert len(tensors) == 2 + 2 * 12 + 2
    assert gpt2_name("model/h1/attn/c_attn/w") == "transformer.h.1.attn.c_attn.weight"
    assert gpt2_name("model/ln_f/g") == "transformer.ln_f.weight"
    assert gpt2_name("model/h0/ln_2/b") == "transformer.h.0.ln_2.bias"


@torch.no_grad()
def test_logits_match_openai(expected):
    model = GPT2LMHeadModel.from_pretrained(TF_TINY)
    assert (model.config.vocab_size, model.config.n_positions, model.config.n_head) == (100, 16, 4)
    assert model.lm_head.weight is model.transformer.wte.weight
    logits = model(torch.from_numpy(expected["tokens"]).long()).logits
    np.testing.assert_allclose(logits.numpy(), expected["logits"], atol=1e-5, rtol=0)
    base = GPT2Model.from_pretrained(TF_TINY)
    assert set(base.state_dict()) == {k.removeprefix("transformer.") for k in model.transformer.state_dict()}


def cache_as_present(cache, start: int = 0) -> np.ndarray:
    """Our cache, layers of (B, nh, T, hs) keys/values -> OpenAI's [B, layer, k/v, nh, T, hs]."""
    layers = [torch.stack([k[:, :, start:], v[:, :, start:]], dim=1) for k, v in cache]  # (B, 2, nh, T, hs)
    return torch.stack(layers, dim=1).numpy()


@torch.no_grad()
def test_two_step_run_through_our_cache_matches_past_and_present(expected):
    model = GPT2LMHeadModel.from_pretrained(TF_TINY)
    tokens = torch.from_numpy(expected["tokens"]).long()
    first = model(tokens[:, :8], use_cache=True)
    np.testing.assert_allclose(first.logits.numpy(), expected["first_logits"], atol=1e-5, rtol=0)
    np.testing.assert_allclose(cache_as_present(first.past_key_values), expected["present"][..., :8, :], atol=1e-5, rtol=0)
    second = model(tokens[:, 8:], past_key_values=first.past_key_values, use_cache=True)
    np.testing.assert_allclose(second.logits.numpy(), expected["second_logits"], atol=1e-5, rtol=0)
    np.testing.assert_allclose(cache_as_present(second.past_key_values, start=8), expected["second_present"], atol=1e-5, rtol=0)
    np.testing.assert_allclose(cache_as_present(second.past_key_values), expected["present"], atol=1e-5, rtol=0)


def copy_fixture(tmp_path: Path) -> Path:
    folder = tmp_path / "tf"
    shutil.copytree(TF_TINY, folder)
    return folder


def test_corrupt_data_shard_fails_its_checksum(tmp_path):
    folder = copy_fixture(tmp_path)
    data_path = folder / "model.ckpt.data-00000-of-00001"
    data = bytearray(data_path.read_bytes())
    data[len(data) // 2] ^= 0x40
    data_path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"model\.ckpt\.data-00000-of-00001: corrupt: tensor model/\S+ fails its crc32c"):
        GPT2LMHeadModel.from_pretrained(folder)


def test_truncated_data_shard_is_named(tmp_path):
    folder = copy_fixture(tmp_path)
    data_path = folder / "model.ckpt.data-00000-of-00001"
    data_path.write_bytes(data_path.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"data-00000-of-00001: truncated: tensor model/\S+ ends at byte"):
        GPT2LMHeadModel.from_pretrained(folder)


def test_corrupt_or_truncated_index_is_refused(tmp_path):
    folder = copy_fixture(tmp_path)
    index_path = folder / "model.ckpt.index"
    original = index_path.read_bytes()
    damaged = bytearray(original)
    damaged[20] ^= 0x01
    index_path.write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match=r"model\.ckpt\.index: corrupt: block at byte 0 fails its crc32c"):
        GPT2LMHeadModel.from_pretrained(folder)
    index_path.write_bytes(original[:-10])
    with pytest.raises(ValueError, match=r"model\.ckpt\.index: not a TF checkpoint index"):
        GPT2LMHeadModel.from_pretrained(folder)


def test_missing_data_shard_is_named(tmp_path):
    folder = copy_fixture(tmp_path)
    (folder / "model.ckpt.data-00000-of-00001").unlink()
    with pytest.raises(FileNotFoundError, match="data shard model.ckpt.data-00000-of-00001"):
        GPT2LMHeadModel.from_pretrained(folder)


@torch.no_grad()
def test_tf_checkpoint_converts_to_a_folder_transformers_opens(tmp_path, expected):
    transformers = pytest.importorskip("transformers")
    GPT2LMHeadModel.from_pretrained(TF_TINY).save_pretrained(tmp_path)
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    logits = hf(torch.from_numpy(expected["tokens"]).long()).logits
    np.testing.assert_allclose(logits.numpy(), expected["logits"], atol=1e-5, rtol=0)


def test_an_empty_data_shard_of_empty_tensors_reads_under_warnings_as_errors(tmp_path):
    """An empty shard is no map (its bytes are b"", read-only): its tensors' pages are not given
    back, since there are none, and nothing warns (a read-only array handed to torch would)."""
    folder = copy_fixture(tmp_path)
    index = folder / "model.ckpt.index"
    entries = read_sstable(index)
    fields = parse_proto(entries[b"model/ln_f/g"])
    fields[2] = [fuzzing.encode_proto({2: [fuzzing.encode_proto({1: [0]})]})]  # shape [0]
    fields[4], fields[5], fields[6] = [0], [0], [masked_crc32c(b"")]  # offset, size, crc32c
    fuzzing.write_sstable(index, {b"": entries[b""], b"model/ln_f/g": fuzzing.encode_proto(fields)})
    (folder / "model.ckpt.data-00000-of-00001").write_bytes(b"")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tensors = read_bundle(folder / "model.ckpt")
    assert list(tensors) == ["model/ln_f/g"] and tensors["model/ln_f/g"].shape == (0,)
