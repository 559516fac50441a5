"""from_pretrained / save_pretrained against transformers, both ways, and every source format."""

from __future__ import annotations

import json
import os
import socket

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from gpt2attn import GPT2LMHeadModel, GPT2Model
from tests.helpers import fake_hub_cache, hf_twin, mapped_ranges, max_diff, randomize, tiny_config

TOKENS = torch.tensor([[5, 17, 3, 88, 41, 2, 60], [9, 9, 70, 1, 33, 12, 96]])


def lm(seed=0, **overrides) -> GPT2LMHeadModel:
    return randomize(GPT2LMHeadModel(tiny_config(**overrides)), seed).eval()


def hf_lm(folder):
    return transformers.GPT2LMHeadModel.from_pretrained(folder, attn_implementation="eager").eval()


@torch.no_grad()
def test_transformers_opens_our_folder(tmp_path):
    model = lm()
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["architectures"] == ["GPT2LMHeadModel"]
    assert sorted(os.listdir(tmp_path)) == ["config.json", "generation_config.json", "model.safetensors"]  # as transformers writes
    stored = load_file(tmp_path / "model.safetensors")  # the reference reader accepts our writer
    assert "lm_head.weight" not in stored  # tied: stored once, as HF does
    assert torch.equal(stored["transformer.h.1.attn.c_attn.weight"], model.transformer.h[1].attn.c_attn.weight)
    assert max_diff(hf_lm(tmp_path)(TOKENS).logits, model(TOKENS).logits) < 1e-4


@torch.no_grad()
@pytest.mark.parametrize("safe", [True, False])
def test_we_open_a_transformers_folder(tmp_path, safe):
    hf = hf_twin(lm(seed=1)).eval()
    hf.save_pretrained(tmp_path, safe_serialization=safe)
    ours = GPT2LMHeadModel.from_pretrained(tmp_path)
    assert not ours.training
    assert ours.lm_head.weight is ours.transformer.wte.weight
    assert max_diff(ours(TOKENS).logits, hf(TOKENS).logits) < 1e-4
    base = GPT2Model.from_pretrained(tmp_path)  # the LM checkpoint into the bare model: head dropped
    assert max_diff(base(TOKENS).last_hidden_state, hf.transformer(TOKENS).last_hidden_state) < 1e-4


@torch.no_grad()
def test_base_model_checkpoint_into_lm_ties_head(tmp_path):
    base = randomize(GPT2Model(tiny_config()), 2).eval()
    base.save_pretrained(tmp_path)
    ours = GPT2LMHeadModel.from_pretrained(tmp_path)
    assert ours.lm_head.weight is ours.transformer.wte.weight
    expected = base(TOKENS).last_hidden_state @ base.wte.weight.T
    assert max_diff(ours(TOKENS).logits, expected) < 1e-4


@torch.no_grad()
def test_untied_head_round_trips(tmp_path):
    model = lm(tie_word_embeddings=False)
    assert model.lm_head.weight is not model.transformer.wte.weight
    model.save_pretrained(tmp_path)
    ours = GPT2LMHeadModel.from_pretrained(tmp_path)
    assert torch.equal(ours.lm_head.weight, model.lm_head.weight)
    assert max_diff(hf_lm(tmp_path)(TOKENS).logits, model(TOKENS).logits) < 1e-4


