"""Behaviour of the model beyond parity: masks, caches, head_mask, init, dropout, config files, tracing."""

from __future__ import annotations

import json
import math

import pytest
import torch

from gpt2attn import GPT2Config, GPT2LMHeadModel, KVCache
from gpt2attn.layers import ACTIVATIONS
from tests.helpers import max_diff, randomize, tiny_config


@pytest.fixture(scope="module")
def model():
    return randomize(GPT2LMHeadModel(tiny_config()), seed=0).eval()


# Bad inputs and configs: tests/model/test_bad_inputs.py.


# --- masks and numerics ----------------------------------------------------------------


def test_rows_that_mask_everything_are_finite(model):
    x = torch.randint(0, 97, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, :5] = 0
    mask[1, :] = 0  # a row of nothing but padding
    out = model(x, attention_mask=mask, output_attentions=True)
    assert torch.isfinite(out.logits).all()
    assert all(torch.isfinite(w).all() for w in out.attentions)
    assert torch.isfinite(model(x, attention_mask=mask).logits).all()  # SDPA path too


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_at_full_context_has_no_inf_or_nan(dtype):
    m = randomize(GPT2LMHeadModel(tiny_config()), seed=1).eval().to(dtype)
    x = torch.randint(0, 97, (2, 32))  # n_positions tokens
    mask = torch.ones(2, 32, dtype=torch.long)
    mask[1, :20] = 0
    for kwargs in ({}, {"attention_mask": mask}, {"attention_mask": mask, "output_attentions": True}):
        out = m(x, **kwargs)
        assert out.logits.dtype == dtype
        assert torch.isfinite(out.logits).all(), kwargs


def test_4d_masks_bool_and_additive_equal_the_2d_mask(model):
    x = torch.randint(0, 97, (2, 6))
    mask2d = torch.ones(2, 6, dtype=torch.long)
    mask2d[0, :2] = 0
    expected = model(x, attention_mask=mask2d).logits
    allowed = torch.tril(torch.ones(6, 6, dtype=torch.bool)) & mask2d.bool()[:, None, None, :]
    allowed = allowed | ~allowed.any(-1, keepdim=True)
    additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    real = mask2d.bool()
    for mask4d in (allowed, additive):
        got = model(x, attention_mask=mask4d).logits
        assert max_diff(got[real], expected[real]) <= 1e-5


def test_position_ids_default_to_arange_not_the_mask(model):
    x = torch.randint(0, 97, (1, 6))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1]])
    default = model(x, attention_mask=mask).logits
    explicit = model(x, attention_mask=mask, position_ids=torch.arange(6)[None]).logits
    assert max_diff(default, explicit) == 0.0


def test_cache_grows_past_its_first_size_without_changing_results(model):
    x = torch.randint(0, 97, (1, 20))
    cache = KVCache(model.config.n_layer)
    pieces = [x[:, :3], x[:, 3:4], x[:, 4:11], x[:, 11:20]]
    logits = [model(p, past_key_values=cache).logits for p in pieces]
    assert cache.length == 20
    assert max_diff(torch.cat(logits, 1), model(x).logits) <= 1e-5


def test_preallocated_cache_is_written_in_place(model):
    x = torch.randint(0, 97, (1, 9))
    cache = KVCache.preallocate(2, 1, 4, 16, 8)
    buffer = cache.keys[0]
    model(x[:, :5], past_key_values=cache)
    model(x[:, 5:], past_key_values=cache)
    assert cache.keys[0] is buffer and cache.length == 9
    assert max_diff(cache[0][0], model(x).past_key_values[0][0]) <= 1e-6


# --- head_mask -------------------------------------------------------------------------


