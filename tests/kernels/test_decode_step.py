"""gpt2attn.decode_step (a whole decoding step in one C++ call) against its reference, the model's
own forward, for a plain fp32 model and in every precision quantize() offers, at gpt2-small's
shapes in every build this CPU can run, on 2 threads; and generate() taking it exactly when it can
(decided once per request by gpt2attn.generation.decoder.unfused_reason).

The reference for each comparison is the same model run through its modules (for a quantized
model, the per-layer kernels), so the only difference is the step: same weights, same rounding."""

import copy
import gc
import re

import pytest
import torch
from torch import nn

from gpt2attn import GPT2Config, GPT2LMHeadModel, kernels
from gpt2attn.cache import KVCache
from gpt2attn.decode_step import DecodeStep
from gpt2attn.generation import decoder as D
from gpt2attn.generation.search import FUSED_TOKENS
from gpt2attn.layers import kernel_products, no_tap
from gpt2attn.quantize import DECODE_ROWS
from tests.helpers import hf_twin, kernel_builds, max_diff, needs_kernels, num_threads, randomize, tiny_config

MODES = ["plain", "fp32", "fp16", "bf16", "int8"]  # plain: the model as loaded, no quantize() call


def model_for(mode, **overrides):
    fields = dict(n_embd=64, n_head=4, vocab_size=203)  # int8 needs widths in blocks of 32
    fields.update(overrides)
    base = randomize(GPT2LMHeadModel(tiny_config(**fields)), seed=5, std=0.1).eval()
    return base if mode == "plain" else base.quantize(mode)


