"""llm.c model files, checked against files and logits made by llm.c's own train_gpt2.py
(tests/data/llmc/README.md says how)."""

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
