"""gpt2attn.kernels (the CPU decoding products) against their plain-torch references, the
fallback when they cannot be built, and quantize()'s fp32 / fp16 / bf16 modes end to end.

Where the kernels cannot run on the test machine (no AVX2/FMA/F16C, no compiler), the tests that
compare a kernel with its reference skip with that reason; the fallback tests run everywhere."""

import copy
import ctypes
import os

import pytest
import torch

from gpt2attn import GPT2LMHeadModel
from gpt2attn import kernels as K
from gpt2attn.quantize import DECODE_ROWS, Float32Linear, HalfLinear, Int8Linear, kernels
from helpers import hf_twin, max_diff, randomize, tiny_config

needs_kernels = pytest.mark.skipif(not K.available(), reason="the CPU kernels cannot run on this machine")
G = torch.Generator().manual_seed(0)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return max_diff(a, b) / b.abs().max().item()


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B", [1, 3, DECODE_ROWS])
@pytest.mark.parametrize("K_, N", [(64, 96), (100, 37), (40, 21), (103, 19), (768, 2304)])  # loops' tails: N's (37,
# 21, 19), and K's (103: inputs left after the cols kernel's four at a time)
def test_cols_and_rows_match_their_references(dtype, B, K_, N):
    x, w, bias = torch.randn(B, K_, generator=G), torch.randn(K_, N, generator=G).to(dtype), torch.randn(N, generator=G)
    assert relative(K.cols(x, w, bias), K.cols_reference(x, w, bias)) < 1e-5
    assert relative(K.cols(x, w, None), K.cols_reference(x, w, None)) < 1e-5
    wt = w.t().contiguous()  # (N, K)
    assert relative(K.rows(x, wt, bias), K.rows_reference(x, wt, bias)) < 1e-5
    assert relative(K.rows(x, wt, None), K.rows_reference(x, wt, None)) < 1e-5


@needs_kernels
def test_quantize_q8_is_exactly_the_reference():
    x = torch.randn(5, 256, generator=G) * torch.logspace(-3, 2, 256)
    x[1, 32:64] = 0  # a block of zeros: scale 0, values 0
    xq, xs = K.quantize_q8(x)
    rq, rs = K.quantize_q8_reference(x)
    assert torch.equal(xq, rq) and torch.equal(xs, rs)
    assert torch.equal(xs[1, 1], torch.tensor(0.0)) and xq.abs().max() == 127
    assert relative((xq.view(5, -1, 32).float() * xs[..., None]).view(5, 256), x) < 1 / 127


@needs_kernels
@pytest.mark.parametrize("B", [1, 2, 7])
@pytest.mark.parametrize("K_", [96, 64])  # 3 blocks of 32 (AVX-512 takes two, then one) and 2
def test_rows_q8_matches_its_reference(B, K_):
    N = 70  # 70 rows: groups of 4 and a tail
    x, bias = torch.randn(B, K_, generator=G), torch.randn(N, generator=G)
    w8 = torch.randint(-127, 128, (N, K_), generator=G, dtype=torch.int8)
    scale = torch.rand(N, generator=G)
    assert relative(K.rows_q8(x, w8, scale, bias), K.rows_q8_reference(x, w8, scale, bias)) < 1e-5
    exact = x @ (w8.float() * scale[:, None]).t() + bias  # what int8 input blocks approximate
    assert relative(K.rows_q8_reference(x, w8, scale, bias), exact) < 0.02


@needs_kernels
@pytest.mark.parametrize("streams", [1, 3, 8])
def test_read_sum_sums(streams):
    x = torch.randn(100_003, generator=G)  # runs of 32 per stream and thread, and what they leave
    assert abs(K.read_sum(x, streams) - x.double().sum().item()) < 1e-2


@pytest.fixture
def no_kernels(monkeypatch):
    monkeypatch.setattr(K, "library", lambda: None)


