"""Bad generate() requests: each raises (or warns) with a message that names the problem."""

import json
import warnings

import pytest
import torch

from gpt2attn import GPT2LMHeadModel
from gpt2attn.errors import CheckpointError
from gpt2attn.generation.config import GenerationConfig, as_generation_config, save_generation_config
from tests.helpers import randomize, tiny_config

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
    ("position ids shape", dict(position_ids=torch.arange(2)[None]), ValueError,
     "position_ids must be (1, 3): one per cached and prompt token, got (1, 2)"),
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


def test_assisted_decoding_refuses_what_it_cannot_do_by_name(model):
    def refused(**kwargs):
        with pytest.raises(ValueError) as info:
            model.generate(kwargs.pop("input_ids", IDS), max_new_tokens=2, **kwargs)
        return str(info.value)

    assert refused(assistant_model=model, prompt_lookup_num_tokens=3) == (
        "pass assistant_model or prompt_lookup_num_tokens, not both")
    assert refused(prompt_lookup_num_tokens=3, num_return_sequences=2, do_sample=True) == (
        "assisted decoding (assistant_model / prompt_lookup_num_tokens) decodes greedily or samples one sequence: "
        "num_beams=1, num_return_sequences=1")
    assert refused(input_ids=PADDED, prompt_lookup_num_tokens=3) == (
        "assisted decoding takes one prompt of input_ids (batch size 1), without inputs_embeds or past_key_values")
    other = GPT2LMHeadModel(tiny_config(vocab_size=98)).eval()
    assert refused(assistant_model=other) == (
        "assistant_model has vocab_size 98, the model 97: they must share the vocabulary")


def test_messages_in_full(model):
    """The whole sentence of refusals whose rows above check a fragment."""
    def refused(exc, ids, **kwargs):
        with pytest.raises(exc) as info:
            model.generate(ids, max_new_tokens=2, **kwargs)
        return str(info.value)

    assert refused(ValueError, None, bos_token_id=None) == (
        "generate() needs input_ids or inputs_embeds (or a bos_token_id to start from)")
    assert refused(ValueError, torch.zeros(2, 0, dtype=torch.long)) == (
        "input_ids must hold at least one token, got shape (2, 0)")
    assert refused(ValueError, IDS, token_type_ids=[[1, 2, 3]]) == (
        "token_type_ids must have the shape of the prompt, got [[1, 2, 3]]")
    assert refused(TypeError, IDS, stopping_criteria=[len, "eos"]) == (
        "stopping_criteria must be a StoppingCriteriaList or a list of callables (sequences, scores) -> bool per row")


def test_a_mask_is_inferred_from_pad_ids_unless_pad_is_eos():
    """As transformers: with no attention_mask, prompt tokens equal to pad_token_id are padding, unless
    pad is also an eos id (then they may be real text)."""
    model = randomize(GPT2LMHeadModel(tiny_config()), seed=3).eval()
    ones = torch.ones_like(PADDED)
    for eos in (96, [96, 0]):
        kw = dict(max_new_tokens=4, pad_token_id=0, eos_token_id=eos)
        masked = model.generate(PADDED, attention_mask=(PADDED != 0).long(), **kw)
        unmasked = model.generate(PADDED, attention_mask=ones, **kw)
        assert not torch.equal(masked, unmasked)  # the mask matters for this prompt
        assert torch.equal(model.generate(PADDED, **kw), masked if eos == 96 else unmasked)


def test_token_types_go_with_inputs_embeds_as_with_ids():
    model = randomize(GPT2LMHeadModel(tiny_config()), seed=3).eval()
    types = torch.tensor([[3, 4, 4]])
    with_ids = model.generate(IDS, token_type_ids=types, max_new_tokens=4, eos_token_id=None)
    embeds = model.transformer.wte(IDS).detach()
    with_embeds = model.generate(inputs_embeds=embeds, token_type_ids=types, max_new_tokens=4, eos_token_id=None)
    assert torch.equal(with_embeds, with_ids[:, 3:])
    assert not torch.equal(with_ids, model.generate(IDS, max_new_tokens=4, eos_token_id=None))  # the types count


