"""gpt2attn.kernels' products (the CPU decoding kernels) against their plain-torch references, in
every build this CPU can run, at gpt2-small's shapes and on 2 threads; the references where the
kernels cannot run; quantize()'s fp32 / fp16 / bf16 / int8 layers end to end.

Where the kernels cannot run on the test machine (no AVX2/FMA/F16C, no compiler), the tests that
compare a kernel with its reference skip with that reason; the fallback tests run everywhere.
The kernel cache and the environment switches: tests/kernels/test_cache.py."""

import copy

import pytest
import torch

from gpt2attn import GPT2LMHeadModel, kernels
from gpt2attn.quantize import DECODE_ROWS, Float32Linear, HalfLinear, Int8Linear
from gpt2attn.quantize import kernels as layer_kernels
from tests.helpers import REPO, hf_twin, kernel_build, kernel_builds, max_diff, needs_kernels, num_threads, randomize, tiny_config

G = torch.Generator().manual_seed(0)
GPT2_SMALL = [(768, 2304), (768, 768), (768, 3072), (3072, 768)]  # each block's (K, N)
VOCAB = 50257  # the head's N: more than any block's width


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return max_diff(a, b) / b.abs().max().item()


@pytest.mark.parametrize("B", [1, 3, DECODE_ROWS])
# loops' tails: N's (37, 21, 19), and K's (103: inputs left after the cols kernel's four at a time)
@pytest.mark.parametrize("K, N", [(64, 96), (100, 37), (40, 21), (103, 19)] + GPT2_SMALL)
def test_cols_and_rows_match_their_references(build, B, K, N):
    x, w, bias = torch.randn(B, K, generator=G), torch.randn(K, N, generator=G), torch.randn(N, generator=G)
    assert relative(kernels.cols(x, w, bias), kernels.cols_reference(x, w, bias)) < 1e-5
    assert relative(kernels.cols(x, w, None), kernels.cols_reference(x, w, None)) < 1e-5
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        wt = w.t().contiguous().to(dtype)  # (N, K)
        assert relative(kernels.rows(x, wt, bias), kernels.rows_reference(x, wt, bias)) < 1e-5
        assert relative(kernels.rows(x, wt, None), kernels.rows_reference(x, wt, None)) < 1e-5


# A prompt's products (more than DECODE_ROWS rows) take the register tiles: the cols tiles, which a
# rows weight takes too from 16 rows on (copied transposed), and below that the rows tiles. B's
# leaving every number of rows after the full tiles in each (1-7 after the AVX-512 cols tiles of 8
# rows, 1-5 after AVX2's of 6, 1-3 after the rows tiles of 4), N's past a full panel or tile (37, 21,
# 19: and past a whole register), K's past a whole register (100, 103) and past a block of k's
# (800, 3072), gpt2-small's shapes.
@pytest.mark.parametrize("B", [DECODE_ROWS + 1, 10, 12, 13, 14, 15, 17, 18, 19, 20, 21, 22, 23, 128, 131])
@pytest.mark.parametrize("K, N", [(64, 96), (100, 37), (40, 21), (103, 19), (800, 50)] + GPT2_SMALL)
def test_a_prompt_s_tiles_match_their_references(build, B, K, N):
    x, w, bias = torch.randn(B, K, generator=G) * 4, torch.randn(K, N, generator=G), torch.randn(N, generator=G)
    exact = x.double() @ w.double() + bias.double()
    assert relative(kernels.cols(x, w, bias), exact) < 1e-5
    assert relative(kernels.cols(x, w, None), exact - bias.double()) < 1e-5
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        wt = w.t().contiguous().to(dtype)  # (N, K)
        exact = x.double() @ wt.double().t() + bias.double()
        assert relative(kernels.rows(x, wt, bias), exact) < 1e-5, dtype
        assert relative(kernels.rows(x, wt, None), exact - bias.double()) < 1e-5, dtype


@pytest.mark.parametrize("B", [17, 131])
@pytest.mark.parametrize("K, N", [(100, 37), (800, 50), (3072, 768)])
def test_a_long_prompt_s_rows_product_is_the_cols_product_of_the_widened_weight(build, B, K, N):
    """From 16 rows on (decode.cpp's TRANSPOSED_ROWS) a rows weight's prompt takes the cols tiles,
    its weight transposed and widened as it is copied: the very bits of the cols product on the fp32
    (K, N) weight it holds, where the rows tiles' sums (across lanes) would differ in the last bits."""
    x, w, bias = torch.randn(B, K, generator=G) * 4, torch.randn(K, N, generator=G), torch.randn(N, generator=G)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        wt = w.t().contiguous().to(dtype)  # (N, K)
        held = wt.float().t().contiguous()  # (K, N): the same values
        assert torch.equal(kernels.rows(x, wt, bias), kernels.cols(x, held, bias)), dtype
        assert torch.equal(kernels.rows(x, wt, None), kernels.cols(x, held, None)), dtype


