import pytest
import torch

from gpt2attn import GPT2Config, GPT2LMHeadModel
from tests.helpers import hf_twin, randomize, tiny_config


@pytest.fixture(scope="module")
def models():
    model = randomize(GPT2LMHeadModel(tiny_config(n_positions=64)), seed=1).eval()
    return model, hf_twin(model).eval()


def test_greedy_matches_transformers(models):
    model, hf = models
    prompt = torch.randint(1, 97, (1, 7), generator=torch.Generator().manual_seed(0))
    ours = model.generate(prompt, max_new_tokens=20)
    theirs = hf.generate(prompt, max_new_tokens=20)
    assert torch.equal(ours, theirs)


def test_a_default_config_model_generates_like_transformers():
    """GPT-2's default config keeps bos = eos = 50256; with a smaller vocabulary that eos never
    occurs, so it never stops a row, and min_new_tokens has nothing to suppress."""
    model = randomize(GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=32, n_layer=1, n_head=2)), seed=2).eval()
    hf = model.to_transformers().eval()
    prompt = torch.randint(0, 100, (2, 5), generator=torch.Generator().manual_seed(0))
    for settings in (dict(), dict(num_beams=3, min_new_tokens=4), dict(do_sample=True, top_k=5)):
        torch.manual_seed(0)
        ours = model.generate(prompt, max_new_tokens=12, **settings)
        torch.manual_seed(0)
        theirs = hf.generate(prompt, max_new_tokens=12, **settings)
        assert ours.shape == (2, 17) and torch.equal(ours, theirs), settings


def test_input_ids_and_their_embeddings_give_the_ids_then_the_new_tokens(models):
    model, hf = models
    prompt = torch.randint(1, 97, (2, 6), generator=torch.Generator().manual_seed(4))
    embeds = model.transformer.wte(prompt).detach() + 0.01  # not the ids' own: the embeddings are what counts
    ours = model.generate(prompt, inputs_embeds=embeds, max_new_tokens=8)
    assert torch.equal(ours, hf.generate(prompt, inputs_embeds=embeds, max_new_tokens=8))
    assert torch.equal(ours[:, :6], prompt)
    assert torch.equal(ours[:, 6:], model.generate(inputs_embeds=embeds, max_new_tokens=8))
    with pytest.raises(ValueError, match="input_ids must be the 0 cached tokens or those and the 6"):
        model.generate(prompt[:, :4], inputs_embeds=embeds, max_new_tokens=8)


def test_inputs_embeds_with_beams_and_several_sequences_as_transformers(models):
    """Each embedded prompt is repeated per beam / returned sequence, as its ids would be."""
    model, hf = models
    prompt = torch.randint(1, 97, (2, 5), generator=torch.Generator().manual_seed(6))
    embeds = model.transformer.wte(prompt).detach() + 0.01
    for kw in (dict(num_beams=2), dict(num_beams=3, num_return_sequences=2)):
        kw = dict(kw, max_new_tokens=6, eos_token_id=None)
        ours = model.generate(inputs_embeds=embeds, **kw)
        assert ours.shape == (2 * kw.get("num_return_sequences", 1), 6)
        assert torch.equal(ours, hf.generate(inputs_embeds=embeds, **kw)), kw


def test_left_padded_batch_equals_each_prompt_alone(models):
    model, hf = models
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 97, (n,), generator=g) for n in (6, 3, 1)]
    ids = torch.zeros(3, 6, dtype=torch.long)
    mask = torch.zeros(3, 6, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, 6 - len(p) :], mask[row, 6 - len(p) :] = p, 1
    batch = model.generate(ids, max_new_tokens=12, attention_mask=mask)
    theirs = hf.generate(ids, attention_mask=mask, max_new_tokens=12)
    assert torch.equal(batch, theirs)
    for row, p in enumerate(prompts):
        alone = model.generate(p[None], max_new_tokens=12)
        assert torch.equal(batch[row, 6:], alone[0, len(p) :])


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(models):
    model, _ = models
    prompt = torch.tensor([[5, 6, 7]])
    a = model.generate(prompt, max_new_tokens=15, do_sample=True, seed=11)
    b = model.generate(prompt, max_new_tokens=15, do_sample=True, generator=torch.Generator().manual_seed(11))
    assert torch.equal(a, b)
    greedy = model.generate(prompt, max_new_tokens=15)
    assert torch.equal(model.generate(prompt, max_new_tokens=15, do_sample=True, top_k=1, seed=4), greedy)
    assert torch.equal(model.generate(prompt, max_new_tokens=15, do_sample=True, temperature=1e-4, seed=4), greedy)