def test_a_row_of_padding_only_is_an_error(model):
    with pytest.raises(ValueError, match=r"attention_mask rows \[0\] are all padding"):
        model.generate(PADDED, attention_mask=torch.tensor([[0, 0, 0], [1, 1, 1]]))


def test_right_padding_warns_as_transformers_does(model):
    with pytest.warns(UserWarning, match="right-padding was detected"):
        model.generate(PADDED, attention_mask=torch.tensor([[1, 1, 0], [1, 1, 1]]), max_new_tokens=2)
    with warnings.catch_warnings():  # left padding, the right way: no warning
        warnings.simplefilter("error")
        model.generate(PADDED, attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]), max_new_tokens=2)


def test_eos_list_is_supported(model):
    free = model.generate(IDS, max_new_tokens=8, eos_token_id=None)
    first, second = int(free[0, 4]), int(free[0, 6])
    out = model.generate(IDS, max_new_tokens=8, eos_token_id=[96, second, first], pad_token_id=96)
    stop = next(i for i in range(3, free.size(1)) if int(free[0, i]) in (first, second))
    assert out.size(1) == stop + 1 and torch.equal(out[0], free[0, : stop + 1])


# Each GenerationConfig setting at its bound (accepted) and one step past it (refused, with the
# whole message): check() alone, no model. V is the vocabulary size the ids are checked against.
V = 97
BOUNDS = [
    # (setting, accepted values, refused value, the whole message)
    ("num_beams", [1], 0, "num_beams must be an integer >= 1, got 0"),
    ("num_beams", [1], True, "num_beams must be an integer >= 1, got True"),
    ("num_return_sequences", [1], 0, "num_return_sequences must be an integer >= 1, got 0"),
    ("min_length", [0], -1, "min_length must be an integer >= 0, got -1"),
    ("no_repeat_ngram_size", [0], -1, "no_repeat_ngram_size must be an integer >= 0, got -1"),
    ("encoder_no_repeat_ngram_size", [0], 1,
     "encoder_no_repeat_ngram_size=1: GPT-2 has no encoder whose n-grams could be banned; leave it 0"),
    ("forced_eos_token_id", [0, V - 1, [0, V - 1], (3,)], V,
     f"forced_eos_token_id must be a token id in [0, {V}) or a list of them, got {V}"),
    ("forced_eos_token_id", [0], -1, f"forced_eos_token_id must be a token id in [0, {V}) or a list of them, got -1"),
    ("forced_eos_token_id", [0], [], f"forced_eos_token_id must be a token id in [0, {V}) or a list of them, got []"),
    ("forced_eos_token_id", [0], [1, V], f"forced_eos_token_id must be a token id in [0, {V}) or a list of them, got [1, {V}]"),
    ("forced_eos_token_id", [1], True, f"forced_eos_token_id must be a token id in [0, {V}) or a list of them, got True"),
    ("num_assistant_tokens", [1], 0, "num_assistant_tokens must be an integer >= 1, got 0"),
    ("max_new_tokens", [1], 0, "max_new_tokens must be an integer >= 1, got 0"),
    ("max_length", [1], 0, "max_length must be an integer >= 1, got 0"),
    ("min_new_tokens", [0], -1, "min_new_tokens must be an integer >= 0, got -1"),
    ("top_k", [0], -1, "top_k must be an integer >= 0, got -1"),
    ("prompt_lookup_num_tokens", [1], 0, "prompt_lookup_num_tokens must be an integer >= 1, got 0"),
    ("max_matching_ngram_size", [1], 0, "max_matching_ngram_size must be an integer >= 1, got 0"),
    ("temperature", [1e-9, 7], 0.0, "temperature must be a finite number > 0, got 0.0"),
    ("temperature", [1e-9], float("inf"), "temperature must be a finite number > 0, got inf"),
    ("temperature", [1e-9], True, "temperature must be a finite number > 0, got True"),
    ("repetition_penalty", [1e-9], -1.0, "repetition_penalty must be a finite number > 0, got -1.0"),
    ("repetition_penalty", [1e-9], float("nan"), "repetition_penalty must be a finite number > 0, got nan"),
    ("top_p", [1.0, 1e-9], 0.0, "top_p must be in (0, 1], got 0.0"),
    ("top_p", [1.0], 1.0000001, "top_p must be in (0, 1], got 1.0000001"),
    ("typical_p", [1.0, 1e-9], 0.0, "typical_p must be in (0, 1], got 0.0"),
    ("typical_p", [1.0], 1.5, "typical_p must be in (0, 1], got 1.5"),
    ("min_p", [0, 0.0, 1.0], -0.1, "min_p must be in [0, 1], got -0.1"),
    ("min_p", [1.0], 1.1, "min_p must be in [0, 1], got 1.1"),
    ("min_p", [1.0], float("nan"), "min_p must be in [0, 1], got nan"),
    ("length_penalty", [-2.0, 0, 3], float("inf"), "length_penalty must be a finite number, got inf"),
    ("length_penalty", [1.0], "1", "length_penalty must be a finite number, got '1'"),
    ("early_stopping", [True, False, "never"], "sometimes",
     "early_stopping must be True, False or 'never', got 'sometimes'"),
    ("bad_words_ids", [[[0], [V - 1, 5]], ((1,),)], [[V]],
     f"bad_words_ids must be a non-empty list of non-empty lists of token ids in [0, {V}), got [[{V}]]"),
    ("bad_words_ids", [[[0]]], [[-1]],
     f"bad_words_ids must be a non-empty list of non-empty lists of token ids in [0, {V}), got [[-1]]"),
    ("bad_words_ids", [[[0]]], [], f"bad_words_ids must be a non-empty list of non-empty lists of token ids in [0, {V}), got []"),
    ("bad_words_ids", [[[0]]], [[]], f"bad_words_ids must be a non-empty list of non-empty lists of token ids in [0, {V}), got [[]]"),
    ("bad_words_ids", [[[0]]], "ab", f"bad_words_ids must be a non-empty list of non-empty lists of token ids in [0, {V}), got 'ab'"),
    ("stop_strings", ["x", ["a", "b"], ("c",)], "", "stop_strings must be a non-empty string or a list of them, got ''"),
    ("stop_strings", ["x"], [], "stop_strings must be a non-empty string or a list of them, got []"),
    ("stop_strings", ["x"], ["a", ""], "stop_strings must be a non-empty string or a list of them, got ['a', '']"),
    ("stop_strings", ["x"], [1], "stop_strings must be a non-empty string or a list of them, got [1]"),
    ("stop_strings", ["x"], 5, "stop_strings must be a non-empty string or a list of them, got 5"),
]