def test_a_prompt_s_tiles_give_the_same_sums_on_any_number_of_threads(build):
    """Each output is one thread's sum, in one order: 1, 2 and 3 threads give the same bits."""
    x, w = torch.randn(67, 768, generator=G), torch.randn(768, 2304, generator=G)
    w16, bias = w.t().contiguous().half(), torch.randn(2304, generator=G)
    results = []
    for n in (1, 2, 3):
        with num_threads(n):
            results.append((kernels.cols(x, w, bias), kernels.rows(x, w16, bias)))
    for cols, rows in results[1:]:
        assert torch.equal(cols, results[0][0]) and torch.equal(rows, results[0][1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8])
def test_the_head_at_gpt2_small_shape(build, dtype):
    x, bias = torch.randn(3, 768, generator=G), torch.randn(VOCAB, generator=G)
    if dtype == torch.int8:
        w8, scale = torch.randint(-127, 128, (VOCAB, 768), generator=G, dtype=torch.int8), torch.rand(VOCAB, generator=G)
        assert relative(kernels.rows_q8(x, kernels.group_rows_q8(w8), scale, bias), kernels.rows_q8_reference(x, w8, scale, bias)) < 1e-5
    else:
        w = (torch.randn(VOCAB, 768, generator=G) * 0.02).to(dtype)
        assert relative(kernels.rows(x, w, bias), kernels.rows_reference(x, w, bias)) < 1e-5


