"""TransformerLens 4's TransformerBridge boots from our model offline: same logits, same hook values
and the same head ablation as when it boots from transformers' GPT-2 with the same weights.

Booting swaps the model's blocks for TransformerLens' hooked components in place (it does so to
transformers' models too), so our own inspect runs on an untouched copy."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers import hf_twin, max_diff, randomize, tiny_config
from tests.ecosystem.test_bridge import char_hf_tokenizer

from gpt2attn import GPT2LMHeadModel, inspect

tl_bridge = pytest.importorskip(
    "transformer_lens.model_bridge", reason="transformer-lens 4 is not installed (pip install -e '.[ecosystem]')"
)


@pytest.fixture(scope="module")
def bridges():
    """Both bridges, booted with no hub access: the config comes from the model, the tokenizer is ours."""
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    tok = char_hf_tokenizer()
    ours = randomize(GPT2LMHeadModel(tiny_config(vocab_size=len(tok)))).eval()
    hf = hf_twin(ours).eval()
    plain = copy.deepcopy(ours)
    boot = tl_bridge.TransformerBridge.boot_transformers
    b_ours = boot("gpt2", hf_model=ours, tokenizer=tok, device="cpu")
    b_hf = boot("gpt2", hf_model=hf, tokenizer=char_hf_tokenizer(), device="cpu")  # a boot adjusts its tokenizer
    yield plain, ours, b_ours, b_hf
    mp.undo()


def tokens():
    return torch.tensor([char_hf_tokenizer()("to be, or not")["input_ids"]])


def test_bridge_wraps_our_model_and_matches_logits_and_every_hook(bridges):
    plain, ours, b_ours, b_hf = bridges
    assert b_ours.original_model is ours and type(ours) is GPT2LMHeadModel  # our model, booted in place
    x = tokens()
    logits, cache = b_ours.run_with_cache(x)
    hf_logits, hf_cache = b_hf.run_with_cache(x)
    assert max_diff(logits, plain(x).logits) < 1e-5
    assert max_diff(logits, hf_logits) < 1e-5
    assert set(cache.keys()) == set(hf_cache.keys())
    for name in ("blocks.0.attn.hook_pattern", "blocks.1.attn.hook_z", "blocks.1.hook_resid_post", "ln_final.hook_normalized"):
        assert name in cache.keys()
    worst = max(max_diff(cache[k], hf_cache[k]) for k in cache.keys())
    assert worst < 1e-5
    # TransformerLens' pattern is our attention-weights tap
    with inspect.capture(plain, layers=[0], names=["weights"]) as acts:
        plain(x)
    assert max_diff(cache["blocks.0.attn.hook_pattern"], acts["h.0.attn.weights"]) < 1e-6


def test_head_ablation_through_hooks_matches(bridges):
    plain, _, b_ours, b_hf = bridges
    x = tokens()

    def zero_head_2(z, hook):  # z: (B, T, nh, hs)
        z[:, :, 2] = 0.0
        return z

    hooks = [("blocks.1.attn.hook_z", zero_head_2)]
    got, want = b_ours.run_with_hooks(x, fwd_hooks=hooks), b_hf.run_with_hooks(x, fwd_hooks=hooks)
    assert max_diff(got, want) < 1e-5
    assert max_diff(got, plain(x).logits) > 1e-3  # the ablation changed something
    with inspect.edit(plain, "h.1.attn.weights", inspect.zero_head(2)):  # and equals our own ablation
        assert max_diff(got, plain(x).logits) < 1e-5