@torch.no_grad()
def test_filtered_tokens_are_never_sampled(models):
    model, _ = models
    prompt = torch.tensor([[9, 8, 7, 6]])
    logits = model(prompt).logits[0, -1]
    for kw, allowed in (
        (dict(top_k=5), set(logits.topk(5).indices.tolist())),
        (dict(top_p=0.5), _nucleus(logits, 0.5)),
    ):
        seen = {int(model.generate(prompt, max_new_tokens=1, do_sample=True, seed=s, **kw)[0, -1]) for s in range(200)}
        assert seen <= allowed, (kw, seen, allowed)
        assert len(seen) > 1 or len(allowed) == 1  # it does sample, not just take the argmax


def _nucleus(logits, top_p):
    """Smallest set of most likely tokens whose probability reaches top_p (computed with numpy)."""
    import numpy as np

    p = np.exp(logits.double().numpy() - logits.double().numpy().max())
    p /= p.sum()
    keep, mass = set(), 0.0
    for i in np.argsort(-p):
        keep.add(int(i))
        mass += p[i]
        if mass >= top_p:
            return keep
    return keep


def test_repetition_penalty_matches_transformers(models):
    model, hf = models
    prompt = torch.tensor([[3, 4, 3, 4, 3]])
    ours = model.generate(prompt, max_new_tokens=15, repetition_penalty=1.8)
    theirs = hf.generate(prompt, max_new_tokens=15, repetition_penalty=1.8)
    assert torch.equal(ours, theirs)


def test_repetition_penalty_skips_left_padding_even_where_it_holds_the_tokens_to_come(models):
    """Each left-padded row continues as the prompt alone does in transformers, although its
    padding positions hold the very tokens that row goes on to write; the first real token still
    counts (the last row's one token is what greedy decoding would repeat without the penalty)."""
    model, hf = models
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        repeats = [t for t in range(1, 97) if hf(torch.tensor([[t]])).logits[0, -1].argmax() == t]
    prompts = [torch.randint(1, 97, (n,), generator=g) for n in (6, 3)] + [torch.tensor(repeats[:1])]
    kw = dict(max_new_tokens=10, eos_token_id=None, pad_token_id=0, repetition_penalty=2.0)
    alone = [hf.generate(p[None], **kw)[0, len(p) :] for p in prompts]
    assert alone[2][0] != prompts[2][0]  # the penalty on that token decides the row
    ids = torch.zeros(3, 6, dtype=torch.long)
    mask = torch.zeros(3, 6, dtype=torch.long)
    for row, p in enumerate(prompts):
        n_pad = 6 - len(p)
        ids[row, :n_pad], ids[row, n_pad:], mask[row, n_pad:] = alone[row][:n_pad], p, 1
    batch = model.generate(ids, attention_mask=mask, **kw)[:, 6:]
    assert torch.equal(batch, torch.stack(alone))


def test_eos_stops_each_row(models):
    model, hf = models
    prompt = torch.tensor([[1, 2, 3], [40, 41, 42]])
    free = model.generate(prompt, max_new_tokens=10)
    eos = int(free[0, 5])  # row 0's third new token
    out = model.generate(prompt, max_new_tokens=10, eos_token_id=eos, pad_token_id=96)
    theirs = hf.generate(prompt, max_new_tokens=10, do_sample=False, eos_token_id=eos, pad_token_id=96)
    assert torch.equal(out, theirs)
    first = (free[0, 3:] == eos).nonzero()[0, 0] + 3
    assert out[0, first] == eos and (out[0, first + 1 :] == 96).all()


def test_streaming_yields_the_same_tokens(models):
    model, _ = models
    prompt = torch.tensor([[5, 6]])
    steps = list(model.generate(prompt, max_new_tokens=8, stream=True))
    assert torch.equal(torch.stack(steps, dim=1), model.generate(prompt, max_new_tokens=8)[:, 2:])


