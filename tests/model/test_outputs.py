"""Output objects behave as transformers' ModelOutput: attributes, keys, indices, pytree nodes."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.utils._pytree as pytree
import transformers

from gpt2attn import GPT2LMHeadModel
from gpt2attn.cache import KVCache
from gpt2attn.outputs import CausalLMOutput
from tests.helpers import hf_twin, randomize, tiny_config


@pytest.fixture(scope="module")
def models():
    ours = randomize(GPT2LMHeadModel(tiny_config())).eval()
    return ours, hf_twin(ours)


def test_keys_indices_and_tuples_follow_transformers(models):
    ours, theirs = models
    ids = torch.randint(0, ours.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    for kwargs in ({}, {"labels": ids}, {"output_attentions": True, "output_hidden_states": True}):
        a, b = ours(ids, **kwargs), theirs(ids, **kwargs)
        assert list(a.keys()) == list(b.keys())
        assert len(a.to_tuple()) == len(b.to_tuple()) == len(a)
        torch.testing.assert_close(a[0], b[0], rtol=0, atol=1e-5)  # loss with labels, else logits
        torch.testing.assert_close(a["logits"], b["logits"], rtol=0, atol=1e-5)
        assert a[:2][1] is a.to_tuple()[1]
        assert dict(a.items()).keys() == set(a)


def test_setting_a_field_updates_the_mapping():
    logits = torch.zeros(1, 2, 3)
    out = CausalLMOutput(logits=logits)
    assert list(out) == ["logits"] and out[0] is logits
    out.loss = torch.tensor(2.0)
    assert list(out) == ["loss", "logits"] and out[0].item() == 2.0  # field order, not insertion order
    out["loss"] = None
    assert list(out) == ["logits"]
    with pytest.raises(KeyError, match="no field 'logit'"):
        out["logit"] = logits
    with pytest.raises(KeyError):
        out["loss"]  # unset fields are not keys, as in transformers


def test_built_from_a_mapping_as_libraries_rebuild_them():
    logits = torch.ones(1, 1, 4)
    out = CausalLMOutput({"logits": logits})  # accelerate's type(x)({k: v ...})
    assert out.logits is logits and list(out) == ["logits"]
    with pytest.raises(TypeError, match="no field"):
        CausalLMOutput({"nope": logits})


def test_outputs_and_cache_are_pytree_nodes(models):
    ours, _ = models
    ids = torch.randint(0, ours.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1))
    out = ours(ids, labels=ids)
    leaves, spec = pytree.tree_flatten(out)
    n_layer = ours.config.n_layer
    assert len(leaves) == 2 + 2 * n_layer  # loss, logits, then each layer's key and value
    doubled = pytree.tree_unflatten([t * 2 for t in leaves], spec)
    assert type(doubled) is CausalLMOutput and isinstance(doubled.past_key_values, KVCache)
    assert doubled.past_key_values.length == out.past_key_values.length == 5
    torch.testing.assert_close(doubled.logits, out.logits * 2)
    torch.testing.assert_close(doubled.past_key_values[1][0], out.past_key_values[1][0] * 2)


def test_outputs_pickle(models):
    ours, _ = models
    with torch.no_grad():
        out = ours(torch.tensor([[1, 2, 3]]))
    back = pickle.loads(pickle.dumps(out))
    assert list(back) == list(out)
    torch.testing.assert_close(back.logits, out.logits)
    assert isinstance(out, dict) and isinstance(transformers.modeling_outputs.CausalLMOutput(), dict)


def test_cache_takes_both_names_as_transformers_5_24_and_earlier(models):
    """transformers 5.24 renamed `past_key_values` to `cache`; code written with either name runs."""
    ours, theirs = models
    ids = torch.randint(0, ours.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(3))
    first = ours(ids[:, :5])
    assert first.past_key_values is first.cache and first["past_key_values"] is first["cache"]
    full = theirs(ids).logits[:, 5:]
    for name in ("cache", "past_key_values"):
        past = ours(ids[:, :5]).cache
        step = ours(ids[:, 5:], **{name: past}).logits
        torch.testing.assert_close(step, full, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="not both"):
        ours(ids[:, 5:], cache=first.cache, past_key_values=first.cache)
    generated = ours.generate(ids[:, :5], cache=ours(ids[:, :4]).cache, max_new_tokens=3, do_sample=False)
    torch.testing.assert_close(generated, ours.generate(ids[:, :5], max_new_tokens=3, do_sample=False))