@torch.no_grad()
@pytest.mark.parametrize("safe", [True, False])
def test_sharded_both_ways(tmp_path, safe):
    model = lm()
    model.save_pretrained(tmp_path / "ours", safe_serialization=safe, max_shard_size="20KB")
    index = "model.safetensors.index.json" if safe else "pytorch_model.bin.index.json"
    weight_map = json.loads((tmp_path / "ours" / index).read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1
    hf = hf_lm(tmp_path / "ours")
    assert max_diff(hf(TOKENS).logits, model(TOKENS).logits) < 1e-4
    hf.save_pretrained(tmp_path / "theirs", safe_serialization=safe, max_shard_size="20KB")
    ours = GPT2LMHeadModel.from_pretrained(tmp_path / "theirs")
    assert max_diff(ours(TOKENS).logits, model(TOKENS).logits) < 1e-4


@torch.no_grad()
def test_resave_with_fewer_files_removes_old_shards(tmp_path):
    model = lm()
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    model.save_pretrained(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "generation_config.json", "model.safetensors"]  # as transformers writes


@torch.no_grad()
def test_wrapped_and_old_state_dicts_load():
    model = lm()
    config = model.config
    state = {}
    for name, t in model.state_dict().items():
        state["module._orig_mod." + name.removeprefix("transformer.")] = t.clone()
    state["module._orig_mod.h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 32, 32))
    state["module._orig_mod.h.0.attn.masked_bias"] = torch.tensor(-1e4)
    ours = GPT2LMHeadModel.from_pretrained(state, config=config)
    assert max_diff(ours(TOKENS).logits, model(TOKENS).logits) == 0


@torch.no_grad()
def test_state_dict_source_is_copied_not_shared():
    model = lm()
    loaded = GPT2LMHeadModel.from_pretrained(model.state_dict(), config=model.config)
    loaded.transformer.ln_f.bias.add_(1.0)
    assert not torch.equal(loaded.transformer.ln_f.bias, model.transformer.ln_f.bias)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight


@torch.no_grad()
def test_state_dict_without_config_infers_openai_size():
    model = GPT2Model(tiny_config(n_embd=768, n_head=12, n_layer=1, vocab_size=50, n_positions=8))
    loaded = GPT2Model.from_pretrained(model.state_dict())
    assert (loaded.config.n_head, loaded.config.n_layer, loaded.config.vocab_size) == (12, 1, 50)
    with pytest.raises(ValueError, match="n_head"):
        GPT2Model.from_pretrained(GPT2Model(tiny_config()).state_dict())


@torch.no_grad()
def test_single_weights_file(tmp_path):
    model = lm()
    model.save_pretrained(tmp_path)
    ours = GPT2LMHeadModel.from_pretrained(tmp_path / "model.safetensors")
    assert max_diff(ours(TOKENS).logits, model(TOKENS).logits) == 0


@torch.no_grad()
def test_dtype_and_device_applied_while_loading(tmp_path, monkeypatch):
    model = lm()
    model.save_pretrained(tmp_path)
    calls = []
    original = torch.nn.Module.to
    monkeypatch.setattr(torch.nn.Module, "to", lambda *a, **k: calls.append(a) or original(*a, **k))
    ours = GPT2LMHeadModel.from_pretrained(tmp_path, dtype="bf16", device="cpu")
    assert calls == []  # no model.to(...) after the fact
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    assert torch.equal(ours.transformer.wpe.weight, model.transformer.wpe.weight.bfloat16())
    assert ours.lm_head.weight is ours.transformer.wte.weight
    assert not any(p.is_meta for p in ours.parameters())
    model.half().save_pretrained(tmp_path)
    assert GPT2LMHeadModel.from_pretrained(tmp_path, dtype="auto").dtype == torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        GPT2LMHeadModel.from_pretrained(tmp_path, dtype="float8")


def test_missing_unexpected_and_wrong_shape_are_named(tmp_path):
    lm().save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    state = load_file(path)
    del state["transformer.h.1.mlp.c_fc.bias"]
    state["transformer.h.0.attn.extra"] = torch.zeros(3)
    state["transformer.ln_f.weight"] = torch.zeros(31)
    save_file(state, path)
    with pytest.raises(ValueError) as err:
        GPT2LMHeadModel.from_pretrained(tmp_path)
    message = str(err.value)
    assert str(path) in message
    assert "missing keys: transformer.h.1.mlp.c_fc.bias" in message
    assert "unexpected keys: transformer.h.0.attn.extra" in message
    assert "transformer.ln_f.weight: expected (32,), found (31,)" in message


def test_wrong_model_type_is_refused(tmp_path):
    lm().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    with pytest.raises(ValueError, match=r"config\.json.*model_type 'bert'"):
        GPT2LMHeadModel.from_pretrained(tmp_path)


@pytest.mark.parametrize("safe", [True, False])
def test_truncated_files_are_refused(tmp_path, safe):
    lm().save_pretrained(tmp_path, safe_serialization=safe)
    path = tmp_path / ("model.safetensors" if safe else "pytorch_model.bin")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(ValueError, match="truncated"):
        GPT2LMHeadModel.from_pretrained(tmp_path)


def test_corrupt_safetensors_header_is_refused(tmp_path):
    lm().save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:12] = b"\xff\xfe{]"
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="corrupt safetensors header"):
        GPT2LMHeadModel.from_pretrained(tmp_path)


