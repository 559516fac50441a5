import copy
import gc
import mmap
from pathlib import Path

import pytest
import torch

from gpt2attn import GPT2LMHeadModel, GPT2Model, inspect
from gpt2attn.quantize import Int8Linear, kernels
from tests.helpers import hf_twin, max_diff, num_threads, randomize, shared_data, tiny_config


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return max_diff(a, b) / b.abs().max().item()


@pytest.fixture(scope="module")
def models():
    """(fp32 model, its int8 copy, transformers' fp32 twin), on random weights."""
    model = randomize(GPT2LMHeadModel(tiny_config()), seed=2, std=0.1).eval()
    return model, copy.deepcopy(model).quantize("int8"), hf_twin(model).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 97, (3, 12), generator=torch.Generator().manual_seed(0))


def test_every_conv1d_and_the_head_become_int8_under_their_names(models):
    model, q, _ = models
    assert [n for n, _ in q.named_modules()] == [n for n, _ in model.named_modules()]
    quantized = kernels(q)
    conv_names = [n for n, m in model.named_modules() if type(m).__name__ == "Conv1D"]
    assert sorted(quantized) == sorted(conv_names + ["lm_head"]) and len(conv_names) == 4 * 2
    assert all(isinstance(q.get_submodule(n), Int8Linear) and q.get_submodule(n).conv for n in conv_names)
    assert all(value.endswith("prefill: gpt2attn int8 rows by groups of 16, every row of a prompt in one pass (input in blocks of 32)") for value in quantized.values())


def test_int8_logits_stay_close_to_transformers_fp32(models, ids):
    _, q, hf = models
    with torch.no_grad():
        ours, theirs = q(ids).logits, hf(ids).logits
    assert relative_error(ours, theirs) < 0.1  # a misplaced weight would be ~1
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() > 0.9


def test_int8_weights_are_the_fp32_weights_rounded_per_output_channel(models):
    model, q, _ = models
    w = model.transformer.h[0].mlp.c_fc.weight.t()  # (out, in)
    w8, scale, bias = q.transformer.h[0].mlp.c_fc.int8_weight()
    assert w8.dtype == torch.int8 and torch.equal(w8.abs().amax(dim=1), torch.full((w.size(0),), 127, dtype=torch.int8))
    assert max_diff(w8.float() * scale[:, None], w) <= scale.max().item() / 2 + 1e-7
    assert torch.equal(bias, model.transformer.h[0].mlp.c_fc.bias)