def test_without_the_kernels_every_product_is_its_reference(no_kernels):
    x, w, bias = torch.randn(2, 64, generator=G), torch.randn(64, 32, generator=G), torch.randn(32, generator=G)
    assert not K.available() and K.instruction_set() == "none: plain torch"
    assert torch.equal(K.cols(x, w, bias), K.cols_reference(x, w, bias))
    assert torch.equal(K.rows(x, w.t(), bias), K.rows_reference(x, w.t(), bias))
    w8, scale = torch.randint(-127, 128, (32, 64), generator=G, dtype=torch.int8), torch.rand(32, generator=G)
    assert torch.equal(K.rows_q8(x, w8, scale, None), K.rows_q8_reference(x, w8, scale, None))
    model = randomize(GPT2LMHeadModel(tiny_config()), seed=1, std=0.1).eval()
    prompt = torch.randint(0, 97, (1, 6), generator=G)
    expected = model.generate(prompt, max_new_tokens=6)
    assert torch.equal(copy.deepcopy(model).quantize("fp32").generate(prompt, max_new_tokens=6), expected)
    assert all(value.startswith("decode: plain torch") for value in kernels(model.quantize("int8")).values())


def test_a_failed_build_warns_once_and_falls_back(monkeypatch, tmp_path):
    monkeypatch.setattr(K, "_unusable", lambda: None)
    monkeypatch.setattr(K, "_compiler", lambda: "false")  # a "compiler" that always fails
    monkeypatch.setenv("GPT2ATTN_CACHE", str(tmp_path))
    K.library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="CPU decoding kernels unavailable, using plain torch: building"):
            assert K.library() is None
        x, w = torch.randn(1, 8), torch.randn(8, 4)
        assert torch.equal(K.cols(x, w, None), x @ w)
    finally:
        K.library.cache_clear()


@needs_kernels
def test_a_compiler_without_avx512_builds_the_avx2_kernels(monkeypatch, tmp_path):
    refuses = tmp_path / "cxx"  # g++ that refuses every AVX-512 flag, as an old compiler would
    refuses.write_text(f'#!/bin/sh\nfor a in "$@"; do case "$a" in -mavx512*) exit 1;; esac; done\nexec {K._compiler()} "$@"\n')
    refuses.chmod(0o755)
    monkeypatch.setattr(K, "_compiler", lambda: str(refuses))
    monkeypatch.setattr(K, "_cpu_flags", lambda: {"avx2", "fma", "f16c", *K.AVX512})
    monkeypatch.delenv("GPT2ATTN_AVX512", raising=False)
    monkeypatch.setenv("GPT2ATTN_CACHE", str(tmp_path))
    K.library.cache_clear()
    try:
        assert K.library() is not None
        assert [path.name for path in (tmp_path / "kernels").iterdir()] == [K._build(K.FLAGS).name]
        assert K.instruction_set() == "AVX2, FMA, F16C"  # what was built, not what was asked for
        x, w = torch.randn(2, 40, generator=G), torch.randn(21, 40, generator=G)
        assert relative(K.rows(x, w, None), K.rows_reference(x, w, None)) < 1e-5
    finally:
        K.library.cache_clear()


@needs_kernels
def test_a_first_build_says_so_once_and_a_cached_one_says_nothing(monkeypatch, tmp_path, capfd):
    built = K._build()  # the library already in the cache; a stand-in compiler copies it to its -o path
    copies = tmp_path / "cxx"
    copies.write_text(f'#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\ncp {built} "$2"\n')
    copies.chmod(0o755)
    monkeypatch.setattr(K, "_compiler", lambda: str(copies))
    monkeypatch.setenv("GPT2ATTN_CACHE", str(tmp_path / "cache"))
    K.library.cache_clear()
    try:
        capfd.readouterr()
        assert K.library() is not None
        assert capfd.readouterr().err == ("gpt2attn: compiling the CPU decoding kernels for this CPU, once "
                                          f"(cached in {tmp_path / 'cache' / 'kernels'})\n")
        K.library.cache_clear()  # a new process, as far as the build is concerned: the cache holds it now
        assert K.library() is not None
        assert capfd.readouterr().err == ""
    finally:
        K.library.cache_clear()


def test_unusable_names_the_reason(monkeypatch):
    monkeypatch.setenv("GPT2ATTN_KERNELS", "0")
    assert K._unusable() == "GPT2ATTN_KERNELS=0"
    monkeypatch.delenv("GPT2ATTN_KERNELS")
    monkeypatch.setattr(K, "_cpu_flags", lambda: {"avx2"})
    if K.platform.system() == "Linux" and K.platform.machine() in ("x86_64", "AMD64"):
        assert K._unusable() == "this CPU lacks fma, f16c"


