"""GGUF (llama.cpp): files made by llama.cpp's own converter (tests/data/gguf/README.md), files of
every GGML type we read written with the gguf package's writer, and our writer checked against the
converter's keys and names and against transformers' own GGUF loader."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gpt2attn import GPT2Config, GPT2LMHeadModel
from gpt2attn.cli import main as cli
from gpt2attn.formats import detect_format, gguf as ours, save
from tests.helpers import DATA as TEST_DATA, randomize, tiny_config

gguf = pytest.importorskip("gguf", reason="the gguf package (pip install 'gpt2attn[gguf]') reads GGUF")
transformers = pytest.importorskip("transformers")

DATA = TEST_DATA / "gguf"
FIXTURES = {"f16": DATA / "tiny-f16.gguf", "q8_0": DATA / "tiny-q8_0.gguf"}
Q = gguf.GGMLQuantizationType


def transformers_gguf(path: Path, config: GPT2Config):
    """transformers' own load of a GGUF (it dequantizes with gguf), given the config: it would set
    n_positions to 1024 whatever the file's gpt2.context_length says."""
    hf_config = transformers.GPT2Config(vocab_size=config.vocab_size, n_positions=config.n_positions,
                                        n_embd=config.n_embd, n_layer=config.n_layer, n_head=config.n_head,
                                        tie_word_embeddings=config.tie_word_embeddings)
    return transformers.GPT2LMHeadModel.from_pretrained(str(path.parent), gguf_file=path.name, config=hf_config).eval()


def ids_for(config: GPT2Config, T: int = 12) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (2, T), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def assert_logits_equal_transformers(path: Path, atol: float = 1e-5) -> GPT2LMHeadModel:
    model = GPT2LMHeadModel.from_pretrained(path)
    x = ids_for(model.config)
    theirs = transformers_gguf(path, model.config)(x).logits
    assert (model(x).logits - theirs).abs().max() <= atol
    return model


@pytest.mark.parametrize("kind", list(FIXTURES))
def test_llama_cpp_converter_files_give_transformers_logits(kind):
    model = assert_logits_equal_transformers(FIXTURES[kind])
    assert model.config.n_positions == 128  # gpt2.context_length, not transformers' 1024
    assert model.lm_head.weight is model.transformer.wte.weight  # the converter's output.weight is wte again
    assert detect_format(FIXTURES[kind]) is ours


def test_embedded_tokenizer_is_gpt2s(tmp_path):
    tokenizer = ours.tokenizer_of(FIXTURES["f16"])
    theirs = transformers.AutoTokenizer.from_pretrained(str(DATA), gguf_file=FIXTURES["f16"].name)
    for text in ("Hello world", " café\n\n  naïve—tokens 12345 <|endoftext|>", "ROMEO:\nBut soft!"):
        assert tokenizer.encode(text).ids == theirs(text)["input_ids"], text
        assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text


# --- every GGML type we read, in files written by the gguf package itself ---------------------------

K_BLOCK_SCALES = {  # byte offsets of each K-quant block's f16 scales (d, dmin), as ggml lays them out
    Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
}


def quantized(array: np.ndarray, kind) -> np.ndarray:
    """array in GGML type `kind`: gguf's own quantizer where it has one; for the K-quants (which
    gguf-py only dequantizes) random blocks with sane f16 scales, so the file holds real K-quant data."""
    if kind not in K_BLOCK_SCALES:
        return gguf.quants.quantize(array, kind)
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rows, cols = array.shape
    raw = np.random.default_rng(0).integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for offset in K_BLOCK_SCALES[kind]:
        raw[:, :, offset : offset + 2] = np.frombuffer(np.float16(0.002).tobytes(), dtype=np.uint8)
    return raw.reshape(rows, -1)


