"""gpt2attn.generation.sampling.draw: torch.multinomial's tokens and random stream, at GPT-2's
vocabulary, whether it computes every entry's variate (as multinomial) or the nonzero ones alone."""

import warnings

import numpy as np
import pytest
import torch

from gpt2attn.generation import sampling
from gpt2attn.generation.processors import top_p

V = 50257


def _probs(kind: str, rows: int, seed: int) -> torch.Tensor:
    """(rows, V) probabilities of random logits: all nonzero, or after a top-k of 50, or after a
    top-p of 0.9 (a few hundred tokens a row)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, V, generator=g) * (4.0 if kind == "top_p" else 3.0)
    if kind == "top_k":
        logits = logits.masked_fill(logits < logits.topk(50).values[:, -1:], float("-inf"))
    if kind == "top_p":
        logits = top_p(logits, 0.9)
    return logits.softmax(dim=-1)


@pytest.fixture
def multinomial_calls(monkeypatch):
    """Counts the calls of torch.multinomial (after the once-a-process check has made its own)."""
    assert sampling.same_as_multinomial()
    calls = []
    original = torch.multinomial
    monkeypatch.setattr(torch, "multinomial", lambda *args, **kwargs: calls.append(args) or original(*args, **kwargs))
    return calls


@pytest.mark.parametrize("kind", ["top_k", "top_p", "dense"])
@pytest.mark.parametrize("rows", [1, 3])
def test_draw_gives_multinomial_s_tokens_and_leaves_the_generator_where_it_does(kind, rows, multinomial_calls):
    probs = _probs(kind, rows, seed=rows)
    live = int((probs > 0).sum())
    theirs, ours = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    expected = [torch.multinomial(probs, 1, generator=theirs).squeeze(1) for _ in range(10)]
    multinomial_calls.clear()
    got = [sampling.draw(probs, ours) for _ in range(10)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert torch.equal(theirs.get_state(), ours.get_state())
    assert len({tuple(e.tolist()) for e in expected}) > 1  # the draws differ: the stream decides them
    if kind == "dense":  # every entry's variate is needed: multinomial's own work
        assert len(multinomial_calls) == 10
    else:  # top-k's 50 and top-p's few hundred a row: the nonzero entries' alone
        assert 50 <= live <= sampling.MOST_LIVE and multinomial_calls == []


def test_draw_on_the_default_generator_is_multinomial_s(multinomial_calls):
    probs = _probs("top_k", 2, seed=0)
    torch.manual_seed(3)
    expected = [torch.multinomial(probs, 1).squeeze(1) for _ in range(5)]
    after = torch.get_rng_state()
    torch.manual_seed(3)
    multinomial_calls.clear()
    got = [sampling.draw(probs) for _ in range(5)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected)) and torch.equal(torch.get_rng_state(), after)
    assert multinomial_calls == []


def test_the_once_a_process_check_catches_another_variate(monkeypatch):
    assert sampling.same_as_multinomial.__wrapped__()
    monkeypatch.setattr(sampling, "LOW_53", (1 << 52) - 1)  # a uniform of 52 bits: other variates
    assert not sampling.same_as_multinomial.__wrapped__()


def test_where_the_check_fails_draw_is_multinomial(monkeypatch, multinomial_calls):
    monkeypatch.setattr(sampling, "same_as_multinomial", lambda: False)
    probs = _probs("top_k", 1, seed=0)
    theirs, ours = torch.Generator().manual_seed(2), torch.Generator().manual_seed(2)
    assert torch.equal(sampling.draw(probs, ours), torch.multinomial(probs, 1, generator=theirs).squeeze(1))
    assert len(multinomial_calls) == 2


@pytest.mark.parametrize("bad", ["negative", "nan", "inf", "zero row"])
def test_bad_probabilities_raise_multinomial_s_error(bad):
    probs = _probs("top_k", 2, seed=0)
    if bad == "negative":
        probs[1, probs[1].argmax()] = -0.5
    elif bad == "nan":
        probs[0, 0] = float("nan")
    elif bad == "inf":
        probs[0, 3] = float("inf")
    else:
        probs[1] = 0.0
    with pytest.raises(RuntimeError) as theirs:
        torch.multinomial(probs, 1)
    with pytest.raises(RuntimeError) as ours:
        sampling.draw(probs)
    assert str(ours.value) == str(theirs.value)


def test_the_once_a_process_check_catches_a_generator_left_elsewhere(monkeypatch):
    calls = []
    original = sampling.sparse_draw

    def leaves_it_one_draw_on(probs, live, generator):  # right tokens, but the last draw takes one word too many
        calls.append(1)
        tokens = original(probs, live, generator)
        if len(calls) == 4:
            torch.empty(1, dtype=torch.int64).random_(generator=generator)
        return tokens

    monkeypatch.setattr(sampling, "sparse_draw", leaves_it_one_draw_on)
    assert not sampling.same_as_multinomial.__wrapped__() and len(calls) == 4


def test_a_uniform_of_zero_gives_multinomial_s_pick_too():
    """u = 0 (one draw in 2^53) makes q = 0: probs / q is inf for a live token and NaN for a zero
    probability, which argmax picks; the variates of every entry, as multinomial computes them, decide."""
    probs = _probs("top_k", 3, seed=0)
    live = probs > 0
    words = torch.randint(1, 1 << 62, probs.shape, generator=torch.Generator().manual_seed(0))
    dead = (~live[0]).nonzero()[5].item()
    words[0, dead] = 1 << 60  # the low 53 bits zero: u = 0 at a zero probability
    words[1, live[1].nonzero()[-1].item()] = 0  # and at a live token
    every_q = (-torch.log1p(-(words & sampling.LOW_53).double() * 2.0**-53)).float()
    expected = (probs / every_q).argmax(dim=1)
    assert expected[0].item() == dead and probs[1, expected[1]] > 0
    with warnings.catch_warnings():  # numpy's divide-by-zero and invalid-value warnings: an error under -W error
        warnings.simplefilter("error")
        got = sampling.tokens_of(probs.numpy(), np.flatnonzero(live.numpy()), words.numpy())
    assert torch.equal(got, expected)


@pytest.mark.parametrize("live_a_row", [1, sampling.MOST_LIVE])
def test_one_live_token_a_row_or_the_most_live_take_the_live_tokens_alone(live_a_row, multinomial_calls):
    probs = _probs("dense", 1, seed=5)
    probs[:, live_a_row:] = 0.0  # the first live_a_row tokens alone
    theirs, ours = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    expected = [torch.multinomial(probs, 1, generator=theirs).squeeze(1) for _ in range(3)]
    multinomial_calls.clear()
    assert all(torch.equal(sampling.draw(probs, ours), e) for e in expected)
    assert torch.equal(theirs.get_state(), ours.get_state()) and multinomial_calls == []


def test_probabilities_in_double_are_multinomial_s_own(multinomial_calls):
    probs = _probs("top_k", 2, seed=0).double()
    theirs, ours = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    assert torch.equal(sampling.draw(probs, ours), torch.multinomial(probs, 1, generator=theirs).squeeze(1))
    assert len(multinomial_calls) == 2  # its variates stay double: no float rounding to share


def test_probabilities_that_are_a_view_with_strides_give_multinomial_s_tokens(multinomial_calls):
    wide = torch.zeros(3, 2 * V)
    wide[:, 1::2] = _probs("top_k", 3, seed=6)  # every other column: rows of V with a stride of 2
    probs = wide[:, 1::2]
    assert not probs.is_contiguous()
    theirs, ours = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    expected = [torch.multinomial(probs, 1, generator=theirs).squeeze(1) for _ in range(5)]
    multinomial_calls.clear()
    assert all(torch.equal(sampling.draw(probs, ours), e) for e in expected)
    assert torch.equal(theirs.get_state(), ours.get_state()) and multinomial_calls == []


def test_variates_rounded_to_float_decide_a_near_tie_as_multinomial_s_do():
    """Two tokens of equal probability whose uniforms differ by one in 2^53: their variates differ
    in double and round to the same float, so multinomial's argmax takes the first of the two; with
    the doubles the first one's larger q would lose."""
    probs = torch.zeros(1, V)
    first, second = 1000, 30000
    probs[0, [first, second]] = 0.5
    words = torch.randint(1, 1 << 62, probs.shape, generator=torch.Generator().manual_seed(1))
    base = (1 << 52) + 12345  # u a little above 1/2
    words[0, first], words[0, second] = base + 1, base
    every_q = -torch.log1p(-(words & sampling.LOW_53).double() * 2.0**-53)
    assert every_q[0, first] > every_q[0, second] and every_q[0, first].float() == every_q[0, second].float()
    expected = (probs / every_q.float()).argmax(dim=1)
    assert expected.item() == first
    live = np.flatnonzero(probs.numpy() > 0)
    assert torch.equal(sampling.tokens_of(probs.numpy(), live, words.numpy()), expected)