def test_bad_requests_raise_before_work(models):
    model, _ = models
    with pytest.raises(ValueError, match="n_positions=64"):
        model.generate(torch.zeros(1, 60, dtype=torch.long), max_new_tokens=5)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(torch.zeros(1, 3, dtype=torch.long), do_sample=True, temperature=0)
    with pytest.raises(ValueError, match="top_p"):
        model.generate(torch.zeros(1, 3, dtype=torch.long), top_p=1.5)


def test_cli_streams_the_same_text_as_generate(tmp_path, capsys, models):
    from gpt2attn.cli import main
    from gpt2attn.tokenizer import char_tokenizer

    model, _ = models
    alphabet = "".join(chr(c) for c in range(32, 32 + 97))  # 97 characters = vocab_size
    tokenizer = char_tokenizer(alphabet)
    model.save_pretrained(tmp_path)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    assert main(["generate", "--model", str(tmp_path), "--greedy", "--max-new-tokens", "12", "hello"]) == 0
    expected = model.generate(torch.tensor([tokenizer.encode("hello").ids]), max_new_tokens=12)
    assert capsys.readouterr().out == tokenizer.decode(expected[0].tolist()) + "\n"
    assert main(["generate", "--model", str(tmp_path / "nope"), "hi"]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path), "--max-new-tokens", "0", "hi"]) == 2
    assert "--max-new-tokens must be >= 1, got 0" in capsys.readouterr().err


def test_cli_window_slides_past_the_context(models):
    """gpt2attn generate goes on past n_positions (64 here) from the last half of the text."""
    from gpt2attn.commands.generate import continue_ids

    model, _ = models
    n_ctx = model.config.n_positions
    prompt = [5, 6, 7]
    got = list(continue_ids(model, prompt, 100, do_sample=False, eos_token_id=None))
    # By hand, without a cache: when the window is full it restarts from its last 32 tokens.
    ids, start = list(prompt), 0
    with torch.no_grad():
        while len(ids) < len(prompt) + 100:
            if len(ids) - start == n_ctx:
                start = len(ids) - n_ctx // 2
            ids.append(int(model(torch.tensor([ids[start:]])).logits[0, -1].argmax()))
    assert got == ids[len(prompt) :]

    long_prompt = [i % 97 for i in range(80)]  # longer than the context: its last 63 tokens are used
    expected = model.generate(torch.tensor([long_prompt[-(n_ctx - 1) :]]), max_new_tokens=1)[0, -1]
    assert list(continue_ids(model, long_prompt, 1, do_sample=False, eos_token_id=None)) == [int(expected)]


def test_cli_takes_a_hub_name_from_the_cache(tmp_path, monkeypatch, capsys, models):
    """`gpt2attn generate --model NAME` finds model and tokenizer in huggingface_hub's cache."""
    import huggingface_hub

    from gpt2attn.cli import main
    from gpt2attn.tokenizer import char_tokenizer, load_tokenizer
    from tests.helpers import fake_hub_cache

    model, _ = models
    tokenizer = char_tokenizer("".join(chr(c) for c in range(32, 32 + 97)))
    snapshot = fake_hub_cache(tmp_path, "someone/tiny-gpt2", model)
    tokenizer.save(str(snapshot / "tokenizer.json"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    assert load_tokenizer("someone/tiny-gpt2", cache_dir=tmp_path).encode("hi").ids == tokenizer.encode("hi").ids
    assert main(["generate", "--model", "someone/tiny-gpt2", "--greedy", "--max-new-tokens", "5", "hello"]) == 0
    expected = model.generate(torch.tensor([tokenizer.encode("hello").ids]), max_new_tokens=5)
    assert capsys.readouterr().out == tokenizer.decode(expected[0].tolist()) + "\n"


def _count_forwards(model):
    """A list that grows by one each time model.transformer runs."""
    calls = []
    model.transformer.register_forward_hook(lambda *_: calls.append(1))
    return calls


def test_assisted_decoding_equals_greedy_with_several_tokens_per_forward(models):
    model, _ = models
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10]])
    greedy = model.generate(prompt, max_new_tokens=30, eos_token_id=None)
    verifier = randomize(GPT2LMHeadModel(tiny_config(n_positions=64)), seed=1).eval()  # same weights as model
    verifier.load_state_dict(model.state_dict())
    calls = _count_forwards(verifier)

    # An assistant that always agrees (the model itself): 1 prompt pass, then 6 tokens per forward.
    out = verifier.generate(prompt, max_new_tokens=30, eos_token_id=None, assistant_model=model, num_assistant_tokens=5)
    assert torch.equal(out, greedy)
    assert len(calls) == 1 + 5  # 30 tokens: 1 from the prompt pass, then 5 forwards of (5 drafts + 1)

    # A smaller, different assistant (1 layer): drafts are often wrong, the output is still greedy's.
    small = randomize(GPT2LMHeadModel(tiny_config(n_positions=64, n_layer=1)), seed=5).eval()
    assert torch.equal(verifier.generate(prompt, max_new_tokens=30, eos_token_id=None, assistant_model=small), greedy)

    # Prompt lookup on text that repeats itself (this model falls into loops).
    looping = greedy[:, :30]
    calls.clear()
    out = verifier.generate(looping, max_new_tokens=30, eos_token_id=None, prompt_lookup_num_tokens=4)
    assert torch.equal(out, model.generate(looping, max_new_tokens=30, eos_token_id=None))
    assert len(calls) < 30 / 2  # more than two tokens per forward on average