def both_ways(model, B, prompt_len=6, capacity=16):
    """(reference logits, step logits, reference cache, step cache) for one new token after a prompt."""
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (B, prompt_len + 1), generator=torch.Generator().manual_seed(B))
    caches = [KVCache.preallocate(cfg.n_layer, B, cfg.n_head, capacity, cfg.n_embd // cfg.n_head) for _ in range(2)]
    with torch.no_grad(), num_threads(2):
        for cache in caches:
            model(ids[:, :prompt_len], cache=cache)
        expected = model(ids[:, prompt_len:], cache=caches[0]).logits[:, -1]
        assert D.unfused_reason(model, B) is None
        got = DecodeStep(model)(ids[:, prompt_len:], caches[1])
    return expected, got, caches[0], caches[1]


def count_steps(monkeypatch) -> list:
    """A list that gets an entry for each step the kernels take: one a DecodeStep call, one a token
    of the greedy loop's (DecodeStep.greedy)."""
    calls = []
    monkeypatch.setattr(DecodeStep, "__call__", lambda self, *a, f=DecodeStep.__call__: calls.append(1) or f(self, *a))

    def greedy(self, *args, f=DecodeStep.greedy):
        n = f(self, *args)
        calls.extend([1] * n)
        return n
    monkeypatch.setattr(DecodeStep, "greedy", greedy)
    return calls


@needs_kernels
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("B", [1, 3, DECODE_ROWS])
def test_step_equals_the_modules(mode, B):
    expected, got, ref_cache, cache = both_ways(model_for(mode), B)
    assert max_diff(got, expected) < 1e-5
    assert cache.length == ref_cache.length == 7
    assert max_diff(cache.block, ref_cache.block) < 1e-5  # the new keys and values, in place, nothing else


@needs_kernels
@pytest.mark.parametrize("mode", ["plain", "fp16", "bf16"])
@pytest.mark.parametrize("overrides", [
    dict(n_embd=36, n_head=3, n_inner=100, vocab_size=37),  # head size 12 and odd widths: every loop's tail
    dict(n_embd=40, n_head=4, n_inner=72, vocab_size=45),  # widths of 8 past a multiple of 16: AVX-512's tail
    dict(scale_attn_by_inverse_layer_idx=True, n_layer=3),
    dict(scale_attn_weights=False, activation_function="gelu_pytorch_tanh"),
])
def test_step_follows_the_config(mode, overrides):
    expected, got, ref_cache, cache = both_ways(model_for(mode, **overrides), 2)
    assert max_diff(got, expected) < 1e-5 and max_diff(cache.block, ref_cache.block) < 1e-5


@needs_kernels
@pytest.mark.parametrize("B", [1, 3])
def test_int8_step_with_odd_and_even_block_counts(B):
    # 96 inputs: 3 blocks of 32 (AVX-512 takes them two at a time, then one); 160: 5; 64 of the head: 2
    expected, got, ref_cache, cache = both_ways(model_for("int8", n_embd=96, n_head=4, n_inner=160), B)
    assert max_diff(got, expected) < 1e-5 and max_diff(cache.block, ref_cache.block) < 1e-5


@needs_kernels
@pytest.mark.parametrize("mode", ["plain", "fp16", "int8"])
def test_a_step_gives_the_same_logits_on_any_number_of_threads(mode):
    # 3 heads of 32 (int8 needs widths in blocks of 32): on 2 threads one takes 1 head and the other
    # 2, on 3 threads one each, so every thread computes the q, k and v of its own heads in c_attn
    # and attends to them with no barrier between (each thread's run of rows, 32 a head, is whole
    # groups of 16); with heads of 12 (n_embd 36) no run is, and the rows are shared out as in every
    # other product. A row's sum is one thread's, computed alike on any thread, so the rows kinds give
    # the same bits on any number of threads; plain's (in, out) products sum each thread's share of
    # the inputs, so there the sums' order changes with the threads.
    for n_embd, n_head in [(96, 3), (36, 3)]:
        if mode == "int8" and n_embd % 32:
            continue
        model = model_for(mode, n_embd=n_embd, n_head=n_head, n_inner=128)
        cfg = model.config
        ids = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
        got = {}
        for threads in (1, 2, 3):
            cache = KVCache.preallocate(cfg.n_layer, 2, cfg.n_head, 16, cfg.n_embd // cfg.n_head)
            with torch.no_grad(), num_threads(threads):
                model(ids[:, :6], cache=cache)  # the prompt, through the modules
                step_cache = copy.deepcopy(cache)
                expected = model(ids[:, 6:], cache=cache).logits[:, -1]
                got[threads] = DecodeStep(model)(ids[:, 6:], step_cache)
            assert max_diff(got[threads], expected) < 1e-5, (n_embd, threads)
            assert max_diff(step_cache.block, cache.block) < 1e-5, (n_embd, threads)
        if mode != "plain":
            assert torch.equal(got[1], got[2]) and torch.equal(got[1], got[3]), n_embd


@pytest.fixture(scope="module")
def gpt2_small_blocks():
    """gpt2-small's shapes (vocabulary 50257, wider than every layer; 12 heads of 64), 2 blocks."""
    cfg = GPT2Config.from_preset("gpt2")
    cfg.n_layer = 2
    torch.manual_seed(0)  # the large-scores check below reads this model's own scores: the same model every run
    return GPT2LMHeadModel(cfg).eval()


@needs_kernels
@pytest.mark.parametrize("build", sorted(kernel_builds()))
@pytest.mark.parametrize("mode, large_scores", [(mode, True) for mode in MODES] + [("int8", False)])
def test_step_at_gpt2_small_shapes(gpt2_small_blocks, build, mode, large_scores, monkeypatch):
    monkeypatch.setattr(kernels, "library", lambda: kernel_builds()[build])
    model = copy.deepcopy(gpt2_small_blocks)
    if large_scores:  # every query and key gets 4 added to each of its values: q . k / 8 about 64 x 16 / 8 = 128
        with torch.no_grad():
            for block in model.transformer.h:
                block.attn.c_attn.bias[: 2 * model.config.n_embd] += 4.0
        seen, attn = {}, model.transformer.h[0].attn
        attn.tap = lambda name, x: seen.setdefault(name, x)
        with torch.no_grad():
            model(torch.randint(0, 50257, (2, 6), generator=torch.Generator().manual_seed(2)))
        attn.tap = no_tap
        scores = seen["q"] @ seen["k"].transpose(-1, -2) * attn.scale  # (B, nh, T, T) of a prompt
        assert scores.max() > 100 and (scores.amax(-1) - scores.amin(-1)).min() > 1  # large, and far from uniform
    if mode != "plain":
        model.quantize(mode)
    expected, got, ref_cache, cache = both_ways(model, 2, prompt_len=12)  # 13 keys: 8 a vector, and a tail
    # int8 rounds each product's input to 255 levels per 32 values: where the step's LayerNorm or
    # GELU differs from torch's in the last bit, a value can round the other way, which moves the
    # logits by about 1%, at large scores and at ordinary ones alike (measured on 12 random
    # gpt2-small-shaped models at ordinary scores: 8 within 3e-7, 4 at 0.5-1.4%; with 1e-5 here
    # the test failed on about one run in three)
    tolerance = 0.05 if mode == "int8" else 1e-5
    assert max_diff(got, expected) / expected.abs().max() < tolerance
    assert max_diff(cache.block, ref_cache.block) / ref_cache.block.abs().max() < tolerance


@needs_kernels
def test_the_step_keeps_the_tensors_it_points_into():
    """DecodeStep hands decode.cpp raw pointers into the model's tensors and keeps those tensors:
    with the model it was made from deleted and its memory reused, it computes the same logits."""
    model = model_for("plain")
    expected, _, _, _ = both_ways(model, 2)
    gone = copy.deepcopy(model)
    step = DecodeStep(gone)
    del gone
    gc.collect()
    # had the step let go of a tensor, its memory is taken again here and filled with NaN (the tiny
    # model's blocks, under malloc's mmap threshold, come back from its free lists)
    litter = [torch.full_like(p, float("nan")) for p in model.parameters() for _ in range(3)]
    ids = torch.randint(0, 203, (2, 7), generator=torch.Generator().manual_seed(2))  # both_ways' ids for B=2
    cache = KVCache.preallocate(2, 2, 4, 16, 16)
    with torch.no_grad(), num_threads(2):
        model(ids[:, :6], cache=cache)
        got = step(ids[:, 6:], cache)
    del litter
    assert max_diff(got, expected) < 1e-5


@needs_kernels
def test_the_last_position_of_the_cache_and_of_the_model():
    model = model_for("fp32", n_positions=8)
    expected, got, _, _ = both_ways(model, 2, prompt_len=7, capacity=8)  # the new token takes position 7 of 8
    assert max_diff(got, expected) < 1e-5
    full = KVCache.preallocate(2, 1, 4, 9, 16)
    full.length = 8
    with pytest.raises(ValueError, match="position past the model's n_positions"):
        DecodeStep(model)(torch.zeros(1, 1, dtype=torch.long), full)
    assert full.length == 8 and not full.block.any()  # nothing computed


@needs_kernels
@pytest.mark.parametrize("mode", MODES)
def test_generate_takes_the_step_and_keeps_its_tokens(mode, monkeypatch):
    model = model_for(mode)
    prompt = torch.randint(0, 203, (2, 5), generator=torch.Generator().manual_seed(9))
    watched = copy.deepcopy(model)
    watched.transformer.h[0].register_forward_hook(lambda *args: None)  # something watching: the modules run
    assert D.unfused_reason(watched) == "a forward hook on transformer.h.0"
    calls = count_steps(monkeypatch)
    for kwargs in (dict(do_sample=False), dict(num_beams=3), dict(do_sample=True, top_k=20)):
        torch.manual_seed(0)
        fused = model.generate(prompt, max_new_tokens=10, min_new_tokens=10, **kwargs)
        assert len(calls) >= 9
        calls.clear()
        torch.manual_seed(0)
        modules = watched.generate(prompt, max_new_tokens=10, min_new_tokens=10, **kwargs)
        assert not calls
        assert torch.equal(fused, modules), kwargs


@needs_kernels
def test_a_plain_model_decodes_in_one_call_at_transformers_parity_untouched(monkeypatch):
    """No quantize(): generate takes the step with the model's own parameters, its modules and
    parameters as they were (nothing a user or PEFT would notice), logits within 1e-5 of transformers."""
    model = model_for("plain")
    modules = [(name, type(m)) for name, m in model.named_modules()]
    params = {name: (p, p.detach().clone()) for name, p in model.named_parameters()}
    prompt = torch.randint(0, 203, (2, 5), generator=torch.Generator().manual_seed(2))
    calls = count_steps(monkeypatch)
    out = model.generate(prompt, max_new_tokens=8, min_new_tokens=8, return_dict_in_generate=True, output_logits=True)
    assert len(calls) == 7  # every token after the first
    with torch.no_grad():
        expected = hf_twin(model).eval()(out.sequences).logits[:, 4:-1]  # (B, 8, V): the logits of each new token
    assert max_diff(torch.stack(out.logits, dim=1), expected) < 1e-5
    assert [(name, type(m)) for name, m in model.named_modules()] == modules
    for name, p in model.named_parameters():
        assert p is params[name][0] and torch.equal(p, params[name][1]) and p.requires_grad, name


@needs_kernels
def test_a_plain_model_s_first_token_comes_from_the_head_product_every_step_takes():
    """generate's prompt pass takes its last logits from the step's own head product (the kernels'
    rows product on wte, at gpt2-small's vocabulary of 50257), not torch's one-row product, so
    every new token's logits come from one kernel (the blocks' products of the prompt are the
    kernels' too: layers.kernel_products)."""
    model = model_for("plain", vocab_size=50257)
    prompt = torch.randint(0, 50257, (1, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), num_threads(2):
        out = model.generate(prompt, max_new_tokens=1, return_dict_in_generate=True, output_logits=True)
        with kernel_products():
            hidden = model.transformer(prompt).last_hidden_state[:, -1].contiguous()  # (1, C)
        want = DecodeStep(model).logits(hidden)
        torch_head = model.lm_head(hidden)
    assert torch.equal(out.logits[0], want)
    assert max_diff(want, torch_head) < 1e-5 and not torch.equal(want, torch_head)  # same logits, another sum order


@needs_kernels
def test_a_prompt_s_gelu_within_kernel_products_is_the_kernels(monkeypatch):
    """Within kernel_products() (generate's prompt pass) the MLP's tanh GELU is the kernels' (the
    step's own), and outside it torch's; both give the same hidden states to fp32 rounding."""
    from gpt2attn import kernels

    model = model_for("plain")
    prompt = torch.randint(0, 203, (2, 9), generator=torch.Generator().manual_seed(4))
    calls = []
    monkeypatch.setattr(kernels, "gelu", lambda x, real=kernels.gelu: calls.append(x.shape) or real(x))
    with torch.no_grad():
        with kernel_products():
            inside = model.transformer(prompt).last_hidden_state
        assert calls == [(2, 9, model.config.n_inner or 4 * model.config.n_embd)] * model.config.n_layer
        calls.clear()
        outside = model.transformer(prompt).last_hidden_state
    assert not calls and max_diff(inside, outside) < 1e-5


@needs_kernels
@pytest.mark.parametrize("mode", ["plain", "int8"])
def test_left_padded_prompts_take_the_step_and_keep_their_tokens(mode, monkeypatch):
    model = model_for(mode)
    watched = copy.deepcopy(model)
    watched.transformer.register_forward_pre_hook(lambda *args: None)
    ids = torch.randint(1, 203, (3, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]])
    calls = count_steps(monkeypatch)
    for kwargs in (dict(do_sample=False), dict(num_beams=2)):
        fused = model.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, **kwargs)
        assert len(calls) >= 5
        calls.clear()
        assert torch.equal(fused, watched.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, **kwargs))
        assert not calls


@needs_kernels
def test_token_types_take_the_modules(monkeypatch):
    model = model_for("int8")
    calls = count_steps(monkeypatch)
    ids = torch.randint(1, 203, (2, 5), generator=torch.Generator().manual_seed(1))
    model.generate(ids, token_type_ids=torch.zeros_like(ids), max_new_tokens=4)
    assert not calls
    model.generate(ids, max_new_tokens=4)
    assert calls


@needs_kernels
def test_the_path_is_chosen_once_per_request(monkeypatch):
    model = model_for("plain")
    asked = []
    monkeypatch.setattr(D, "unfused_reason", lambda *a, f=D.unfused_reason: asked.append(1) or f(*a))
    model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=12, min_new_tokens=12)
    assert len(asked) == 1


