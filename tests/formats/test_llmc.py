"""llm.c model files (gpt2attn/formats/llmc.py), checked against files and logits made by llm.c's
own train_gpt2.py (tests/data/llmc/README.md says how); then (sections below) what a reader of a
damaged or hostile file sees, and the rules a written file keeps."""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

import pytest
import torch

from gpt2attn import CheckpointError, GPT2LMHeadModel
from gpt2attn.formats import detect_format, hf, llmc, save
from tests.helpers import DATA as TEST_DATA, mapped_ranges, randomize, tiny_config

DATA = TEST_DATA / "llmc"
FP32, BF16 = DATA / "tiny_fp32.bin", DATA / "tiny_bf16.bin"


def header_ints(path: Path) -> list[int]:
    return list(struct.unpack("<8i", path.read_bytes()[:32]))


@torch.no_grad()
def test_logits_equal_llmc_forward():
    expected = torch.load(DATA / "expected.pt", weights_only=True)
    model = GPT2LMHeadModel.from_pretrained(FP32)
    assert model.config.vocab_size == 50257 and model.config.n_positions == 64  # padded rows cut back to V
    assert model.lm_head.weight is model.transformer.wte.weight
    logits = model(expected["tokens"]).logits[..., expected["columns"]]
    assert (logits - expected["logits"]).abs().max() <= 1e-5


def test_bf16_file_holds_the_fp32_weights_rounded_to_bf16():
    fp32 = GPT2LMHeadModel.from_pretrained(FP32).state_dict()
    bf16 = GPT2LMHeadModel.from_pretrained(BF16).state_dict()
    assert all(bf16[name].dtype == torch.bfloat16 for name in bf16)
    for name, tensor in fp32.items():
        assert torch.equal(bf16[name], tensor.to(torch.bfloat16)), name


@pytest.mark.parametrize("src, dtype, expected", [(FP32, "fp32", FP32), (FP32, "bf16", BF16), (BF16, None, BF16)])
def test_writes_what_llmc_writes_byte_for_byte(tmp_path, src, dtype, expected):
    save(GPT2LMHeadModel.from_pretrained(src), tmp_path / "out.bin", dtype=dtype)
    assert (tmp_path / "out.bin").read_bytes() == expected.read_bytes()


def test_round_trip_is_exact_and_pads_the_vocabulary(tmp_path):
    model = randomize(GPT2LMHeadModel(tiny_config(vocab_size=100)))
    save(model, tmp_path / "m.bin")
    assert header_ints(tmp_path / "m.bin") == [20240326, 3, 32, 100, 2, 4, 32, 128]
    back = GPT2LMHeadModel.from_pretrained(tmp_path / "m.bin")
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    padded = torch.frombuffer(bytearray((tmp_path / "m.bin").read_bytes()[1024 : 1024 + 128 * 32 * 4]),
                              dtype=torch.float32).view(128, 32)
    assert torch.equal(padded[:100], model.transformer.wte.weight) and not padded[100:].any()


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc/self/maps")
def test_weights_are_views_of_the_mapped_file(tmp_path):
    shutil.copy(FP32, tmp_path / "m.bin")
    model = GPT2LMHeadModel.from_pretrained(tmp_path / "m.bin")
    ranges = mapped_ranges((tmp_path / "m.bin").resolve())
    assert ranges
    for name, p in model.named_parameters():
        assert any(start <= p.data_ptr() < end for start, end in ranges), name


def test_dtype_and_device_apply_while_loading():
    model = GPT2LMHeadModel.from_pretrained(BF16, dtype="float32", device="cpu")
    assert model.dtype == torch.float32


def test_llmc_bin_and_pytorch_bin_are_told_apart_by_content(tmp_path):
    torch.save(randomize(GPT2LMHeadModel(tiny_config())).state_dict(), tmp_path / "pytorch_model.bin")
    assert detect_format(tmp_path / "pytorch_model.bin") is hf
    assert detect_format(FP32) is llmc
    (tmp_path / "weights.data").write_bytes(FP32.read_bytes())  # the magic, whatever the name
    assert detect_format(tmp_path / "weights.data") is llmc


def spoil(tmp_path, edit) -> Path:
    data = bytearray(FP32.read_bytes())
    data = edit(data) or data
    path = tmp_path / "bad.bin"
    path.write_bytes(bytes(data))
    return path


def set_int(index: int, value: int):
    def edit(data: bytearray) -> None:
        data[4 * index : 4 * index + 4] = struct.pack("<i", value)
    return edit


@pytest.mark.parametrize("edit, fragment", [
    (lambda d: d[:-100], "truncated: the llm.c header's sizes"),
    (lambda d: d[:600], "truncated llm.c model file: 600 bytes"),
    (lambda d: d + b"\0" * 8, "the file has 3250952"),
    (set_int(0, 20240520), "magic (header[0]) is 20240520, expected 20240326"),
    (set_int(1, 4), "unsupported llm.c version (header[1]) 4"),
    (set_int(4, 3), "L=3"),
    (set_int(3, 50305), "V (header[3]) = 50305 is larger than the padded vocabulary Vp (header[7]) = 50304"),
    (set_int(6, 0), "C (header[6]) is 0, must be positive"),
    (set_int(5, 3), "C (header[6]) = 16 and H (header[5]) = 3"),
], ids=["truncated", "shorter-than-header", "too-long", "magic", "version", "L", "V>Vp", "C=0", "C%H"])
def test_bad_files_get_one_error_naming_file_and_field(tmp_path, edit, fragment):
    path = spoil(tmp_path, edit)
    with pytest.raises(ValueError) as err:
        GPT2LMHeadModel.from_pretrained(path)
    assert type(err.value) is CheckpointError  # ours (a ValueError), not one from deep inside
    assert str(path) in str(err.value) and fragment in str(err.value)