def test_head_mask_scales_a_heads_probabilities(model):
    """Scaling head h's attention probabilities by s is the same as scaling its values by s,
    which we can do independently by scaling that head's slice of c_attn's value columns."""
    x = torch.randint(0, 97, (2, 7))
    layer, head, s = 1, 2, 0.25
    head_mask = torch.ones(2, 4)
    head_mask[layer, head] = s
    got = model(x, head_mask=head_mask).logits

    scaled = randomize(GPT2LMHeadModel(tiny_config()), seed=0).eval()
    c_attn = scaled.transformer.h[layer].attn.c_attn
    cols = slice(2 * 32 + head * 8, 2 * 32 + (head + 1) * 8)  # v block, this head's 8 columns
    with torch.no_grad():
        c_attn.weight[:, cols] *= s
        c_attn.bias[cols] *= s
    assert max_diff(got, scaled(x).logits) <= 1e-5

    ones = model(x, head_mask=torch.ones(4)).logits  # [n_head] form, applied to every layer
    assert max_diff(ones, model(x).logits) <= 1e-5


# --- init, dropout, activations ----------------------------------------------------------


def test_init_follows_openai_scheme():
    cfg = GPT2Config(n_layer=6, n_embd=256, n_head=4, vocab_size=2000, n_positions=256)
    m = GPT2LMHeadModel(cfg)
    sd = m.state_dict()
    assert m.lm_head.weight is m.transformer.wte.weight
    for name, p in sd.items():
        if name.endswith("c_proj.weight"):
            assert abs(p.std().item() - 0.02 / math.sqrt(12)) < 0.1 * 0.02 / math.sqrt(12), name
        elif name.endswith(("attn.weight", "c_fc.weight", "wte.weight", "wpe.weight")):
            assert abs(p.std().item() - 0.02) < 0.002, name
            assert abs(p.mean().item()) < 0.002, name
        elif name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith(".bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
    untied = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=3000, tie_word_embeddings=False))
    assert untied.lm_head.weight is not untied.transformer.wte.weight
    assert abs(untied.lm_head.weight.std().item() - 0.02) < 0.002


def test_dropout_only_in_train_mode():
    m = GPT2LMHeadModel(tiny_config(resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2))
    x = torch.randint(0, 97, (2, 10))
    m.train()
    assert not torch.equal(m(x).logits, m(x).logits)
    assert not torch.equal(m(x, output_attentions=True).logits, m(x, output_attentions=True).logits)
    m.eval()
    assert torch.equal(m(x).logits, m(x).logits)


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activation_matches_transformers(name):
    from transformers.activations import ACT2FN

    x = torch.linspace(-6, 6, 1001)
    assert max_diff(ACTIVATIONS[name](x), ACT2FN[name](x)) <= 1e-6


def test_layers_can_be_swapped_for_identity():
    m = GPT2LMHeadModel(tiny_config(n_layer=1))
    m.transformer.h[0].ln_1 = torch.nn.Identity()
    m.transformer.h[0].ln_2 = torch.nn.Identity()
    m.transformer.ln_f = torch.nn.Identity()
    out = m(torch.randint(0, 97, (1, 5)), output_hidden_states=True)
    assert torch.equal(out.hidden_states[-1] @ m.transformer.wte.weight.T, out.logits)


# --- config ----------------------------------------------------------------------------


def test_config_round_trips_hf_dicts_and_files(tmp_path):
    import transformers

    hf = transformers.GPT2Config(n_embd=64, n_head=8, n_layer=3, activation_function="relu", summary_type="mean",
                                 finetuning_task="sst2")
    cfg = GPT2Config.from_dict(hf.to_dict())
    assert (cfg.n_embd, cfg.n_head, cfg.n_layer, cfg.activation_function, cfg.summary_type) == (64, 8, 3, "relu", "mean")
    assert cfg.extra["finetuning_task"] == "sst2"  # not a GPT-2 field, kept
    back = transformers.GPT2Config.from_dict(cfg.to_dict())
    for key in ("n_embd", "n_head", "n_layer", "activation_function", "summary_type", "vocab_size", "finetuning_task"):
        assert getattr(back, key) == getattr(hf, key), key
    aliased = GPT2Config.from_dict({"hidden_size": 48, "num_attention_heads": 6, "num_hidden_layers": 2, "max_position_embeddings": 64})
    assert (aliased.n_embd, aliased.n_head, aliased.n_layer, aliased.n_positions) == (48, 6, 2, 64)
    assert aliased.hidden_size == 48
    path = tmp_path / "config.json"
    cfg.to_json_file(path)
    assert GPT2Config.from_json_file(path).to_json_string() == cfg.to_json_string()
    assert json.loads(path.read_text())["model_type"] == "gpt2"
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind


