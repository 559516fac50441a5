"""generate() token for token against transformers.generate on the same weights: beam search
variants, every filter, scores; single prompts and left-padded batches; the shipped char model."""

import pytest
import torch

from gpt2attn import GPT2LMHeadModel
from gpt2attn.shipped import DEFAULT_MODEL_DIR
from tests.helpers import hf_twin, randomize, tiny_config

# A random model whose greedy rows are not one repeated token (std 0.5 spreads the logits).
EOS = 25  # a token this model emits often, so eos handling is exercised


@pytest.fixture(scope="module")
def models():
    model = randomize(GPT2LMHeadModel(tiny_config(n_positions=64)), seed=1, std=0.5).eval()
    return model, hf_twin(model, "sdpa").eval()  # transformers' default attention, as a user runs it


def _prompts():
    g = torch.Generator().manual_seed(3)
    single = (torch.randint(1, 97, (1, 6), generator=g), None)
    lengths = (6, 3, 1)
    ids = torch.zeros(3, 6, dtype=torch.long)
    mask = torch.zeros(3, 6, dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, 6 - n :], mask[row, 6 - n :] = torch.randint(1, 97, (n,), generator=g), 1
    return {"single": single, "left-padded": (ids, mask)}


def _close(ours, theirs, tol=2e-5):
    """Scores equal within tol relative to their size (log-probabilities here reach -40, where
    one float32 step is 4e-6), -inf exactly where transformers has -inf. generate's one-call
    decoding step adds in another order than MKL (logits about 1e-6 relative apart), which
    temperature, penalties and beams' running sums scale up to about 1.5e-5."""
    if isinstance(ours, torch.Tensor):
        ours, theirs = (ours,), (theirs,)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert torch.equal(torch.isinf(a), torch.isinf(b))
        finite = torch.isfinite(b)
        assert ((a[finite] - b[finite]).abs() <= tol * b[finite].abs().clamp(min=1)).all()


BEAMS = {
    "4 beams": dict(num_beams=4),
    "length_penalty 0.5, early_stopping": dict(num_beams=4, length_penalty=0.5, early_stopping=True, eos_token_id=EOS),
    "length_penalty 2, never": dict(num_beams=3, length_penalty=2.0, early_stopping="never", eos_token_id=EOS),
    "length_penalty -1, False": dict(num_beams=3, length_penalty=-1.0, early_stopping=False, eos_token_id=EOS),
    "no_repeat_ngram 2": dict(num_beams=4, no_repeat_ngram_size=2, early_stopping=True),
    "bad_words": dict(num_beams=4, bad_words_ids=[[13], [65, 25], [28, 62]]),
    "min_new_tokens": dict(num_beams=4, min_new_tokens=6, eos_token_id=EOS),
    "eos list": dict(num_beams=3, eos_token_id=[EOS, 13, 62]),
    "num_return_sequences": dict(num_beams=4, num_return_sequences=3, eos_token_id=EOS),
    "repetition_penalty": dict(num_beams=3, repetition_penalty=1.5),
}


@pytest.mark.parametrize("prompt", ["single", "left-padded"])
@pytest.mark.parametrize("name", list(BEAMS))
def test_beam_search_equals_transformers(models, name, prompt):
    model, hf = models
    ids, mask = _prompts()[prompt]
    kw = dict(BEAMS[name], max_new_tokens=12, return_dict_in_generate=True, output_scores=True, output_logits=True)
    ours = model.generate(ids, attention_mask=mask, **kw)
    theirs = hf.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(ours.sequences, theirs.sequences)
    assert torch.equal(ours.beam_indices.long(), theirs.beam_indices.long())
    _close(ours.sequences_scores, theirs.sequences_scores)
    _close(ours.scores, theirs.scores)
    _close(ours.logits, theirs.logits)
    # each token's score in its hypothesis: transformers' method, and its documented identity
    steps = model.compute_transition_scores(ours.sequences, ours.scores, ours.beam_indices)
    _close(steps, hf.compute_transition_scores(theirs.sequences, theirs.scores, theirs.beam_indices))
    n_new = (ours.beam_indices >= 0).sum(dim=1)
    _close(steps.sum(dim=1) / n_new ** kw.get("length_penalty", 1.0), ours.sequences_scores)


