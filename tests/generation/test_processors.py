"""Each logits processor equals transformers' on hand-made logits (1e-6): a nucleus of several
tokens, ties at the top-k boundary, penalties on seen tokens; and the chain's order."""

import pytest
import torch
from transformers.generation import logits_process as hf

from gpt2attn.generation import GenerationConfig
from gpt2attn.generation import processors as ours

# Row 0: probabilities ~ .35 .25 .15 .10 .08 ...: top_p=0.7 keeps three, 0.75 four (the boundary
# token included). Row 1: three tokens tied at the 2nd-best value (top_k=2 keeps all four).
LOGITS = torch.tensor([
    [2.0, 1.66, 1.15, 0.75, 0.53, 0.1, -0.4, -1.0, -3.0, -5.0],
    [3.0, 1.0, 1.0, 1.0, 0.5, 0.2, -0.1, -0.5, -2.0, -2.5],
    [0.3, 0.2, 0.25, 0.1, 0.0, 0.15, 0.05, -0.05, 0.12, 0.22],
])
IDS = torch.tensor([[1, 4, 1, 7], [0, 0, 2, 3], [9, 8, 9, 8]])


def _same(a, b):
    assert torch.equal(torch.isinf(a), torch.isinf(b)), (a, b)
    finite = torch.isfinite(b)
    assert (a[finite] - b[finite]).abs().max().item() <= 1e-6


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_top_k(k):
    _same(ours.top_k(LOGITS, k), hf.TopKLogitsWarper(k)(IDS, LOGITS))
    kept = torch.isfinite(ours.top_k(LOGITS, k))
    assert kept[0].sum() == k  # no ties in row 0: exactly k
    if k == 2:
        assert kept[1].sum() == 4  # the best, and the three tied for second


@pytest.mark.parametrize("p", [0.3, 0.6, 0.7, 0.75, 0.9, 0.99])
def test_top_p(p):
    _same(ours.top_p(LOGITS, p), hf.TopPLogitsWarper(p)(IDS, LOGITS))
    assert torch.isfinite(ours.top_p(LOGITS, 0.75))[0].sum() == 4  # nucleus of several, boundary kept


@pytest.mark.parametrize("p", [0.05, 0.3, 0.6])
def test_min_p(p):
    _same(ours.min_p(LOGITS, p), hf.MinPLogitsWarper(p)(IDS, LOGITS))


@pytest.mark.parametrize("mass", [0.2, 0.5, 0.9])
def test_typical_p(mass):
    _same(ours.typical_p(LOGITS, mass), hf.TypicalLogitsWarper(mass)(IDS, LOGITS))


@pytest.mark.parametrize("keep", [2, 3])
def test_min_tokens_to_keep_for_beams(keep):
    _same(ours.top_p(LOGITS, 0.1, keep), hf.TopPLogitsWarper(0.1, min_tokens_to_keep=keep)(IDS, LOGITS))
    _same(ours.min_p(LOGITS, 0.9, keep), hf.MinPLogitsWarper(0.9, min_tokens_to_keep=keep)(IDS, LOGITS))
    _same(ours.typical_p(LOGITS, 0.1, keep), hf.TypicalLogitsWarper(0.1, min_tokens_to_keep=keep)(IDS, LOGITS))


@pytest.mark.parametrize("penalty", [0.7, 1.5])
def test_repetition_penalty(penalty):
    _same(ours.repetition_penalty(LOGITS, IDS, penalty), hf.RepetitionPenaltyLogitsProcessor(penalty)(IDS, LOGITS.clone()))
    ignore = torch.tensor([[True, False, False, False], [True, True, False, False], [False] * 4])
    expected = hf.RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=torch.tensor([1, 2, 0]))(IDS, LOGITS.clone())
    _same(ours.repetition_penalty(LOGITS, IDS, penalty, ignore), expected)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_no_repeat_ngram(n):
    ids = torch.tensor([[1, 2, 3, 1, 2], [4, 4, 4, 4, 5], [1, 2, 1, 2, 1]])
    _same(ours.no_repeat_ngram(LOGITS, ids, n), hf.NoRepeatNGramLogitsProcessor(n)(ids, LOGITS.clone()))


def test_bad_words_and_min_length():
    words = [[5], [2, 3], [4, 1, 7], [9, 8, 0]]
    eos = torch.tensor([6])
    _same(ours.bad_words(LOGITS, IDS, words), hf.NoBadWordsLogitsProcessor(words, eos)(IDS, LOGITS))
    _same(ours.suppress(LOGITS, torch.tensor([6, 2])),
          hf.MinLengthLogitsProcessor(10, torch.tensor([6, 2]))(IDS, LOGITS))


def test_temperature_comes_before_the_filters():
    """transformers' order: temperature, top-k, top-p, min-p, typical (tempering changes what top-p keeps)."""
    cfg = GenerationConfig(do_sample=True, temperature=0.5, top_k=6, top_p=0.8, min_p=0.05, typical_p=0.95)
    chain = ours.build_processors(cfg, prompt_len=4, vocab_size=10)
    expected = LOGITS
    for warper in (hf.TemperatureLogitsWarper(0.5), hf.TopKLogitsWarper(6), hf.TopPLogitsWarper(0.8),
                   hf.MinPLogitsWarper(0.05), hf.TypicalLogitsWarper(0.95)):
        expected = warper(IDS, expected)
    _same(ours.apply(chain, IDS, LOGITS), expected)
    tempered_after = ours.temperature(ours.top_p(ours.top_k(LOGITS, 6), 0.8), 0.5)
    assert not torch.equal(torch.isinf(tempered_after), torch.isinf(expected))  # the order shows


