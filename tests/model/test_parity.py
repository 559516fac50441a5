"""Parity with transformers' GPT-2 (eager attention): fp32, every parameter random, |diff| <= 1e-5."""

from __future__ import annotations

import pytest
import torch

from gpt2attn import GPT2LMHeadModel, GPT2Model
from tests.helpers import hf_twin, max_diff, randomize, tiny_config

ATOL = 1e-5

VARIANTS = {
    "default": {},
    "gelu": {"activation_function": "gelu"},
    "gelu_fast": {"activation_function": "gelu_fast"},
    "gelu_pytorch_tanh": {"activation_function": "gelu_pytorch_tanh"},
    "quick_gelu": {"activation_function": "quick_gelu"},
    "relu": {"activation_function": "relu"},
    "silu": {"activation_function": "silu"},
    "tanh": {"activation_function": "tanh"},
    "n_inner": {"n_inner": 48},
    "inverse_layer_idx": {"scale_attn_by_inverse_layer_idx": True, "n_layer": 3},
    "reorder_and_upcast": {"reorder_and_upcast_attn": True},
    "unscaled": {"scale_attn_weights": False},
    "untied": {"tie_word_embeddings": False},
    "ln_eps": {"layer_norm_epsilon": 1e-2},
}


def make_pair(seed: int = 0, **overrides):
    model = randomize(GPT2LMHeadModel(tiny_config(**overrides)), seed=seed).eval()
    return model, hf_twin(model).eval()


def ids(B: int, T: int, vocab: int = 97, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_outputs_match(variant):
    ours, hf = make_pair(**VARIANTS[variant])
    x = ids(2, 12)
    a = ours(x, output_hidden_states=True, output_attentions=True)
    b = hf(x, output_hidden_states=True, output_attentions=True)
    assert max_diff(a.logits, b.logits) <= ATOL
    assert len(a.hidden_states) == len(b.hidden_states) == ours.config.n_layer + 1
    for h_ours, h_hf in zip(a.hidden_states, b.hidden_states):
        assert max_diff(h_ours, h_hf) <= ATOL
    assert len(a.attentions) == len(b.attentions) == ours.config.n_layer
    for w_ours, w_hf in zip(a.attentions, b.attentions):
        assert w_ours.shape == (2, 4, 12, 12)
        assert max_diff(w_ours, w_hf) <= ATOL
    for i in range(ours.config.n_layer):
        k, v = a.past_key_values[i]
        assert k.shape == (2, 4, 12, 8)
        assert max_diff(k, b.past_key_values.layers[i].keys) <= ATOL
        assert max_diff(v, b.past_key_values.layers[i].values) <= ATOL


@pytest.mark.parametrize("variant", VARIANTS)
def test_loss_and_every_gradient_match(variant):
    ours, hf = make_pair(**VARIANTS[variant])
    x = ids(2, 12)
    labels = x.clone()
    labels[0, :4] = -100  # ignored positions
    labels[1, -1] = -100
    loss_ours = ours(x, labels=labels).loss
    loss_hf = hf(x, labels=labels).loss
    assert max_diff(loss_ours, loss_hf) <= ATOL
    loss_ours.backward()
    loss_hf.backward()
    hf_params = dict(hf.named_parameters())
    names = [name for name, _ in ours.named_parameters()]
    assert sorted(names) == sorted(hf_params)
    for name, p in ours.named_parameters():
        assert p.grad is not None, name
        assert max_diff(p.grad, hf_params[name].grad) <= ATOL, name


def test_loss_ignores_minus_100_like_a_manual_mean():
    ours, _ = make_pair()
    x = ids(2, 10)
    labels = x.clone()
    labels[:, ::3] = -100
    logits = ours(x).logits
    logp = torch.log_softmax(logits[:, :-1].double(), dim=-1)
    target = labels[:, 1:]
    keep = target != -100
    manual = -logp.gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)[keep].mean()
    assert max_diff(ours(x, labels=labels).loss, manual) <= ATOL


def test_gpt2model_without_head_matches():
    ours = randomize(GPT2Model(tiny_config()), seed=3).eval()
    hf = hf_twin(ours).eval()
    x = ids(3, 9)
    a = ours(x, output_hidden_states=True)
    b = hf(x, output_hidden_states=True)
    assert max_diff(a.last_hidden_state, b.last_hidden_state) <= ATOL
    for h_ours, h_hf in zip(a.hidden_states, b.hidden_states, strict=True):
        assert max_diff(h_ours, h_hf) <= ATOL


@pytest.mark.parametrize("variant", ["default", "inverse_layer_idx", "reorder_and_upcast"])
def test_cached_continuation_equals_full_pass(variant):
    ours, hf = make_pair(**VARIANTS[variant])
    x = ids(2, 14)
    full = ours(x).logits
    prefix = ours(x[:, :9])
    suffix = ours(x[:, 9:], past_key_values=prefix.past_key_values)  # 5 queries over 14 keys
    assert max_diff(suffix.logits, full[:, 9:]) <= ATOL
    hf_prefix = hf(x[:, :9], use_cache=True)
    hf_suffix = hf(x[:, 9:], past_key_values=hf_prefix.past_key_values)
    assert max_diff(suffix.logits, hf_suffix.logits) <= ATOL
    # The suffix pass asked for weights too: the eager path counts its mask from the lower right.
    prefix = ours(x[:, :9])
    with_weights = ours(x[:, 9:], past_key_values=prefix.past_key_values, output_attentions=True)
    assert max_diff(with_weights.logits, full[:, 9:]) <= ATOL
    assert with_weights.attentions[0].shape == (2, 4, 5, 14)


