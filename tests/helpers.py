"""Shared test helpers: tiny random configs, fully randomised weights, a transformers twin."""

from __future__ import annotations

import ctypes
import io
import logging
import os
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from gpt2attn import GPT2Config, GPT2LMHeadModel, GPT2Model

REPO = Path(__file__).resolve().parents[1]  # the checkout; tests import this package as `tests` from here
DATA = REPO / "tests" / "data"  # the small files the tests read (each folder's README.md says how it was made)
SHARED_DATA = Path(os.environ.get("GPT2ATTN_SHARED_DATA", REPO.parent / "shared" / "data"))


def shared_data(name: str) -> Path:
    """A folder of ../shared/data, or skip the test (a user's clone does not have it)."""
    path = SHARED_DATA / name
    if not path.exists():
        pytest.skip(f"{path} is absent: this test needs the project's shared data (../shared/data/{name})")
    return path


@contextmanager
def load_report(level: int | None = logging.WARNING):
    """What from_pretrained writes, while inside, to the logger transformers writes its loading report
    to. The handler sits on that logger itself (once transformers is imported, its loggers stop
    propagating at its root), and the logger takes `level` meanwhile, whatever verbosity another
    test left transformers at; None leaves transformers' verbosity in charge."""
    stream, logger = io.StringIO(), logging.getLogger("transformers.modeling_utils")
    handler, old_level = logging.StreamHandler(stream), logger.level
    logger.addHandler(handler)
    if level is not None:
        logger.setLevel(level)
    try:
        yield stream
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


@contextmanager
def num_threads(n: int):
    """torch (and so the kernels) on n threads inside the block, whatever the environment set."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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
    with open("/proc/self/maps") as maps:
        for line in maps:
            if line.rstrip().endswith(str(path)):
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                ranges.append((start, end))
    return ranges


# ---- gpt2attn explore: the models its pages are tested on, and the page's encoding read back ----

EXPLORE_TEXT = "To be, or not to be:\nthat is the question."


def char_model_folder(folder: Path, text: str = EXPLORE_TEXT, **config) -> Path:
    """A random tiny char-level model (n_embd 32) saved with its tokenizer.json."""
    from gpt2attn.tokenizer import char_tokenizer

    tok = char_tokenizer(text)
    model = randomize(GPT2LMHeadModel(tiny_config(vocab_size=tok.get_vocab_size(), n_positions=64, **config)), seed=3)
    model.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def hf_gpt2_folder(folder: Path) -> Path:
    """A random tiny transformers GPT2LMHeadModel saved with save_pretrained, with GPT-2's genuine
    tokenizer files beside it (skips without the shared data)."""
    import shutil

    import transformers

    tokenizer_files = shared_data("gpt2-tokenizer")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=50257, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(tokenizer_files / name, folder / name)
    return folder


def unpack_weights(blob: str, scale: int) -> torch.Tensor:
    """An explore page's packed weights back as floats: base64, zlib, low-byte then high-byte planes."""
    import base64
    import zlib

    raw = torch.frombuffer(bytearray(zlib.decompress(base64.b64decode(blob))), dtype=torch.uint8)
    low, high = raw.view(2, -1).long()
    return (low + 256 * high).double() / scale


def lower_triangle_rows(packed: torch.Tensor, T: int) -> list[torch.Tensor]:
    """Rows of a packed causal triangle: row i holds keys 0..i."""
    return [packed[i * (i + 1) // 2: (i + 1) * (i + 2) // 2] for i in range(T)]


@torch.no_grad()
def ablation_effects(model, ids: list[int], position: int) -> torch.Tensor:
    """(L, nh): change of log p(top token) at `position` with each head zeroed, one forward per head
    through inspect.edit, the way a user would compute it."""
    from gpt2attn import inspect

    x = torch.tensor([ids])
    clean = model(x).logits[0, position].log_softmax(-1)
    token = clean.argmax()
    effects = torch.zeros(model.config.n_layer, model.config.n_head)
    for layer in range(model.config.n_layer):
        for head in range(model.config.n_head):
            with inspect.edit(model, f"h.{layer}.attn.weights", inspect.zero_head(head)):
                effects[layer, head] = model(x).logits[0, position].log_softmax(-1)[token] - clean[token]
    return effects


def _kernels_available() -> bool:
    from gpt2attn import kernels

    return kernels.available()


needs_kernels = pytest.mark.skipif(not _kernels_available(), reason="the CPU kernels cannot run on this machine")


def kernel_build(flags: list[str]) -> object:
    """gpt2attn's CPU kernels built with these compiler flags (from the cache where built before), loaded."""
    from gpt2attn import kernels

    return kernels._bind(ctypes.CDLL(str(kernels.build(kernels.SOURCES, flags, []))))


@lru_cache(maxsize=None)
def kernel_builds() -> dict[str, object]:
    """Every build of gpt2attn's CPU kernels this CPU can run, by name ('avx2', 'avx512'), loaded;
    empty where the kernels cannot run here."""
    from gpt2attn import cpu, kernels

    if not kernels.available():
        return {}
    wide = [kernels.FLAGS + list(kernels.AVX512.values())] if set(kernels.AVX512) <= cpu.flags() else []
    return {name: kernel_build(flags + kernels.prefetch_flags())
            for name, flags in zip(("avx2", "avx512"), [kernels.FLAGS] + wide)}