SAMPLING = {
    "temperature": dict(temperature=0.7, top_k=0),
    "top_k": dict(top_k=5),
    "top_p": dict(top_p=0.8, top_k=0),
    "min_p": dict(min_p=0.1, top_k=0),
    "typical_p": dict(typical_p=0.7, top_k=0),
    "all warpers": dict(temperature=1.3, top_k=20, top_p=0.9, min_p=0.02, typical_p=0.95),
    "penalties": dict(repetition_penalty=1.3, no_repeat_ngram_size=2, bad_words_ids=[[13], [28, 65]], min_length=12),
    "beam sample": dict(num_beams=3, top_k=10, top_p=0.9, eos_token_id=EOS),
    "num_return_sequences": dict(num_return_sequences=3, top_p=0.9),
}


@pytest.mark.parametrize("prompt", ["single", "left-padded"])
@pytest.mark.parametrize("name", list(SAMPLING))
def test_sampling_equals_transformers_on_the_same_random_stream(models, name, prompt):
    """Both draw with torch.multinomial from the global generator: same seed, same tokens."""
    model, hf = models
    ids, mask = _prompts()[prompt]
    kw = dict(SAMPLING[name], do_sample=True, max_new_tokens=12, return_dict_in_generate=True, output_scores=True)
    torch.manual_seed(7)
    ours = model.generate(ids, attention_mask=mask, **kw)
    torch.manual_seed(7)
    theirs = hf.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(ours.sequences, theirs.sequences)
    _close(ours.scores, theirs.scores)


@pytest.mark.parametrize("prompt", ["single", "left-padded"])
def test_greedy_scores_and_eos_list_equal_transformers(models, prompt):
    model, hf = models
    ids, mask = _prompts()[prompt]
    kw = dict(max_new_tokens=15, eos_token_id=[EOS, 62], min_new_tokens=2, return_dict_in_generate=True,
              output_scores=True, output_logits=True)
    ours, theirs = model.generate(ids, attention_mask=mask, **kw), hf.generate(ids, attention_mask=mask, **kw)
    assert torch.equal(ours.sequences, theirs.sequences)
    _close(ours.scores, theirs.scores)
    _close(ours.logits, theirs.logits)
    assert ours.past_key_values.get_seq_length() == theirs.past_key_values.get_seq_length()
    for normalize in (False, True):
        _close(model.compute_transition_scores(ours.sequences, ours.logits, normalize_logits=normalize),
               hf.compute_transition_scores(theirs.sequences, theirs.logits, normalize_logits=normalize))


def test_max_length_and_config_eos_default_as_transformers(models):
    model, hf = models
    ids = _prompts()["single"][0]
    assert model.generation_config.eos_token_id == 0  # from the config, as transformers reads it
    for kw in (dict(), dict(max_length=11), dict(eos_token_id=EOS, max_length=30)):
        assert torch.equal(model.generate(ids, **kw), hf.generate(ids, **kw)), kw


def test_token_type_ids_inputs_embeds_and_a_given_cache_equal_transformers(models):
    model, hf = models
    ids = _prompts()["single"][0]
    types = torch.tensor([[3, 3, 3, 4, 4, 5]])
    kw = dict(max_new_tokens=10, eos_token_id=None)
    assert torch.equal(model.generate(ids, token_type_ids=types, **kw), hf.generate(ids, token_type_ids=types, **kw))

    embeds = model.transformer.wte(ids).detach()
    ours = model.generate(inputs_embeds=embeds, **kw)
    assert torch.equal(ours, hf.generate(inputs_embeds=embeds, **kw))
    assert ours.shape == (1, 10)  # only the new tokens, as transformers returns them

    past = model(ids[:, :4]).past_key_values
    continued = model.generate(ids, past_key_values=past, **kw)
    assert torch.equal(continued, model.generate(ids, **kw))
    hf_past = hf(ids[:, :4], use_cache=True).past_key_values
    assert torch.equal(continued, hf.generate(ids, past_key_values=hf_past, **kw))