# top_p at GPT-2's vocabulary: bit for bit transformers' mask, from the sorted values alone unless a
# tie straddles the line ------------------------------------------------------------------------

V = 50257


def _gpt2_rows(kind: str, seed: int) -> torch.Tensor:
    """(3, V) logits: random at three scales (the largest gives a nucleus of a few tokens), after a
    top-k of 50 (all but 50 at -inf), or from four values only (ties everywhere)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "ties":
        return torch.randint(0, 4, (3, V), generator=g).float()
    rows = torch.randn(3, V, generator=g) * torch.tensor([[1.0], [5.0], [30.0]])
    return ours.top_k(rows, 50) if kind == "top_k" else rows


@pytest.fixture
def by_order(monkeypatch):
    """Counts the calls of top_p's path through torch's sort order."""
    calls = []
    original = ours._top_p_by_order
    monkeypatch.setattr(ours, "_top_p_by_order", lambda *args: calls.append(args) or original(*args))
    return calls


@pytest.mark.parametrize("row", ["random", "ties", "inf", "nan", "all -inf"])
@pytest.mark.parametrize("k", [1, 50, V - 1, V, V + 1])
def test_top_k_over_gpt2_s_vocabulary_is_transformers(row, k):
    scores = _gpt2_rows("ties" if row == "ties" else "random", k)
    if row == "inf":
        scores[:, 3:60] = float("inf")  # more infinite tokens than k (for k up to 50)
    elif row == "nan":
        scores[:, 9] = float("nan")  # counts as the largest
        scores[1, 100:200] = float("nan")
    elif row == "all -inf":
        scores[1] = float("-inf")
    expected = hf.TopKLogitsWarper(k)(IDS, scores.clone())
    torch.testing.assert_close(ours.top_k(scores, k), expected, rtol=0, atol=0, equal_nan=True)
    if row == "random" and k == 50:
        assert (torch.isfinite(expected).sum(dim=1) == 50).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_top_k_of_other_dtypes_is_transformers(dtype):
    scores = _gpt2_rows("ties", 1).to(dtype)  # ties at the k-th value
    expected = hf.TopKLogitsWarper(50)(IDS, scores.clone())
    assert torch.equal(ours.top_k(scores, 50), expected) and (torch.isfinite(expected).sum(dim=1) > 50).all()


@pytest.mark.parametrize("kind", ["random", "top_k"])
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.95, 0.999, 1.0])
def test_top_p_over_gpt2_s_vocabulary_is_transformers_mask_without_its_sort(kind, p, by_order):
    for seed in range(4):
        scores = _gpt2_rows(kind, seed)
        expected = hf.TopPLogitsWarper(p)(IDS, scores.clone())
        assert torch.equal(ours.top_p(scores, p), expected)
        if kind == "random" and p == 0.9:  # a nucleus of many tokens in the first row
            assert 100 < torch.isfinite(expected[0]).sum() < V
    assert by_order == []


@pytest.mark.parametrize("p, keep", [(0.3, 1), (0.6, 1), (0.9, 1), (0.1, 3), (0.9, 2000)])
def test_top_p_with_tied_values_on_the_line_takes_transformers_order(p, keep, by_order):
    for seed in range(4):
        scores = _gpt2_rows("ties", seed)
        expected = hf.TopPLogitsWarper(p, min_tokens_to_keep=keep)(IDS, scores.clone())
        assert torch.equal(ours.top_p(scores, p, keep), expected)
    assert by_order  # four values, each ~12500 tokens: the line falls inside a run of equal ones


@pytest.mark.parametrize("row", ["inf", "nan", "all -inf"])
def test_top_p_of_a_row_with_inf_or_nan_is_transformers(row, by_order):
    scores = _gpt2_rows("random", 0)[:1]
    if row == "inf":
        scores[0, 7] = float("inf")
    elif row == "nan":
        scores[0, 9] = float("nan")
    else:
        scores[0] = float("-inf")
    expected = hf.TopPLogitsWarper(0.9)(IDS, scores.clone())
    torch.testing.assert_close(ours.top_p(scores, 0.9), expected, rtol=0, atol=0, equal_nan=True)
    assert by_order == []  # its masses are NaN: nothing dropped, without the order


def test_top_p_on_a_mass_exactly_at_1_minus_p_is_transformers():
    """Four equal logits: masses 1/4, 1/2, 3/4, 1 exactly; at p = 0.5 the second worst's mass is
    1 - p itself, and it goes (at most 1 - p)."""
    scores = torch.tensor([[0.0, 0.0, 0.0, 0.0, float("-inf")]])
    expected = hf.TopPLogitsWarper(0.5)(IDS, scores.clone())
    assert torch.equal(ours.top_p(scores, 0.5), expected) and torch.isfinite(expected).sum() == 2


@pytest.mark.parametrize("warper, theirs, torch_method", [
    (lambda s: ours.top_k(s, 50), hf.TopKLogitsWarper(50), "topk"),
    (lambda s: ours.top_p(s, 0.9), hf.TopPLogitsWarper(0.9), "sort"),
], ids=["top_k", "top_p"])
def test_float32_logits_on_the_cpu_ask_torch_for_no_topk_or_sort(monkeypatch, warper, theirs, torch_method):
    scores = _gpt2_rows("random", 1)
    expected = theirs(IDS, scores.clone())

    def refused(*args, **kwargs):
        raise AssertionError(f"torch's {torch_method} was asked for")

    monkeypatch.setattr(torch.Tensor, torch_method, refused)
    assert torch.equal(warper(scores), expected)


def test_top_p_of_float64_logits_is_transformers():
    scores = _gpt2_rows("random", 2).double()
    assert torch.equal(ours.top_p(scores, 0.9), hf.TopPLogitsWarper(0.9)(IDS, scores.clone()))
