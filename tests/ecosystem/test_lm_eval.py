"""lm-evaluation-harness on gpt2attn's model, handed over as transformers' would be
(`HFLM(pretrained=model)`): every request type scores exactly as on transformers' model with the
same weights."""

from __future__ import annotations

import pytest

lm_eval_hf = pytest.importorskip("lm_eval.models.huggingface")
from lm_eval.api.instance import Instance  # noqa: E402

from tests.helpers import hf_gpt2_folder  # noqa: E402

import gpt2attn  # noqa: E402

pytestmark = pytest.mark.slow


def requests(kind: str, args: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, a, i) for i, a in enumerate(args)]


def test_hflm_scores_ours_as_transformers(tmp_path):
    import transformers

    folder = hf_gpt2_folder(tmp_path / "gpt2-hf")
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    ours = gpt2attn.GPT2LMHeadModel.from_pretrained(folder).eval()
    theirs = transformers.GPT2LMHeadModel.from_pretrained(folder, attn_implementation="eager").eval()
    pairs = [("The cat sat on the", " mat"), ("Hello", " world, how are you"), ("1 2 3", " 4 5 6 7 8")]
    texts = [("To be, or not to be, that is the question.",), ("A longer text " * 12,)]
    until = [("Once upon a time", {"until": ["\n"], "max_gen_toks": 8, "do_sample": False})]
    results = []
    for model in (ours, theirs):
        lm = lm_eval_hf.HFLM(pretrained=model, tokenizer=tok, batch_size=2, device="cpu", max_length=64)
        results.append((lm.loglikelihood(requests("loglikelihood", pairs)),
                        lm.loglikelihood_rolling(requests("loglikelihood_rolling", texts)),
                        lm.generate_until(requests("generate_until", until))))
    (ll, rolling, generated), (hf_ll, hf_rolling, hf_generated) = results
    assert len(ll) == len(pairs) and len(rolling) == len(texts)
    for (score, greedy), (hf_score, hf_greedy) in zip(ll, hf_ll):
        assert abs(score - hf_score) <= 1e-4 and greedy == hf_greedy
    for score, hf_score in zip(rolling, hf_rolling):
        assert abs(score - hf_score) <= 1e-4
    assert generated == hf_generated and generated[0] != ""
