"""Code written for transformers' GPT-2, run on gpt2attn: transformers' own config objects, the
attention-backend switch, generate's per-step outputs and keywords, from_pretrained's other forms.
Each behaviour is compared with transformers on the same weights where transformers has it; each was
missing before (transformers' own test file, ../shared/hf-tests, found them).
"""

from __future__ import annotations

import inspect
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from tests.helpers import hf_twin, load_report, max_diff, randomize, tiny_config  # noqa: E402

import gpt2attn  # noqa: E402
from gpt2attn import GPT2Config, GPT2LMHeadModel, GPT2Model  # noqa: E402

IDS = torch.tensor([[5, 9, 2, 7, 1], [3, 3, 8, 1, 4]])


def hf_config(**overrides):
    fields = dict(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                  attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2Config(**{**fields, **overrides})


@pytest.mark.parametrize("cls", [GPT2Model, GPT2LMHeadModel, gpt2attn.GPT2ForSequenceClassification,
                                 gpt2attn.GPT2DoubleHeadsModel])
def test_a_transformers_config_builds_the_model_and_stays_its_config(cls):
    config = hf_config(pad_token_id=0)
    model = cls(config)
    assert model.config is config  # as in transformers: the object passed in, not a copy
    assert config._attn_implementation == "sdpa"  # resolved at construction, as transformers does


def test_a_transformers_config_gives_the_same_logits_as_ours():
    torch.manual_seed(0)
    ours = randomize(GPT2LMHeadModel(tiny_config())).eval()
    theirs_config = GPT2LMHeadModel(hf_config()).eval()
    theirs_config.load_state_dict(ours.state_dict())
    assert max_diff(ours(IDS).logits, theirs_config(IDS).logits) == 0.0
    assert max_diff(ours(IDS).logits, hf_twin(ours)(IDS).logits) < 1e-5


def test_a_config_without_gpt2_fields_is_refused_naming_them():
    class NotGPT2:
        vocab_size, n_embd = 10, 8

    with pytest.raises(TypeError, match="NotGPT2 is not a GPT-2 config: it has no n_positions, n_layer, n_head"):
        GPT2Model(NotGPT2())


def test_config_reads_like_transformers():
    assert GPT2Config.attribute_map == transformers.GPT2Config.attribute_map
    params = inspect.signature(GPT2Config.__init__).parameters
    assert {"vocab_size", "n_embd", "n_layer", "n_head", "n_inner", "tie_word_embeddings"} <= set(params)
    config = GPT2Config(dtype="float16", label2id={"label": "0"}, id2label={0: "label"})
    assert config.dtype == torch.float16 and config.torch_dtype == torch.float16
    assert config.to_dict()["dtype"] == "float16"  # written as a name, as transformers writes it
    assert transformers.GPT2Config.from_dict(config.to_dict()).dtype == torch.float16
    assert not config.is_encoder_decoder and config.sub_configs == {}
    assert set(config) == set(vars(config))  # iterating gives the attribute names
    assert GPT2Config(n_layer=3).to_diff_dict() == {"n_layer": 3, "model_type": "gpt2"}


def test_attn_implementation_switches_the_attention_path(monkeypatch):
    calls = []
    textbook = gpt2attn.layers.scaled_dot_product_attention
    monkeypatch.setattr(gpt2attn.layers, "scaled_dot_product_attention",
                        lambda *a: calls.append("textbook") or textbook(*a))
    model = randomize(GPT2LMHeadModel(tiny_config())).eval()
    sdpa = model(IDS).logits
    assert calls == [] and model.config._attn_implementation == "sdpa"
    model.set_attn_implementation("eager")
    assert model.config._attn_implementation == "eager"
    eager = model(IDS).logits
    assert calls == ["textbook"] * 2  # one per layer
    assert max_diff(sdpa, eager) < 1e-5
    with pytest.raises(ValueError, match='Specified `attn_implementation="flash_attention_2"` is not supported'):
        model.set_attn_implementation("flash_attention_2")
    model.set_attn_implementation({"vision_config": "sdpa"})  # a dict: only its "" entry is GPT-2's
    assert model.config._attn_implementation == "eager"
    model.set_attn_implementation({"": "sdpa"})
    assert model.config._attn_implementation == "sdpa" and not model.transformer.h[0].attn.textbook


def test_from_pretrained_takes_attn_implementation(tmp_path):
    GPT2LMHeadModel(tiny_config()).save_pretrained(tmp_path)
    model = GPT2LMHeadModel.from_pretrained(tmp_path, attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    assert all(block.attn.textbook for block in model.transformer.h)
    assert not GPT2LMHeadModel.from_pretrained(tmp_path).transformer.h[0].attn.textbook


def test_from_config_records_the_backend_and_dtype():
    model = GPT2LMHeadModel._from_config(tiny_config(), attn_implementation="eager", dtype=torch.bfloat16)
    assert model.config._attn_implementation == "eager" and model.dtype == torch.bfloat16
    for cls in (GPT2LMHeadModel, transformers.GPT2LMHeadModel):  # the config's dtype is the default, and recorded
        assert cls._from_config(hf_config(dtype="bfloat16")).dtype == torch.bfloat16, cls
        model = cls._from_config(hf_config(dtype="bfloat16"), dtype=torch.float16)
        assert model.dtype == model.config.dtype == torch.float16, cls
        model = cls._from_config(hf_config())
        assert model.dtype == torch.float32 and model.config.dtype is None, cls


def saved_dtypes(folder) -> dict:
    config = json.loads((folder / "config.json").read_text())
    return {key: config[key] for key in ("dtype", "torch_dtype") if key in config}


def test_a_model_loaded_in_another_dtype_is_saved_as_what_it_is(tmp_path):
    """An fp16 folder loaded in fp32 (or as an int8 model) and saved: config.json says float32, as
    transformers writes it, so that transformers' default ('auto') loads the fp32 weights in fp32,
    not in the fp16 the first folder recorded. A model cast after loading is saved as its new dtype."""
    randomize(GPT2LMHeadModel(tiny_config())).to(torch.float16).save_pretrained(tmp_path / "fp16")
    for name, cls in [("ours", GPT2LMHeadModel), ("theirs", transformers.GPT2LMHeadModel)]:
        model = cls.from_pretrained(tmp_path / "fp16", dtype=torch.float32)
        assert model.config.dtype == torch.float32, name
        model.save_pretrained(tmp_path / name)
        assert saved_dtypes(tmp_path / name).get("dtype") == "float32", name
        assert transformers.GPT2LMHeadModel.from_pretrained(tmp_path / name).dtype == torch.float32, name
        assert GPT2LMHeadModel.from_pretrained(tmp_path / name, dtype="auto").dtype == torch.float32, name
        model.to(torch.bfloat16).save_pretrained(tmp_path / f"{name}-bf16")
        assert saved_dtypes(tmp_path / f"{name}-bf16").get("dtype") == "bfloat16", name
    assert saved_dtypes(tmp_path / "ours") == {"dtype": "float32", "torch_dtype": "float32"}  # 4.x reads the second
    quantized = GPT2LMHeadModel.from_pretrained(tmp_path / "fp16", quantize="int8")
    assert quantized.config.dtype == torch.float32
    quantized.save_pretrained(tmp_path / "int8")
    assert saved_dtypes(tmp_path / "int8") == {"dtype": "float32", "torch_dtype": "float32"}
    assert transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "int8").dtype == torch.float32


def test_from_pretrained_leaves_the_callers_config_as_it_was(tmp_path):
    """transformers loads into a copy of config=: two models loaded with one config, one of them
    eager, each keep their own backend and dtype, and the caller's config object is unchanged."""
    GPT2LMHeadModel(tiny_config()).to(torch.float16).save_pretrained(tmp_path)
    for cls in (GPT2LMHeadModel, transformers.GPT2LMHeadModel):
        config = hf_config()
        before = (config.to_dict(), config._attn_implementation, config.name_or_path)
        eager = cls.from_pretrained(tmp_path, config=config, attn_implementation="eager")
        wide = cls.from_pretrained(tmp_path, config=config, dtype=torch.float32)
        assert (config.to_dict(), config._attn_implementation, config.name_or_path) == before, cls
        assert eager.config is not config and wide.config is not eager.config, cls
        assert (eager.config._attn_implementation, eager.config.dtype) == ("eager", torch.float16), cls
        assert (wide.config._attn_implementation, wide.config.dtype) == ("sdpa", torch.float32), cls


@pytest.mark.parametrize("num_beams", [1, 2])
def test_generate_returns_attentions_and_hidden_states_as_transformers(num_beams):
    torch.manual_seed(0)
    model = randomize(GPT2LMHeadModel(tiny_config())).eval()
    twin = hf_twin(model)
    kwargs = dict(max_new_tokens=3, do_sample=False, num_beams=num_beams, return_dict_in_generate=True,
                  output_attentions=True, output_hidden_states=True, eos_token_id=-1, pad_token_id=0)
    ours, theirs = model.generate(IDS, **kwargs), twin.generate(IDS, **kwargs)
    assert torch.equal(ours.sequences, theirs.sequences)
    assert len(ours.attentions) == len(theirs.attentions) == 3
    for step_ours, step_theirs in zip(ours.attentions, theirs.attentions):
        assert [a.shape for a in step_ours] == [a.shape for a in step_theirs]
        if num_beams == 1:  # beams are reordered between steps in transformers' cache, not in ours
            assert max(max_diff(a, b) for a, b in zip(step_ours, step_theirs)) < 1e-5
    for step_ours, step_theirs in zip(ours.hidden_states, theirs.hidden_states):
        assert [h.shape for h in step_ours] == [h.shape for h in step_theirs]
        if num_beams == 1:
            assert max(max_diff(a, b) for a, b in zip(step_ours, step_theirs)) < 1e-5


def test_generate_keywords_of_transformers():
    torch.manual_seed(0)
    model = randomize(GPT2LMHeadModel(tiny_config(eos_token_id=5))).eval()
    twin = hf_twin(model)
    # a negative eos never occurs: generation runs to its length
    with pytest.warns(UserWarning, match="negative id never occurs"):
        out = model.generate(IDS, max_new_tokens=6, eos_token_id=-1)
    assert out.shape == (2, 11)
    # forced_eos_token_id: the last token is eos
    forced = model.generate(IDS, max_new_tokens=4, forced_eos_token_id=3, eos_token_id=-1, pad_token_id=0)
    assert torch.equal(forced, twin.generate(IDS, max_new_tokens=4, forced_eos_token_id=3, eos_token_id=-1,
                                             pad_token_id=0))
    assert forced[:, -1].tolist() == [3, 3]
    # position_ids given: the same tokens as those generate derives
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    plain = model.generate(IDS, attention_mask=mask, max_new_tokens=4, do_sample=False)
    assert torch.equal(plain, model.generate(IDS, attention_mask=mask, position_ids=positions, max_new_tokens=4,
                                             do_sample=False))
    # no prompt: one row started from bos, as transformers does
    start = model.generate(max_new_tokens=3, do_sample=False)
    assert torch.equal(start, model.generate(torch.tensor([[0]]), max_new_tokens=3, do_sample=False))
    assert torch.equal(start, twin.generate(max_new_tokens=3, do_sample=False))


def test_remove_invalid_values_makes_the_logits_finite():
    model = GPT2LMHeadModel(tiny_config()).eval()
    with torch.no_grad():
        model.lm_head.weight[7] = float("inf")  # token 7's logit is +inf or nan wherever the hidden state is not 0
    out = model.generate(IDS, max_new_tokens=2, remove_invalid_values=True, return_dict_in_generate=True,
                         output_scores=True)
    assert all(torch.isfinite(s).all() for s in out.scores)


def test_from_pretrained_loading_report(tmp_path):
    model = GPT2LMHeadModel(tiny_config())
    model.save_pretrained(tmp_path)
    loaded, info = GPT2Model.from_pretrained(tmp_path, output_loading_info=True)
    assert info["missing_keys"] == set() and info["mismatched_keys"] == set()
    assert max_diff(loaded.wte.weight, model.transformer.wte.weight) == 0.0
    with load_report() as report:
        _, info = gpt2attn.GPT2DoubleHeadsModel.from_pretrained(tmp_path, output_loading_info=True)
    assert "has weights the checkpoint lacks" in report.getvalue()
    assert info["missing_keys"] == {"multiple_choice_head.summary.weight", "multiple_choice_head.summary.bias"}
    # a head with another number of labels: refused, unless mismatched sizes are forgiven
    head = gpt2attn.GPT2ForSequenceClassification(tiny_config(pad_token_id=0))
    head.save_pretrained(tmp_path / "head")
    with pytest.raises(gpt2attn.CheckpointError, match="shape mismatch for score.weight"):
        gpt2attn.GPT2ForSequenceClassification.from_pretrained(tmp_path / "head", num_labels=5)
    with pytest.raises(RuntimeError, match="shape mismatch for score.weight"):  # what transformers raises
        gpt2attn.GPT2ForSequenceClassification.from_pretrained(tmp_path / "head", num_labels=5)
    with load_report() as report:
        five = gpt2attn.GPT2ForSequenceClassification.from_pretrained(tmp_path / "head", num_labels=5,
                                                                       ignore_mismatched_sizes=True)
    assert ("weights of the wrong shape, newly initialised: score.weight (Reinit due to size mismatch - "
            "checkpoint (2, 32) vs model (5, 32))") in report.getvalue()
    assert five.score.weight.shape == (5, 32)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # transformers' own switch silences our report too
    try:
        with load_report(level=None) as report:
            _, info = gpt2attn.GPT2ForSequenceClassification.from_pretrained(
                tmp_path / "head", num_labels=5, ignore_mismatched_sizes=True, output_loading_info=True)
    finally:
        transformers.logging.set_verbosity(verbosity)
    assert report.getvalue() == ""
    assert info["mismatched_keys"] == {"score.weight"} and info["missing_keys"] == set()  # reported apart


def test_from_pretrained_of_a_state_dict_and_under_meta(tmp_path):
    model = randomize(GPT2LMHeadModel(tiny_config())).eval()
    again = GPT2LMHeadModel.from_pretrained(None, config=model.config, state_dict=model.state_dict())
    assert max_diff(again(IDS).logits, model(IDS).logits) == 0.0
    model.save_pretrained(tmp_path)
    with torch.device("meta"), pytest.raises(RuntimeError, match="meta device context manager"):
        GPT2LMHeadModel.from_pretrained(tmp_path)


def test_shift_labels_are_used_as_they_are():
    model = randomize(GPT2LMHeadModel(tiny_config())).eval()
    twin = hf_twin(model)
    shifted = torch.tensor([[9, 2, 7, 1, -100], [3, 8, 1, 4, -100]])
    ours = model(IDS, labels=IDS, shift_labels=shifted).loss
    assert abs(ours.item() - twin(IDS, labels=IDS, shift_labels=shifted).loss.item()) < 1e-5
    assert abs(ours.item() - model(IDS, labels=IDS).loss.item()) < 1e-5  # the same targets, shifted by hand
    assert abs(model(IDS, shift_labels=IDS).loss.item() - ours.item()) > 1e-3


def test_post_init_keeps_the_weights_and_the_output_names_its_cache():
    model = randomize(GPT2LMHeadModel(tiny_config()))
    before = model.transformer.h[0].mlp.c_fc.weight.clone()
    model.post_init()
    assert torch.equal(before, model.transformer.h[0].mlp.c_fc.weight)
    out = model(IDS)
    assert "past_key_values" in out and "cache" in out
    model.resize_token_embeddings(100)
    assert model.vocab_size == model.config.vocab_size == 100


def test_gradient_checkpointing_set_in_the_config_is_on():
    model = GPT2LMHeadModel(tiny_config(gradient_checkpointing=True))
    assert model.is_gradient_checkpointing
    assert not GPT2LMHeadModel(tiny_config()).is_gradient_checkpointing


def test_generate_continues_from_a_cache_with_the_whole_sequence_embedded():
    """transformers' form: inputs_embeds of every position, the cached ones too; the new tokens are the
    same as one generate call of the whole length, and as transformers' continuation."""
    torch.manual_seed(0)
    model = randomize(GPT2LMHeadModel(tiny_config())).eval()
    twin = hf_twin(model)
    kw = dict(do_sample=False, eos_token_id=-1, pad_token_id=0, return_dict_in_generate=True)
    embeds = model.transformer.wte(IDS).detach()
    whole = model.generate(inputs_embeds=embeds, max_new_tokens=4, **kw).sequences
    first = model.generate(inputs_embeds=embeds, max_new_tokens=3, **kw)
    continued = torch.cat([embeds, model.transformer.wte(first.sequences).detach()], dim=1)
    last = model.generate(inputs_embeds=continued, max_new_tokens=1, past_key_values=first.past_key_values, **kw)
    assert torch.equal(torch.cat([first.sequences, last.sequences], dim=1), whole)
    hf_first = twin.generate(inputs_embeds=embeds, max_new_tokens=3, **kw)
    hf_last = twin.generate(inputs_embeds=continued, max_new_tokens=1, past_key_values=hf_first.past_key_values, **kw)
    assert torch.equal(last.sequences, hf_last.sequences)


def test_from_pretrained_records_where_the_model_came_from(tmp_path):
    """As transformers: model.name_or_path and config.name_or_path (TRL's DPO builds its reference
    model from it; an adapter records it as its base model); not written into config.json."""
    peft = pytest.importorskip("peft")
    GPT2LMHeadModel(tiny_config()).save_pretrained(tmp_path)
    model = GPT2LMHeadModel.from_pretrained(tmp_path)
    assert model.name_or_path == model.config.name_or_path == model.config._name_or_path == str(tmp_path)
    assert "_name_or_path" not in model.config.to_dict()
    model.add_adapter(peft.LoraConfig(r=2, target_modules=["c_attn"]))
    assert model.peft_config["default"].base_model_name_or_path == str(tmp_path)
    assert GPT2LMHeadModel(tiny_config()).name_or_path == ""


def test_generate_takes_embeddings_as_long_as_the_cache_as_the_next_positions():
    """inputs_embeds of as many positions as are cached are the positions after the cache (the
    whole-sequence form above needs more positions than are cached): the tokens generate gives for
    the whole prompt as ids."""
    torch.manual_seed(0)
    model = randomize(GPT2LMHeadModel(tiny_config())).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    kw = dict(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=4)
    past = model(ids[:, :3]).past_key_values
    after = model.generate(inputs_embeds=model.transformer.wte(ids[:, 3:]).detach(), past_key_values=past, **kw)
    assert torch.equal(after, model.generate(ids, **kw)[:, 6:])