@pytest.mark.parametrize("name, sizes", [("gpt2", (768, 12, 12)), ("gpt2-medium", (1024, 24, 16)), ("gpt2-large", (1280, 36, 20)), ("gpt2-xl", (1600, 48, 25))])
def test_presets_match_transformers_defaults_and_sizes(name, sizes):
    import transformers

    cfg = GPT2Config.from_preset(name)
    assert (cfg.n_embd, cfg.n_layer, cfg.n_head) == sizes
    hf_default = transformers.GPT2Config()
    for key in ("vocab_size", "n_positions", "activation_function", "layer_norm_epsilon", "initializer_range"):
        assert getattr(cfg, key) == getattr(hf_default, key)
    with torch.device("meta"):
        n_params = GPT2LMHeadModel(cfg).num_parameters()
    expected = {"gpt2": 124.4e6, "gpt2-medium": 354.8e6, "gpt2-large": 774.0e6, "gpt2-xl": 1557.6e6}[name]
    assert abs(n_params - expected) / expected < 0.002


def test_lm_head_inference_path_equals_linear():
    from gpt2attn.model import LMHead

    head = LMHead(48, 10000, bias=False)
    x = torch.randn(3, 5, 48)
    expected = torch.nn.functional.linear(x, head.weight)
    with torch.no_grad():
        got = head(x)  # sliced, transposed-into-place path
    assert got.shape == (3, 5, 10000) and got.is_contiguous()
    assert max_diff(got, expected) <= 1e-5
    assert max_diff(head(x), expected) == 0.0  # with autograd: plain nn.Linear


# --- tracing: input checks step aside, the forward is one graph --------------------------------


@pytest.mark.slow
def test_compile_fullgraph_has_no_graph_break(model):
    """torch.compile(fullgraph=True) fails on any graph break; the ids-range checks (.item())
    step aside while compiling. Prefill, a cached step, masks, labels and tuples all compile."""
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    x = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[0, :2] = 0
    with torch.no_grad():
        prefill, expected = compiled(x), model(x)
        assert max_diff(prefill.logits, expected.logits) <= 1e-5
        step = compiled(x[:, :1], past_key_values=prefill.past_key_values)
        assert max_diff(step.logits, model(x[:, :1], past_key_values=expected.past_key_values).logits) <= 1e-5
        padded = compiled(x, attention_mask=mask, labels=x, output_attentions=True, return_dict=False)
        reference = model(x, attention_mask=mask, labels=x, output_attentions=True, return_dict=False)
    assert type(padded) is tuple and all(max_diff(a, b) <= 1e-5 for a, b in zip(padded[:2], reference[:2]))


@pytest.mark.slow
def test_a_compiled_cached_step_with_a_symbolic_batch_size(model):
    """Called with a second batch size, torch.compile recompiles with the batch dimension symbolic:
    the cache's batch check must compare the sizes (it compared them by `in`, which dynamo, for two
    symbols, answered False: 'hold batch size 2, input has batch size 2')."""
    torch._dynamo.reset()  # sizes seen by earlier tests' compiles would make it symbolic at once
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    x = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        compiled(torch.randint(0, 97, (3, 6), generator=torch.Generator().manual_seed(7)))
        prefill, expected = compiled(x), model(x)
        step = compiled(x[:, :1], past_key_values=prefill.past_key_values)
        assert max_diff(step.logits, model(x[:, :1], past_key_values=expected.past_key_values).logits) <= 1e-5
        # still refused where the sizes differ (fullgraph raises it as dynamo's error, same message)
        with pytest.raises(Exception, match="past_key_values hold batch size 2, input has batch size 1"):
            compiled(x[:1, :1], past_key_values=prefill.past_key_values)
    torch._dynamo.reset()


def test_torch_export_of_the_forward(model):
    x = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(4))
    exported = torch.export.export(model, (x,), {"use_cache": False})
    y = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(5))  # other values, same shape
    assert max_diff(exported.module()(y, use_cache=False).logits, model(y).logits) <= 1e-5