@pytest.mark.parametrize("change, fragment", [
    (dict(activation_function="gelu"), "activation_function 'gelu'"),
    (dict(n_inner=64), "n_inner 64"),
    (dict(layer_norm_epsilon=1e-6), "layer_norm_epsilon"),
    (dict(tie_word_embeddings=False), "lm_head.weight differs from wte"),
])
def test_a_model_llmc_cannot_run_is_refused_and_nothing_written(tmp_path, change, fragment):
    model = randomize(GPT2LMHeadModel(tiny_config(**change)))
    (tmp_path / "old.bin").write_bytes(b"old")
    for name in ("new.bin", "old.bin"):
        with pytest.raises(ValueError, match=fragment):
            save(model, tmp_path / name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.bin"]
    assert (tmp_path / "old.bin").read_bytes() == b"old"


def test_unknown_dtype_is_refused(tmp_path):
    with pytest.raises(ValueError, match="llm.c stores fp32 or bf16 tensors, not fp16"):
        save(GPT2LMHeadModel(tiny_config()), tmp_path / "m.bin", dtype="fp16")
    assert not (tmp_path / "m.bin").exists()


def test_convert_writes_llmc_by_suffix_and_reads_it_back(tmp_path, capsys):
    from gpt2attn.cli import main

    model = randomize(GPT2LMHeadModel(tiny_config()))
    model.save_pretrained(tmp_path / "hf")
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "m.bin"), "--dtype", "bf16"]) == 0
    assert header_ints(tmp_path / "m.bin")[:2] == [20240326, 5]
    back = GPT2LMHeadModel.from_pretrained(tmp_path / "m.bin")
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor.to(torch.bfloat16)), name
    assert main(["convert", str(FP32), str(tmp_path / "m.bin")]) == 2  # exists: needs --overwrite
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert main(["convert", str(FP32), str(tmp_path / "m.bin"), "--overwrite"]) == 0
    assert (tmp_path / "m.bin").read_bytes() == FP32.read_bytes()
    assert main(["convert", str(FP32), str(tmp_path / "folder")]) == 0  # no suffix: an HF folder
    assert (tmp_path / "folder" / "model.safetensors").is_file()
    assert main(["convert", str(FP32), str(tmp_path / "out.pt")]) == 2
    assert "reads nanogpt files (.pt) but does not write them" in capsys.readouterr().err


def table(out: str) -> dict[str, list[str]]:
    return {line[:10].strip(): line[10:].split() for line in out.splitlines()
            if line.startswith(("embedding", "layer ", "logits"))}


@torch.no_grad()
def test_parity_between_two_sources_shows_where_bf16_departs(tmp_path, capsys):
    from gpt2attn.cli import main

    assert main(["parity", str(FP32), str(BF16), "--tokens", "8", "--batch", "2"]) == 1
    out = capsys.readouterr().out
    rows = table(out)
    assert list(rows) == ["embedding", "layer 0", "layer 1", "logits"]
    assert all(row[-1] == "NO" for row in rows.values()) and out.rstrip().splitlines()[-1].startswith("FAIL")
    assert "dtype: A torch.float32, B torch.float32" in out  # the bf16 file upcast: its rounding alone
    tokens = torch.randint(0, 50257, (2, 8), generator=torch.Generator().manual_seed(0))
    a, b = (GPT2LMHeadModel.from_pretrained(p, dtype="float32")(tokens).logits for p in (FP32, BF16))
    assert float(rows["logits"][0]) == pytest.approx((a - b).abs().max().item(), rel=1e-3)
    # the same weights in another format: no departure at all; and B defaults to transformers
    assert main(["convert", str(FP32), str(tmp_path / "hf")]) == 0
    assert main(["parity", str(FP32), str(tmp_path / "hf")]) == 0
    out = capsys.readouterr().out
    assert all(float(row[0]) == 0 for row in table(out).values()) and "PASS" in out
    assert main(["parity", str(FP32)]) == 0
    assert "transformers loaded gpt2attn's loaded weights" in capsys.readouterr().out


def test_parity_refuses_two_different_models(tmp_path, capsys):
    from gpt2attn.cli import main

    randomize(GPT2LMHeadModel(tiny_config())).save_pretrained(tmp_path / "other")
    assert main(["parity", str(FP32), str(tmp_path / "other")]) == 2
    assert "are models of different sizes (vocab_size 50257 vs 97" in capsys.readouterr().err


# ==================================================================================================
# What a reader of a damaged or hostile file sees
#
# llm.c model files, the details a reader of a damaged or hostile file sees (found by mutation
# testing): the header's sizes read as signed little-endian int32, each held against gpt2attn's limit
# (docs/hostile-files.md's table), the length check's message, and the writer's refusal listing every
# problem it found. The expected sizes come from llm.c's layout (a 256-int32 header, then wte padded
# to Vp rows, wpe, 12 tensors per layer, ln_f) and from the model written here, not from the reader.
# ==================================================================================================


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


# ==================================================================================================
# The rules a written file keeps
#
# The rules a user sees, pinned by what a written file holds or what a loaded model is: llm.c's
# padded vocabulary, and what the writer accepts and refuses. The expected values come from llm.c's
# layout (formats/llmc.py's docstring) and the model written, never from our reader.
# ==================================================================================================


def assert_same_weights(a: GPT2LMHeadModel, b: GPT2LMHeadModel) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


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