def test_token_by_token_decoding_equals_full_pass():
    ours, hf = make_pair()
    x = ids(2, 12)
    full = ours(x).logits
    hf_full = hf(x).logits
    past, steps = None, []
    for t in range(x.size(1)):
        out = ours(x[:, t : t + 1], past_key_values=past)
        past = out.past_key_values
        steps.append(out.logits)
    stepped = torch.cat(steps, dim=1)
    assert past.length == 12
    assert max_diff(stepped, full) <= ATOL
    assert max_diff(stepped, hf_full) <= ATOL


def test_legacy_tuple_past_is_accepted_and_left_untouched():
    ours, hf = make_pair()
    x = ids(1, 10)
    legacy = ours(x[:, :6]).past_key_values.to_legacy()
    assert isinstance(legacy, tuple) and isinstance(legacy[0], tuple)
    snapshot = [(k.clone(), v.clone()) for k, v in legacy]
    out = ours(x[:, 6:], past_key_values=legacy)
    assert max_diff(out.logits, ours(x).logits[:, 6:]) <= ATOL
    for (k, v), (k0, v0) in zip(legacy, snapshot):
        assert torch.equal(k, k0) and torch.equal(v, v0)
    # transformers' own DynamicCache is accepted as past too.
    hf_past = hf(x[:, :6], use_cache=True).past_key_values
    assert max_diff(ours(x[:, 6:], past_key_values=hf_past).logits, out.logits) <= ATOL


@pytest.mark.parametrize("with_config", [False, True], ids=["DynamicCache()", "DynamicCache(config=)"])
def test_an_empty_dynamic_cache_starts_a_loop(with_config):
    from transformers import DynamicCache

    ours, hf = make_pair()
    x = ids(2, 10)
    empty = DynamicCache(config=hf.config) if with_config else DynamicCache()
    first = ours(x[:, :6], past_key_values=empty)
    assert torch.equal(first.logits, ours(x[:, :6]).logits)
    then = ours(x[:, 6:], past_key_values=first.past_key_values)
    assert max_diff(then.logits, ours(x).logits[:, 6:]) <= ATOL
    assert max_diff(then.logits, hf(x).logits[:, 6:]) <= ATOL


@pytest.mark.parametrize("with_config", [False, True])
def test_a_dynamic_cache_passed_in_grows_in_place_as_in_transformers(with_config):
    """transformers' loops keep passing the same DynamicCache object: each call extends it."""
    from transformers import DynamicCache

    ours, hf = make_pair()
    x = ids(2, 10)
    cache = DynamicCache(config=hf.config) if with_config else DynamicCache()
    steps = [ours(x[:, :6], cache=cache).logits]
    for t in range(6, 10):
        out = ours(x[:, t : t + 1], cache=cache)
        assert out.cache is cache and cache.get_seq_length() == t + 1
        steps.append(out.logits)
    assert max_diff(torch.cat(steps, dim=1), hf(x).logits) <= ATOL


def test_left_padding_with_explicit_position_ids():
    ours, hf = make_pair()
    x = ids(3, 10)
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[0, :4] = 0
    mask[2, :7] = 0
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    a = ours(x, attention_mask=mask, position_ids=position_ids, output_attentions=True, output_hidden_states=True)
    b = hf(x, attention_mask=mask, position_ids=position_ids, output_attentions=True, output_hidden_states=True)
    real = mask.bool()  # padded query rows attend to nothing real; their outputs are not compared
    assert max_diff(a.logits[real], b.logits[real]) <= ATOL
    for h_ours, h_hf in zip(a.hidden_states, b.hidden_states):
        assert max_diff(h_ours[real], h_hf[real]) <= ATOL
    for w_ours, w_hf in zip(a.attentions, b.attentions):
        assert max_diff(w_ours.transpose(1, 2)[real], w_hf.transpose(1, 2)[real]) <= ATOL
    # Each padded row equals its prompt run alone.
    alone = ours(x[0:1, 4:]).logits
    assert max_diff(a.logits[0, 4:], alone[0]) <= ATOL


def test_padding_mask_with_cache_continues_like_full_pass():
    ours, _ = make_pair()
    x = ids(2, 12)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :5] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    full = ours(x, attention_mask=mask, position_ids=pos).logits
    first = ours(x[:, :8], attention_mask=mask[:, :8], position_ids=pos[:, :8])
    rest = ours(x[:, 8:], past_key_values=first.past_key_values, attention_mask=mask, position_ids=pos[:, 8:])
    assert max_diff(rest.logits, full[:, 8:]) <= ATOL