@pytest.mark.parametrize("shape", [(128, 3072), (3, 4099), (13,)])  # gpt2-small's MLP; past chunks and registers
def test_gelu_is_torch_s_tanh_gelu(build, shape):
    x = torch.randn(shape, generator=G) * 4
    x.view(-1)[:7] = torch.tensor([0.0, -100.0, 100.0, float("inf"), -float("inf"), float("nan"), 1e-30])
    torch.testing.assert_close(kernels.gelu(x), kernels.gelu_reference(x), rtol=1e-5, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("V", [1, 13, VOCAB])
def test_argmax_is_torch_s_with_ties_infinities_and_nans(build, V):
    """generate's greedy pick: the first of equal largest values, and the first NaN in a row that
    holds one, as torch's argmax, at GPT-2's vocabulary and at tails shorter than a register."""
    scores = torch.randn(6, V, generator=G) * 30
    scores[1] = scores[1].max()  # every value equal: the first
    scores[2, V // 2 :] = scores[2].max() + 1  # ties from the middle on
    scores[3] = -float("inf")
    scores[4, V - 1] = float("inf")
    scores[5, V // 3] = float("nan")
    scores[5, V - 1] = float("nan")
    assert torch.equal(kernels.argmax(scores), scores.argmax(dim=-1))
    assert torch.equal(kernels.argmax(scores[:, : V // 2 + 1].t().t()), scores[:, : V // 2 + 1].argmax(dim=-1))


def test_quantize_q8_is_exactly_the_reference(build):
    x = torch.randn(5, 256, generator=G) * torch.logspace(-3, 2, 256)
    x[1, 32:64] = 0  # a block of zeros: scale 0, values 0
    xq, xs = kernels.quantize_q8(x)
    rq, rs = kernels.quantize_q8_reference(x)
    assert torch.equal(xq, rq) and torch.equal(xs, rs)
    assert torch.equal(xs[1, 1], torch.tensor(0.0)) and xq.abs().max() == 127
    assert relative((xq.view(5, -1, 32).float() * xs[..., None]).view(5, 256), x) < 1 / 127


@pytest.mark.parametrize("B", [1, 2, 7])
@pytest.mark.parametrize("K, N", [(96, 70), (64, 70)] + GPT2_SMALL)  # 3 blocks of 32 (AVX-512 takes two, then one), 2
def test_rows_q8_matches_its_reference(build, B, K, N):
    _check_rows_q8(B, K, N)


# a prompt's rows: quantized by the threads together (more than 8), in chunks of 2^18 bytes of int8
# x (85 rows at K = 3072: 130 rows are two chunks), spans taken in turn
@pytest.mark.parametrize("B, K, N", [(9, 96, 70), (37, 768, 2304), (130, 3072, 768), (130, 768, 3072), (67, 768, 768)])
def test_rows_q8_of_a_prompt_matches_its_reference(build, B, K, N):
    _check_rows_q8(B, K, N)


def _check_rows_q8(B, K, N):
    x, bias = torch.randn(B, K, generator=G), torch.randn(N, generator=G)
    w8 = torch.randint(-127, 128, (N, K), generator=G, dtype=torch.int8)
    scale = torch.rand(N, generator=G)
    assert relative(kernels.rows_q8(x, kernels.group_rows_q8(w8), scale, bias), kernels.rows_q8_reference(x, w8, scale, bias)) < 1e-5
    exact = x @ (w8.float() * scale[:, None]).t() + bias  # what int8 input blocks approximate
    assert relative(kernels.rows_q8_reference(x, w8, scale, bias), exact) < 0.02


@pytest.mark.parametrize("N", [5, 16, 70])  # fewer rows than a group, one group, four groups and 6 rows left
@pytest.mark.parametrize("K", [64, 7])  # quads only; a tail of 3 bytes a row
def test_the_int8_layout_holds_each_weight_where_group_rows_q8_documents_it(N, K):
    w8 = torch.randint(-127, 128, (N, K), generator=G, dtype=torch.int8)
    grouped = kernels.group_rows_q8(w8)
    assert grouped.shape == w8.shape and grouped.dtype == torch.uint8
    assert torch.equal(kernels.ungroup_rows_q8(grouped), w8)
    flat, quads = grouped.view(-1).tolist(), K // 4 * 4
    for r in range(N):  # row r's weights, found by the layout the docstring gives
        first = r // 16 * 16
        n, i = min(16, N - first), r - first  # the rows of its group, its place there
        for k in range(K):
            at = first * K + (4 * n * (k // 4) + 4 * i + k % 4 if k < quads else 4 * n * (K // 4) + (k - quads) * n + i)
            assert flat[at] == int(w8[r, k]) + 128, (r, k)


def test_rows_q8_gives_the_same_bits_on_any_threads_in_a_prompt_and_in_either_build(monkeypatch):
    # a row's sum is one group's, block by block in one order, whichever thread takes it, read in
    # quarters or among the groups left (the last padded), for a step's rows or a prompt's, and
    # the AVX2 build sums each block as exactly as the AVX-512 one
    builds = kernel_builds()
    if not builds:
        pytest.skip("the kernels cannot run here")
    w8 = torch.randint(-127, 128, (3072 + 5, 768), generator=G, dtype=torch.int8)
    grouped, scale = kernels.group_rows_q8(w8), torch.rand(3072 + 5, generator=G)
    x = torch.randn(40, 768, generator=G)
    outs = []
    for lib in builds.values():
        monkeypatch.setattr(kernels, "library", lambda lib=lib: lib)
        for threads in (1, 2, 3):
            with num_threads(threads):
                outs += [kernels.rows_q8(x, grouped, scale, None), kernels.rows_q8(x[:3], grouped, scale, None)]
    for out in outs:
        assert torch.equal(out, outs[0][: out.size(0)])
    assert relative(outs[0], kernels.rows_q8_reference(x, w8, scale, None)) < 1e-5


def test_the_prefetch_distance_changes_no_sums(monkeypatch):
    # the rows products ask for their weights further ahead on some CPUs (kernels.PREFETCH_AHEAD):
    # built with each distance, a step's product of the head's rows (real GPT-2 shapes, large
    # values, 2 threads) gives the same bits in every weight dtype
    if not kernel_builds():
        pytest.skip("the kernels cannot run here")
    wide = list(kernels.AVX512.values()) if "avx512" in kernel_builds() else []
    intel = [f"-DGPT2ATTN_PREFETCH_AHEAD={kernels.PREFETCH_AHEAD['GenuineIntel']}"]
    libs = [kernel_build(kernels.FLAGS + wide + define) for define in ([], intel)]  # simd.h's default distance, and Intel's
    x, w = torch.randn(DECODE_ROWS, 768, generator=G) * 1e3, torch.randn(VOCAB, 768, generator=G) * 1e3
    bias = torch.randn(VOCAB, generator=G)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        wt = w.to(dtype)
        outs = []
        for lib in libs:
            monkeypatch.setattr(kernels, "library", lambda lib=lib: lib)
            with num_threads(2):
                outs.append(kernels.rows(x, wt, bias))
        assert torch.equal(outs[0], outs[1]), dtype
        assert relative(outs[0], kernels.rows_reference(x, wt, bias)) < 1e-5, dtype


def test_a_steps_cols_product_gives_the_same_bits_in_either_build(monkeypatch):
    # the AVX-512 build adds 16 outputs a step where the AVX2 one adds 8, each output the same sums
    # in the same order; N leaves 8 outputs after the last 16 and 5 after the last 8, K rows after
    # the quarters
    builds = kernel_builds()
    if len(builds) < 2:
        pytest.skip("this CPU runs only the AVX2 kernels")
    K, N = 770, 3072 + 8 + 5
    w, bias = torch.randn(K, N, generator=G) * 30, torch.randn(N, generator=G)
    x = torch.randn(3, K, generator=G) * 100
    for threads in (2, 3):
        outs = []
        for lib in builds.values():
            monkeypatch.setattr(kernels, "library", lambda lib=lib: lib)
            with num_threads(threads):
                outs.append(kernels.cols(x, w, bias))
        assert torch.equal(outs[0], outs[1]), threads
        assert relative(outs[0], kernels.cols_reference(x, w, bias)) < 1e-5


@pytest.mark.parametrize("sign", [1, -1])
def test_rows_q8_at_the_largest_weights_and_inputs(build, sign):
    # every weight and every quantized input at 127 in magnitude, signs matched so every product adds:
    # each 32-value sum as large as it can be (the AVX2 build adds pairs of 127 x 127 in int16)
    K, N = 768, 37
    pattern = torch.where(torch.arange(K) % 3 == 0, -1, 1)
    w8 = (127 * pattern).to(torch.int8).expand(N, K).contiguous()
    x = (3.0 * sign * pattern).float().expand(2, K).contiguous()
    scale = torch.full((N,), 0.01)
    exact = x.double() @ (w8.double() * scale.double()[:, None]).t()
    assert torch.allclose(exact.abs(), torch.full_like(exact, 3.0 * 127 * 0.01 * K))  # every product adds
    assert relative(kernels.rows_q8(x, kernels.group_rows_q8(w8), scale, None).double(), exact) < 1e-6


def test_a_matrix_the_kernels_do_not_take_is_refused(build):
    x = torch.randn(1, 40, generator=G)
    with pytest.raises(ValueError, match="no matrix of kind 4 with K=40"):  # int8 rows need K in blocks of 32
        kernels.rows_q8(x, torch.zeros(8, 40, dtype=torch.uint8), torch.ones(8), None)
    with pytest.raises(TypeError, match="takes float32"):
        kernels.cols(x, torch.zeros(40, 8, dtype=torch.float16), None)


@pytest.fixture
def no_kernels(monkeypatch):
    monkeypatch.setattr(kernels, "library", lambda: None)


def test_without_the_kernels_every_product_is_its_reference(no_kernels):
    x, w, bias = torch.randn(2, 64, generator=G), torch.randn(64, 32, generator=G), torch.randn(32, generator=G)
    assert not kernels.available() and kernels.instruction_set() == "none: plain torch"
    assert torch.equal(kernels.cols(x, w, bias), kernels.cols_reference(x, w, bias))
    assert torch.equal(kernels.rows(x, w.t(), bias), kernels.rows_reference(x, w.t(), bias))
    w8, scale = torch.randint(-127, 128, (32, 64), generator=G, dtype=torch.int8), torch.rand(32, generator=G)
    assert torch.equal(kernels.rows_q8(x, kernels.group_rows_q8(w8), scale, None), kernels.rows_q8_reference(x, w8, scale, None))
    model = randomize(GPT2LMHeadModel(tiny_config()), seed=1, std=0.1).eval()
    prompt = torch.randint(0, 97, (1, 6), generator=G)
    expected = model.generate(prompt, max_new_tokens=6)
    assert torch.equal(copy.deepcopy(model).quantize("fp32").generate(prompt, max_new_tokens=6), expected)
    assert all(value.startswith("decode: plain torch") for value in layer_kernels(model.quantize("int8")).values())


def test_int8_decodes_in_blocks_of_32_with_or_without_the_kernels(monkeypatch):
    """Without kernels, int8 decoding and prefill take the q8 reference (the input in blocks of
    32): the same results as the kernels', to fp32 rounding."""
    layer = Int8Linear(torch.randn(48, 64, generator=G), torch.randn(48, generator=G))
    x = torch.randn(2, 64, generator=G) * torch.logspace(-2, 1, 64)  # blocks of very different sizes
    reference = kernels.rows_q8_reference(x, layer.weight8, layer.scale, layer.bias)
    fast = layer(x)
    monkeypatch.setattr(kernels, "library", lambda: None)
    slow = layer(x)
    assert torch.equal(slow, reference)
    if kernel_builds():
        assert relative(fast, slow) < 1e-5
    assert torch.equal(layer.prefill(x), slow)


@pytest.fixture(scope="module")
def model():
    return randomize(GPT2LMHeadModel(tiny_config()), seed=2, std=0.1).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(3))


def decode_logits(model, ids):
    """Logits of every position, fed one token per forward through the KV cache (the decoding path)."""
    out, past = [], None
    with torch.no_grad():
        for t in range(ids.size(1)):
            step = model(ids[:, t : t + 1], past_key_values=past, use_cache=True)
            out.append(step.logits)
            past = step.past_key_values
    return torch.cat(out, dim=1)


@needs_kernels
def test_fp32_mode_decodes_through_the_kernels_at_transformers_parity(model, ids, monkeypatch):
    fast = copy.deepcopy(model).quantize("fp32")
    assert all(isinstance(m, Float32Linear) for n, m in fast.named_modules() if n.endswith(("c_attn", "c_proj", "c_fc", "lm_head")))
    assert fast.lm_head.weight is fast.transformer.wte.weight  # the parameters themselves, tie kept
    assert {k: v.shape for k, v in fast.state_dict().items()} == {k: v.shape for k, v in model.state_dict().items()}
    calls = []
    for name in ("cols", "rows"):
        monkeypatch.setattr(kernels, name, lambda *a, f=getattr(kernels, name), n=name: calls.append(n) or f(*a))
    with torch.no_grad():
        expected = hf_twin(model).eval()(ids).logits
    got = decode_logits(fast, ids)
    assert {"cols", "rows"} <= set(calls)  # the kernels did the products
    assert max_diff(got, expected) < 1e-5
    prompt = ids[:1, :3]
    assert torch.equal(fast.generate(prompt, max_new_tokens=8), model.generate(prompt, max_new_tokens=8))


def test_fp32_mode_keeps_training_gradients(model, ids):
    fast, reference = copy.deepcopy(model).quantize("fp32"), copy.deepcopy(model)  # eval: no dropout
    loss = fast(ids[:1, :1], labels=ids[:1, :1]).loss  # one row: the decode-sized call, with gradients
    loss.backward()
    ref_loss = reference(ids[:1, :1], labels=ids[:1, :1]).loss
    ref_loss.backward()
    w, w_ref = fast.transformer.h[0].mlp.c_fc.weight, reference.transformer.h[0].mlp.c_fc.weight
    assert w.grad is not None and max_diff(w.grad, w_ref.grad) < 1e-6


# native: a bf16 prompt through torch's bf16 product (the path of a CPU with AVX512-BF16 or AMX), which
# rounds its input and output to bf16 too; else the weight widened to fp32. Both run on any CPU.
@pytest.mark.parametrize("mode, dtype, native", [("fp16", torch.float16, False), ("bf16", torch.bfloat16, False),
                                                 ("bf16", torch.bfloat16, True)])
def test_half_modes_compute_with_the_rounded_weights(model, ids, mode, dtype, native):
    half = copy.deepcopy(model).quantize(mode)
    for layer in half.modules():
        if isinstance(layer, HalfLinear):
            layer.native_bf16 = native
    assert isinstance(half.transformer.h[0].attn.c_attn, HalfLinear)
    assert half.transformer.h[0].attn.c_attn.weight16.dtype == dtype
    rounded = copy.deepcopy(model)  # fp32 model whose matrices are the 16-bit values
    with torch.no_grad():
        for name, p in rounded.named_parameters():
            if p.dim() == 2 and "wpe" not in name:  # wte too: it is the tied head
                p.copy_(p.to(dtype).float())
    with torch.no_grad():
        expected, full = rounded(ids).logits, model(ids).logits
        decoded, prefill = decode_logits(half, ids), half(ids).logits  # the kernels; torch
        assert relative(decoded, expected) < (1e-3 if mode == "bf16" else 1e-4)
        assert relative(prefill, expected) < (1e-2 if native else 1e-3 if mode == "bf16" else 1e-4)
        assert (relative(prefill, decoded) > 1e-4) == native  # bf16 inputs: not decoding's sums
        assert relative(half(ids).logits, full) < (0.05 if mode == "bf16" else 0.01)
    state = half.state_dict()
    assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in model.state_dict().items()}
    assert state["lm_head.weight"] is half.transformer.wte.weight
    assert torch.equal(state["transformer.h.0.attn.c_attn.weight"], rounded.transformer.h[0].attn.c_attn.weight)


@needs_kernels
def test_int8_prefill_and_decoding_go_through_the_q8_kernel_alike(model, ids, monkeypatch):
    """One int8 copy serves both: a prompt's rows (14, more than DECODE_ROWS) take the same q8
    kernel as decoding's, each row quantized alike, so the two give the same logits."""
    q = copy.deepcopy(model).quantize("int8")
    assert not any(isinstance(t, torch.ScriptObject) for m in q.modules() for t in vars(m).values())  # no packed copy
    calls = []
    monkeypatch.setattr(kernels, "rows_q8", lambda *a, f=kernels.rows_q8: calls.append(a[0].size(0)) or f(*a))
    with torch.no_grad():
        prefill = q(ids).logits
        assert calls and min(calls) == ids.numel() > DECODE_ROWS
        decoded = decode_logits(q, ids)
    assert relative(decoded, prefill) < 1e-5
    assert relative(decoded, model(ids).logits) < 0.1


@pytest.mark.parametrize("rows", [1, DECODE_ROWS + 1])
def test_int8_layer_of_width_not_a_multiple_of_32_takes_the_dequantized_weight(rows):
    layer = Int8Linear(torch.randn(8, 40, generator=G), None)
    x = torch.randn(rows, 40, generator=G)
    assert relative(layer(x), x @ layer.dequantized_weight().t()) < 1e-6
    assert layer.kernel.startswith("torch fp32 on the dequantized weight")


@pytest.mark.parametrize("mode", ["fp32", "fp16", "bf16", "int8"])
@pytest.mark.parametrize("tied", [True, False])
def test_a_quantized_model_saves_and_reloads_tied_or_not(mode, tied, tmp_path):
    plain = randomize(GPT2LMHeadModel(tiny_config(tie_word_embeddings=tied, n_embd=64)), seed=4, std=0.1).eval()
    quantized = copy.deepcopy(plain).quantize(mode)
    quantized.save_pretrained(tmp_path)
    again = GPT2LMHeadModel.from_pretrained(tmp_path)
    assert (again.lm_head.weight is again.transformer.wte.weight) == tied
    state = quantized.state_dict()
    for name, tensor in again.state_dict().items():
        assert torch.equal(tensor, state[name]), name  # the weights it computes with, in fp32


@needs_kernels
@pytest.mark.parametrize("streams", [1, 3, 8])
def test_the_benchmarks_read_sum_sums(streams, monkeypatch):
    """scripts/read_rate.cpp (the benchmarks' read rate; not part of the package) sums what it reads."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    from bench_common import read_sum

    x = torch.randn(100_003, generator=G)  # runs of 32 per stream and thread, and what they leave
    with num_threads(2):
        assert abs(read_sum(x, streams) - x.double().sum().item()) < 1e-2


@needs_kernels
def test_a_first_build_says_so_once_and_a_cached_one_says_nothing(monkeypatch, tmp_path, capfd):
    built = kernels.build(kernels.SOURCES, kernels.flags(), [])  # a stand-in compiler copies it to its -o path
    copies = tmp_path / "cxx"
    copies.write_text(f'#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\ncp {built} "$2"\n')
    copies.chmod(0o755)
    monkeypatch.setattr(kernels, "_compiler", lambda: str(copies))
    monkeypatch.setenv("GPT2ATTN_CACHE", str(tmp_path / "cache"))
    kernels.library.cache_clear()
    try:
        capfd.readouterr()
        assert kernels.library() is not None
        assert capfd.readouterr().err == ("gpt2attn: compiling the CPU decoding kernels for this CPU, once "
                                          f"(cached in {tmp_path / 'cache' / 'kernels'})\n")
        kernels.library.cache_clear()  # a new process, as far as the build is concerned: the cache holds it now
        assert kernels.library() is not None
        assert capfd.readouterr().err == ""
    finally:
        kernels.library.cache_clear()