def test_shipped_char_model_greedy_and_beams_equal_transformers():
    from gpt2attn.tokenizer import load_tokenizer

    model = GPT2LMHeadModel.from_pretrained(DEFAULT_MODEL_DIR).eval()
    hf = hf_twin(model, "sdpa").eval()
    tok = load_tokenizer(DEFAULT_MODEL_DIR)
    ids = torch.tensor([tok.encode("ROMEO:\nWhat say").ids])
    for kw in (dict(), dict(num_beams=4, no_repeat_ngram_size=3), dict(num_beams=3, length_penalty=0.6, num_return_sequences=2)):
        kw = dict(kw, max_new_tokens=30, return_dict_in_generate=True, output_scores=True)
        ours, theirs = model.generate(ids, **kw), hf.generate(ids, **kw)
        assert torch.equal(ours.sequences, theirs.sequences), kw
        _close(ours.scores, theirs.scores)
        if "num_beams" in kw:
            _close(ours.sequences_scores, theirs.sequences_scores)
    assert len(set(tok.decode(ours.sequences[0, ids.size(1):].tolist()))) > 5  # real text, not one character


def test_bad_words_whose_prefix_is_the_whole_prompt_ban_the_first_new_token(models):
    model, hf = models
    prompt = torch.tensor([[65]])
    first = int(hf.generate(prompt, max_new_tokens=1, eos_token_id=None)[0, 1])  # what greedy picks after 65
    kw = dict(max_new_tokens=5, eos_token_id=None, bad_words_ids=[[65, first]])
    ours = model.generate(prompt, **kw)
    assert torch.equal(ours, hf.generate(prompt, **kw))
    assert ours[0, 1] != first  # banned at step 1, where the prefix [65] is all there is


def test_a_prompt_ending_with_a_stop_string_goes_on_until_the_text_writes_it_again(models):
    import transformers

    from gpt2attn.tokenizer import char_tokenizer

    model, hf = models
    tokenizer = char_tokenizer("".join(chr(c) for c in range(32, 32 + 97)))
    free = hf.generate(torch.tensor([[5, 6, 7, 8, 9]]), max_new_tokens=20, eos_token_id=None)
    prompt = free[:, :8]
    stop = tokenizer.decode(prompt[0, -2:].tolist())  # the prompt's last two characters
    assert stop in tokenizer.decode(free[0, 9:].tolist())  # ... which the model writes again later
    kw = dict(max_new_tokens=20, eos_token_id=None, stop_strings=[stop])
    theirs = hf.generate(prompt, tokenizer=transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer), **kw)
    ours = model.generate(prompt, tokenizer=tokenizer, **kw)
    assert torch.equal(ours, theirs)
    assert ours.size(1) > prompt.size(1) + 2 and tokenizer.decode(ours[0].tolist()).endswith(stop)


@pytest.mark.parametrize("penalties", [dict(repetition_penalty=1.5), dict(no_repeat_ngram_size=2),
                                       dict(repetition_penalty=1.2, no_repeat_ngram_size=3)],
                         ids=["repetition_penalty", "no_repeat_ngram", "both"])
def test_assisted_decoding_and_prompt_lookup_with_processors_equal_greedy(models, penalties):
    """The check of each draft token sees the tokens accepted before it, never the drafts after it."""
    model, hf = models
    prompt = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])  # repeats itself: prompt lookup finds drafts
    kw = dict(penalties, max_new_tokens=25, eos_token_id=None)
    greedy = hf.generate(prompt, **kw)
    small = randomize(GPT2LMHeadModel(tiny_config(n_positions=64, n_layer=1)), seed=5).eval()
    assert torch.equal(model.generate(prompt, assistant_model=model, num_assistant_tokens=5, **kw), greedy)
    assert torch.equal(model.generate(prompt, assistant_model=small, **kw), greedy)
    assert torch.equal(model.generate(prompt, prompt_lookup_num_tokens=4, **kw), greedy)