def write_with_gguf_package(path: Path, model: GPT2LMHeadModel, kind, output: str = "tied") -> None:
    """A GPT-2 GGUF written tensor by tensor with gguf.GGUFWriter, in llama.cpp's names and layouts:
    2-D weights in `kind`, the rest F32; output.weight as wte ('tied'), absent, or the model's head."""
    cfg = model.config
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_block_count(cfg.n_layer)
    writer.add_context_length(cfg.n_positions)
    writer.add_embedding_length(cfg.n_embd)
    writer.add_feed_forward_length(4 * cfg.n_embd)
    writer.add_head_count(cfg.n_head)
    writer.add_layer_norm_eps(cfg.layer_norm_epsilon)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    names = {"wte": "token_embd", "wpe": "position_embd", "ln_f": "output_norm"}
    blocks = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",
              "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
    tensors = {}
    for key, value in state.items():
        parts = key.split(".")
        if key == "lm_head.weight":
            continue
        if parts[1] == "h":
            module = ".".join(parts[3:-1])
            name = f"blk.{parts[2]}.{blocks[module]}.{parts[-1]}"
            if parts[-1] == "weight" and value.ndim == 2:
                value = value.T  # Conv1D (in, out) -> llama.cpp's (out, in)
        else:
            name = f"{names[parts[1]]}.{parts[2]}"
        tensors[name] = np.ascontiguousarray(value)
    if output == "tied":
        tensors["output.weight"] = tensors["token_embd.weight"]
    elif output == "own":
        tensors["output.weight"] = np.ascontiguousarray(state["lm_head.weight"])
    for name, value in tensors.items():
        if value.ndim == 2 and name != "position_embd.weight":
            writer.add_tensor(name, quantized(value, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, value.astype(np.float32), raw_dtype=Q.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


READ_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]


@pytest.fixture(scope="module")
def wide_model():
    """n_embd 256: every row a whole number of K-quant blocks (256 values)."""
    return randomize(GPT2LMHeadModel(tiny_config(vocab_size=64, n_embd=256, n_head=4, n_layer=1)), std=0.05).eval()


@pytest.mark.parametrize("kind", READ_TYPES, ids=lambda k: k.name)
def test_every_type_gives_transformers_logits(tmp_path, wide_model, kind):
    path = tmp_path / f"{kind.name}.gguf"
    write_with_gguf_package(path, wide_model, kind)
    model = assert_logits_equal_transformers(path)
    reader = gguf.GGUFReader(path)
    qkv = next(t for t in reader.tensors if t.name == "blk.0.attn_qkv.weight")
    assert qkv.tensor_type == kind
    expected = gguf.quants.dequantize(qkv.data, kind).reshape(768, 256).T  # back to Conv1D's (in, out)
    assert np.array_equal(model.transformer.h[0].attn.c_attn.weight.detach().numpy(), expected)


@pytest.mark.parametrize("output", ["absent", "own"])
def test_head_tied_without_output_weight_untied_when_it_differs(tmp_path, output):
    model = randomize(GPT2LMHeadModel(tiny_config(tie_word_embeddings=False)))
    path = tmp_path / "m.gguf"
    write_with_gguf_package(path, model, Q.F32, output=output)
    back = GPT2LMHeadModel.from_pretrained(path)
    if output == "absent":
        assert back.config.tie_word_embeddings and back.lm_head.weight is back.transformer.wte.weight
    else:
        assert not back.config.tie_word_embeddings
        assert torch.equal(back.lm_head.weight, model.lm_head.weight)
        assert not torch.equal(back.lm_head.weight, back.transformer.wte.weight)
        assert_logits_equal_transformers(path)


# --- writing -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bpe_model():
    """A random model with GPT-2's own tokenizer, as the converter needs it (vocab 50257)."""
    tokenizer = ours.tokenizer_of(FIXTURES["f16"])
    model = randomize(GPT2LMHeadModel(tiny_config(vocab_size=50257, n_embd=32, n_head=2, n_positions=64)), std=0.1)
    return model.eval(), tokenizer


def test_written_file_has_the_converters_keys_names_and_tokenizer(tmp_path, bpe_model):
    model, tokenizer = bpe_model
    save(model, tmp_path / "m.gguf", dtype="q8_0", tokenizer=tokenizer)
    mine, theirs = gguf.GGUFReader(tmp_path / "m.gguf"), gguf.GGUFReader(FIXTURES["q8_0"])
    skip = {"general.name", "general.size_label"}  # the converter's naming of its source folder
    assert set(mine.fields) - skip == set(theirs.fields) - skip
    for key in set(theirs.fields) - skip:
        if key.startswith(("tokenizer.", "general.file_type", "general.architecture", "general.type")):
            assert mine.fields[key].contents() == theirs.fields[key].contents(), key
    assert sorted((t.name, t.tensor_type) for t in mine.tensors) == sorted((t.name, t.tensor_type) for t in theirs.tensors)
    assert ours.tokenizer_of(tmp_path / "m.gguf").encode(" Hello").ids == tokenizer.encode(" Hello").ids


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "q8_0"])
def test_round_trip_exact_for_f32_within_the_types_rounding_otherwise(tmp_path, bpe_model, dtype):
    model, tokenizer = bpe_model
    path = tmp_path / f"m-{dtype}.gguf"
    save(model, path, dtype=dtype)
    back = GPT2LMHeadModel.from_pretrained(path)
    kind = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}[dtype]
    for name, tensor in model.state_dict().items():
        got = back.state_dict()[name]
        if dtype == "f32" or tensor.dim() == 1 or name.endswith("wpe.weight"):  # kept F32, as the converter does
            assert torch.equal(got, tensor), name
        else:
            array = tensor.detach().numpy()
            array = array if name.endswith(("wte.weight", "lm_head.weight")) else array.T
            rounded = gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(array), kind), kind)
            rounded = rounded if name.endswith(("wte.weight", "lm_head.weight")) else rounded.T
            assert np.array_equal(got.numpy(), rounded), name
    assert_logits_equal_transformers(path)


