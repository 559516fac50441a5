"""llm.c model files, the details a reader of a damaged or hostile file sees (found by mutation
testing): the header's sizes read as signed little-endian int32, each held against gpt2attn's limit
(docs/hostile-files.md's table), the length check's message, and the writer's refusal listing every
problem it found. The expected sizes come from llm.c's layout (a 256-int32 header, then wte padded
to Vp rows, wpe, 12 tensors per layer, ln_f) and from the model written here, not from the reader."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch

from gpt2attn import CheckpointError, GPT2LMHeadModel
from gpt2attn.formats import llmc, save
from tests.helpers import randomize, tiny_config

HEADER = 256 * 4  # llm.c's header: 256 int32


def model_of(**overrides) -> GPT2LMHeadModel:
    return randomize(GPT2LMHeadModel(tiny_config(**overrides))).eval()


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[GPT2LMHeadModel, bytes]:
    """A tiny model (V=100, maxT=32, L=2, H=4, C=32) and the bytes of its fp32 llm.c file."""
    model = model_of(vocab_size=100)
    path = tmp_path_factory.mktemp("llmc") / "m.bin"
    save(model, path, dtype="fp32")
    return model, path.read_bytes()


def file_of(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "bad.bin"
    path.write_bytes(data)
    return path


def with_int(data: bytes, index: int, value: int) -> bytes:
    return data[: 4 * index] + struct.pack("<i", value) + data[4 * index + 4 :]


def load_error(path: Path) -> str:
    with pytest.raises(ValueError) as err:
        GPT2LMHeadModel.from_pretrained(path)
    assert type(err.value) is CheckpointError and err.value.file == str(path)
    return str(err.value)


def expected_length(model: GPT2LMHeadModel, padded_rows: int) -> int:
    """Header + every parameter once (the head is wte) + wte's zero rows up to Vp, as fp32."""
    values = sum(p.numel() for p in model.parameters()) + padded_rows * model.config.n_embd
    return HEADER + 4 * values


SIZES = "maxT=32, V=100, L=2, H=4, C=32, Vp=128, version 3"


def test_a_file_of_the_header_alone_is_held_to_its_sizes(tmp_path, written):
    """Exactly 1024 bytes is a whole header: the error is the sizes' (what they need), not 'shorter
    than the header', which is for 1023 bytes."""
    model, data = written
    needed = expected_length(model, 128 - 100)
    assert len(data) == needed
    path = file_of(tmp_path, data[:HEADER])
    message = load_error(path)
    assert message == f"{path}: truncated: the llm.c header's sizes ({SIZES}) need {needed} bytes, the file has {HEADER}"
    path = file_of(tmp_path, data[: HEADER - 1])
    assert load_error(path) == f"{path}: truncated llm.c model file: 1023 bytes, the header alone is 1024"


def test_a_file_longer_than_its_sizes_is_not_called_truncated(tmp_path, written):
    model, data = written
    path = file_of(tmp_path, data + bytes(4))
    message = load_error(path)
    assert message == f"{path}: the llm.c header's sizes ({SIZES}) need {len(data)} bytes, the file has {len(data) + 4}"


@pytest.mark.parametrize("index, field", [(2, "maxT"), (4, "L"), (5, "H"), (6, "C")])
def test_negative_sizes_are_read_as_signed_int32_and_refused(tmp_path, written, index, field):
    """llm.c's header is int32: 0xFFFFFFFF is -1 (not 4294967295, which would read as 'above the limit')."""
    path = file_of(tmp_path, with_int(written[1], index, -1))
    assert f"llm.c header field {field} (header[{index}]) is -1, must be positive" in load_error(path)


# gpt2attn's limits (docs/hostile-files.md): n_positions 2^20, vocab_size 2^21, n_layer 256,
# n_head 1024, n_embd 2^16; Vp up to 128 more than vocab_size's.
LIMITS = [(2, "maxT", 2**20), (3, "V", 2**21), (4, "L", 256), (5, "H", 1024), (6, "C", 2**16), (7, "Vp", 2**21 + 128)]


@pytest.mark.parametrize("index, field, limit", LIMITS, ids=[row[1] for row in LIMITS])
def test_each_size_is_held_to_its_limit_and_the_limit_itself_passes(tmp_path, written, index, field, limit):
    path = file_of(tmp_path, with_int(written[1], index, limit + 1))
    message = load_error(path)
    assert message.startswith(f"{path}: llm.c header field {field} (header[{index}]) is {limit + 1}, "
                              f"above gpt2attn's limit of {limit}")
    path = file_of(tmp_path, with_int(written[1], index, limit))
    message = load_error(path)  # still refused, by a later check (its divisibility, V <= Vp or its length)
    assert "above gpt2attn's limit" not in message