@pytest.mark.parametrize("name,accepted,refused,message", BOUNDS, ids=[f"{b[0]}={b[2]!r}" for b in BOUNDS])
def test_each_setting_is_checked_at_its_bound(name, accepted, refused, message):
    for value in accepted:
        GenerationConfig(**{name: value}).check(V)
    with pytest.raises(ValueError) as info:
        GenerationConfig(**{name: refused}).check(V)
    assert str(info.value) == message


def test_several_returns_need_sampling_or_as_many_beams():
    for ok in (dict(num_return_sequences=2, do_sample=True), dict(num_return_sequences=2, num_beams=2),
               dict(num_return_sequences=2, num_beams=3), dict(num_beams=2)):
        GenerationConfig(**ok).check(V)
    with pytest.raises(ValueError) as info:
        GenerationConfig(num_return_sequences=2).check(V)
    assert str(info.value) == ("num_return_sequences=2 needs num_beams >= it or do_sample=True: greedy decoding "
                               "gives one sequence per prompt")
    with pytest.raises(ValueError) as info:
        GenerationConfig(num_return_sequences=3, num_beams=2, do_sample=True).check(V)
    assert str(info.value) == "num_return_sequences (3) must be <= num_beams (2)"


@pytest.mark.parametrize("name", ["bos_token_id", "pad_token_id", "eos_token_id"])
def test_special_ids_the_caller_passes_lie_in_the_vocabulary_the_models_own_need_not(name):
    """An id the caller passes (named in `keywords`) must be < V; the model's own default may be any
    id >= 0 (a tiny model from GPT-2's default config keeps eos = 50256)."""
    none = {"bos_token_id": "", "pad_token_id": " (or negative: none)",
            "eos_token_id": " (or negative: never stop) or a non-empty list of them"}[name]
    GenerationConfig(**{name: V - 1}).check(V, keywords=[name])
    GenerationConfig(**{name: 50256}).check(V)  # the model's own
    GenerationConfig(**{name: 50256}).check(V, keywords=["max_new_tokens"])  # another keyword's
    with pytest.raises(ValueError) as info:
        GenerationConfig(**{name: V}).check(V, keywords=[name])
    assert str(info.value) == f"{name} must be a token id in [0, {V}){none}, got {V}"
    with pytest.raises(ValueError) as info:
        GenerationConfig(**{name: 1.0}).check(V)
    assert str(info.value) == f"{name} must be a token id >= 0{none}, got 1.0"