def test_int8_outputs_keep_every_channel_whatever_its_scale():
    """Output channels whose weights are 1000x smaller than others' keep their precision: each
    row has its own scale (one scale for the whole matrix would round the small rows to zero)."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(8, 64, generator=g) * torch.logspace(-3, 0, 8)[:, None]  # (out, in)
    x = torch.randn(5, 64, generator=g)
    got, want = Int8Linear(weight, None)(x), x @ weight.t()  # (5, out)
    per_channel = (got - want).norm(dim=0) / want.norm(dim=0)  # (out,)
    assert (per_channel < 0.05).all(), per_channel  # about 0.02 here: the input is rounded to int8 too


def test_state_dict_keeps_hf_keys_and_shapes_and_the_tie(models):
    model, q, _ = models
    expected = {k: v.shape for k, v in model.state_dict().items()}
    state = q.state_dict()
    assert {k: v.shape for k, v in state.items()} == expected
    assert all(v.dtype == torch.float32 for v in state.values())
    assert state["lm_head.weight"].data_ptr() == q.transformer.wte.weight.data_ptr()


def test_saved_int8_model_reloads_to_the_same_int8_weights(models, ids, tmp_path):
    import transformers

    _, q, _ = models
    q.save_pretrained(tmp_path)
    again = GPT2LMHeadModel.from_pretrained(tmp_path, quantize="int8")
    for name, layer in kernels(q).items():
        w8, scale, _ = q.get_submodule(name).int8_weight()
        w8_again, scale_again, _ = again.get_submodule(name).int8_weight()
        assert torch.equal(w8_again, w8), name
        torch.testing.assert_close(scale_again, scale, rtol=1e-6, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, q(ids).logits, rtol=0, atol=1e-5)
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path)  # an ordinary fp32 HF folder
    for key, value in hf.state_dict().items():
        assert torch.equal(value, q.state_dict()[key]), key


def test_load_state_dict_requantizes(models, ids):
    model, q, _ = models
    fresh = randomize(GPT2LMHeadModel(tiny_config()), seed=9).eval().quantize("int8")
    fresh.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, q(ids).logits)
    state = model.state_dict()
    state["transformer.h.0.mlp.c_fc.weight"] = state["transformer.h.0.mlp.c_fc.weight"][:, :-1]
    with pytest.raises(RuntimeError, match=r"size mismatch for transformer.h.0.mlp.c_fc.weight: \(32, 127\)"):
        fresh.load_state_dict(state)
    del state["transformer.h.0.mlp.c_fc.bias"]
    with pytest.raises(RuntimeError, match="Missing key.*transformer.h.0.mlp.c_fc.bias"):
        fresh.load_state_dict(state)


def test_generate_with_the_cache_matches_full_recompute(models):
    _, q, _ = models
    prompt = torch.randint(0, 97, (2, 5), generator=torch.Generator().manual_seed(1))
    out = q.generate(prompt, max_new_tokens=10)
    streamed = torch.stack(list(q.generate(prompt, max_new_tokens=10, stream=True)), dim=1)
    assert torch.equal(out[:, 5:], streamed)
    with torch.no_grad():
        for t in range(5, out.size(1)):
            full = q(out[:, :t], use_cache=False).logits[:, -1]  # no cache: the whole prefix again
            cached_choice = out[:, t]
            margin = full.gather(1, cached_choice[:, None]).squeeze(1) - full.max(dim=-1).values
            assert (margin > -0.05 * full.abs().max()).all(), t  # the cached run's token is (near) the best


def test_inspect_taps_work_on_the_int8_model(models, ids):
    model, q, _ = models
    with torch.no_grad():
        with inspect.capture(model, layers=[1], names=["weights", "hidden"]) as ref:
            model(ids)
        with inspect.capture(q, layers=[1], names=["weights", "hidden"]) as acts:
            q(ids)
        assert relative_error(acts["h.1.attn.weights"], ref["h.1.attn.weights"]) < 0.05
        assert relative_error(acts["h.1.mlp.hidden"], ref["h.1.mlp.hidden"]) < 0.05
        with inspect.edit(q, "h.1.attn.weights", inspect.zero_head(2)):
            ablated = q(ids).logits
        assert max_diff(ablated, q(ids).logits) > 1e-3


def test_base_model_and_untied_head(ids):
    body = randomize(GPT2Model(tiny_config()), seed=3, std=0.1).eval()
    expected = body(ids).last_hidden_state
    body.quantize("int8")
    assert isinstance(body.h[0].attn.c_attn, Int8Linear)
    assert relative_error(body(ids).last_hidden_state, expected) < 0.1
    untied = randomize(GPT2LMHeadModel(tiny_config(tie_word_embeddings=False)), seed=4, std=0.1).eval()
    expected = untied(ids).logits
    head = untied.lm_head.weight.detach().clone()
    untied.quantize("int8")
    assert type(untied.lm_head) is Int8Linear
    assert relative_error(untied(ids).logits, expected) < 0.1
    saved = untied.state_dict()["lm_head.weight"]
    assert saved.data_ptr() != untied.transformer.wte.weight.data_ptr()
    # the weight it computes with (int8 widened back), not the fp32 one it was made from (kept alive)
    assert torch.equal(saved, untied.lm_head.hf_weight()) and not torch.equal(saved, head)


def test_without_a_mode_quantize_makes_int8_layers():
    from gpt2attn.quantize import quantize

    for model in (quantize(GPT2LMHeadModel(tiny_config()).eval()), GPT2LMHeadModel(tiny_config()).eval().quantize()):
        assert set(map(type, (model.lm_head, model.transformer.h[0].attn.c_attn))) == {Int8Linear}


def test_bad_requests_name_the_problem():
    model = GPT2LMHeadModel(tiny_config()).eval()
    with pytest.raises(ValueError, match="unknown quantize mode 'int4'"):
        model.quantize("int4")
    with pytest.raises(ValueError, match="takes an fp32, fp16 or bf16 model; this one has torch.float64 weights"):
        copy.deepcopy(model).double().quantize("int8")


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["fp32", "fp16", "bf16", "int8", "q4"])
def test_a_16_bit_model_quantizes_to_what_its_fp32_widening_quantizes_to(dtype, mode, ids):
    """A model in fp16 or bf16 (a 16-bit checkpoint as from_pretrained gives it) takes quantize():
    what stays becomes fp32 (the tied embedding the same Parameter), and it computes and generates
    what the model widened to fp32 first and then quantized does, to the bit."""
    model = randomize(GPT2LMHeadModel(tiny_config(n_layer=3)), seed=6, std=0.1).eval().to(dtype)
    expected = copy.deepcopy(model).float().quantize(mode)
    wte = model.transformer.wte.weight
    model.requires_grad_(False)  # frozen stays frozen (fp32 mode keeps the widened weights as parameters)
    model.quantize(mode)
    assert model.transformer.wte.weight is wte and {p.dtype for p in model.parameters()} == {torch.float32}
    assert not any(p.requires_grad for p in model.parameters())
    assert model.dtype == torch.float32
    assert torch.equal(model(ids).logits, expected(ids).logits)
    generated = model.generate(ids[:1, :5], max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(generated, expected.generate(ids[:1, :5], max_new_tokens=6, do_sample=False, pad_token_id=0))


def test_cli_generate_quantize_int8(tmp_path, capsys, models):
    from gpt2attn.cli import main
    from gpt2attn.tokenizer import char_tokenizer

    model, q, _ = models
    tokenizer = char_tokenizer("".join(chr(c) for c in range(32, 32 + 97)))
    model.save_pretrained(tmp_path)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    args = ["generate", "--model", str(tmp_path), "--greedy", "--max-new-tokens", "8", "--quantize", "int8", "hello"]
    assert main(args) == 0
    expected = q.generate(torch.tensor([tokenizer.encode("hello").ids]), max_new_tokens=8)
    assert capsys.readouterr().out == tokenizer.decode(expected[0].tolist()) + "\n"


@torch.no_grad()
def test_int8_validation_loss_within_half_a_percent_of_fp32():
    """The shipped char model on a fixed slice of tinyshakespeare's validation split (its last
    10%, as the training recipe splits it): 64 blocks of 128 characters."""
    from gpt2attn.shipped import DEFAULT_MODEL_DIR
    from gpt2attn.tokenizer import load_tokenizer

    text = (shared_data("tinyshakespeare") / "input.txt").read_text()
    ids = torch.tensor(load_tokenizer(DEFAULT_MODEL_DIR).encode(text[int(len(text) * 0.9) :]).ids)
    blocks = ids[: 64 * 128].view(64, 128)
    fp32 = GPT2LMHeadModel.from_pretrained(DEFAULT_MODEL_DIR)
    int8 = GPT2LMHeadModel.from_pretrained(DEFAULT_MODEL_DIR, quantize="int8")
    loss32 = fp32(blocks, labels=blocks).loss.item()
    loss8 = int8(blocks, labels=blocks).loss.item()
    assert loss32 < 1.9  # the model is the trained one, not noise
    assert abs(loss8 - loss32) / loss32 < 0.005, (loss8, loss32)


@pytest.mark.slow
@torch.no_grad()
def test_int8_decoding_loss_within_half_a_percent_of_fp32():
    """The same model and text as above, but fed one character per forward through the KV cache
    (8 blocks, batch 8): the path generate takes, with int8 input blocks in the kernel."""
    import torch.nn.functional as F

    from gpt2attn.shipped import DEFAULT_MODEL_DIR
    from gpt2attn.tokenizer import load_tokenizer

    text = (shared_data("tinyshakespeare") / "input.txt").read_text()
    ids = torch.tensor(load_tokenizer(DEFAULT_MODEL_DIR).encode(text[int(len(text) * 0.9) :]).ids)
    blocks = ids[: 8 * 128].view(8, 128)
    losses = []
    for mode in (None, "int8"):
        model = GPT2LMHeadModel.from_pretrained(DEFAULT_MODEL_DIR, quantize=mode).eval()
        logits, past = [], None
        for t in range(127):
            step = model(blocks[:, t : t + 1], past_key_values=past, use_cache=True)
            logits.append(step.logits)
            past = step.past_key_values
        logits = torch.cat(logits, dim=1)  # (8, 127, V)
        losses.append(F.cross_entropy(logits.flatten(0, 1), blocks[:, 1:].flatten()).item())
    loss32, loss8 = losses
    assert loss32 < 1.9
    assert abs(loss8 - loss32) / loss32 < 0.005, (loss8, loss32)


WIDENED = "torch (MKL) fp32 on the widened weight"  # without the kernels
ONEDNN = "torch (oneDNN) bf16, the CPU's own: input and output rounded to bf16, fp32 sums"


@pytest.mark.parametrize("mode, dtype, cpu_flags, vendor, prefill", [
    ("fp16", "float16", {"avx2", "avx512_bf16"}, "AuthenticAMD", "tiles"), ("bf16", "bfloat16", {"avx2"}, "AuthenticAMD", "tiles"),
    ("bf16", "bfloat16", {"avx2", "avx512_bf16"}, "AuthenticAMD", ONEDNN),
    ("bf16", "bfloat16", {"avx2", "avx512_bf16"}, "GenuineIntel", "tiles"),
    ("bf16", "bfloat16", {"avx2", "avx512_bf16", "amx_bf16"}, "GenuineIntel", ONEDNN)])
def test_a_half_layer_names_its_kernels(mode, dtype, cpu_flags, vendor, prefill, monkeypatch):
    """A bf16 prompt takes the CPU's own bf16 products where they beat the tiles: AMX, or AVX512-BF16
    on AMD (the CPU is this test's)."""
    from gpt2attn import cpu
    from gpt2attn import kernels as K

    monkeypatch.setattr(cpu, "flags", lambda: cpu_flags)
    monkeypatch.setattr(cpu, "vendor_family_model", lambda: (vendor, 25, 17))
    model = randomize(GPT2LMHeadModel(tiny_config()), seed=0).quantize(mode)
    decode = f"gpt2attn {dtype} rows" if K.available() else "plain torch"
    if prefill == "tiles":  # the decoding kernel, in register tiles
        prefill = f"gpt2attn {dtype} rows, register tiles" if K.available() else WIDENED
    assert model.transformer.h[0].attn.c_attn.kernel == f"decode: {decode}; prefill: {prefill}"


@pytest.mark.parametrize("flags, native", [({"avx2", "fma"}, []), ({"avx2", "avx512_bf16"}, ["avx512_bf16"]),
                                           ({"amx_bf16", "avx512_bf16"}, ["amx_bf16", "avx512_bf16"])])
def test_cpu_bf16_report_reads_the_cpu_flags(monkeypatch, flags, native):
    from gpt2attn import cpu

    monkeypatch.setattr(cpu, "flags", lambda: flags)
    has, sentence = cpu.bf16_report()
    assert has is bool(native)
    if native:
        assert sentence.startswith(f"this CPU has {' and '.join(native)} (torch capability ")
    else:
        assert sentence.startswith("this CPU has neither amx_bf16 nor avx512_bf16")


@torch.no_grad()
@pytest.mark.parametrize("mode", ["fp32", "fp16", "bf16", "bf16 native"])
def test_each_mode_computes_x_times_its_rounded_weight_for_steps_and_prompts(mode, monkeypatch):
    """A Conv1D (in, out) and the untied head (out, in), each as x W + b with the fp32 weight rounded
    to the mode's dtype, for a decoding step's few rows (up to DECODE_ROWS) and a prompt's many;
    "bf16 native": the oneDNN prompt path, whose input and output are rounded to bf16 too. The CPU
    flags are the test's (torch emulates bf16 products where the CPU lacks them)."""
    import gpt2attn.quantize as Q
    from gpt2attn import cpu

    monkeypatch.setattr(cpu, "flags", lambda: {"amx_bf16", "avx512_bf16"} if mode == "bf16 native" else {"avx2"})
    dtype = {"fp32": torch.float32, "fp16": torch.float16}.get(mode, torch.bfloat16)
    cfg = tiny_config(n_embd=64, vocab_size=300, tie_word_embeddings=False)
    plain = randomize(GPT2LMHeadModel(cfg), seed=3, std=0.1).eval()
    model = copy.deepcopy(plain).quantize(mode.split()[0])
    for name in ("transformer.h.1.mlp.c_fc", "lm_head"):  # 64 -> 256 (in, out); 64 -> 300 (out, in)
        fp32 = plain.get_submodule(name)
        w = fp32.weight.to(dtype).float()
        w = w if name != "lm_head" else w.t()  # (in, out)
        bias = torch.zeros(w.size(1)) if fp32.bias is None else fp32.bias
        for rows in (3, Q.DECODE_ROWS, 20):  # a step's rows, as many as a step takes, a prompt's
            x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
            if mode == "bf16 native" and rows > Q.DECODE_ROWS:
                want = (x.to(dtype).float() @ w).to(dtype).float() + bias
            else:
                want = x @ w + bias
            assert relative_error(model.get_submodule(name)(x), want) < 1e-5, (name, rows)
    if mode == "fp32" and Q.cpu_kernels.available():
        assert kernels(model)["lm_head"].startswith("decode: gpt2attn fp32 rows;")
        assert kernels(model)["transformer.h.1.mlp.c_fc"].startswith("decode: gpt2attn fp32 cols;")


@torch.no_grad()
def test_a_half_layer_made_directly_takes_an_nn_linear_weight():
    """HalfLinear(weight (out, in), bias, dtype): conv is False unless asked for."""
    from gpt2attn.quantize import HalfLinear

    weight, bias = torch.randn(48, 32), torch.randn(48)
    layer = HalfLinear(weight, bias, torch.float16)
    assert (layer.in_features, layer.out_features) == (32, 48)
    x = torch.randn(3, 32)
    assert relative_error(layer(x), x @ weight.half().float().t() + bias) < 1e-5


@pytest.mark.parametrize("out_features, rows", [(50257, 128), (2304, 9), (2304, 300)])
def test_a_16_bit_prompt_equals_the_widened_product(out_features, rows):
    """A prompt of a 16-bit layer (more than DECODE_ROWS rows; the head's vocabulary too): x times
    the rounded weight plus the bias, whichever path it takes (the kernels or torch)."""
    from gpt2attn.quantize import HalfLinear

    torch.manual_seed(0)
    weight, bias = torch.randn(out_features, 768) * 0.05, torch.randn(out_features)
    layer = HalfLinear(weight, bias, torch.float16)
    x = torch.randn(rows, 768)
    want = x.double() @ layer.weight16.double().t() + bias.double()
    with num_threads(2), torch.no_grad():
        got = layer(x)
    assert got.shape == (rows, out_features)
    assert max_diff(got, want.float()) < 1e-5 * float(want.abs().max())


def test_16_bit_prompts_on_two_python_threads_at_once_each_get_their_own_product():
    """Two threads prefilling layers of different widths and weights at the same time each get
    their own product (each kernel call has its own scratch space)."""
    import threading

    from gpt2attn.quantize import HalfLinear

    torch.manual_seed(0)
    layers = [HalfLinear(torch.randn(n, 768) * 0.05, torch.randn(n), torch.float16) for n in (2304, 3072)]
    x = torch.randn(64, 768)
    wants = [x.double() @ layer.weight16.double().t() + layer.bias.double() for layer in layers]
    errors = []

    def run(layer, want):
        with torch.no_grad():
            for _ in range(20):
                errors.append(max_diff(layer(x), want.float()) / float(want.abs().max()))

    threads = [threading.Thread(target=run, args=pair) for pair in zip(layers, wants)]
    with num_threads(2):
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert len(errors) == 40 and max(errors) < 1e-5


@pytest.mark.parametrize("conv", [True, False])
@pytest.mark.parametrize("rows", [1, 8, 9, 128, 257])
def test_an_fp32_layer_computes_x_w_plus_b_for_any_number_of_rows(rows, conv):
    """Up to DECODE_ROWS rows the decoding kernel, more in its register tiles (or torch without the
    kernels): every row count gives x W + b, for a Conv1D's (in, out) weight and an nn.Linear's
    (out, in) (c_attn's shape, 2 threads)."""
    from gpt2attn.quantize import Float32Linear

    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(768, 2304) * 0.05 if conv else torch.randn(2304, 768) * 0.05)
    bias = torch.nn.Parameter(torch.randn(2304))
    layer = Float32Linear(weight, bias, conv)
    x = torch.randn(rows, 768) * 4
    w = weight.detach().double() if conv else weight.detach().double().t()
    want = (x.double() @ w + bias.detach().double()).float()
    with num_threads(2), torch.no_grad():
        got = layer(x)
    assert got.shape == (rows, 2304)
    assert max_diff(got, want) < 1e-5 * float(want.abs().max())


