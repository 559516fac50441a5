"""gpt2attn.decode_step (a whole decoding step in one C++ call) against its reference, the model's
own forward, in every precision quantize() offers; and generate() taking it exactly when it can.

The reference for each comparison is the same quantized model run through its modules (the
per-layer kernels), so the only difference is step.cpp: same weights, same rounding of them."""

import copy

import pytest
import torch

from gpt2attn import GPT2LMHeadModel
from gpt2attn import decode_step as D
from gpt2attn import kernels as K
from gpt2attn.cache import KVCache
from gpt2attn.quantize import DECODE_ROWS
from helpers import max_diff, randomize, tiny_config

needs_kernels = pytest.mark.skipif(not K.available(), reason="the CPU kernels cannot run on this machine")
MODES = ["fp32", "fp16", "bf16", "int8"]


def model_for(mode, **overrides):
    fields = dict(n_embd=64, n_head=4, vocab_size=203)  # int8 needs widths in blocks of 32
    fields.update(overrides)
    base = randomize(GPT2LMHeadModel(tiny_config(**fields)), seed=5, std=0.1).eval()
    return base.quantize(mode)


def both_ways(model, B, prompt_len=6, capacity=16):
    """(reference logits, step logits, reference cache, step cache) for one new token after a prompt."""
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (B, prompt_len + 1), generator=torch.Generator().manual_seed(B))
    caches = [KVCache.preallocate(cfg.n_layer, B, cfg.n_head, capacity, cfg.n_embd // cfg.n_head) for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            model(ids[:, :prompt_len], cache=cache)
        expected = model(ids[:, prompt_len:], cache=caches[0]).logits[:, -1]
        step = D.DecodeStep(model)
        assert step.usable(ids[:, prompt_len:], caches[1])
        got = step(ids[:, prompt_len:], caches[1])
    return expected, got, caches[0], caches[1]


@needs_kernels
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("B", [1, 3, DECODE_ROWS])
def test_step_equals_the_modules(mode, B):
    expected, got, ref_cache, cache = both_ways(model_for(mode), B)
    assert max_diff(got, expected) < 1e-5
    assert cache.length == ref_cache.length == 7
    assert max_diff(cache.block, ref_cache.block) < 1e-5  # the new keys and values, in place, nothing else


@needs_kernels
@pytest.mark.parametrize("mode", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("overrides", [
    dict(n_embd=36, n_head=3, n_inner=100, vocab_size=37),  # head size 12 and odd widths: every loop's tail
    dict(n_embd=40, n_head=4, n_inner=72, vocab_size=45),  # widths of 8 past a multiple of 16: AVX-512's tail
    dict(scale_attn_by_inverse_layer_idx=True, n_layer=3),
    dict(scale_attn_weights=False, activation_function="gelu_pytorch_tanh"),
])
def test_step_follows_the_config(mode, overrides):
    expected, got, ref_cache, cache = both_ways(model_for(mode, **overrides), 2)
    assert max_diff(got, expected) < 1e-5 and max_diff(cache.block, ref_cache.block) < 1e-5


@needs_kernels
@pytest.mark.parametrize("B", [1, 3])
def test_int8_step_with_odd_and_even_block_counts(B):
    # 96 inputs: 3 blocks of 32 (AVX-512 takes them two at a time, then one); 160: 5; 64 of the head: 2
    expected, got, ref_cache, cache = both_ways(model_for("int8", n_embd=96, n_head=4, n_inner=160), B)
    assert max_diff(got, expected) < 1e-5 and max_diff(cache.block, ref_cache.block) < 1e-5


@needs_kernels
def test_the_last_position_of_the_cache_and_of_the_model():
    model = model_for("fp32", n_positions=8)
    expected, got, _, _ = both_ways(model, 2, prompt_len=7, capacity=8)  # the new token takes position 7 of 8
    assert max_diff(got, expected) < 1e-5
    full = KVCache.preallocate(2, 1, 4, 8, 16)
    full.length = 8
    assert not D.DecodeStep(model).usable(torch.zeros(1, 1, dtype=torch.long), full)  # no room: the modules say why


@needs_kernels
@pytest.mark.parametrize("mode", MODES)
def test_generate_takes_the_step_and_keeps_its_tokens(mode, monkeypatch):
    model = model_for(mode)
    prompt = torch.randint(0, 203, (2, 5), generator=torch.Generator().manual_seed(9))
    watched = copy.deepcopy(model)
    watched.transformer.h[0].register_forward_hook(lambda *args: None)  # something watching: the modules run
    assert D.unfused_reason(watched) == "a forward hook on transformer.h.0"
    calls = []
    monkeypatch.setattr(D.DecodeStep, "__call__", lambda self, *a, f=D.DecodeStep.__call__: calls.append(1) or f(self, *a))
    for kwargs in (dict(do_sample=False), dict(num_beams=3), dict(do_sample=True, top_k=20)):
        torch.manual_seed(0)
        fused = model.generate(prompt, max_new_tokens=10, min_new_tokens=10, **kwargs)
        assert len(calls) >= 9
        calls.clear()
        torch.manual_seed(0)
        modules = watched.generate(prompt, max_new_tokens=10, min_new_tokens=10, **kwargs)
        assert not calls
        assert torch.equal(fused, modules), kwargs


@needs_kernels
def test_padded_prompts_and_token_types_take_the_modules(monkeypatch):
    model = model_for("int8")
    calls = []
    monkeypatch.setattr(D.DecodeStep, "__call__", lambda self, *a, f=D.DecodeStep.__call__: calls.append(1) or f(self, *a))
    ids = torch.randint(1, 203, (2, 5), generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    model.generate(ids, attention_mask=mask, max_new_tokens=4)
    model.generate(ids, token_type_ids=torch.zeros_like(ids), max_new_tokens=4)
    assert not calls
    model.generate(ids, max_new_tokens=4)
    assert calls


def test_unfused_reason_names_each_obstacle(monkeypatch):
    plain = randomize(GPT2LMHeadModel(tiny_config()), seed=1).eval()
    assert "not quantized" in D.unfused_reason(plain)
    model = copy.deepcopy(plain).quantize("fp32")
    monkeypatch.setattr(K, "available", lambda: False)
    assert D.unfused_reason(model) == "the kernels are not available here"
    monkeypatch.undo()
    if not K.available():
        pytest.skip("the CPU kernels cannot run on this machine")
    assert D.unfused_reason(model) is None
    assert "training mode" in D.unfused_reason(copy.deepcopy(model).train())
    relu = copy.deepcopy(plain)
    relu.config.activation_function = "relu"
    assert "activation_function 'relu'" in D.unfused_reason(relu.quantize("fp32"))
    tapped = copy.deepcopy(model)
    tapped.transformer.h[1].mlp.tap = lambda name, x: x
    assert D.unfused_reason(tapped) == "a tap on transformer.h.1.mlp"
    with pytest.raises(ValueError, match="DecodeStep: a tap on transformer.h.1.mlp"):
        D.DecodeStep(tapped)


@needs_kernels
def test_a_matrix_that_does_not_fit_is_refused_before_anything_runs():
    model = model_for("fp32")
    step = D.DecodeStep(model)
    step.layers[1].mlp_proj.N += 8  # wider than the residual stream: would write past its buffer
    cache = KVCache.preallocate(2, 1, 4, 16, 16)
    with pytest.raises(ValueError, match="do not fit"):
        step(torch.tensor([[3]]), cache)
    assert cache.length == 0 and not cache.block.any()
