"""attn_implementation naming a function registered in transformers' AttentionInterface (how TGI,
vLLM and users plug in their kernels): every layer calls it as transformers' GPT-2 does, with
forward's extra keywords, and a mask only when a mask function is registered for the name."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from tests.helpers import max_diff, randomize

from gpt2attn import GPT2Config, GPT2LMHeadModel

VOCAB = 50257  # GPT-2's own: larger than any layer


@pytest.fixture
def recording():
    """Register "recording" (transformers' sdpa, noting what each call was given) for the test only;
    `with_mask` registers transformers' sdpa mask function under the same name."""
    calls = []

    def attention(module, query, key, value, attention_mask, **kwargs):
        calls.append({"module": module, "mask": attention_mask, "q_len": query.shape[2], **kwargs})
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    def register(with_mask: bool):
        AttentionInterface.register("recording", attention)
        if with_mask:
            AttentionMaskInterface.register("recording", sdpa_mask)
        return calls

    yield register
    AttentionInterface._global_mapping.pop("recording", None)
    AttentionMaskInterface._global_mapping.pop("recording", None)


def models(attn_implementation: str):
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=4, n_embd=64, vocab_size=VOCAB, n_positions=64)
    ours = randomize(GPT2LMHeadModel(config)).eval()
    theirs = ours.to_transformers()
    ours.set_attn_implementation(attn_implementation)
    theirs.set_attn_implementation(attn_implementation)
    return ours, theirs


def test_a_registered_function_gets_every_layer_and_forwards_extra_keywords(recording):
    assert GPT2LMHeadModel._supports_attention_backend  # what TGI and vLLM check before plugging theirs in
    calls = recording(with_mask=False)
    ours, theirs = models("recording")
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = ours(ids, kernel_setting=7).logits
        ours_calls, calls[:] = list(calls), []
        want = theirs(ids, kernel_setting=7).logits
        sdpa = models("sdpa")[0](ids).logits
    assert max_diff(got, want) < 1e-5 and max_diff(got, sdpa) < 1e-5
    # one call per layer, in order, each with the keyword the caller gave and transformers' arguments
    assert [c["module"] for c in ours_calls] == [block.attn for block in ours.transformer.h]
    for c, t in zip(ours_calls, calls):
        assert c["kernel_setting"] == t["kernel_setting"] == 7
        assert c["scaling"] == t["scaling"] and c["dropout"] == t["dropout"] == 0.0
        assert c["mask"] is None and t["mask"] is None

    padding = torch.ones(2, 11, dtype=torch.long)
    padding[1, :4] = 0
    calls[:] = []
    with torch.no_grad():
        ours(ids, attention_mask=padding)
        theirs(ids, attention_mask=padding)
    # no mask function registered for the name: the kernel gets no mask, padding or not, as in transformers
    assert len(calls) == 4 and all(c["mask"] is None for c in calls)


def test_with_a_mask_function_padding_reaches_the_kernel_as_in_transformers(recording):
    recording(with_mask=True)
    ours, theirs = models("recording")
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    with torch.no_grad():
        got = ours(ids, attention_mask=mask).logits
        want = theirs(ids, attention_mask=mask).logits
    real = mask.bool()
    assert max_diff(got[real], want[real]) < 1e-5


def test_generate_with_a_registered_function_equals_transformers(recording):
    calls = recording(with_mask=True)
    ours, theirs = models("recording")
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(3))
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    got = ours.generate(prompt, **options)
    assert {c["q_len"] for c in calls} == {5, 1}  # the prompt, then one token a step, all through it
    assert torch.equal(got, theirs.generate(prompt, **options))


def test_unregistered_and_unsupported_backends_are_refused_by_name():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=50))
    for name in ("nobody_registered_this", "flash_attention_2", "kernels-community/flash-attn"):
        with pytest.raises(ValueError, match=f'attn_implementation="{name}"'):
            model.set_attn_implementation(name)
    assert model.config._attn_implementation == "sdpa"  # unchanged by the refusals


def test_built_in_backends_still_refuse_unknown_keywords():
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=50))
    with pytest.raises(TypeError, match="kernel_setting"):
        model(torch.tensor([[1, 2]]), kernel_setting=7)
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        model(torch.tensor([[1, 2]]), cu_seq_lens_q=torch.tensor([0, 2]))