@pytest.mark.parametrize("drafts", ["itself", "assistant", "prompt lookup"])
def test_assisted_decoding_returns_the_dict_outputs_with_token_types_and_padding(models, drafts):
    """With return_dict_in_generate, assisted decoding returns what greedy decoding returns: the
    sequences, scores and raw logits token for token as transformers' assisted generate (a
    left-padded prompt with token types), and one entry of attentions / hidden states per token,
    each that of the forward position that chose it, equal to greedy decoding's."""
    model, _ = models
    prompt = torch.tensor([[0, 0, 5, 6, 7, 5, 6, 7, 5]])
    mask = (prompt != 0).long()
    types = torch.tensor([[0, 0, 1, 1, 2, 2, 1, 1, 2]])
    kw = dict(attention_mask=mask, token_type_ids=types, max_new_tokens=10, eos_token_id=None, pad_token_id=0,
              repetition_penalty=1.2, return_dict_in_generate=True, output_scores=True, output_logits=True,
              output_attentions=True, output_hidden_states=True)
    eager = hf_twin(model, "eager").eval()  # transformers' sdpa returns no attention weights
    if drafts == "prompt lookup":
        ours_kw = theirs_kw = dict(prompt_lookup_num_tokens=2)
    else:  # the model itself drafts what it will accept: several tokens a forward
        assistant = model if drafts == "itself" else randomize(GPT2LMHeadModel(tiny_config(n_positions=64, n_layer=1)), seed=5).eval()
        hf_assistant = eager if drafts == "itself" else hf_twin(assistant, "eager").eval()
        hf_assistant.generation_config.num_assistant_tokens = 3
        hf_assistant.generation_config.num_assistant_tokens_schedule = "constant"
        ours_kw, theirs_kw = dict(assistant_model=assistant, num_assistant_tokens=3), dict(assistant_model=hf_assistant)
    theirs = eager.generate(prompt, **kw, **theirs_kw)
    ours = model.generate(prompt, **kw, **ours_kw)
    greedy = model.generate(prompt, **kw)
    assert torch.equal(ours.sequences, theirs.sequences) and torch.equal(ours.sequences, greedy.sequences)
    _close(ours.scores, theirs.scores)
    _close(ours.logits, theirs.logits)
    for key in ("attentions", "hidden_states"):
        steps, greedy_steps = getattr(ours, key), getattr(greedy, key)
        assert len(steps) == len(greedy_steps) == 10
        for step, greedy_step in zip(steps, greedy_steps):
            assert [t.shape for t in step] == [t.shape for t in greedy_step]
            _close(step, greedy_step)  # a verify forward of several positions adds in another order
    assert ours.past_key_values.get_seq_length() == ours.sequences.size(1) - 1  # the last token is not cached yet


def test_assisted_sampling_accepts_drafts_by_transformers_rule():
    """Speculative sampling: each draft is kept with probability min(1, p / q) until one is
    rejected, then the next token comes from max(0, p - q) renormalised (from p after them all):
    on the same random stream, the tokens kept equal transformers' _speculative_sampling."""
    from transformers.generation.utils import _speculative_sampling

    from gpt2attn.generation.assisted import accepted

    g = torch.Generator().manual_seed(0)
    kept_counts = set()
    for seed in range(100):
        d, V = 3, 11
        q_logits = torch.randn(1, d, V, generator=g)
        p_logits = torch.cat((q_logits, torch.randn(1, 1, V, generator=g)), dim=1) + torch.randn(1, d + 1, V, generator=g)
        guesses = torch.multinomial(q_logits[0].softmax(-1), 1, generator=g).squeeze(1)  # (d,) drawn from q
        ids = torch.cat((torch.tensor([4, 2]), guesses))[None]  # the prompt, then the drafts
        torch.manual_seed(seed)
        theirs, n = _speculative_sampling(ids, q_logits, d, p_logits)
        torch.manual_seed(seed)
        ours = accepted(guesses, q_logits[0], p_logits[0], do_sample=True, generator=None)
        assert torch.equal(ours, theirs[0]), seed
        kept_counts.add(int(n))
    assert kept_counts == {0, 1, 2, 3}  # every outcome, from all drafts rejected to all kept, was met


def test_assisted_sampling_keeps_the_models_distribution():
    """The first token after a draft, over many draws, follows the model's own p whatever the
    assistant's q: what sampling without an assistant gives."""
    from gpt2attn.generation.assisted import accepted

    g = torch.Generator().manual_seed(1)
    p_logits, q_logits = torch.randn(2, 6, generator=g), torch.randn(1, 6, generator=g)
    draws = 4000
    counts = torch.zeros(6)
    for _ in range(draws):
        guess = torch.multinomial(q_logits.softmax(-1), 1, generator=g)[0]  # (1,) a draft from q
        counts[accepted(guess, q_logits, p_logits, do_sample=True, generator=g)[0]] += 1
    assert (counts / draws - p_logits[0].softmax(-1)).abs().max() < 0.03  # 4 standard errors at most