class Wrapped(nn.Module):  # as PEFT wraps a layer: the step cannot see what it adds
    def __init__(self, layer):
        super().__init__()
        self.base_layer = layer
        self.eval()

    def forward(self, x):
        return self.base_layer(x) + 1


def test_unfused_reason_names_each_obstacle(monkeypatch):
    plain = randomize(GPT2LMHeadModel(tiny_config()), seed=1).eval()
    monkeypatch.setattr(kernels, "available", lambda: False)
    assert D.unfused_reason(plain) == "the kernels are not available here"
    monkeypatch.undo()
    if not kernels.available():
        pytest.skip("the CPU kernels cannot run on this machine")
    assert D.unfused_reason(plain) is None
    assert D.unfused_reason(plain, rows=DECODE_ROWS + 1) == "9 rows (the step takes at most 8)"
    assert D.unfused_reason(plain, token_type_ids=torch.zeros(1, 1)) == "token types"
    assert D.unfused_reason(copy.deepcopy(plain).train()) == "the model is in training mode (dropout)"
    half_trained = copy.deepcopy(plain)
    half_trained.transformer.h[1].mlp.train()
    assert D.unfused_reason(half_trained) == "transformer.h.1.mlp is in training mode (dropout)"
    relu = copy.deepcopy(plain)
    relu.config.activation_function = "relu"
    assert "activation_function 'relu'" in D.unfused_reason(relu)
    tapped = copy.deepcopy(plain)
    tapped.transformer.h[1].mlp.tap = lambda name, x: x
    assert D.unfused_reason(tapped) == "a tap on transformer.h.1.mlp"
    pre = copy.deepcopy(plain)
    pre.transformer.ln_f.register_forward_pre_hook(lambda *args: None)
    assert D.unfused_reason(pre) == "a forward hook on transformer.ln_f"
    handle = nn.modules.module.register_module_forward_pre_hook(lambda *args: None)
    try:
        assert D.unfused_reason(plain) == "a global forward hook"
    finally:
        handle.remove()
    wrapped = copy.deepcopy(plain)
    wrapped.transformer.h[0].attn.c_attn = Wrapped(wrapped.transformer.h[0].attn.c_attn)
    assert D.unfused_reason(wrapped) == "transformer.h.0.attn.c_attn is a Wrapped"
    assert D.unfused_reason(copy.deepcopy(plain).double()) == "a parameter that is not contiguous fp32 on the CPU"
    block = copy.deepcopy(plain)
    block.transformer.h[0].mlp = nn.Sequential(block.transformer.h[0].mlp).eval()
    assert D.unfused_reason(block) == "a module of transformer.h.0 was replaced"


