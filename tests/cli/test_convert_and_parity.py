"""`gpt2attn convert` and `gpt2attn parity`, run in-process through gpt2attn.cli.main."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from gpt2attn import GPT2LMHeadModel
from gpt2attn.cli import main
from gpt2attn.layers import MLP
from tests.helpers import DATA, randomize, shared_data, tiny_config

TF_TINY = DATA / "openai-tf-tiny"


def safetensors_dtypes(path: Path) -> set[str]:
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8 : 8 + header_len])
    return {info["dtype"] for name, info in header.items() if name != "__metadata__"}


@torch.no_grad()
def test_convert_tf_checkpoint_for_transformers(tmp_path, capsys):
    src = tmp_path / "tf"
    shutil.copytree(TF_TINY, src)
    (src / "encoder.json").write_text('{"a": 0}')  # OpenAI's tokenizer file names
    (src / "vocab.bpe").write_text("#version: 0.2\n")
    assert main(["convert", str(src), str(tmp_path / "hf")]) == 0
    assert "29,184 parameters" in capsys.readouterr().out
    assert (tmp_path / "hf" / "vocab.json").read_text() == '{"a": 0}'
    assert (tmp_path / "hf" / "merges.txt").read_text() == "#version: 0.2\n"
    expected = np.load(TF_TINY / "expected.npz")
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    logits = hf(torch.from_numpy(expected["tokens"]).long()).logits
    np.testing.assert_allclose(logits.numpy(), expected["logits"], atol=1e-5, rtol=0)


def test_convert_to_bf16_and_shards(tmp_path):
    assert main(["convert", str(TF_TINY), str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    assert safetensors_dtypes(tmp_path / "bf16" / "model.safetensors") == {"BF16"}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert main(["convert", str(tmp_path / "bf16"), str(tmp_path / "sharded"), "--max-shard-size", "20KB"]) == 0
    assert len(list((tmp_path / "sharded").glob("model-*-of-*.safetensors"))) > 1
    original = GPT2LMHeadModel.from_pretrained(tmp_path / "bf16")
    resharded = GPT2LMHeadModel.from_pretrained(tmp_path / "sharded")
    for (name, a), b in zip(original.state_dict().items(), resharded.state_dict().values()):
        assert torch.equal(a, b), name


def test_convert_reports_a_missing_source(tmp_path, capsys):
    assert main(["convert", str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2
    assert "gpt2attn convert: error:" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def hf_folder(tmp_path: Path) -> Path:
    model = randomize(GPT2LMHeadModel(tiny_config()), seed=3)
    model.save_pretrained(tmp_path / "model")
    return tmp_path / "model"


def test_parity_passes_for_a_faithful_checkpoint(tmp_path, capsys):
    folder = hf_folder(tmp_path)
    assert main(["parity", str(folder), "--tokens", "9"]) == 0
    out = capsys.readouterr().out
    assert f"transformers loaded {folder} itself" in out
    assert "layer 0" in out and "layer 1" in out and "logits" in out
    assert "greedy next-token agreement: 100.0%" in out
    assert out.rstrip().splitlines()[-1].startswith("PASS")


def test_parity_fails_when_our_model_drifts(tmp_path, capsys, monkeypatch):
    folder = hf_folder(tmp_path)
    real_forward = MLP.forward
    monkeypatch.setattr(MLP, "forward", lambda self, x: real_forward(self, x) + 0.01)
    assert main(["parity", str(folder)]) == 1
    out = capsys.readouterr().out
    layer0 = next(line for line in out.splitlines() if line.startswith("layer 0"))
    assert layer0.endswith("NO")
    assert float(layer0.split()[2]) == pytest.approx(0.01, rel=1e-3)  # the drift we injected
    assert out.rstrip().splitlines()[-1].startswith("FAIL")


def test_parity_tf_checkpoint_in_bf16(capsys):
    assert main(["parity", str(TF_TINY), "--dtype", "bf16", "--batch", "1"]) == 0
    out = capsys.readouterr().out
    assert "gpt2attn's loaded weights" in out
    assert "dtype: gpt2attn torch.bfloat16, transformers torch.bfloat16" in out


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_precision_parity_catches_a_5_percent_attention_scale(tmp_path, capsys, monkeypatch, dtype):
    """In bf16/fp16 the allowed error is tied to transformers' own rounding error (vs float32 on
    the same weights): a faithful model passes, one whose attention scale is 5% off fails."""
    folder = hf_folder(tmp_path)
    assert main(["parity", str(folder), "--dtype", dtype]) == 0
    assert "1.5x transformers' own error" in capsys.readouterr().out

    load = GPT2LMHeadModel.from_pretrained.__func__

    def with_scale_off(cls, *args, **kwargs):
        model = load(cls, *args, **kwargs)
        for block in model.transformer.h:
            block.attn.scale *= 1.05
        return model

    monkeypatch.setattr(GPT2LMHeadModel, "from_pretrained", classmethod(with_scale_off))
    assert main(["parity", str(folder), "--dtype", dtype]) == 1
    out = capsys.readouterr().out
    assert next(line for line in out.splitlines() if line.startswith("layer 0")).endswith("NO")
    assert out.rstrip().splitlines()[-1].startswith("FAIL")


def test_parity_text_without_tokenizer_is_a_clear_error(tmp_path, capsys):
    folder = hf_folder(tmp_path)
    assert main(["parity", str(folder), "--text", "Hello world"]) == 2
    assert "--text needs tokenizer files" in capsys.readouterr().err


def test_parity_text_with_tokenizer(tmp_path, capsys):
    tokenizer = shared_data("gpt2-tokenizer")
    model = randomize(GPT2LMHeadModel(tiny_config(vocab_size=50257, n_embd=16, n_head=2)), seed=4)
    model.save_pretrained(tmp_path / "model")
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(tokenizer / name, tmp_path / "model" / name)
    assert main(["parity", str(tmp_path / "model"), "--text", "Hello world"]) == 0
    assert "2 tokens of --text" in capsys.readouterr().out  # "Hello world" -> [15496, 995]


def test_parity_without_transformers_says_so(tmp_path, capsys, monkeypatch):
    folder = hf_folder(tmp_path)
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    assert main(["parity", str(folder)]) == 2
    assert "pip install transformers" in capsys.readouterr().err