@pytest.mark.parametrize("vendor, tiles", [("AuthenticAMD", True), ("GenuineIntel", False), (None, True)])
def test_a_prompt_s_fp32_products_take_the_tiles_or_torch_s_by_the_cpu(vendor, tiles, monkeypatch):
    """A prompt's fp32 rows (more than DECODE_ROWS) take the kernels' register tiles, except on
    Intel's CPUs, where torch's product (MKL) is the faster (cpu.torch_fp32_prompts): so do
    quantize("fp32")'s layers and, within kernel_products() (generate's prompt pass), the plain
    model's Conv1D; a step's few rows take the kernels' either way. gpt2-small's c_attn, 2 threads."""
    from gpt2attn import cpu
    from gpt2attn import kernels as K
    from gpt2attn.layers import Conv1D, kernel_products
    from gpt2attn.quantize import DECODE_ROWS, Float32Linear

    monkeypatch.setattr(cpu, "vendor_family_model", lambda: None if vendor is None else (vendor, 6, 207))
    calls = []
    monkeypatch.setattr(K, "cols", lambda x, w, b, real=K.cols: calls.append(x.size(0)) or real(x, w, b))
    torch.manual_seed(0)
    conv = Conv1D(2304, 768)
    torch.nn.init.normal_(conv.bias)
    layer = Float32Linear(conv.weight, conv.bias, conv=True)
    prefill = "gpt2attn fp32 cols, register tiles" if tiles and K.available() else "torch (MKL) fp32"
    assert layer.kernel.endswith(f"prefill: {prefill}")
    for rows in (DECODE_ROWS, DECODE_ROWS + 1, 128):
        x = torch.randn(rows, 768) * 4
        with num_threads(2), torch.no_grad():
            with kernel_products():
                plain = conv(x)
            fp32 = layer(x)
            want = torch.addmm(conv.bias, x, conv.weight)  # transformers' product
        kernel = tiles or rows <= DECODE_ROWS
        assert calls == [rows, rows] * kernel, rows
        calls.clear()
        if kernel:
            assert max_diff(plain, want) < 1e-5 * float(want.abs().max()) and torch.equal(plain, fp32)
        else:
            assert torch.equal(plain, want) and torch.equal(fp32, want)