def test_assisted_decoding_stops_at_eos_like_greedy(models):
    model, _ = models
    prompt = torch.tensor([[5, 6, 7, 8, 9, 10]])
    free = model.generate(prompt, max_new_tokens=20, eos_token_id=None)
    eos = int(free[0, 12])
    expected = model.generate(prompt, max_new_tokens=20, eos_token_id=eos)
    assert torch.equal(model.generate(prompt, max_new_tokens=20, eos_token_id=eos, assistant_model=model), expected)
    assert torch.equal(model.generate(prompt, max_new_tokens=20, eos_token_id=eos, prompt_lookup_num_tokens=3), expected)


def test_generation_config_from_config_file_and_keywords(tmp_path, models):
    """Defaults: generation_config.json when saved, else the config's special tokens; keywords win."""
    import transformers

    model, _ = models
    m = GPT2LMHeadModel(tiny_config(n_positions=64, eos_token_id=7, bos_token_id=3))
    assert (m.generation_config.eos_token_id, m.generation_config.bos_token_id) == (7, 3)
    m.generation_config = m.generation_config.update(num_beams=3, no_repeat_ngram_size=2, max_new_tokens=9)
    m.save_pretrained(tmp_path)
    theirs = transformers.GenerationConfig.from_pretrained(tmp_path)  # transformers reads our file
    assert (theirs.num_beams, theirs.no_repeat_ngram_size, theirs.max_new_tokens, theirs.eos_token_id) == (3, 2, 9, 7)
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path)
    assert loaded.generation_config == m.generation_config
    prompt = torch.tensor([[5, 6, 7]])
    assert torch.equal(loaded.generate(prompt), loaded.generate(prompt, num_beams=3, no_repeat_ngram_size=2, max_new_tokens=9))
    assert loaded.generate(prompt, max_new_tokens=4, eos_token_id=None).shape == (1, 7)


def test_stop_strings_end_the_text(models):
    from gpt2attn.tokenizer import char_tokenizer

    model, _ = models
    tokenizer = char_tokenizer("".join(chr(c) for c in range(32, 32 + 97)))
    prompt = torch.tensor([[5, 6, 7]])
    free = model.generate(prompt, max_new_tokens=20, eos_token_id=None)
    stop = tokenizer.decode(free[0, 8:10].tolist())  # two characters the model writes at new tokens 5-6
    out = model.generate(prompt, max_new_tokens=20, eos_token_id=None, stop_strings=[stop], tokenizer=tokenizer)
    text = tokenizer.decode(out[0].tolist())
    assert text.endswith(stop) and text.count(stop) == 1 and torch.equal(out[0], free[0, : out.size(1)])


