"""Cross-attention (add_cross_attention=True) against transformers on the same random weights:
names and shapes, logits and weights with an encoder padding mask, with and without the cache."""

from __future__ import annotations

import pytest
import torch

from gpt2attn import GPT2LMHeadModel, GPT2Model
from gpt2attn.cache import KVCache
from tests.helpers import hf_twin, max_diff, randomize, tiny_config

B, T, T_ENC = 2, 6, 5


@pytest.fixture(scope="module")
def models():
    ours = randomize(GPT2LMHeadModel(tiny_config(add_cross_attention=True)), 7).eval()
    return ours, hf_twin(ours)


def inputs(seed=0):
    """Decoder ids, encoder states, and an encoder mask that pads the last two positions of row 1."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (B, T), generator=g)
    enc = torch.randn(B, T_ENC, 32, generator=g)
    enc_mask = torch.ones(B, T_ENC, dtype=torch.long)
    enc_mask[1, -2:] = 0
    return ids, enc, enc_mask


def test_names_and_shapes_are_transformers():
    import transformers

    ours = GPT2Model(tiny_config(add_cross_attention=True))
    hf = transformers.GPT2Model(transformers.GPT2Config.from_dict(ours.config.to_dict()))
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in hf.state_dict().items()}
    block = ours.h[0]
    assert block.crossattention.q_attn.weight.shape == (32, 32)
    assert block.crossattention.c_attn.weight.shape == (32, 64)  # keys and values only
    assert not hasattr(block.attn, "q_attn") and not hasattr(GPT2Model(tiny_config()).h[0], "crossattention")


@pytest.mark.parametrize("mask", [True, False], ids=["encoder_mask", "no_mask"])
def test_parity_logits_weights_and_gradients(models, mask):
    ours, hf = models
    ids, enc, enc_mask = inputs()
    kwargs = dict(encoder_hidden_states=enc, encoder_attention_mask=enc_mask if mask else None, labels=ids)
    a = ours(ids, output_attentions=True, **kwargs)
    b = hf(ids, output_attentions=True, **kwargs)
    assert max_diff(a.logits, b.logits) < 1e-5 and max_diff(a.loss, b.loss) < 1e-5
    assert len(a.cross_attentions) == len(b.cross_attentions) == 2
    for x, y in zip(a.cross_attentions, b.cross_attentions):
        assert x.shape == (B, 4, T, T_ENC) and max_diff(x, y) < 1e-5
    if mask:
        assert a.cross_attentions[0][1, :, :, -2:].abs().max() == 0  # padded encoder positions get no weight
    # Gradients on the fused path (no weights asked for), into the encoder states too.
    ours.zero_grad(), hf.zero_grad()
    enc_a, enc_b = enc.clone().requires_grad_(), enc.clone().requires_grad_()
    ours(ids, **{**kwargs, "encoder_hidden_states": enc_a}).loss.backward()
    hf(ids, **{**kwargs, "encoder_hidden_states": enc_b}).loss.backward()
    theirs = dict(hf.named_parameters())
    assert max(max_diff(p.grad, theirs[n].grad) for n, p in ours.named_parameters()) < 1e-5
    assert max_diff(enc_a.grad, enc_b.grad) < 1e-5


@torch.no_grad()
def test_an_encoder_row_of_padding_alone_as_transformers_on_each_backend(models):
    """A decoder row whose encoder positions are all padding: with the weights asked for (the
    textbook formula, transformers' eager) it attends to every one of them alike (the dtype's lowest
    value is added, not -inf: no NaN); with PyTorch's kernel (transformers' sdpa) it gets nothing."""
    ours, hf = models
    ids, enc, enc_mask = inputs()
    enc_mask[1] = 0
    kwargs = dict(encoder_hidden_states=enc, encoder_attention_mask=enc_mask, output_attentions=True)
    a, b = ours(ids, **kwargs), hf(ids, **kwargs)
    assert max_diff(a.logits, b.logits) < 1e-5
    for x, y in zip(a.cross_attentions, b.cross_attentions):
        assert max_diff(x, y) < 1e-5
        assert max_diff(x[1], torch.full_like(x[1], 1 / T_ENC)) < 1e-6
    # without the weights ("sdpa"): that row gets nothing from cross-attention, as transformers' sdpa gives it
    kwargs = dict(encoder_hidden_states=enc, encoder_attention_mask=enc_mask)
    sdpa = hf_twin(ours, "sdpa")
    assert max_diff(ours(ids, **kwargs).logits, sdpa(ids, **kwargs).logits) < 1e-5
    corrupted = enc.clone()
    corrupted[1] = 1e6  # the padded encoder states do not matter
    assert torch.equal(ours(ids, **kwargs).logits, ours(ids, **{**kwargs, "encoder_hidden_states": corrupted}).logits)


def test_cache_prefill_and_steps(models):
    """Prefill 4 tokens, then one token at a time: the cross keys/values are computed once and
    reused, and every step's logits equal transformers' cached steps and the uncached run."""
    ours, hf = models
    ids, enc, enc_mask = inputs(1)
    full = ours(ids, encoder_hidden_states=enc, encoder_attention_mask=enc_mask).logits
    kwargs = dict(encoder_hidden_states=enc, encoder_attention_mask=enc_mask, use_cache=True)
    a, b = ours(ids[:, :4], **kwargs), hf(ids[:, :4], **kwargs)
    assert max_diff(a.logits, b.logits) < 1e-5
    cache = a.past_key_values
    assert isinstance(cache, KVCache) and cache.cross_keys[0].shape == (B, 4, T_ENC, 8)
    cross_k = [k.clone() for k in cache.cross_keys]
    c_attn = [block.crossattention.c_attn for block in ours.transformer.h]
    calls = []
    hooks = [m.register_forward_hook(lambda *_: calls.append(1)) for m in c_attn]
    try:
        for t in range(4, T):
            a = ours(ids[:, t : t + 1], past_key_values=a.past_key_values, **kwargs)
            b = hf(ids[:, t : t + 1], past_key_values=b.past_key_values, **kwargs)
            assert max_diff(a.logits, b.logits) < 1e-5
            assert max_diff(a.logits[:, 0], full[:, t]) < 1e-5
    finally:
        for h in hooks:
            h.remove()
    assert calls == []  # the encoder's keys and values were not computed again
    assert all(torch.equal(k, a.past_key_values.cross_keys[i]) for i, k in enumerate(cross_k))
    assert a.past_key_values.length == T


def test_cache_is_a_pytree_with_cross_keys(models):
    import torch.utils._pytree as pytree

    ours, _ = models
    ids, enc, _ = inputs()
    with torch.no_grad():
        cache = ours(ids, encoder_hidden_states=enc).past_key_values
    leaves, spec = pytree.tree_flatten(cache)
    assert len(leaves) == 4 * ours.config.n_layer  # self keys, values, cross keys, values
    back = pytree.tree_unflatten(leaves, spec)
    assert back.cross_values[1] is cache.cross_values[1] and back.length == cache.length


def test_errors_name_the_problem():
    ids, enc, enc_mask = inputs()
    plain = GPT2Model(tiny_config())
    with pytest.raises(ValueError, match="add_cross_attention"):
        plain(ids, encoder_hidden_states=enc)
    model = GPT2Model(tiny_config(add_cross_attention=True))
    with pytest.raises(ValueError, match=r"encoder_hidden_states have shape \(2, 5, 16\)"):
        model(ids, encoder_hidden_states=enc[..., :16])
    with pytest.raises(ValueError, match=r"encoder_attention_mask has shape \(2, 4\)"):
        model(ids, encoder_hidden_states=enc, encoder_attention_mask=enc_mask[:, :4])
    # Without encoder states the cross-attention layers are skipped, as in transformers.
    assert model(ids).last_hidden_state.shape == (B, T, 32)


def test_gradient_checkpointing_passes_the_encoder_states(models):
    ours, _ = models
    ids, enc, enc_mask = inputs(2)
    grads = []
    for checkpointing in (False, True):
        ours.zero_grad()
        ours.transformer.gradient_checkpointing = checkpointing
        ours.train()  # dropout is 0 in tiny_config: the same function, checkpointed or not
        try:
            kwargs = dict(encoder_hidden_states=enc, encoder_attention_mask=enc_mask, labels=ids, use_cache=False)
            ours(ids, **kwargs).loss.backward()
        finally:
            ours.transformer.gradient_checkpointing = False
            ours.eval()
        grads.append(ours.transformer.h[0].crossattention.q_attn.weight.grad.clone())
    assert grads[0].abs().max() > 0 and max_diff(grads[0], grads[1]) < 1e-6
