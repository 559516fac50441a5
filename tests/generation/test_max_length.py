"""generate(max_length=N) counts as transformers counts: the tokens the output starts with, cached
ones included, plus the embedded positions when inputs_embeds stand for other tokens. Each case is
compared with transformers' own generate on the same weights and the same cache."""

from __future__ import annotations

import pytest
import torch

from gpt2attn import GPT2LMHeadModel
from tests.helpers import hf_twin, randomize, tiny_config

MAX_LENGTH = 15


@pytest.fixture(scope="module")
def models():
    model = randomize(GPT2LMHeadModel(tiny_config(n_positions=64)), seed=2, std=0.5).eval()
    return model, hf_twin(model, "sdpa").eval()


IDS = torch.randint(1, 97, (1, 10), generator=torch.Generator().manual_seed(5))


def run(model, case: str):
    """generate() with max_length on one of the prompt shapes a user can give."""
    kw = dict(max_length=MAX_LENGTH, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        if case == "ids":
            return model.generate(IDS, **kw)
        past = model(IDS[:, :6], use_cache=True).past_key_values  # 6 tokens cached
        embeds = model.transformer.wte(IDS[:, 6:])  # 4 more, as embeddings
        if case == "ids + cache":
            return model.generate(IDS, past_key_values=past, **kw)
        if case == "embeds + cache, ids = the cached tokens":
            return model.generate(IDS[:, :6], inputs_embeds=embeds, past_key_values=past, **kw)
        if case == "embeds + cache, ids = cached and embedded tokens":
            return model.generate(IDS, inputs_embeds=embeds, past_key_values=past, **kw)
        if case == "embeds":
            return model.generate(inputs_embeds=model.transformer.wte(IDS), **kw)
        if case == "embeds, ids = their tokens":
            return model.generate(IDS, inputs_embeds=model.transformer.wte(IDS), **kw)
    raise AssertionError(case)


@pytest.mark.parametrize("case, length", [
    ("ids", MAX_LENGTH),
    ("ids + cache", MAX_LENGTH),  # the 6 cached tokens count
    ("embeds + cache, ids = the cached tokens", MAX_LENGTH - 4),  # 6 cached + 4 embedded count, 5 new
    ("embeds + cache, ids = cached and embedded tokens", MAX_LENGTH - 4),
    ("embeds", MAX_LENGTH - 10),  # only the new tokens come back
    ("embeds, ids = their tokens", MAX_LENGTH),
])
def test_max_length_counts_as_transformers_counts(models, case, length):
    model, hf = models
    ours, theirs = run(model, case), run(hf, case)
    assert ours.shape == theirs.shape == (1, length)
    if "embeds + cache" in case:
        # transformers feeds the ids, not the embeddings, once a cache is given, so its tokens
        # differ; ours continue the same 10-token context as a plain greedy run over the ids
        n_new = length - (6 if case.endswith("the cached tokens") else 10)
        full = model.generate(IDS, max_new_tokens=n_new, do_sample=False, eos_token_id=None)
        assert torch.equal(ours[:, -n_new:], full[:, 10:])
    else:
        assert torch.equal(ours, theirs)


def test_max_length_with_no_room_left_names_the_count(models):
    model, _ = models
    with torch.no_grad():
        past = model(IDS[:, :6], use_cache=True).past_key_values
        embeds = model.transformer.wte(IDS[:, 6:])
        with pytest.raises(ValueError, match="max_length=10 .* 10 tokens"):
            model.generate(IDS[:, :6], inputs_embeds=embeds, past_key_values=past, max_length=10)