def test_a_negative_bos_is_refused_a_negative_pad_or_eos_means_none():
    with pytest.raises(ValueError, match=r"^bos_token_id must be a token id >= 0, got -1$"):
        GenerationConfig(bos_token_id=-1).check(V)
    GenerationConfig(pad_token_id=-1).check(V, keywords=["pad_token_id"])
    for eos in (-1, [5, -1]):
        with pytest.warns(UserWarning) as caught:
            GenerationConfig(eos_token_id=eos).check(V, keywords=["eos_token_id"])
        assert [str(w.message) for w in caught] == [
            f"eos_token_id={eos!r}: a negative id never occurs, so generation stops only at its length"]
        assert GenerationConfig(eos_token_id=eos).eos_ids == ([] if eos == -1 else [5])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GenerationConfig(eos_token_id=[0, V - 1]).check(V, keywords=["eos_token_id"])


def test_generation_config_files_keep_what_differs_and_name_the_file_they_refuse(tmp_path):
    config = GenerationConfig(max_new_tokens=7, eos_token_id=[3, 4], do_sample=True, seed=11)
    assert config.to_dict() == {"max_new_tokens": 7, "eos_token_id": [3, 4], "do_sample": True}  # seed is not saved
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "generation_config.json").read_text()) == config.to_dict()
    assert GenerationConfig.from_pretrained(tmp_path) == GenerationConfig(max_new_tokens=7, eos_token_id=[3, 4],
                                                                          do_sample=True)
    model = GPT2LMHeadModel(tiny_config())
    model.generation_config = config
    save_generation_config(model, tmp_path / "m")
    assert json.loads((tmp_path / "m" / "generation_config.json").read_text()) == config.to_dict()
    save_generation_config(torch.nn.Linear(1, 1), tmp_path / "none")  # a model without one writes nothing
    assert not (tmp_path / "none").exists()

    path = tmp_path / "bad" / "generation_config.json"
    with pytest.raises(CheckpointError) as info:
        GenerationConfig.from_pretrained(tmp_path / "bad")
    assert info.value.file == str(path) and "cannot read the generation config (" in str(info.value)
    path.parent.mkdir()
    path.write_text('{"top_k": -2}')
    with pytest.raises(CheckpointError) as info:
        GenerationConfig.from_pretrained(tmp_path / "bad")
    assert info.value.file == str(path) and str(info.value) == f"{path}: top_k must be an integer >= 0, got -2"
    path.write_text('[1]')
    with pytest.raises(CheckpointError) as info:
        GenerationConfig.from_pretrained(tmp_path / "bad")
    assert str(info.value) == f"{path}: a generation config must be a JSON object, got list"


def test_a_transformers_generation_config_is_applied_over_the_base_and_checked():
    import transformers

    base = GenerationConfig(eos_token_id=5, max_new_tokens=3)
    theirs = transformers.GenerationConfig(top_k=7, do_sample=True)
    assert as_generation_config(theirs, base) == GenerationConfig(eos_token_id=5, max_new_tokens=3, top_k=7,
                                                                  do_sample=True)
    assert as_generation_config(theirs) == GenerationConfig(top_k=7, do_sample=True)
    assert as_generation_config(base, GenerationConfig(top_k=1)) is base
    with pytest.raises(ValueError) as info:
        as_generation_config(transformers.GenerationConfig(diversity_penalty=0.5, num_beam_groups=2))
    assert str(info.value) == ("generation_config sets ['diversity_penalty', 'num_beam_groups'], which gpt2attn's "
                               "generate does not implement")
    with pytest.raises(TypeError) as info:
        as_generation_config({"top_k": 3})
    assert str(info.value) == ("generation_config must be a GenerationConfig (gpt2attn's or transformers'), "
                               "got dict")