def test_cli_samples_differ_and_beams_run(tmp_path, capsys, models):
    """Each --num-samples continuation has its own seed; --num-beams gives beam search's text."""
    from gpt2attn.cli import main
    from gpt2attn.tokenizer import char_tokenizer

    model, _ = models
    tokenizer = char_tokenizer("".join(chr(c) for c in range(32, 32 + 97)))
    model.save_pretrained(tmp_path)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    args = ["generate", "--model", str(tmp_path), "--max-new-tokens", "20", "--top-k", "0", "--seed", "1", "hello"]
    assert main(args + ["--num-samples", "3"]) == 0
    samples = capsys.readouterr().out.split("\n---------------\n")
    assert len(samples) == 3 and len(set(samples)) == 3
    assert main(args + ["--greedy", "--num-beams", "3", "--no-repeat-ngram-size", "2"]) == 0
    expected = model.generate(torch.tensor([tokenizer.encode("hello").ids]), max_new_tokens=20, num_beams=3,
                              no_repeat_ngram_size=2, do_sample=False)
    assert capsys.readouterr().out == tokenizer.decode(expected[0].tolist()) + "\n"
    assert main(args + ["--greedy", "--prompt-lookup", "3"]) == 0
    expected = model.generate(torch.tensor([tokenizer.encode("hello").ids]), max_new_tokens=20)
    assert capsys.readouterr().out == tokenizer.decode(expected[0].tolist()) + "\n"


def test_generate_outputs_read_as_transformers_outputs(models):
    model, _ = models
    out = model.generate(torch.tensor([[5, 6]]), max_new_tokens=3, return_dict_in_generate=True, output_scores=True)
    assert out["sequences"] is out.sequences is out[0] and list(out.keys()) == ["sequences", "scores", "cache"]
    beams = model.generate(torch.tensor([[5, 6]]), max_new_tokens=3, num_beams=2, return_dict_in_generate=True)
    assert "sequences_scores" not in beams and beams.beam_indices.shape == (1, 3)


@pytest.mark.parametrize("layout", ["preallocated block", "a tensor per layer"])
def test_cache_reorder_equals_a_gather_for_every_beam_mapping(layout):
    """KVCache.reorder writes rows in place in a dependency order (gathering only cycles):
    for every mapping of 4 beams, swaps and cycles included, it equals buf[rows]. Given start,
    where each row already equals its source before start[i], it copies only the rest."""
    import itertools

    from gpt2attn.cache import KVCache

    g = torch.Generator().manual_seed(0)
    for rows in itertools.product(range(4), repeat=4):
        for with_start in (False, True):
            cache = KVCache.preallocate(2, 4, 2, 8, 3)
            if layout == "a tensor per layer":
                cache = KVCache.from_legacy([(k.clone(), v.clone()) for k, v in zip(cache.keys, cache.values)])
            cache.length = 5
            for buf in (*cache.keys, *cache.values):
                buf.copy_(torch.randn(buf.shape, generator=g))
            want = [buf[:, :, :5][list(rows)].clone() for buf in (*cache.keys, *cache.values)]
            start = None
            if with_start:  # as beams do: row i follows a common history up to where it parted, d[i]
                d = torch.randint(0, 6, (4,), generator=g).tolist()
                for buf in (*cache.keys, *cache.values):
                    for i in range(4):
                        buf[i, :, : d[i]] = buf[0, :, : d[i]]
                start = [min(d[i], d[src]) for i, src in enumerate(rows)]  # what row i shares with its source
                want = [buf[:, :, :5][list(rows)].clone() for buf in (*cache.keys, *cache.values)]
            cache.reorder(torch.tensor(rows), start=start)
            assert (cache.block is not None) == (layout == "preallocated block")
            for buf, expected in zip((*cache.keys, *cache.values), want):
                assert torch.equal(buf[:, :, :5], expected), (rows, start)