def test_resave_keeps_other_files_and_leaves_no_temporaries(tmp_path):
    lm().save_pretrained(tmp_path / "m", max_shard_size="20KB")
    (tmp_path / "m" / "tokenizer.json").write_text("{}")
    (tmp_path / "m" / "notes").mkdir()
    (tmp_path / "m" / "notes" / "README.md").write_text("mine")
    lm(seed=3).save_pretrained(tmp_path / "m")
    assert sorted(os.listdir(tmp_path)) == ["m"]  # the old folder and the temporary one are gone
    assert sorted(os.listdir(tmp_path / "m")) == ["config.json", "generation_config.json", "model.safetensors", "notes", "tokenizer.json"]
    assert (tmp_path / "m" / "notes" / "README.md").read_text() == "mine"


def test_resave_in_another_format_drops_every_old_weights_file(tmp_path):
    """Old .bin shards, their index and config.json are the model's: never kept beside new weights."""
    lm().save_pretrained(tmp_path / "m", max_shard_size="20KB", safe_serialization=False)
    old = set(os.listdir(tmp_path / "m"))
    assert "pytorch_model.bin.index.json" in old and len([name for name in old if name.endswith(".bin")]) > 1
    (tmp_path / "m" / "vocab.json").write_text("{}")
    lm(seed=3).save_pretrained(tmp_path / "m")
    lm(seed=3).save_pretrained(tmp_path / "fresh")
    assert sorted(os.listdir(tmp_path / "m")) == sorted(os.listdir(tmp_path / "fresh") + ["vocab.json"])