def test_bf16_logits_within_justified_tolerance():
    """bf16 keeps 8 significant bits (relative step 2**-8 ≈ 0.4%), and rounding compounds through
    every matmul, LayerNorm and softmax of these deliberately wild random weights. So the bf16
    error is judged against the fp32 result and against what transformers itself achieves in bf16
    on the same weights: ours may be at most 1.5x transformers' error (max and mean), and the mean
    error must stay below 2% of the logits' spread (a few bf16 steps)."""
    ours, hf = make_pair(seed=5)
    x = ids(2, 16)
    reference = ours(x).logits.double()
    err_ours = ours.to(torch.bfloat16)(x).logits.double() - reference
    err_hf = hf.to(torch.bfloat16)(x).logits.double() - reference
    assert err_ours.abs().max() <= 1.5 * err_hf.abs().max()
    assert err_ours.abs().mean() <= 1.5 * err_hf.abs().mean()
    assert err_ours.abs().mean() <= 0.02 * reference.std()


def test_sdpa_fast_path_equals_eager_path():
    ours, _ = make_pair(attn_pdrop=0.0)
    x = ids(2, 12)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :3] = 0
    for kwargs in ({}, {"attention_mask": mask}):
        fast = ours(x, **kwargs).logits  # F.scaled_dot_product_attention
        eager = ours(x, output_attentions=True, **kwargs).logits  # textbook softmax(qkᵀ/√d + mask)v
        real = mask.bool()  # a padded query that sees no key differs by design (see test_padded_rows_...)
        assert max_diff(fast[real], eager[real]) <= ATOL


def test_padded_rows_follow_transformers_on_each_backend():
    """Left padding: a padded position sees no key. transformers' eager spreads equal weights over the
    keys there, its sdpa adds nothing; ours does the same on the backend of the same name, so whole
    tensors equal transformers' (tools compare them)."""
    ours, _ = make_pair(attn_pdrop=0.0)
    x = ids(2, 12)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :3] = 0
    for backend in ("sdpa", "eager"):
        ours.set_attn_implementation(backend)
        assert max_diff(ours(x, attention_mask=mask).logits, hf_twin(ours, backend)(x, attention_mask=mask).logits) <= ATOL
    assert max_diff(ours(x, attention_mask=mask).logits[0, :3], hf_twin(ours, "sdpa")(x, attention_mask=mask).logits[0, :3]) > 0.1


def test_packed_sequences_follow_transformers_on_each_backend():
    """Several sequences packed into a row, told apart by position ids restarting at 0: without a
    padding mask or a cache, transformers' mask keeps each sequence to itself (a block-diagonal causal
    mask), so each packed sequence equals it run alone; with a cache (use_cache left at the config's
    True) or a padding mask, tokens attend across sequences, as in transformers."""
    ours, _ = make_pair(attn_pdrop=0.0)
    x = ids(2, 9)
    packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1], [0, 1, 2, 3, 4, 5, 0, 1, 2]])  # 3 and 2 sequences
    for backend in ("sdpa", "eager"):
        ours.set_attn_implementation(backend)
        hf = hf_twin(ours, backend)
        for position_ids in (packed, packed[:1]):  # (B, T), and (1, T) shared by both rows
            a = ours(x, position_ids=position_ids, use_cache=False).logits
            assert max_diff(a, hf(x, position_ids=position_ids, use_cache=False).logits) <= ATOL
            for row in range(2):
                restarts = (position_ids[row % position_ids.size(0)] == 0).nonzero().flatten().tolist() + [9]
                for start, end in zip(restarts, restarts[1:]):  # each packed sequence as if run alone
                    assert max_diff(a[row, start:end], ours(x[row : row + 1, start:end]).logits[0]) <= ATOL
        across = ours(x, position_ids=packed).logits  # a cache is built: no packing, as in transformers
        assert max_diff(across, hf(x, position_ids=packed).logits) <= ATOL
        assert max_diff(across[0, 4:7], ours(x[0:1, 4:7]).logits[0]) > 0.1
        ones = torch.ones(2, 9, dtype=torch.long)
        kept = ours(x, position_ids=packed, attention_mask=ones, use_cache=False).logits
        assert max_diff(kept, hf(x, position_ids=packed, attention_mask=ones, use_cache=False).logits) <= ATOL
        assert max_diff(kept, across) <= ATOL


def test_state_dicts_load_both_ways_strictly():
    for overrides in ({}, {"tie_word_embeddings": False}):
        ours, hf = make_pair(**overrides)
        fresh = GPT2LMHeadModel(tiny_config(**overrides))
        fresh.load_state_dict(hf.state_dict(), strict=True)
        assert max_diff(fresh(ids(1, 5)).logits, ours(ids(1, 5)).logits) == 0.0
        hf.load_state_dict(ours.state_dict(), strict=True)
        for name, tensor in ours.state_dict().items():
            assert tensor.shape == hf.state_dict()[name].shape, name
    assert ours.state_dict()["transformer.h.0.attn.c_attn.weight"].shape == (32, 96)  # [n_embd, 3*n_embd]