def test_assisted_sampling_redraws_from_p_minus_q_where_they_differ_only_on_rare_tokens():
    """After a rejected draft the replacement comes from max(0, p - q) renormalised, even when p and
    q differ only on tokens of probability 1e-30 (the residual is scaled up to sum to one, not
    left to underflow): the one token where p > q is the replacement."""
    from gpt2attn.generation.assisted import accepted

    base = torch.tensor([2.0, 1.0, 0.0, 0.5, -70.0, -70.0])  # tokens 4 and 5: probability about 1e-31
    q_logits = base.clone()[None]
    q_logits[0, 4] += 2.3  # the assistant puts 10x the model's probability on token 4 ...
    p_logits = torch.stack((base, base))
    p_logits[0, 5] += 2.3  # ... the model 10x the assistant's on token 5; elsewhere p == q
    guess = torch.tensor([4])  # kept with probability p/q = 0.1
    g = torch.Generator().manual_seed(0)
    replaced = [accepted(guess, q_logits, p_logits, do_sample=True, generator=g) for _ in range(20)]
    rejected = [t for t in replaced if t.numel() == 1]
    assert len(rejected) >= 10 and all(int(t[0]) == 5 for t in rejected)


@pytest.mark.parametrize("vocab", [3, 50257])
def test_prompt_lookup_drafts_as_transformers(vocab):
    """draft_from_prompt proposes what transformers' PromptLookupCandidateGenerator proposes (no
    processors, no eos): what followed the first earlier match of the longest matching n-gram, at
    most num_tokens; nothing when no n-gram recurs (with GPT-2's vocabulary random text rarely does)."""
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    from gpt2attn.generation.assisted import draft_from_prompt

    g = torch.Generator().manual_seed(0)
    sizes = set()
    for trial in range(60):
        L, num_tokens, max_ngram = trial % 12 + 1, trial % 4 + 1, trial % 3 + 1
        ids = torch.randint(0, vocab, (1, L), generator=g)
        theirs = PromptLookupCandidateGenerator(num_output_tokens=num_tokens, max_matching_ngram_size=max_ngram,
                                                max_length=10_000).get_candidates(ids)[0][0, L:]
        ours, scores = draft_from_prompt(num_tokens, max_ngram)(ids, 10)
        assert torch.equal(ours, theirs), (ids, num_tokens, max_ngram)
        assert scores is None
        assert ours.numel() <= min(num_tokens, 10)
        sizes.add(ours.numel())
    assert 0 in sizes and (max(sizes) >= 3 or vocab > 3)  # misses, and (3 tokens) drafts of several tokens


def test_assisted_sampling_with_top_k_1_equals_greedy(models):
    """Sampling from one token a step (top_k=1) is greedy decoding: through the assistant's drafts
    (its q one-hot too) and through prompt lookup's, the tokens equal greedy's; seeded runs of a
    wider top-k repeat themselves."""
    model, _ = models
    prompt = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    kw = dict(max_new_tokens=20, eos_token_id=None)
    greedy = model.generate(prompt, **kw)
    small = randomize(GPT2LMHeadModel(tiny_config(n_positions=64, n_layer=1)), seed=5).eval()
    for drafts in (dict(assistant_model=small), dict(assistant_model=model), dict(prompt_lookup_num_tokens=3)):
        assert torch.equal(model.generate(prompt, do_sample=True, top_k=1, **drafts, **kw), greedy)
        first = model.generate(prompt, do_sample=True, top_k=20, seed=3, **drafts, **kw)
        assert torch.equal(model.generate(prompt, do_sample=True, top_k=20, seed=3, **drafts, **kw), first)


@pytest.mark.parametrize("kw", [dict(num_beams=2), dict(num_beams=2, num_return_sequences=2),
                                dict(do_sample=True, num_return_sequences=2, top_k=5)],
                         ids=["2 beams", "2 beams 2 sequences", "2 samples"])