def test_avx512_is_built_only_where_the_cpu_has_all_of_it(monkeypatch):
    monkeypatch.delenv("GPT2ATTN_AVX512", raising=False)
    monkeypatch.setattr(K, "_cpu_flags", lambda: {"avx2", "fma", "f16c", "avx512f", "avx512bw"})
    assert K.flags() == K.FLAGS
    monkeypatch.setattr(K, "_cpu_flags", lambda: {"avx2", "fma", "f16c", *K.AVX512})
    assert K.flags() == K.FLAGS + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"]
    monkeypatch.setenv("GPT2ATTN_AVX512", "0")
    assert K.flags() == K.FLAGS


@needs_kernels
@pytest.mark.skipif(not set(K.AVX512) <= K._cpu_flags(), reason="this CPU has no AVX-512: its one build is the AVX2 one")
def test_the_avx2_build_also_matches_the_references_on_an_avx512_cpu(monkeypatch):
    """The other tests run the AVX-512 build here; this one the AVX2 build every other CPU runs."""
    asked = os.environ.get("GPT2ATTN_AVX512", "1") != "0"  # the user's GPT2ATTN_AVX512=0 builds AVX2 alone
    assert K.instruction_set().startswith("AVX-512") == asked
    monkeypatch.setenv("GPT2ATTN_AVX512", "0")
    lib = K._bind(ctypes.CDLL(str(K._build())))
    monkeypatch.setattr(K, "library", lambda: lib)
    for K_, N in [(40, 21), (768, 2304)]:
        x, w, bias = torch.randn(3, K_, generator=G), torch.randn(N, K_, generator=G), torch.randn(N, generator=G)
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            assert relative(K.rows(x, w.to(dtype), bias), K.rows_reference(x, w.to(dtype), bias)) < 1e-5
            wc = w.t().contiguous().to(dtype)
            assert relative(K.cols(x, wc, bias), K.cols_reference(x, wc, bias)) < 1e-5
    x, bias = torch.randn(2, 96, generator=G), torch.randn(70, generator=G)
    w8, scale = torch.randint(-127, 128, (70, 96), generator=G, dtype=torch.int8), torch.rand(70, generator=G)
    assert relative(K.rows_q8(x, w8, scale, bias), K.rows_q8_reference(x, w8, scale, bias)) < 1e-5


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
        monkeypatch.setattr(K, name, lambda *a, f=getattr(K, name), n=name: calls.append(n) or f(*a))
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


@pytest.mark.parametrize("mode, dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_half_modes_compute_with_the_rounded_weights(model, ids, mode, dtype):
    half = copy.deepcopy(model).quantize(mode)
    assert isinstance(half.transformer.h[0].attn.c_attn, HalfLinear)
    assert half.transformer.h[0].attn.c_attn.weight16.dtype == dtype
    rounded = copy.deepcopy(model)  # fp32 model whose matrices are the 16-bit values
    with torch.no_grad():
        for name, p in rounded.named_parameters():
            if p.dim() == 2 and "wpe" not in name:  # wte too: it is the tied head
                p.copy_(p.to(dtype).float())
    with torch.no_grad():
        expected, full = rounded(ids).logits, model(ids).logits
        for got in (decode_logits(half, ids), half(ids).logits):  # decoding (kernels) and prefill (torch)
            assert relative(got, expected) < 1e-3 if mode == "bf16" else relative(got, expected) < 1e-4
        assert relative(half(ids).logits, full) < (0.05 if mode == "bf16" else 0.01)
    state = half.state_dict()
    assert {k: v.shape for k, v in state.items()} == {k: v.shape for k, v in model.state_dict().items()}
    assert state["lm_head.weight"] is half.transformer.wte.weight
    assert torch.equal(state["transformer.h.0.attn.c_attn.weight"], rounded.transformer.h[0].attn.c_attn.weight)


@needs_kernels
def test_int8_decoding_goes_through_the_q8_kernel_close_to_prefill(model, ids, monkeypatch):
    q = copy.deepcopy(model).quantize("int8")
    calls = []
    monkeypatch.setattr(K, "rows_q8", lambda *a, f=K.rows_q8: calls.append(1) or f(*a))
    with torch.no_grad():
        prefill = q(ids).logits  # 14 rows: fbgemm
        assert not calls
        decoded = decode_logits(q, ids)
    assert calls
    assert relative(decoded, prefill) < 0.05
    assert relative(decoded, model(ids).logits) < 0.1


def test_int8_layer_of_width_not_a_multiple_of_32_takes_fbgemm():
    layer = Int8Linear(torch.randn(8, 40, generator=G), None)
    x = torch.randn(1, 40, generator=G)
    assert relative(layer(x), x @ layer.dequantized_weight().t()) < 0.05