def test_missing_source_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        GPT2LMHeadModel.from_pretrained(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text(json.dumps(tiny_config().to_dict()))
    with pytest.raises(FileNotFoundError, match="no weights found"):
        GPT2LMHeadModel.from_pretrained(tmp_path)


@torch.no_grad()
def test_hub_name_resolves_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = lm()
    fake_hub_cache(tmp_path, "openai-community/gpt2", model)
    for name in ("openai-community/gpt2", "gpt2"):
        ours = GPT2LMHeadModel.from_pretrained(name, cache_dir=tmp_path)
        assert max_diff(ours(TOKENS).logits, model(TOKENS).logits) == 0


def test_offline_and_not_cached_fails_fast(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def no_network(*args):
        raise AssertionError("offline lookup touched the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)  # so it cannot hang on a connection
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE") as err:
        GPT2LMHeadModel.from_pretrained("openai-community/gpt2-medium", cache_dir=tmp_path)
    assert "hf download openai-community/gpt2-medium" in str(err.value)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc/self/maps")
def test_safetensors_weights_are_used_in_place_not_copied(tmp_path):
    lm().save_pretrained(tmp_path)
    ours = GPT2LMHeadModel.from_pretrained(tmp_path)
    ranges = mapped_ranges((tmp_path / "model.safetensors").resolve())
    assert ranges
    for name, p in ours.named_parameters():
        assert any(start <= p.data_ptr() < end for start, end in ranges), name  # a view of the file map
    converted = GPT2LMHeadModel.from_pretrained(tmp_path, dtype=torch.float16)  # a conversion must copy
    ranges = mapped_ranges((tmp_path / "model.safetensors").resolve())
    assert not any(start <= converted.transformer.wte.weight.data_ptr() < end for start, end in ranges)


@torch.no_grad()
def test_resave_into_the_folder_it_was_loaded_from(tmp_path):
    model = lm()
    model.save_pretrained(tmp_path)
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path)  # its weights map the file about to be replaced
    loaded.save_pretrained(tmp_path, max_shard_size="20KB")
    again = GPT2LMHeadModel.from_pretrained(tmp_path)
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name


@torch.no_grad()
@pytest.mark.parametrize("bias", [True, False])
def test_nanogpt_checkpoint_computes_what_nanogpt_computes(tmp_path, bias):
    """nanoGPT's out/ckpt.pt: torch.compile'd keys, nn.Linear (out, in) weights, model_args, and
    its model's numbers: exact GELU (nn.GELU()) and, with bias=False, no biases at all. The
    reference is transformers' GPT-2 with activation_function="gelu" and zero biases."""
    model = lm(activation_function="gelu")
    if not bias:
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
    linears = ("c_attn.weight", "c_proj.weight", "c_fc.weight")
    state = {
        "_orig_mod." + name: t.t().contiguous() if name.endswith(linears) else t
        for name, t in model.state_dict().items()
        if bias or not name.endswith(".bias")
    }
    config = model.config
    model_args = dict(n_layer=config.n_layer, n_head=config.n_head, n_embd=config.n_embd,
                      block_size=config.n_positions, bias=bias, vocab_size=config.vocab_size, dropout=0.0)
    torch.save({"model": state, "model_args": model_args, "iter_num": 10, "best_val_loss": 1.5}, tmp_path / "ckpt.pt")
    ours = GPT2LMHeadModel.from_pretrained(tmp_path / "ckpt.pt")
    assert ours.config.activation_function == "gelu"
    assert ours.lm_head.weight is ours.transformer.wte.weight
    reference = hf_twin(model).eval()
    assert reference.config.activation_function == "gelu"
    assert max_diff(ours(TOKENS).logits, reference(TOKENS).logits) < 1e-5
    tanh_gelu = hf_twin(lm(activation_function="gelu_new")).eval()
    tanh_gelu.load_state_dict(model.state_dict())
    assert max_diff(ours(TOKENS).logits, tanh_gelu(TOKENS).logits) > 1e-4  # the test tells the two GELUs apart


def test_saved_files_get_the_usual_permissions(tmp_path):
    lm().save_pretrained(tmp_path, max_shard_size="20KB")
    umask = os.umask(0)
    os.umask(umask)
    for file in tmp_path.iterdir():
        assert file.stat().st_mode & 0o777 == 0o666 & ~umask, file.name  # not mkstemp's 0600


# ==================================================================================================
# The tie rule
#
# The tie rule for a checkpoint with no lm_head (loader.build_model), as transformers has it.
# ==================================================================================================


@pytest.mark.parametrize("tie", [True, False])
def test_a_checkpoint_without_lm_head_is_tied_to_wte_whatever_the_config_says(tmp_path, tie):
    """loader.build_model: the head is tied when the config says so or the checkpoint has none."""
    model = lm(tie_word_embeddings=tie)
    state = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(model.config.to_dict()))
    back = GPT2LMHeadModel.from_pretrained(tmp_path)
    assert back.lm_head.weight is back.transformer.wte.weight
    assert torch.equal(back.lm_head.weight, model.transformer.wte.weight)


@pytest.mark.parametrize("tie", [True, False])
def test_a_checkpoint_with_its_own_lm_head_is_untied_only_when_the_config_says(tmp_path, tie):
    model = lm(tie_word_embeddings=False)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["lm_head.weight"] = state["lm_head.weight"] + 1.0  # differs from wte
    save_file(state, tmp_path / "model.safetensors")
    config = model.config.to_dict() | {"tie_word_embeddings": tie}
    (tmp_path / "config.json").write_text(json.dumps(config))
    back = GPT2LMHeadModel.from_pretrained(tmp_path)
    if tie:  # transformers' rule: the config's tie wins, the stored head is dropped
        assert back.lm_head.weight is back.transformer.wte.weight
        assert torch.equal(back.lm_head.weight, state["transformer.wte.weight"])
    else:
        assert back.lm_head.weight is not back.transformer.wte.weight
        assert torch.equal(back.lm_head.weight, state["lm_head.weight"])