def test_a_given_cache_for_two_prompts_with_copies_per_prompt_equals_no_cache(models, kw):
    """Each prompt's cached rows repeat per beam / sample (row 0, row 0, row 1, row 1), not tiled."""
    model, hf = models
    ids = torch.randint(1, 97, (2, 6), generator=torch.Generator().manual_seed(4))
    kw = dict(kw, max_new_tokens=8, eos_token_id=None)
    past = model(ids[:, :4]).past_key_values
    torch.manual_seed(7)
    ours = model.generate(ids, past_key_values=past, **kw)
    torch.manual_seed(7)
    theirs = hf.generate(ids, **kw)  # no cache
    assert torch.equal(ours, theirs)


def test_early_stopping_never_with_a_negative_length_penalty_bounds_by_the_current_length(models):
    """transformers' rule: with early_stopping="never" the best a running beam can still reach is
    its score at max_length only for length_penalty > 0; below 0 a longer beam only loses, so the
    bound is its current length. Bounding by max_length here stops the search before a later,
    better hypothesis (the second one below) is found."""
    model, hf = models
    prompt = torch.tensor([[37, 88, 71, 57]])
    kw = dict(num_beams=2, num_return_sequences=2, length_penalty=-1.0, early_stopping="never", eos_token_id=EOS,
              max_new_tokens=20, return_dict_in_generate=True, output_scores=True)
    ours, theirs = model.generate(prompt, **kw), hf.generate(prompt, **kw)
    assert torch.equal(ours.sequences, theirs.sequences)
    _close(ours.sequences_scores, theirs.sequences_scores)


class StopAfterToken:
    """A caller's stopping criterion, as transformers' StoppingCriteria are written: a row is done
    once its last token is `token`."""

    def __init__(self, token: int):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


@pytest.mark.parametrize("settings", [dict(), dict(num_beams=3)], ids=["greedy", "beams"])
def test_stopping_criteria_as_transformers(models, settings):
    """generate(stopping_criteria=...) stops each row where transformers' generate stops it."""
    from transformers import StoppingCriteriaList

    model, hf = models
    for ids, mask in _prompts().values():
        free = model.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0, **settings)
        token = int(free[0, ids.size(1) + 3])  # one the unconstrained run emits, so the criterion fires
        criteria = StoppingCriteriaList([StopAfterToken(token)])
        ours = model.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0,
                              stopping_criteria=criteria, **settings)
        theirs = hf.generate(ids, attention_mask=mask, max_new_tokens=12, pad_token_id=0,
                             stopping_criteria=criteria, **settings)
        assert torch.equal(ours, theirs)
        assert ours.size(1) < free.size(1)  # the criterion cut the run short


@pytest.mark.parametrize("settings", [dict(), dict(do_sample=True, top_k=10), dict(num_beams=3)],
                         ids=["greedy", "sampling", "beams"])
def test_stopping_criteria_on_a_model_without_eos_as_transformers(settings):
    """No eos: only the caller's criterion stops a row, and a row that stopped before the others
    keeps the tokens it is given (transformers pads finished rows only when there is an eos)."""
    from transformers import StoppingCriteriaList

    model = randomize(GPT2LMHeadModel(tiny_config(n_positions=64, eos_token_id=None, bos_token_id=None)),
                      seed=1, std=0.5).eval()
    hf = hf_twin(model, "sdpa").eval()
    assert model.generation_config.eos_token_id is None and hf.generation_config.eos_token_id is None
    ids = torch.randint(1, 97, (2, 6), generator=torch.Generator().manual_seed(3))
    torch.manual_seed(0)
    free = model.generate(ids, max_new_tokens=12, **settings)
    assert free.size(1) == 18  # nothing stops it
    def lengths(seqs, scores, **kwargs):  # prompt 0 is done at 8 tokens, prompt 1 at 11 (rows: samples or beams)
        return seqs.size(1) >= torch.tensor([8, 11]).repeat_interleave(seqs.size(0) // 2)

    criteria = StoppingCriteriaList([lengths])
    torch.manual_seed(0)
    ours = model.generate(ids, max_new_tokens=12, stopping_criteria=criteria, **settings)
    torch.manual_seed(0)
    theirs = hf.generate(ids, max_new_tokens=12, stopping_criteria=criteria, **settings)
    assert torch.equal(ours, theirs)
    assert ours.size(1) < free.size(1)  # the criterion cut the run short