def test_a_prompt_with_gradients_takes_autograd_s_path():
    """With gradients wanted, an fp32 layer's prompt is torch's product, which autograd follows."""
    from gpt2attn.quantize import Float32Linear

    weight, bias = torch.nn.Parameter(torch.randn(8, 6)), torch.nn.Parameter(torch.randn(6))
    layer = Float32Linear(weight, bias, conv=True)
    x = torch.randn(128, 8)
    layer(x).sum().backward()
    assert torch.allclose(weight.grad, x.sum(0)[:, None].expand(8, 6)) and torch.equal(bias.grad, torch.full((6,), 128.0))


def _step_tensors(model):
    """The packed tensors a decoding step reads, in the order it reads them."""
    names = [f"transformer.h.{i}.{n}" for i in range(model.config.n_layer)
             for n in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")] + ["lm_head"]
    return [getattr(model.get_submodule(n), a) for n in names for a in ("weight16", "grouped", "scale")
            if isinstance(getattr(model.get_submodule(n), a, None), torch.Tensor)]


def _mapping_flags(address: int) -> list[str]:
    """VmFlags of the mapping of this process holding `address` (Linux's /proc/self/smaps)."""
    mapping = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            mapping = start <= address < end
        elif head == "VmFlags:" and mapping:
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


huge_page_advice = pytest.mark.skipif(
    not (hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_ANONYMOUS")
         and Path("/sys/kernel/mm/transparent_hugepage").is_dir()),
    reason="the weight arena's huge-page advice needs Linux with transparent huge pages")


@huge_page_advice
@pytest.mark.parametrize("mode, n_inner", [("fp16", 512), ("bf16", 512), ("int8", 512), ("q4", 512),
                                           ("int8", 520)])  # 520 scales: 2080 bytes, not whole cache lines
def test_quantized_weights_lie_one_after_another_in_a_step_s_order_on_huge_page_advised_memory(mode, n_inner):
    config = tiny_config(n_embd=256, n_head=4, n_inner=n_inner)  # q4's blocks need rows of 256
    model = randomize(GPT2LMHeadModel(config), seed=5, std=0.1).eval().quantize(mode)
    tensors = _step_tensors(model)
    head = len([a for a in ("weight16", "grouped", "scale") if isinstance(getattr(model.lm_head, a, None), torch.Tensor)])
    tensors = tensors[-head:] + tensors[:-head]  # the tied head first (packed first, quantize()), then the layers
    assert len(tensors) >= 4 * config.n_layer + 1
    for before, after in zip(tensors, tensors[1:]):
        end = before.data_ptr() + before.numel() * before.element_size()
        assert after.data_ptr() == -(-end // 64) * 64, "each tensor starts on the cache line after the one before"
    assert "hg" in _mapping_flags(tensors[0].data_ptr())  # madvise(MADV_HUGEPAGE) was asked for


@pytest.mark.parametrize("mode", ["fp16", "int8", "q4"])
def test_reloading_a_quantized_model_refills_its_weights_where_they_are(mode, ids):
    config = tiny_config(n_embd=256, n_head=4, n_inner=512)
    model = randomize(GPT2LMHeadModel(config), seed=6, std=0.1).eval().quantize(mode)
    other = randomize(GPT2LMHeadModel(config), seed=7, std=0.1).eval().quantize(mode)
    fresh = GPT2LMHeadModel(config).eval()  # other's weights packed anew (q4's search may move a level)
    fresh.load_state_dict(other.state_dict())
    fresh.quantize(mode)
    where = [t.data_ptr() for t in _step_tensors(model)]
    model.load_state_dict(other.state_dict())
    assert [t.data_ptr() for t in _step_tensors(model)] == where
    assert all(torch.equal(a, b) for a, b in zip(_step_tensors(model), _step_tensors(fresh)))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, fresh(ids).logits)


@huge_page_advice
def test_a_quantized_model_s_weight_memory_goes_with_it():
    model = randomize(GPT2LMHeadModel(tiny_config()), seed=8, std=0.1).eval().quantize("int8")
    address = _step_tensors(model)[0].data_ptr()
    assert "hg" in _mapping_flags(address)
    del model
    gc.collect()
    try:
        flags = _mapping_flags(address)
    except AssertionError:
        return  # unmapped
    assert "hg" not in flags, "the arena's mapping outlived the model"


def _quantized_outside_the_arena(model, mode, monkeypatch):
    """A copy of `model` quantized with every packed tensor torch's own (the arena bypassed)."""
    from gpt2attn.quantize import WeightArena

    with monkeypatch.context() as patch:
        patch.setattr(WeightArena, "empty", lambda self, shape, dtype: torch.empty(shape, dtype=dtype))
        return copy.deepcopy(model).quantize(mode)


@huge_page_advice
def test_weights_that_outgrow_a_chunk_go_on_in_a_new_one(monkeypatch, ids):
    from gpt2attn.quantize import WeightArena

    config = tiny_config(n_embd=256, n_head=4, n_inner=1024, n_layer=3)  # 1 MiB of int8 a block
    model = randomize(GPT2LMHeadModel(config), seed=9, std=0.1).eval()
    reference = _quantized_outside_the_arena(model, "int8", monkeypatch)
    monkeypatch.setattr(WeightArena, "CHUNK", WeightArena.PAGE)  # chunks of 2 MiB
    q = copy.deepcopy(model).quantize("int8")
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in _step_tensors(q))
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), "tensors overlap"
    runs = sum(start != -(-end // 64) * 64 for (_, end), (start, _) in zip(spans, spans[1:])) + 1
    assert runs > 1, "the weights (about 2.4 MiB) should need more than one chunk of 2 MiB"
    with torch.no_grad():
        assert torch.equal(q(ids).logits, reference(ids).logits)


@huge_page_advice
def test_without_huge_page_advice_the_weights_stay_where_torch_puts_them(monkeypatch, ids):
    import gpt2attn.quantize as quantize_module

    model = randomize(GPT2LMHeadModel(tiny_config()), seed=10, std=0.1).eval()
    reference = _quantized_outside_the_arena(model, "int8", monkeypatch)
    monkeypatch.delattr(quantize_module.mmap, "MADV_HUGEPAGE", raising=False)  # as on macOS or Windows
    chunks = []  # what each request for arena memory gave
    make_chunk = quantize_module._huge_chunk
    monkeypatch.setattr(quantize_module, "_huge_chunk", lambda *args: chunks.append(make_chunk(*args)) or chunks[-1])
    q = copy.deepcopy(model).quantize("int8")
    with torch.no_grad():
        assert torch.equal(q(ids).logits, reference(ids).logits)
    assert chunks and all(chunk is None for chunk in chunks), "no arena memory without the advice"