def test_the_writer_lists_every_problem_each_led_by_its_field(tmp_path):
    model = model_of(activation_function="gelu", n_inner=64, layer_norm_epsilon=1e-6, scale_attn_weights=False,
                     add_cross_attention=True, tie_word_embeddings=False)
    path = tmp_path / "m.bin"
    with pytest.raises(ValueError) as err:
        save(model, path)
    head = f"{path}: cannot write an llm.c file of this model: "
    message = str(err.value)
    assert message.startswith(head)
    problems = message[len(head) :].split("; ")
    leads = ["activation_function 'gelu' (", "n_inner 64 (", "layer_norm_epsilon 1e-06 (",
             "scale_attn_weights / scale_attn_by_inverse_layer_idx (", "add_cross_attention (",
             "lm_head.weight differs from wte ("]
    assert len(problems) == len(leads)
    for problem, lead in zip(problems, leads):
        assert problem.startswith(lead), (problem, lead)
    assert "4 * n_embd = 128" in problems[1]
    assert not path.exists()


def test_a_separate_lm_head_equal_to_wte_is_written_as_the_tied_head(tmp_path):
    """A state dict whose lm_head is a copy of wte (as loaded from a file that stores both) is the
    tied model llm.c runs: the same bytes as the tied model's file."""
    model = model_of()
    save(model, tmp_path / "tied.bin", dtype="fp32")
    state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    assert state["lm_head.weight"].data_ptr() != state["transformer.wte.weight"].data_ptr()
    llmc.write(tmp_path / "copy.bin", state, model.config, dtype="fp32")
    assert (tmp_path / "copy.bin").read_bytes() == (tmp_path / "tied.bin").read_bytes()
    state["lm_head.weight"][0, 0] += 1.0
    with pytest.raises(ValueError, match="lm_head.weight differs from wte"):
        llmc.write(tmp_path / "other.bin", state, model.config, dtype="fp32")


def test_a_vocabulary_of_one_token_pads_to_128_rows(tmp_path):
    model = model_of(vocab_size=1)
    path = tmp_path / "m.bin"
    save(model, path, dtype="fp32")
    assert struct.unpack("<8i", path.read_bytes()[:32])[3:8:4] == (1, 128)
    assert path.stat().st_size == expected_length(model, 127)
    back = GPT2LMHeadModel.from_pretrained(path)
    assert back.config.vocab_size == 1
    assert torch.equal(back.transformer.wte.weight, model.transformer.wte.weight)


def test_a_wrong_shape_outside_the_linears_is_named_as_stored(tmp_path):
    """Only the linear weights are reported in Conv1D's (in, out) orientation; wpe (n_positions,
    n_embd) is reported as it is stored, not transposed."""
    model = model_of(n_positions=16)
    state = dict(model.state_dict())
    state["transformer.wpe.weight"] = torch.zeros(15, 32)
    with pytest.raises(ValueError) as err:
        llmc.write(tmp_path / "m.bin", state, model.config)
    message = str(err.value)
    assert message.startswith(f"{tmp_path / 'm.bin'}: cannot write an llm.c file: ")
    assert message.endswith("transformer.wpe.weight has shape (15, 32), the config asks for (16, 32)")
    assert not (tmp_path / "m.bin").exists()


@pytest.mark.parametrize("shape", [(100, 31), (99, 32), (128, 32)])
def test_a_wrong_wte_is_named_with_the_unpadded_shape_the_caller_must_give(tmp_path, shape):
    """wte is padded to a multiple of 128 rows in the file, but the state dict holds vocab_size rows:
    the error names that shape (not the padded one), whatever the width, before anything is written."""
    model = model_of(vocab_size=100)
    state = dict(model.state_dict())
    state["transformer.wte.weight"] = state["lm_head.weight"] = torch.zeros(shape)
    with pytest.raises(ValueError) as err:
        llmc.write(tmp_path / "m.bin", state, model.config)
    assert str(err.value) == (f"{tmp_path / 'm.bin'}: cannot write an llm.c file: transformer.wte.weight has shape "
                              f"{shape}, the config asks for (100, 32)")
    assert not (tmp_path / "m.bin").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: a state dict on the GPU")
def test_a_model_on_the_gpu_is_written_as_on_the_cpu(tmp_path):
    """The writer copies each tensor to the CPU itself: a CUDA model's file is the CPU model's, byte for byte."""
    model = model_of()
    save(model, tmp_path / "cpu.bin", dtype="fp32")
    save(model.to("cuda"), tmp_path / "gpu.bin", dtype="fp32")
    assert (tmp_path / "gpu.bin").read_bytes() == (tmp_path / "cpu.bin").read_bytes()
