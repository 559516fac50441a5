"""Shared test helpers: tiny random configs, fully randomised weights, a transformers twin."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from gpt2attn import GPT2Config, GPT2LMHeadModel, GPT2Model

SHARED_DATA = Path(os.environ.get("GPT2ATTN_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


def shared_data(name: str) -> Path:
    """A folder of ../shared/data, or skip the test (a user's clone does not have it)."""
    path = SHARED_DATA / name
    if not path.exists():
        pytest.skip(f"{path} is absent: this test needs the project's shared data (../shared/data/{name})")
    return path


def tiny_config(**overrides) -> GPT2Config:
    """A 2-layer GPT-2 small enough for a test; dropout off so outputs are deterministic."""
    fields = dict(
        vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    fields.update(overrides)
    return GPT2Config(**fields)


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 0, std: float = 0.3) -> torch.nn.Module:
    """Give *every* parameter random values (LayerNorm gains near 1, biases non-zero), so a
    mapping or formula that differs anywhere shows up in the outputs."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g) * std
        if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
            p.copy_(1.0 + noise)
        else:
            p.copy_(noise)
    return model


def hf_twin(model: GPT2LMHeadModel | GPT2Model, attn_implementation: str = "eager"):
    """The transformers model of the same config with this model's weights."""
    import transformers

    hf_config = transformers.GPT2Config.from_dict(model.config.to_dict())
    hf_config._attn_implementation = attn_implementation
    cls = transformers.GPT2LMHeadModel if isinstance(model, GPT2LMHeadModel) else transformers.GPT2Model
    hf = cls(hf_config)
    hf.load_state_dict(model.state_dict(), strict=True)
    return hf.train(model.training)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().double() - b.detach().double()).abs().max().item()


def fake_hub_cache(cache, repo_id, model):
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<commit>/...}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    model.save_pretrained(repo / "snapshots" / commit)
    return repo / "snapshots" / commit


def mapped_ranges(path) -> list[tuple[int, int]]:
    """Address ranges where this process maps `path` (Linux /proc/self/maps)."""
    ranges = []
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith(str(path)):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            ranges.append((start, end))
    return ranges
