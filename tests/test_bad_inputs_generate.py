"""Bad generate() requests: each raises (or warns) with a message that names the problem."""

import pytest
import torch

from gpt2attn import GPT2LMHeadModel
from helpers import tiny_config

IDS = torch.tensor([[5, 6, 7]])
PADDED = torch.tensor([[0, 5, 6], [4, 5, 6]])

CASES = [
    # (name, kwargs, exception, fragment of the message)
    ("nan temperature", dict(do_sample=True, temperature=float("nan")), ValueError, "temperature must be a finite number > 0, got nan"),
    ("zero temperature", dict(do_sample=True, temperature=0), ValueError, "temperature must be a finite number > 0, got 0"),
    ("top_p above 1", dict(top_p=1.5), ValueError, "top_p must be in (0, 1], got 1.5"),
    ("negative top_k", dict(top_k=-1), ValueError, "top_k must be an integer >= 0, got -1"),
    ("min_p above 1", dict(min_p=2.0), ValueError, "min_p must be in [0, 1], got 2.0"),
    ("typical_p 0", dict(typical_p=0.0), ValueError, "typical_p must be in (0, 1], got 0.0"),
    ("repetition_penalty 0", dict(repetition_penalty=0.0), ValueError, "repetition_penalty must be a finite number > 0"),
    ("max_new_tokens 0", dict(max_new_tokens=0), ValueError, "max_new_tokens must be an integer >= 1, got 0"),
    ("too long", dict(max_new_tokens=40), ValueError, "n_positions=32"),
    ("max_length below prompt", dict(max_length=2), ValueError, "max_length=2 leaves no room after the prompt of 3 tokens"),
    ("unknown keyword", dict(top_kk=3), TypeError, "unknown keyword(s) ['top_kk']"),
    ("eos out of vocab", dict(eos_token_id=500), ValueError, "eos_token_id must be a token id in [0, 97)"),
    ("empty eos list", dict(eos_token_id=[]), ValueError, "eos_token_id must be a token id"),
    ("bad_words not lists", dict(bad_words_ids=[3]), ValueError, "bad_words_ids must be a non-empty list of non-empty lists"),
    ("early_stopping", dict(num_beams=2, early_stopping="sometimes"), ValueError, "early_stopping must be True, False or 'never'"),
    ("more returns than beams", dict(num_beams=2, num_return_sequences=3), ValueError, "num_return_sequences (3) must be <= num_beams (2)"),
    ("greedy several returns", dict(num_return_sequences=2), ValueError, "greedy decoding gives one sequence per prompt"),
    ("stream with beams", dict(num_beams=2, stream=True), ValueError, "not with beam search"),
    ("stop strings without tokenizer", dict(stop_strings=["\n"]), ValueError, "pass tokenizer=..."),
    ("compile_config", dict(compile_config=5), ValueError, "compile_config must be transformers' CompileConfig or a dict"),
    ("assisted with beams", dict(prompt_lookup_num_tokens=3, num_beams=2), ValueError,
     "assisted decoding (assistant_model / prompt_lookup_num_tokens) decodes greedily or samples one sequence"),
    ("assisted on a batch", dict(input_ids=PADDED, prompt_lookup_num_tokens=3), ValueError,
     "assisted decoding takes one prompt of input_ids (batch size 1), without inputs_embeds or past_key_values"),
    ("mask values", dict(attention_mask=torch.tensor([[1, 2, 1]])), ValueError, "only 0 (padding) and 1 (token), got values [1, 2]"),
    ("mask shape", dict(attention_mask=torch.tensor([[1, 1]])), ValueError, "attention_mask has shape (1, 2), expected (1, 3)"),
    ("float ids", dict(input_ids=torch.tensor([[1.0, 2.0]])), ValueError, "input_ids must be an integer tensor"),
    ("ids out of vocab", dict(input_ids=torch.tensor([[1, 200]])), ValueError, "input_ids hold 200, outside [0, 97)"),
    ("ids not a tensor", dict(input_ids=[[1, 2]]), TypeError, "input_ids must be a torch.Tensor, got list"),
    ("no prompt, no bos", dict(input_ids=None, bos_token_id=None), ValueError, "needs input_ids or inputs_embeds"),
    ("embeds width", dict(input_ids=None, inputs_embeds=torch.zeros(1, 3, 5)), ValueError, "inputs_embeds must be a tensor [B, T, n_embd=32]"),
    ("token types shape", dict(token_type_ids=torch.zeros(1, 2, dtype=torch.long)), ValueError, "token_type_ids must have the shape of the prompt"),
]


@pytest.fixture(scope="module")
def model():
    return GPT2LMHeadModel(tiny_config()).eval()


@pytest.mark.parametrize("name,kwargs,exc,fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_request_names_the_problem(model, name, kwargs, exc, fragment):
    kwargs = dict(kwargs)
    ids = kwargs.pop("input_ids", IDS)
    with pytest.raises(exc) as info:
        model.generate(ids, **kwargs)
    assert fragment in str(info.value)


def test_a_row_of_padding_only_is_an_error(model):
    with pytest.raises(ValueError, match=r"attention_mask rows \[0\] are all padding"):
        model.generate(PADDED, attention_mask=torch.tensor([[0, 0, 0], [1, 1, 1]]))


def test_right_padding_warns_as_transformers_does(model):
    with pytest.warns(UserWarning, match="right-padding was detected"):
        model.generate(PADDED, attention_mask=torch.tensor([[1, 1, 0], [1, 1, 1]]), max_new_tokens=2)


def test_eos_list_is_supported(model):
    free = model.generate(IDS, max_new_tokens=8, eos_token_id=None)
    first, second = int(free[0, 4]), int(free[0, 6])
    out = model.generate(IDS, max_new_tokens=8, eos_token_id=[96, second, first], pad_token_id=96)
    stop = next(i for i in range(3, free.size(1)) if int(free[0, i]) in (first, second))
    assert out.size(1) == stop + 1 and torch.equal(out[0], free[0, : stop + 1])