@pytest.mark.parametrize("quantized", [False, True], ids=["modules", "quantized fp32"])
def test_a_forward_pre_hook_on_a_block_acts_on_every_step_of_generate(quantized):
    """A pre-hook that changes a block's input (steering) is applied at each step, as it is in a
    plain forward: generate equals greedy decoding by full forward passes with the same hook (the
    quantized model's fused step stands aside while a hook watches)."""
    from gpt2attn import kernels

    if quantized and not kernels.available():
        pytest.skip("the CPU kernels cannot run on this machine: quantize('fp32') has no fused step to avoid")
    model = randomize(GPT2LMHeadModel(tiny_config(n_positions=64)), seed=1).eval()
    if quantized:
        model.quantize("fp32")
    prompt = torch.tensor([[5, 6, 7, 8]])
    plain = model.generate(prompt, max_new_tokens=10, eos_token_id=None)
    calls = []

    def steer(module, args):
        calls.append(args[0].size(1))
        return (args[0] * -1.0, *args[1:])

    handle = model.transformer.h[1].register_forward_pre_hook(steer)
    try:
        steered = model.generate(prompt, max_new_tokens=10, eos_token_id=None)
        expected = prompt
        with torch.no_grad():
            for _ in range(10):
                expected = torch.cat([expected, model(expected).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    finally:
        handle.remove()
    assert torch.equal(steered, expected)
    assert not torch.equal(steered, plain)  # the hook changes the text: the comparison has teeth
    assert calls[:2] == [4, 1]  # the prompt, then one token per step


def test_hooks_on_the_model_itself_see_every_step_of_generate_as_in_transformers():
    """transformers' generate calls the model once per step, so a pre-hook on the model sees the prompt
    and then each new token (by keyword, input_ids=...), and a forward hook that edits the logits
    changes the tokens. Ours does the same: the same calls and the same tokens as transformers."""
    model = randomize(GPT2LMHeadModel(tiny_config(n_positions=64)), seed=2).eval()
    twin = hf_twin(model, "sdpa")
    prompt = torch.tensor([[5, 6, 7, 8]])
    seen = {"ours": [], "theirs": []}

    def watcher(name):
        def pre_hook(module, args, kwargs):
            seen[name].append(tuple(kwargs["input_ids"].shape))
        return pre_hook

    def favour_9(module, args, kwargs, out):
        out.logits[..., 9] += 1e4
        return out

    for name, m in (("ours", model), ("theirs", twin)):
        m.register_forward_pre_hook(watcher(name), with_kwargs=True)
        m.register_forward_hook(favour_9, with_kwargs=True)
    ours = model.generate(prompt, max_new_tokens=5, eos_token_id=None, pad_token_id=0)
    theirs = twin.generate(prompt, max_new_tokens=5, eos_token_id=None, pad_token_id=0)
    assert torch.equal(ours, theirs) and ours[0, 4:].tolist() == [9] * 5
    assert seen["ours"] == seen["theirs"] == [(1, 4)] + [(1, 1)] * 4


@pytest.mark.slow  # torch.compile builds two graphs (about half a minute on 2 cores)
def test_a_static_cache_with_compile_config_compiles_the_steps_once_for_later_requests():
    """cache_implementation="static" with transformers' CompileConfig (told to compile on the CPU too):
    generate runs each one-token step through the model's compiled forward, kept on the model
    (model._compiled_call, as in transformers), with greedy's tokens; a later, shorter request runs on
    the same cache and graph, without compiling again. Without _compile_all_devices the CPU runs
    as always, uncompiled."""
    transformers = pytest.importorskip("transformers")
    model = randomize(GPT2LMHeadModel(tiny_config(n_positions=64)), seed=1).eval()
    prompt = torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    expected = model.generate(prompt, max_new_tokens=6, eos_token_id=None)
    model.generate(prompt, max_new_tokens=6, eos_token_id=None, cache_implementation="static",
                   compile_config=transformers.CompileConfig())
    assert "_compiled_call" not in model.__dict__  # a CPU compiles only when told to

    compile_config = transformers.CompileConfig()
    compile_config._compile_all_devices = True
    kw = dict(eos_token_id=None, cache_implementation="static", compile_config=compile_config)
    torch.compiler.reset()
    assert torch.equal(model.generate(prompt, max_new_tokens=6, **kw), expected)
    compiled, steps = model._compiled_call, []
    model._compiled_call = lambda *args, **kwargs: steps.append(1) or compiled(*args, **kwargs)
    with torch.compiler.set_stance("fail_on_recompile"):  # the same cache and graph: nothing to compile
        assert torch.equal(model.generate(prompt, max_new_tokens=4, **kw), expected[:, : 7 + 4])
    assert len(steps) == 3  # the prompt's pass chose the first token, each compiled step one more
