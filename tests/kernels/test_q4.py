"""quantize()'s mode q4: llama.cpp's Q4_K blocks (gpt2attn.q4_k) against an independent reading of
ggml's documented block layouts (Q4_K, Q5_K, Q6_K: the types llama.cpp's q4_K_M mixes, which the
GGUF reader must read), the ROWS_Q4K product against its plain-torch reference at gpt2-small's
shapes on 2 threads in every build this CPU runs, and the mode end to end: the layers it makes,
state_dict, generate through the one-call step, the modules and the references, GGUF round trips."""

from pathlib import Path

import numpy as np
import pytest
import torch

from gpt2attn import GPT2LMHeadModel, kernels, q4_k
from gpt2attn.formats import gguf
from gpt2attn.quantize import Int8Linear, Q4Linear
from tests.helpers import max_diff, needs_kernels, num_threads, randomize, shared_data, tiny_config

GPT2_SMALL = [(768, 2304), (768, 768), (768, 3072), (3072, 768)]  # each block's (K, N)
VOCAB = 50257


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return max_diff(a, b) / b.abs().max().item()


# ggml's block layouts read one block at a time, value by value, as ggml-common.h documents them
# (an implementation of its own: no code shared with gpt2attn.q4_k or the gguf package)

def half(raw: np.ndarray, at: int) -> float:
    return float(raw[at : at + 2].view(np.float16)[0])


def six_bit_pairs(scales: np.ndarray, s: int) -> tuple[int, int]:
    """(scale, min) of sub-block s from a K-quant's 12 bytes of 6-bit scales and mins."""
    if s < 4:
        return int(scales[s]) & 63, int(scales[s + 4]) & 63
    return ((int(scales[s + 4]) & 0xF) | ((int(scales[s - 4]) >> 6) << 4),
            (int(scales[s + 4]) >> 4) | ((int(scales[s]) >> 6) << 4))