def test_cli_generate_convert_and_parity_take_gguf(tmp_path, capsys):
    fixture = FIXTURES["f16"]
    assert cli(["generate", "--model", str(fixture), "Hello", "--max-new-tokens", "4", "--greedy"]) == 0
    said = capsys.readouterr().out
    model, tokenizer = GPT2LMHeadModel.from_pretrained(fixture), ours.tokenizer_of(fixture)
    prompt = torch.tensor([tokenizer.encode("Hello").ids])
    expected = tokenizer.decode(model.generate(prompt, max_new_tokens=4, do_sample=False)[0].tolist())
    assert said.strip() == expected.strip()

    assert cli(["convert", str(fixture), str(tmp_path / "q.gguf"), "--dtype", "q8_0"]) == 0
    assert all(t.tensor_type in (Q.Q8_0, Q.F32) for t in gguf.GGUFReader(tmp_path / "q.gguf").tensors)
    assert cli(["convert", str(fixture), str(tmp_path / "folder")]) == 0
    assert (tmp_path / "folder" / "tokenizer.json").is_file()  # the GGUF's tokenizer, written out
    capsys.readouterr()
    assert cli(["parity", str(fixture), str(tmp_path / "q.gguf")]) == 1  # q8_0 departs beyond fp32's tolerance
    assert "layer 1" in capsys.readouterr().out


def test_the_shipped_character_model_goes_to_gguf_with_its_tokenizer(tmp_path, capsys):
    """The README's tour: `convert` the character model to a .gguf, then `generate --model` it."""
    from gpt2attn.generation import DEFAULT_MODEL_DIR

    assert cli(["convert", str(DEFAULT_MODEL_DIR), str(tmp_path / "m.gguf"), "--dtype", "f32"]) == 0
    assert capsys.readouterr().err == ""  # no "written without the tokenizer" note
    said = []
    for model in (DEFAULT_MODEL_DIR, tmp_path / "m.gguf"):
        assert cli(["generate", "--model", str(model), "ROMEO:", "--max-new-tokens", "30", "--greedy"]) == 0
        said.append(capsys.readouterr().out)
    assert said[1] == said[0] and len(said[0]) > len("ROMEO:\n")


def test_import_gpt2attn_does_not_import_gguf():
    code = "import sys, gpt2attn, gpt2attn.formats; print('gguf' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


# --- bad input -------------------------------------------------------------------------------------------


def damaged(tmp_path: Path, name: str) -> Path:
    data = bytearray(FIXTURES["q8_0"].read_bytes())
    path = tmp_path / f"{name}.gguf"
    if name == "truncated":
        data = data[: len(data) // 2]
    elif name == "header only":
        data = data[:20]
    elif name == "magic":
        data[:4] = b"GGML"
    elif name == "version":
        data[4:8] = (7).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("name, field", [("truncated", "truncated"), ("header only", "truncated"),
                                         ("version", "version 7")])
def test_damaged_files_get_one_error_naming_the_file_and_field(tmp_path, name, field):
    path = damaged(tmp_path, name)
    with pytest.raises(ValueError, match=field) as error:
        GPT2LMHeadModel.from_pretrained(path)
    assert str(path) in str(error.value)


def test_a_wrong_magic_is_not_read_as_gguf(tmp_path):
    path = damaged(tmp_path, "magic")
    assert not ours.detect(path)
    with pytest.raises(ValueError, match="magic") as error:
        ours.read(path)
    assert str(path) in str(error.value)


def test_another_architecture_and_an_unread_type_are_named(tmp_path):
    def write(path: Path, arch: str, raw_dtype, data: np.ndarray) -> Path:
        writer = gguf.GGUFWriter(path, arch)
        for key, value in [("block_count", 1), ("context_length", 32), ("embedding_length", 256),
                           ("attention.head_count", 4)]:
            writer.add_uint32(f"{arch}.{key}", value)
        writer.add_tensor("token_embd.weight", data, raw_dtype=raw_dtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    llama = write(tmp_path / "llama.gguf", "llama", Q.F32, np.zeros((64, 256), dtype=np.float32))
    with pytest.raises(ValueError, match="general.architecture is 'llama'") as error:
        GPT2LMHeadModel.from_pretrained(llama)
    assert str(llama) in str(error.value)
    q2_k = write(tmp_path / "q2k.gguf", "gpt2", Q.Q2_K, np.zeros((64, gguf.GGML_QUANT_SIZES[Q.Q2_K][1]), dtype=np.uint8))
    with pytest.raises(ValueError, match="token_embd.weight has GGML type Q2_K") as error:
        GPT2LMHeadModel.from_pretrained(q2_k)
    assert str(q2_k) in str(error.value)


def test_failures_write_nothing(tmp_path, bpe_model):
    model, tokenizer = bpe_model
    target = tmp_path / "m.gguf"
    with pytest.raises(ValueError, match="q4_0"):
        save(model, target, dtype="q4_0")
    assert not target.exists()
    save(model, target, dtype="f16", tokenizer=tokenizer)
    before = target.read_bytes()
    bad = GPT2LMHeadModel(tiny_config(activation_function="relu"))
    with pytest.raises(ValueError, match="GELU"):
        save(bad, target)
    assert target.read_bytes() == before
    assert cli(["convert", str(damaged(tmp_path, "truncated")), str(tmp_path / "out")]) == 2  # a one-line error
    assert not (tmp_path / "out").exists()