def test_a_layer_the_step_does_not_know_is_named_when_it_is_made():
    """DecodeStep made directly (generate asks unfused_reason first)."""
    model = model_for("plain")
    model.transformer.h[1].mlp.c_fc = Wrapped(model.transformer.h[1].mlp.c_fc)
    message = "Wrapped: the decoding step takes Conv1D, nn.Linear or quantize() layers"
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        DecodeStep(model)


@pytest.mark.parametrize("gain", ["strided", "fp64", "meta"])
def test_a_vector_that_is_not_contiguous_fp32_on_the_cpu_is_refused_rather_than_read(gain):
    model = model_for("plain")  # its LayerNorm gains are (64,)
    model.transformer.h[0].ln_1.weight = nn.Parameter({
        "strided": lambda: torch.ones(128)[::2],
        "fp64": lambda: torch.ones(64, dtype=torch.float64),
        "meta": lambda: torch.ones(64, device="meta"),
    }[gain]())
    with pytest.raises(AssertionError):
        DecodeStep(model)


@needs_kernels
def test_a_matrix_that_does_not_fit_or_an_id_outside_the_vocabulary_is_refused_before_anything_runs():
    model = model_for("fp32")
    cache = KVCache.preallocate(2, 1, 4, 16, 16)
    with pytest.raises(ValueError, match="token id outside the vocabulary"):
        DecodeStep(model)(torch.tensor([[203]]), cache)
    step = DecodeStep(model)
    step.layers[1].mlp_proj.N += 8  # wider than the residual stream: would write past its buffer
    with pytest.raises(ValueError, match="do not fit"):
        step(torch.tensor([[3]]), cache)
    assert cache.length == 0 and not cache.block.any()