def q4_k_block(raw: np.ndarray) -> np.ndarray:  # 144 bytes: d, dmin, scales[12], qs[128]
    d, dmin, scales, qs = half(raw, 0), half(raw, 2), raw[4:16], raw[16:144]
    out = np.zeros(256, np.float32)
    for i in range(256):
        chunk, within = divmod(i, 64)
        byte = qs[32 * chunk + within % 32]
        q = byte & 0xF if within < 32 else byte >> 4
        sc, m = six_bit_pairs(scales, i // 32)
        out[i] = np.float32(np.float32(d) * sc) * int(q) - np.float32(np.float32(dmin) * m)
    return out


def q5_k_block(raw: np.ndarray) -> np.ndarray:  # 176 bytes: d, dmin, scales[12], qh[32], qs[128]
    d, dmin, scales, qh, qs = half(raw, 0), half(raw, 2), raw[4:16], raw[16:48], raw[48:176]
    out = np.zeros(256, np.float32)
    for i in range(256):
        chunk, within = divmod(i, 64)
        byte = qs[32 * chunk + within % 32]
        low = byte & 0xF if within < 32 else byte >> 4
        high = (qh[within % 32] >> (2 * chunk + (within >= 32))) & 1  # bit 2c (first 32) or 2c + 1
        sc, m = six_bit_pairs(scales, i // 32)
        out[i] = np.float32(np.float32(d) * sc) * (int(low) + 16 * int(high)) - np.float32(np.float32(dmin) * m)
    return out


def q6_k_block(raw: np.ndarray) -> np.ndarray:  # 210 bytes: ql[128], qh[64], scales[16] int8, d
    ql, qh, scales, d = raw[0:128], raw[128:192], raw[192:208].view(np.int8), half(raw, 208)
    out = np.zeros(256, np.float32)
    for i in range(256):
        half_, within = divmod(i, 128)  # two halves of 128: 64 bytes of ql and 32 of qh each
        quarter, l = divmod(within, 32)  # values l, l+32, l+64, l+96 of a half share qh[l]
        low_byte = ql[64 * half_ + l + 32 * (quarter % 2)]
        low = low_byte & 0xF if quarter < 2 else low_byte >> 4
        high = (qh[32 * half_ + l] >> (2 * quarter)) & 3
        out[i] = np.float32(d) * np.float32(scales[i // 16]) * ((int(low) | int(high) << 4) - 32)
    return out


BLOCKS = {"Q4_K": (144, q4_k_block, (0, 2)), "Q5_K": (176, q5_k_block, (0, 2)), "Q6_K": (210, q6_k_block, (208,))}


def random_blocks(kind: str, rows: int, K: int, seed: int) -> np.ndarray:
    """Random bytes as `kind` blocks (rows, K/256 * size), the fp16 steps finite and modest."""
    size, _, halves = BLOCKS[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, K // 256, size), dtype=np.uint8)
    for at in halves:
        raw[..., at : at + 2] = (rng.random((rows, K // 256)) * 0.01).astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def independent_dequantize(kind: str, raw: np.ndarray) -> np.ndarray:
    size, block, _ = BLOCKS[kind]
    return np.stack([np.concatenate([block(row[j : j + size]) for j in range(0, row.size, size)]) for row in raw])


def test_q4_k_dequantizes_as_the_documented_layout():
    raw = random_blocks("Q4_K", 3, 512, seed=0)
    expected = independent_dequantize("Q4_K", raw)
    assert torch.equal(q4_k.dequantize_rows(torch.from_numpy(raw), 512), torch.from_numpy(expected))


def write_raw_gguf(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    import gguf as gguf_package

    writer = gguf_package.GGUFWriter(str(path), arch="gpt2")
    for name, (kind, raw) in tensors.items():
        writer.add_tensor(name, raw, raw_dtype=gguf_package.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_the_gguf_reader_reads_the_k_quants_of_q4_k_m(tmp_path):
    pytest.importorskip("gguf")
    raws = {kind: random_blocks(kind, 3, 512, seed=i) for i, kind in enumerate(BLOCKS)}
    path = tmp_path / "k.gguf"
    write_raw_gguf(path, {f"t.{kind}": (kind, raw) for kind, raw in raws.items()})
    file = gguf.GGUFFile(path)
    for kind, raw in raws.items():
        assert file.tensors[f"t.{kind}"][0] == kind
        np.testing.assert_array_equal(file.tensor(f"t.{kind}").numpy(), independent_dequantize(kind, raw), err_msg=kind)


def naive_q4_k(w: torch.Tensor) -> torch.Tensor:
    """Q4_K by each sub-block's min and max alone (no search), its scales rounded as the format
    needs: the rounding a quantizer without a search reaches."""
    N, K = w.shape
    x = w.view(N, -1, 32)
    lo = x.amin(-1).clamp(max=0)
    scale, offset = ((x.amax(-1) - lo) / 15).view(N, -1, 8), (-lo).view(N, -1, 8)
    d, dmin = (scale.amax(-1) / 63).half().float(), (offset.amax(-1) / 63).half().float()
    scale = (d[..., None] * torch.round(scale / d[..., None])).view(N, -1, 1)
    offset = (dmin[..., None] * torch.round(offset / dmin[..., None])).view(N, -1, 1)
    q = torch.round((x + offset) / scale).clamp(0, 15)
    return (scale * q - offset).view(N, K)


def test_the_scale_search_beats_min_max_rounding():
    w = torch.randn(96, 768, generator=torch.Generator().manual_seed(0)) * 0.02
    ours = q4_k.dequantize_rows(q4_k.quantize_rows(w), 768)
    assert (ours - w).norm() < 0.95 * (naive_q4_k(w) - w).norm()
    # every weight within half a step of its sub-block's grid, or at the grid's ends
    blocks = q4_k.quantize_rows(w)
    q, scale, offset = q4_k.unpack(blocks, 768)
    grid = (w.view(96, -1, 32) + offset[..., None]) / scale[..., None]
    inside = (grid >= 0) & (grid <= 15)
    assert ((grid - q.view(96, -1, 32).float()).abs()[inside] <= 0.5 + 1e-4).all()


def test_rows_of_other_lengths_are_refused():
    with pytest.raises(ValueError, match="multiple of 256"):
        q4_k.quantize_rows(torch.zeros(4, 1600))


@pytest.mark.parametrize("B", [1, 3, 6, 8])  # 8: the most a step takes; more, a prompt's spans taken in turn
@pytest.mark.parametrize("K, N", [(256, 70), (512, 5)] + GPT2_SMALL)  # groups of 16 with rows left: 70 and 5
def test_rows_q4k_matches_its_reference(build, B, K, N):
    g = torch.Generator().manual_seed(K + N)
    x, bias = torch.randn(B, K, generator=g), torch.randn(N, generator=g)
    blocks = torch.from_numpy(random_blocks("Q4_K", N, K, seed=N))
    reference = kernels.rows_q4k_reference(x, blocks, bias)
    grouped = q4_k.group_rows(blocks)
    assert relative(kernels.rows_q4k(x, grouped, bias), reference) < 1e-5
    assert relative(kernels.rows_q4k(x, grouped, None), kernels.rows_q4k_reference(x, blocks, None)) < 1e-5
    exact = x @ q4_k.dequantize_rows(blocks, K).t() + bias  # what int8 input blocks approximate
    assert relative(reference, exact) < 0.03


@pytest.mark.parametrize("B", [1, 5])
def test_x_is_quantized_per_256_as_llama_cpp_s_q8_k(build, B):
    # x on each super-block's own grid: integers times a step, the largest 127 (once per 256
    # values, in a different sub-block each time), the rest small. One scale per 256 values takes
    # x exactly, so the product equals x times the dequantized weights; a scale per 32 would not
    # (a sub-block of small integers is rounded to a finer grid: errors of about 1e-3).
    g = torch.Generator().manual_seed(B)
    K, N = 768, 40
    ints = torch.randint(-9, 10, (B, K // 256, 256), generator=g)
    ints[:, :, torch.tensor([5, 300 - 256, 700 - 512])] = 0
    for b in range(B):
        for j, at in enumerate((5, 300 - 256, 700 - 512)):
            ints[b, j, at] = 127 if (b + j) % 2 else -127
    steps = torch.rand(B, K // 256, 1, generator=g, dtype=torch.float64) + 0.5
    x = (ints * steps).view(B, K).float()
    xq, xd = kernels.quantize_q8k_reference(x)
    assert torch.equal(xq.view(B, K // 256, 256).long(), ints)
    blocks = torch.from_numpy(random_blocks("Q4_K", N, K, seed=3))
    exact = x.double() @ q4_k.dequantize_rows(blocks, K).double().t()
    assert relative(kernels.rows_q4k(x, q4_k.group_rows(blocks), None).double(), exact) < 1e-6
    assert relative(kernels.rows_q4k_reference(x, blocks, None).double(), exact) < 1e-6


def test_rows_q4k_at_the_head_shape(build):  # more rows than any block's: 50257 x 768
    g = torch.Generator().manual_seed(0)
    x, bias = torch.randn(2, 768, generator=g), torch.randn(VOCAB, generator=g)
    blocks = torch.from_numpy(random_blocks("Q4_K", VOCAB, 768, seed=1))
    grouped = q4_k.group_rows(blocks)
    assert relative(kernels.rows_q4k(x, grouped, bias), kernels.rows_q4k_reference(x, blocks, bias)) < 1e-5


@pytest.mark.parametrize("N", [5, 16, 70])  # fewer rows than a group, one group, four groups and 6 rows left
def test_the_kernels_layout_holds_each_value_where_q4_k_documents_it(N):
    blocks = torch.from_numpy(random_blocks("Q4_K", N, 512, seed=N))
    grouped = q4_k.group_rows(blocks)
    assert grouped.shape == blocks.shape and torch.equal(q4_k.ungroup_rows(grouped), blocks)
    flat = grouped.view(-1)
    for r in range(N):  # row r's bytes, found by the layout the module docstring gives
        first, n = r // q4_k.GROUP * q4_k.GROUP, min(q4_k.GROUP, N - r // q4_k.GROUP * q4_k.GROUP)
        i = r - first  # the row's place in its group
        for j in range(2):  # each super-block
            at = first * 2 * q4_k.BYTES + j * q4_k.BYTES * n
            row = blocks[r, j * q4_k.BYTES : (j + 1) * q4_k.BYTES]
            assert torch.equal(flat[at + 2 * i : at + 2 * i + 2], row[0:2])  # d
            assert torch.equal(flat[at + 2 * n + 2 * i : at + 2 * n + 2 * i + 2], row[2:4])  # dmin
            assert torch.equal(flat[at + 4 * n + i : at + 16 * n : n], row[4:16])  # scale byte p at 4n + pn + i
            for quad in range(32):  # c = quad // 8, t = quad % 8: bytes 32c + 4t .. + 3 of the row's qs
                start = at + 16 * n + 4 * n * quad + 4 * i
                assert torch.equal(flat[start : start + 4], row[16 + 4 * quad : 20 + 4 * quad])


def test_rows_q4k_gives_the_same_bits_on_any_threads_and_in_a_prompt(build):
    # a row's sum is one group's, whichever thread takes it, read in quarters or among the rows left
    # (the last group padded), for a step's rows or a prompt's
    g = torch.Generator().manual_seed(7)
    grouped = q4_k.group_rows(torch.from_numpy(random_blocks("Q4_K", 3072 + 5, 768, seed=7)))
    x = torch.randn(40, 768, generator=g)
    outs = []
    for threads in (1, 2, 3):
        with num_threads(threads):
            outs += [kernels.rows_q4k(x, grouped, None), kernels.rows_q4k(x[:3], grouped, None)]
    for out in outs:
        assert torch.equal(out, outs[0][: out.size(0)])


@pytest.mark.parametrize("sign", [1, -1])
def test_rows_q4k_at_the_largest_levels_and_inputs(build, sign):
    # every level 15 and every scale 63, x all at its largest, so each 32-value sum is as large as it
    # can be (the AVX2 kernel adds eight quads' pairs in int16 before widening: 30480 at most)
    K, N = 768, 37
    q = torch.full((N, K // 256, 256), 15, dtype=torch.uint8)
    sc = torch.full((N, K // 256, 8), 63, dtype=torch.uint8)
    d = torch.full((N, K // 256), 0.01, dtype=torch.float16)
    blocks = q4_k.pack(d, d, sc, sc, q).view(N, -1)
    x = torch.full((2, K), 3.0 * sign)
    exact = x.double() @ q4_k.dequantize_rows(blocks, K).double().t()
    assert relative(kernels.rows_q4k(x, q4_k.group_rows(blocks), None).double(), exact) < 1e-6


def q4_model(n_layer: int = 2, tied: bool = True) -> tuple[GPT2LMHeadModel, GPT2LMHeadModel]:
    """(a fp32 model 256 wide, the same made q4), random weights of a trained model's size."""
    cfg = tiny_config(n_embd=256, n_layer=n_layer, vocab_size=300, n_positions=64, tie_word_embeddings=tied)
    plain = randomize(GPT2LMHeadModel(cfg), std=0.05).eval()
    model = GPT2LMHeadModel(cfg).eval()
    model.load_state_dict(plain.state_dict())
    return plain, model.quantize("q4")


def test_q4_keeps_8_bits_where_llama_cpp_q4_k_m_gives_more():
    # llama.cpp's q4_K_M (llama-quant.cpp): attn_qkv in Q5_K; ffn_down in Q6_K in the first and
    # last eighth of the layers and every third between (for 12 layers: 0, 3, 6, 9, 10, 11)
    wider = [i for i in range(12) if q4_k.keeps_8_bits(f"transformer.h.{i}.mlp.c_proj", 3072, 12)]
    assert wider == [0, 3, 6, 9, 10, 11]
    assert q4_k.keeps_8_bits("transformer.h.5.attn.c_attn", 768, 12) and q4_k.keeps_8_bits("lm_head", 768, 12)
    assert not q4_k.keeps_8_bits("transformer.h.5.mlp.c_fc", 768, 12)
    assert q4_k.keeps_8_bits("transformer.h.5.mlp.c_fc", 1600, 12)  # gpt2-xl's rows: no Q4_K


def test_q4_layers_and_state_dict():
    plain, model = q4_model()
    for i, block in enumerate(model.transformer.h):
        assert type(block.mlp.c_fc) is Q4Linear and type(block.attn.c_proj) is Q4Linear
        assert type(block.attn.c_attn) is Int8Linear
    assert type(model.lm_head) is Int8Linear
    state, before = model.state_dict(), plain.state_dict()
    assert {k: (v.shape, v.dtype) for k, v in state.items()} == {k: (v.shape, v.dtype) for k, v in before.items()}
    layer = model.transformer.h[0].mlp.c_fc
    assert torch.equal(state["transformer.h.0.mlp.c_fc.weight"], q4_k.dequantize_rows(layer.blocks, 256).t())
    assert 0 < relative(state["transformer.h.0.mlp.c_fc.weight"], before["transformer.h.0.mlp.c_fc.weight"]) < 0.1
    # loading a state dict requantizes from it: a fresh q4 model given these weights holds nearly
    # the same blocks (the search may move a few sub-blocks of the dequantized weights by a step)
    again = q4_model()[1]
    again.load_state_dict(state)
    assert (again.transformer.h[0].mlp.c_fc.blocks == layer.blocks).float().mean() > 0.999
    assert relative(again.state_dict()["transformer.h.0.mlp.c_fc.weight"], state["transformer.h.0.mlp.c_fc.weight"]) < 0.02


@torch.no_grad()
def test_q4_generates_alike_through_the_step_the_modules_and_the_references(monkeypatch):
    plain, model = q4_model()
    prompt = torch.randint(0, 300, (2, 6), generator=torch.Generator().manual_seed(0))
    with num_threads(2):
        fused = model.generate(prompt, max_new_tokens=12, eos_token_id=None, output_scores=True,
                               return_dict_in_generate=True)
        hook = model.register_forward_hook(lambda *args: None)  # a hook: generate takes the modules' path
        modules = model.generate(prompt, max_new_tokens=12, eos_token_id=None, output_scores=True,
                                 return_dict_in_generate=True)
        hook.remove()
        monkeypatch.setattr(kernels, "library", lambda: None)  # every product its plain-torch reference
        references = model.generate(prompt, max_new_tokens=12, eos_token_id=None, output_scores=True,
                                    return_dict_in_generate=True)
    # the same sums to fp32 rounding, but an input rounded to int8 differently (a value at a
    # half-step) moves the logits by up to about 1.5% (measured on this model): the tokens agree,
    # except where the two best logits are closer than that (then the paths may part there, and
    # from there on their logits are of different sequences)
    T = prompt.size(1)
    for other in (modules, references):
        parted = (fused.sequences[:, T:] != other.sequences[:, T:]).nonzero()  # (n, 2): row, step
        steps = len(fused.scores) if len(parted) == 0 else int(parted[:, 1].min())
        assert steps >= 3, "the paths part within three tokens"
        assert torch.equal(fused.sequences[:, : T + steps], other.sequences[:, : T + steps])
        assert relative(torch.stack(fused.scores[:steps]), torch.stack(other.scores[:steps])) < 0.03
        if steps < len(fused.scores):
            row = int(parted[parted[:, 1] == steps][0, 0])
            best = fused.scores[steps][row].topk(2).values
            assert best[0] - best[1] < 0.03 * fused.scores[steps][row].abs().max(), "they part where no tie is"


@torch.no_grad()
def test_q4_validation_loss_within_one_percent_of_fp32():
    """The shipped char model on tinyshakespeare's validation split (its last 10%), 64 blocks of
    128 characters, as test_quantize's int8 test: the 4-bit weights through the prefill path."""
    from gpt2attn.shipped import DEFAULT_MODEL_DIR
    from gpt2attn.tokenizer import load_tokenizer

    text = (shared_data("tinyshakespeare") / "input.txt").read_text()
    ids = torch.tensor(load_tokenizer(DEFAULT_MODEL_DIR).encode(text[int(len(text) * 0.9) :]).ids)
    blocks = ids[: 64 * 128].view(64, 128)
    loss32 = GPT2LMHeadModel.from_pretrained(DEFAULT_MODEL_DIR)(blocks, labels=blocks).loss.item()
    loss4 = GPT2LMHeadModel.from_pretrained(DEFAULT_MODEL_DIR, quantize="q4")(blocks, labels=blocks).loss.item()
    assert loss32 < 1.9  # the model is the trained one, not noise
    assert abs(loss4 - loss32) / loss32 < 0.01, (loss4, loss32)


@torch.no_grad()
def test_a_q4_layer_takes_a_prompt_through_the_q4_k_product():
    _, model = q4_model()
    layer = model.transformer.h[1].mlp.c_fc  # a Conv1D made Q4Linear: 256 -> 1024
    x = torch.randn(20, 256, generator=torch.Generator().manual_seed(1))  # a prompt's rows
    with num_threads(2):
        got = layer(x)
    reference = kernels.rows_q4k_reference(x, layer.blocks, layer.bias, rows=20)  # all rows at once
    assert relative(got, reference) < 1e-5
    assert relative(kernels.rows_q4k_reference(x, layer.blocks, layer.bias), reference) < 1e-6  # chunks of 8


def test_gguf_q4_round_trip(tmp_path):
    pytest.importorskip("gguf")
    plain, model = q4_model(n_layer=4)
    path = tmp_path / "q4.gguf"
    gguf.write(path, plain.state_dict(), plain.config, dtype="q4")
    file = gguf.GGUFFile(path)
    kinds = {name: kind for name, (kind, *_) in file.tensors.items() if name.endswith(gguf.LINEARS)}
    assert kinds["blk.0.ffn_up.weight"] == "Q4_K" and kinds["blk.0.attn_qkv.weight"] == "Q8_0"
    assert [kinds[f"blk.{i}.ffn_down.weight"] for i in range(4)] == ["Q4_K", "Q4_K", "Q8_0", "Q8_0"]
    assert file.tensors["output.weight"][0] == "Q8_0"
    # the Q4_K tensors hold the very blocks quantize('q4') makes
    for i, block in enumerate(model.transformer.h):
        _, ne, start, length = file.tensors[f"blk.{i}.ffn_up.weight"]
        assert torch.equal(torch.frombuffer(file.buffer, dtype=torch.uint8, count=length, offset=start).view(ne[1], -1),
                           block.mlp.c_fc.blocks)
    loaded = GPT2LMHeadModel.from_pretrained(path)
    state, ours = loaded.state_dict(), model.state_dict()
    for name in ours:
        if name.endswith("mlp.c_fc.weight") or name.endswith("attn.c_proj.weight"):
            assert torch.equal(state[name], ours[name]), name
        else:
            assert relative(state[name], ours[name]) < 0.02, name


@needs_kernels
def test_the_step_equals_the_modules_at_gpt2_small_shapes():
    """Two blocks of gpt2-small's shapes (the head 50257 x 768 int8, the blocks' Q4_K rows 768 and
    3072 long) made q4: the one-call step's logits and cache against the modules', 2 threads."""
    from gpt2attn import GPT2Config
    from tests.kernels.test_decode_step import both_ways

    cfg = GPT2Config.from_preset("gpt2")
    cfg.n_layer = 2
    model = randomize(GPT2LMHeadModel(cfg), seed=3, std=0.02).eval().quantize("q4")
    assert type(model.transformer.h[0].mlp.c_proj) is Q4Linear  # (h[1]'s is int8: the last eighth)
    expected, got, ref_cache, cache = both_ways(model, 2, prompt_len=12)
    # the inputs are rounded to int8 per 32 values as in mode int8: where the step's LayerNorm and
    # torch's differ in the last bit, a value at a half-step rounds the other way and the logits move
    # by about 1%, and the keys and values after it too (test_decode_step's int8 case measures it);
    # the products' own sums are checked to fp32 rounding by the kernel tests
    assert relative(got, expected) < 0.05
    assert max_diff(cache.block, ref_cache.block) / ref_cache.block.abs().max() < 0.05


@torch.no_grad()
def test_a_q4_layer_off_the_kernels_multiplies_by_its_dequantized_weight(monkeypatch):
    """Inputs the kernels do not take (fp64 here) and torch.compile's tracing (the flag set by the
    test) get x Wᵀ + b on the dequantized weight, in the input's dtype."""
    weight = torch.randn(16, 256, generator=torch.Generator().manual_seed(2))
    bias = torch.randn(16, generator=torch.Generator().manual_seed(4))
    x = torch.randn(3, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    for b in (None, bias):  # an nn.Linear's (out, in), without and with a bias (fp32, taken to x's dtype)
        layer = Q4Linear(weight, b)
        got = layer(x)
        expected = x @ q4_k.dequantize_rows(layer.blocks, 256).double().t() + (0 if b is None else b.double())
        assert got.dtype == torch.float64 and relative(got, expected) < 1e-12

    _, model = q4_model()
    layer = model.transformer.h[1].mlp.c_fc  # a Conv1D made Q4Linear: 256 -> 1024, with a bias
    x = x.float()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert relative(layer(x), x @ q4_k.dequantize_rows(layer.blocks, 256).t() + layer.bias) < 1e-5