# generate's greedy loop, FUSED_TOKENS a kernel call (DecodeStep.greedy): the request nothing in Python
# watches (greedy, no processors, no scores, stops at eos alone) takes it; its tokens are those of
# the loop in Python over single steps, which a stopping criterion that never stops forces.

NEVER = [lambda sequences, scores: torch.zeros(sequences.size(0), dtype=torch.bool)]


def count_calls(monkeypatch) -> dict:
    """How many times generate called DecodeStep.greedy and DecodeStep.__call__."""
    calls = {"greedy": 0, "step": 0}
    monkeypatch.setattr(DecodeStep, "__call__", lambda self, *a, f=DecodeStep.__call__: calls.update(
        step=calls["step"] + 1) or f(self, *a))
    monkeypatch.setattr(DecodeStep, "greedy", lambda self, *a, f=DecodeStep.greedy: calls.update(
        greedy=calls["greedy"] + 1) or f(self, *a))
    return calls


@needs_kernels
@pytest.mark.parametrize("mode", MODES + ["q4"])
@pytest.mark.parametrize("B", [1, 3])
def test_a_greedy_request_decodes_in_the_kernels_loop_with_the_tokens_of_single_steps(mode, B, monkeypatch):
    model = model_for(mode, n_embd=256) if mode == "q4" else model_for(mode)  # q4 needs widths in blocks of 256
    ids = torch.randint(1, 203, (B, 6), generator=torch.Generator().manual_seed(B))
    mask = torch.ones(B, 6, dtype=torch.long)
    mask[1:, :2] = 0  # left padding in every row but the first: positions and masked keys go along
    calls = count_calls(monkeypatch)
    with num_threads(2):
        free = model.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=None)
        eos = next(int(t) for t in free[0, 7:] if t != free[0, 6])  # row 0's first new token other than its first
        for eos_ids in (None, eos, [eos, int(free[-1, 6 + 4])]):
            calls.update(greedy=0, step=0)
            fused = model.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=eos_ids, pad_token_id=0)
            n_new = fused.size(1) - 6
            assert calls == {"greedy": -(-(n_new - 1) // FUSED_TOKENS), "step": 0}, eos_ids  # 16 tokens a call
            single = model.generate(ids, attention_mask=mask, max_new_tokens=24, eos_token_id=eos_ids, pad_token_id=0,
                                    stopping_criteria=NEVER)
            assert calls["step"] == single.size(1) - 7 and calls["greedy"] == -(-(n_new - 1) // FUSED_TOKENS)
            assert torch.equal(fused, single), eos_ids
            if eos_ids == eos:  # row 0 ended at its first eos: pad after it, or the request ended there
                end = 6 + int((fused[0, 6:] == eos).nonzero()[0])
                assert end > 6 and (fused[0, end + 1 :] == 0).all()
                assert fused.size(1) == 30 or bool((fused[:, 6:] == eos).any(dim=1).all())


@needs_kernels
def test_the_greedy_loop_leaves_the_cache_as_single_steps_do_at_gpt2_s_vocabulary():
    """Decoder.greedy against the same decoder stepped by forward + kernels.argmax: tokens,
    every cached key and value, the cache's length, and rows finished by eos, on 2 threads."""
    model = model_for("int8", vocab_size=50257)
    ids = torch.randint(0, 50257, (2, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), num_threads(2):
        decs = [D.Decoder(model, 2, 5 + 16, "cpu") for _ in range(2)]
        first = [kernels.argmax(dec.forward(ids)) for dec in decs][0]  # (2,)
        out = torch.full((2, 15), -1)
        expected = [first]
        for _ in range(15):
            expected.append(kernels.argmax(decs[1].forward(expected[-1][:, None])))
        expected = torch.stack(expected[1:], dim=1)  # (2, 15)
        eos = torch.tensor([int(expected[0, 20 // 3])])  # ends row 0 (at its first occurrence)
        unfinished = torch.ones(2, dtype=torch.bool)
        n = decs[0].greedy(first, out, unfinished, torch.tensor([], dtype=torch.long), 0)
        assert n == 15 and torch.equal(out, expected) and unfinished.all()
        assert decs[0].length == decs[1].length == 5 + 15 and torch.equal(decs[0].cache.block, decs[1].cache.block)
        # again, row 0 ending at eos: pad (7) after it, while row 1 goes on
        decs[0].rollback(5)
        out.fill_(-1)
        n = decs[0].greedy(first, out, unfinished, eos, 7)
        stop = int((expected[0] == eos).nonzero()[0])
        assert n == 15 and torch.equal(out[1], expected[1]) and torch.equal(out[0, : stop + 1], expected[0, : stop + 1])
        assert (out[0, stop + 1 :] == 7).all() and unfinished.tolist() == [False, int(eos) not in expected[1]]


@needs_kernels
@pytest.mark.parametrize("threads", [2, 3])
def test_the_greedy_loop_picks_the_first_of_equal_logits_and_the_first_nan_across_the_threads_shares(threads):
    """With ln_f's gain 0 and its bias e_0, every logit is wte[:, 0] at every step, so the loop's
    picks are known: the first of two equal largest values that lie in different threads' shares of
    the 50257, the very last value, or the first NaN, behind a larger finite value, as torch.argmax
    picks (the NaN's embedding then makes every later logit NaN: token 0)."""
    model = model_for("plain", vocab_size=50257)
    with torch.no_grad():
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.zero_()[0] = 1.0
        wte = model.transformer.wte.weight
        wte[:, 0] = torch.linspace(-1, 1, 50257).flip(0)  # largest first: token 0 unless changed below
        wte[[100, 40000], 0] = 5.0  # equal, 100 in the first thread's share, 40000 in the last's

    def loop() -> list[int]:  # six tokens of the greedy loop alone, after token 7 (no first pick in Python)
        dec = D.Decoder(model, 1, 3 + 6, "cpu")
        out = torch.full((1, 6), -1)
        with torch.no_grad():
            dec.forward(torch.tensor([[1, 2, 3]]))
            assert dec.greedy(torch.tensor([7]), out, torch.ones(1, dtype=torch.bool), torch.tensor([], dtype=torch.long), 0) == 6
        return out[0].tolist()

    with num_threads(threads):
        assert loop() == [100] * 6 == [int(torch.argmax(wte[:, 0]))] * 6
        with torch.no_grad():
            wte[50256, 0] = 6.0  # the last logit of the last share
        assert loop() == [50256] * 6
        with torch.no_grad():
            wte[45000, 0] = float("nan")
        assert loop() == [45000] + [0] * 5 and int(torch.argmax(wte[:, 0])) == 45000
        ids = torch.tensor([[1, 2, 3]])
        assert torch.equal(model.generate(ids, max_new_tokens=6, eos_token_id=None),
                           model.generate(ids, max_new_tokens=6, eos_token_id=None, stopping_criteria=NEVER))


@needs_kernels
def test_a_token_the_greedy_loop_cannot_feed_raises_as_the_single_step_does():
    """A negative pad_token_id fed after a row's eos: ValueError from both loops, at the same token."""
    model = model_for("int8")
    ids = torch.randint(1, 203, (2, 5), generator=torch.Generator().manual_seed(9))
    free = model.generate(ids, max_new_tokens=20, eos_token_id=None)
    eos = int(free[0, 5 + 2])
    assert eos not in free[1, 5:8]  # row 1 goes on after row 0 ends: row 0 is fed the pad
    for criteria in (None, NEVER):
        with pytest.raises(ValueError, match="a token id outside the vocabulary"):
            model.generate(ids, max_new_tokens=20, eos_token_id=eos, pad_token_id=-1, stopping_criteria=criteria)


@needs_kernels
def test_a_request_whose_rows_all_end_on_the_last_token_of_a_kernel_call_ends_there():
    """eos as the 17th new token (the first from Python, then FUSED_TOKENS from one call): the
    request ends with it, as the loop over single steps does, with no call for a column of pad."""
    model = model_for("int8")
    with num_threads(2):
        for seed in range(100):  # a prompt whose 17th new token has not come before
            ids = torch.randint(1, 203, (1, 6), generator=torch.Generator().manual_seed(seed))
            free = model.generate(ids, max_new_tokens=24, eos_token_id=None)
            if free[0, 6 + FUSED_TOKENS] not in free[0, 6 : 6 + FUSED_TOKENS]:
                break
        else:
            pytest.fail("no prompt of 100 gives a new 17th token")
        eos = int(free[0, 6 + FUSED_TOKENS])
        fused = model.generate(ids, max_new_tokens=24, eos_token_id=eos)
        assert fused.size(1) == 6 + FUSED_TOKENS + 1 and torch.equal(fused, free[:, : 6 + FUSED_TOKENS + 1])
        assert torch.equal(fused, model.generate(ids, max_new_tokens=24, eos_token_id=eos, stopping_criteria=NEVER))


@needs_kernels
@pytest.mark.parametrize("build", sorted(kernel_builds()))
@pytest.mark.parametrize("mode", ["plain", "fp16", "int8", "q4"])
def test_the_greedy_loop_at_gpt2_small_shapes_in_every_build(gpt2_small_blocks, build, mode, monkeypatch):
    """The kernels' greedy loop against single steps of the same build, at gpt2-small's widths and
    vocabulary, 2 rows (one left-padded) on 2 threads: the same tokens, through more than one call."""
    monkeypatch.setattr(kernels, "library", lambda: kernel_builds()[build])
    model = copy.deepcopy(gpt2_small_blocks)
    if mode != "plain":
        model.quantize(mode)
    ids = torch.randint(0, 50257, (2, 5), generator=torch.Generator().manual_seed(6))
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    calls = count_calls(monkeypatch)
    with num_threads(2):
        fused = model.generate(ids, attention_mask=mask, max_new_tokens=FUSED_TOKENS + 4, eos_token_id=None)
        single = model.generate(ids, attention_mask=mask, max_new_tokens=FUSED_TOKENS + 4, eos_token_id=None,
                                stopping_criteria=NEVER)
    assert calls == {"greedy": 2, "step": FUSED_TOKENS + 3}
    assert torch.equal(fused, single)
