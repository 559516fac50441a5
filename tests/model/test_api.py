"""The API around the numbers, as transformers' GPT-2 has it: config keywords and files, forward's
config defaults and tuples, embeddings access and resizing, parameter counts, gradient
checkpointing options, generation helpers. Each compared with transformers where it has one."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import transformers

from gpt2attn import GPT2Config, GPT2LMHeadModel, GPT2Model, GPT2PreTrainedModel
from tests.helpers import fake_hub_cache, hf_twin, max_diff, randomize, tiny_config

# --- config --------------------------------------------------------------------------------

CONFIG_KWARGS = [
    {},
    {"hidden_size": 48, "num_attention_heads": 6, "num_hidden_layers": 2, "max_position_embeddings": 64},
    {"n_embd": 64, "n_head": 8, "n_inner": 100, "activation_function": "relu", "layer_norm_epsilon": 1e-6},
    {"num_labels": 3, "problem_type": "multi_label_classification", "pad_token_id": 0},
    {"id2label": {0: "neg", 1: "neu", 2: "pos"}, "label2id": {"neg": 0, "neu": 1, "pos": 2}},
    {"summary_type": "mean", "summary_use_proj": False, "summary_activation": "tanh",
     "summary_proj_to_labels": False, "summary_first_dropout": 0.3},
    {"output_attentions": True, "output_hidden_states": True, "use_cache": False, "return_dict": False,
     "add_cross_attention": False, "tie_word_embeddings": False, "eos_token_id": [1, 2]},
    {"scale_attn_by_inverse_layer_idx": True, "reorder_and_upcast_attn": True, "architectures": ["GPT2LMHeadModel"]},
]


@pytest.mark.parametrize("kwargs", CONFIG_KWARGS, ids=range(len(CONFIG_KWARGS)))
def test_config_keywords_give_transformers_dict(kwargs):
    ours = GPT2Config(**kwargs)
    theirs = transformers.GPT2Config(**kwargs)
    a, b = ours.to_dict(), theirs.to_dict()
    assert set(a) - set(b) == {"classifier_dropout"}  # a field here; transformers reads it with getattr
    for key in set(a) & set(b):
        assert a[key] == b[key], key
    assert ours.num_labels == theirs.num_labels and ours.hidden_size == theirs.hidden_size
    back = transformers.GPT2Config.from_dict(a).to_dict()  # and transformers reads ours back
    for key in set(b) - {"transformers_version"}:
        assert back[key] == b[key], key


def test_config_reads_transformers_json_with_string_label_keys():
    hf = transformers.GPT2Config(id2label={0: "neg", 1: "pos"}, label2id={"neg": 0, "pos": 1}, n_layer=3)
    d = json.loads(hf.to_json_string())  # JSON: id2label keys are strings
    assert set(d["id2label"]) == {"0", "1"}
    ours = GPT2Config.from_dict(d)
    assert ours.id2label == hf.id2label == {0: "neg", 1: "pos"}  # int keys, as transformers converts them
    assert ours.label2id == {"neg": 0, "pos": 1} and ours.num_labels == 2 and ours.n_layer == 3
    assert ours.extra["transformers_version"] == hf.to_dict()["transformers_version"]


def test_setting_num_labels_keeps_custom_labels_when_the_count_is_the_same_as_transformers():
    labels = dict(id2label={0: "neg", 1: "pos"}, label2id={"neg": 0, "pos": 1})
    ours, hf = GPT2Config(**labels), transformers.GPT2Config(**labels)
    ours.num_labels, hf.num_labels = 2, 2
    assert (ours.id2label, ours.label2id) == (hf.id2label, hf.label2id) == (labels["id2label"], labels["label2id"])
    ours.num_labels, hf.num_labels = 3, 3  # another count: fresh LABEL_i names
    assert (ours.id2label, ours.label2id) == (hf.id2label, hf.label2id)
    assert GPT2Config(num_labels=2, **labels).id2label == transformers.GPT2Config(num_labels=2, **labels).id2label


def test_config_keeps_unknown_keys_as_attributes_and_warns_only_for_non_gpt2_keys():
    with pytest.warns(UserWarning, match="no GPT-2 config has.*type_vocab_size"):
        cfg = GPT2Config(type_vocab_size=16)
    assert cfg.type_vocab_size == 16 and cfg.to_dict()["type_vocab_size"] == 16
    assert transformers.GPT2Config(type_vocab_size=16).type_vocab_size == 16  # transformers keeps it too
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # common transformers keys are silent
        cfg = GPT2Config(torch_dtype="float32", transformers_version="4.40.0", n_ctx=1024, task_specific_params={})
    assert cfg.torch_dtype == torch.float32 and cfg.dtype == torch.float32 and cfg.n_ctx == 1024  # as transformers 5 keeps it


def test_config_aliases_read_and_write_the_fields():
    cfg = GPT2Config(hidden_size=48, num_attention_heads=4)
    assert (cfg.n_embd, cfg.n_head) == (48, 4)
    cfg.num_hidden_layers = 5
    cfg.max_position_embeddings = 77
    assert (cfg.n_layer, cfg.n_positions) == (5, 77)
    assert "hidden_size" not in cfg.to_dict() and cfg.to_dict()["n_layer"] == 5
    cfg.num_labels = 4
    assert cfg.id2label == {i: f"LABEL_{i}" for i in range(4)} and cfg.label2id["LABEL_3"] == 3
    assert GPT2Config.model_type == cfg.to_dict()["model_type"] == transformers.GPT2Config.model_type


def test_config_save_and_from_pretrained_both_ways(tmp_path):
    ours = GPT2Config(n_embd=64, n_head=4, num_labels=3, summary_type="last", architectures=["GPT2LMHeadModel"])
    ours.save_pretrained(tmp_path / "ours")
    assert [p.name for p in (tmp_path / "ours").iterdir()] == ["config.json"]  # no temporary file left
    hf = transformers.AutoConfig.from_pretrained(tmp_path / "ours")
    assert type(hf) is transformers.GPT2Config
    assert (hf.n_embd, hf.num_labels, hf.summary_type, hf.architectures) == (64, 3, "last", ["GPT2LMHeadModel"])

    hf = transformers.GPT2Config(n_layer=3, problem_type="regression", num_labels=1, pad_token_id=7)
    hf.save_pretrained(tmp_path / "theirs")
    back = GPT2Config.from_pretrained(tmp_path / "theirs")
    assert (back.n_layer, back.problem_type, back.num_labels, back.pad_token_id) == (3, "regression", 1, 7)
    assert GPT2Config.from_pretrained(tmp_path / "theirs" / "config.json", n_layer=5).n_layer == 5  # override


def test_model_save_pretrained_writes_architectures(tmp_path):
    model = GPT2LMHeadModel(tiny_config())
    model.save_pretrained(tmp_path)
    assert GPT2Config.from_pretrained(tmp_path).architectures == ["GPT2LMHeadModel"]
    assert transformers.AutoConfig.from_pretrained(tmp_path).architectures == ["GPT2LMHeadModel"]


def test_save_pretrained_takes_a_given_state_dict_and_is_main_process(tmp_path):
    """The accelerate / FSDP pattern written for transformers: save_pretrained(dir, state_dict=gathered,
    is_main_process=rank0). A gathered state dict holds lm_head and wte as two equal tensors."""
    model = GPT2LMHeadModel(tiny_config())
    model.save_pretrained(tmp_path / "rank1", is_main_process=False)
    assert not (tmp_path / "rank1").exists()
    trained = randomize(GPT2LMHeadModel(tiny_config()), seed=5)
    gathered = {k: v.clone() for k, v in trained.state_dict().items()}  # no tensor shared any more
    model.save_pretrained(tmp_path / "rank0", state_dict=gathered)
    ids = torch.tensor([[1, 2, 3, 4]])
    for cls in (GPT2LMHeadModel, transformers.GPT2LMHeadModel):
        assert max_diff(cls.from_pretrained(tmp_path / "rank0")(ids).logits, trained(ids).logits) < 1e-5


def test_config_from_pretrained_takes_hub_names(tmp_path, monkeypatch):
    fake_hub_cache(tmp_path, "someone/tiny-gpt2", GPT2LMHeadModel(tiny_config(n_layer=3)))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = GPT2Config.from_pretrained("someone/tiny-gpt2", cache_dir=tmp_path)
    assert cfg.n_layer == 3 and cfg.architectures == ["GPT2LMHeadModel"]


# --- forward: config defaults and tuples -------------------------------------------------------


@pytest.fixture(scope="module")
def twins():
    ours = randomize(GPT2LMHeadModel(tiny_config()), seed=3).eval()
    return ours, hf_twin(ours)


def _ids(shape, seed=0):
    return torch.randint(0, 97, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("field", ["output_attentions", "output_hidden_states", "use_cache"])
def test_config_sets_forward_defaults_as_in_transformers(twins, field):
    ours, theirs = twins
    ids = _ids((2, 5))
    key = {"output_attentions": "attentions", "output_hidden_states": "hidden_states", "use_cache": "cache"}[field]
    default = getattr(ours.config, field)
    try:
        for value in (True, False):
            setattr(ours.config, field, value)
            setattr(theirs.config, field, value)
            a, b = ours(ids), theirs(ids)
            assert list(a.keys()) == list(b.keys()) and (key in a) == value
            assert (key in ours(ids, **{field: not value})) == (not value)  # an argument wins over the config
    finally:
        setattr(ours.config, field, default)
        setattr(theirs.config, field, default)


@pytest.mark.parametrize("model_cls", [GPT2Model, GPT2LMHeadModel])
def test_return_dict_false_gives_transformers_tuple(model_cls):
    ours = randomize(model_cls(tiny_config()), seed=1).eval()
    theirs = hf_twin(ours)
    ids = _ids((2, 6), seed=1)
    kwargs = dict(output_hidden_states=True, output_attentions=True)
    if model_cls is GPT2LMHeadModel:
        kwargs["labels"] = ids
    a = ours(ids, return_dict=False, **kwargs)
    b = theirs(ids, return_dict=False, **kwargs)
    assert type(a) is tuple and type(b) is tuple and len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor):
            assert max_diff(x, y) <= 1e-5
        elif isinstance(x, tuple) and x and isinstance(x[0], torch.Tensor):  # hidden states, attentions
            assert len(x) == len(y) and all(max_diff(u, v) <= 1e-5 for u, v in zip(x, y))
        elif x == ():  # cross_attentions without cross-attention
            assert y == ()
        else:  # the caches
            assert all(max_diff(u[0], v) <= 1e-5 for u, v in zip(x, [layer.keys for layer in y.layers]))
    ours.config.return_dict = False  # the config's default, as in transformers
    out = ours(ids)
    assert type(out) is tuple and torch.equal(out[0], ours(ids, return_dict=True)[0])


# --- embeddings, resizing, counts --------------------------------------------------------------


def test_embedding_accessors_as_transformers():
    ours = GPT2LMHeadModel(tiny_config())
    theirs = hf_twin(ours)
    assert ours.get_input_embeddings() is ours.transformer.wte
    assert ours.get_output_embeddings() is ours.lm_head
    assert ours.transformer.get_output_embeddings() is None is theirs.transformer.get_output_embeddings()
    assert ours.get_input_embeddings().weight.shape == theirs.get_input_embeddings().weight.shape
    assert ours.get_output_embeddings().weight.shape == theirs.get_output_embeddings().weight.shape

    new = torch.nn.Embedding(97, 32)
    ours.set_input_embeddings(new)
    assert ours.transformer.wte is new and ours.lm_head.weight is not new.weight
    ours.tie_weights()
    assert ours.lm_head.weight is new.weight  # tie_word_embeddings: the head follows
    ids = _ids((1, 4))
    assert max_diff(ours(ids).logits, ours(ids, output_hidden_states=True).hidden_states[-1] @ new.weight.T) <= 1e-5

    head = torch.nn.Linear(32, 97, bias=False)
    untied = GPT2LMHeadModel(tiny_config(tie_word_embeddings=False))
    untied.set_output_embeddings(head)
    untied.tie_weights()  # the config does not tie: nothing changes
    assert untied.lm_head is head and head.weight is not untied.transformer.wte.weight


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("mean_resizing", [False, True])
def test_resize_token_embeddings_equals_transformers(tied, mean_resizing):
    ours = randomize(GPT2LMHeadModel(tiny_config(tie_word_embeddings=tied)), seed=2).eval()
    theirs = hf_twin(ours)
    old_wte = ours.transformer.wte.weight.detach().clone()
    torch.manual_seed(7)
    returned = ours.resize_token_embeddings(120, mean_resizing=mean_resizing)
    torch.manual_seed(7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs.resize_token_embeddings(120, mean_resizing=mean_resizing)
    assert returned is ours.transformer.wte and returned.num_embeddings == 120
    assert ours.config.vocab_size == theirs.config.vocab_size == 120
    assert (ours.lm_head.weight is ours.transformer.wte.weight) == tied
    a, b = ours.state_dict(), theirs.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key  # same seed, same draws: exactly equal
    wte = ours.transformer.wte.weight.detach()
    assert torch.equal(wte[:97], old_wte)
    added = wte[97:]
    if mean_resizing:  # drawn around the old rows' mean, with their covariance scaled by 1e-9
        assert (added - old_wte.mean(0)).abs().max() < 1e-3
    else:  # N(0, initializer_range)
        assert abs(added.std().item() - 0.02) < 0.004 and abs(added.mean().item()) < 0.004
    ids = torch.tensor([[1, 100, 119, 5]])
    assert max_diff(ours(ids, labels=ids).loss, theirs(ids, labels=ids).loss) <= 1e-5


def test_resize_shrinks_and_pads_to_a_multiple_as_transformers():
    ours = randomize(GPT2LMHeadModel(tiny_config()), seed=4)
    theirs = hf_twin(ours)
    old = ours.transformer.wte.weight.detach().clone()
    ours.resize_token_embeddings(50)
    theirs.resize_token_embeddings(50)
    assert torch.equal(ours.transformer.wte.weight, theirs.transformer.wte.weight)
    assert torch.equal(ours.transformer.wte.weight, old[:50]) and ours.lm_head.out_features == 50
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours.resize_token_embeddings(60, pad_to_multiple_of=16)
        theirs.resize_token_embeddings(60, pad_to_multiple_of=16)
    assert ours.config.vocab_size == theirs.config.vocab_size == 64
    assert ours.resize_token_embeddings() is ours.transformer.wte and ours.config.vocab_size == 64
    with pytest.raises(ValueError, match="new_num_tokens must be a positive integer, got 0"):
        ours.resize_token_embeddings(0)
    with pytest.raises(ValueError, match="a multiple of `2.5`, which is not and integer"):
        ours.resize_token_embeddings(70, pad_to_multiple_of=2.5)


@pytest.mark.parametrize("tied", [True, False])
def test_num_parameters_equals_transformers(tied):
    ours = GPT2LMHeadModel(tiny_config(tie_word_embeddings=tied))
    theirs = hf_twin(ours)
    for model in (ours, theirs):
        model.transformer.h[0].requires_grad_(False)
    for only_trainable in (False, True):
        for exclude_embeddings in (False, True):
            kwargs = dict(only_trainable=only_trainable, exclude_embeddings=exclude_embeddings)
            assert ours.num_parameters(**kwargs) == theirs.num_parameters(**kwargs), kwargs
            assert ours.transformer.num_parameters(**kwargs) == theirs.transformer.num_parameters(**kwargs), kwargs


def test_class_attributes_as_transformers():
    for ours, theirs in ((GPT2LMHeadModel, transformers.GPT2LMHeadModel), (GPT2Model, transformers.GPT2Model)):
        assert ours.main_input_name == theirs.main_input_name == "input_ids"
        assert ours.base_model_prefix == theirs.base_model_prefix == "transformer"
        assert ours.can_generate() == theirs.can_generate()
        assert ours.config_class is GPT2Config
    model = GPT2LMHeadModel(tiny_config())
    assert isinstance(model, GPT2PreTrainedModel) and isinstance(model.transformer, GPT2PreTrainedModel)
    assert model.base_model is model.transformer and model.transformer.base_model is model.transformer


# --- gradient checkpointing ----------------------------------------------------------------


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gradient_checkpointing_honours_use_reentrant(use_reentrant):
    ids = _ids((2, 8), seed=5)
    plain = randomize(GPT2LMHeadModel(tiny_config()), seed=5).train()
    plain(ids, labels=ids).loss.backward()
    model = randomize(GPT2LMHeadModel(tiny_config()), seed=5).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    assert model.is_gradient_checkpointing
    params = [p for _, p in model.named_parameters()]
    if use_reentrant:  # reentrant checkpointing refuses autograd.grad: proof that the option reached torch
        with pytest.raises(RuntimeError, match="use_reentrant=True"):
            torch.autograd.grad(model(ids, labels=ids).loss, params)
    else:
        torch.autograd.grad(model(ids, labels=ids).loss, params)
    model(ids, labels=ids).loss.backward()
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        assert max_diff(p.grad, q.grad) <= 1e-5, name


@pytest.mark.parametrize("every_n_layers, offload", [(1, True), (2, False), (3, False)])
def test_activation_checkpointing_every_n_layers_and_offload(monkeypatch, every_n_layers, offload):
    """transformers 5's activation_checkpointing_enable (what its Trainer calls): blocks 0, n, 2n, ...
    are recomputed, offload keeps their saved inputs in host memory; gradients stay the plain ones."""
    import gpt2attn.model

    ids = _ids((2, 8), seed=7)
    cfg = tiny_config(n_layer=4)
    plain = randomize(GPT2LMHeadModel(cfg), seed=7).train()
    plain(ids, labels=ids).loss.backward()
    model = randomize(GPT2LMHeadModel(cfg), seed=7).train()
    model.activation_checkpointing_enable(every_n_layers=every_n_layers, offload=offload)
    assert model.is_activation_checkpointing and model.is_gradient_checkpointing
    recomputed, offloaded = [], []
    checkpoint, save_on_cpu = gpt2attn.model.checkpoint, gpt2attn.model.save_on_cpu
    monkeypatch.setattr(gpt2attn.model, "checkpoint",
                        lambda block, *args, **kw: recomputed.append(block) or checkpoint(block, *args, **kw))
    monkeypatch.setattr(gpt2attn.model, "save_on_cpu", lambda **kw: offloaded.append(kw) or save_on_cpu(**kw))
    model(ids, labels=ids).loss.backward()
    assert recomputed == [block for i, block in enumerate(model.transformer.h) if i % every_n_layers == 0]
    assert len(offloaded) == (len(recomputed) if offload else 0)
    for (name, p), q in zip(plain.named_parameters(), model.parameters()):
        assert max_diff(p.grad, q.grad) <= 1e-5, name
    model.activation_checkpointing_disable()
    assert not model.is_gradient_checkpointing
    with pytest.raises(ValueError, match="every_n_layers"):
        model.activation_checkpointing_enable(every_n_layers=0)


def test_input_require_grads_hook_and_memory_footprint_as_transformers():
    model = GPT2LMHeadModel(tiny_config())
    model.transformer.wte.requires_grad_(False)
    ids = _ids((1, 4), seed=8)
    assert not model.transformer.wte(ids).requires_grad
    model.enable_input_require_grads()
    model.enable_input_require_grads()  # twice: still one hook
    assert model.transformer.wte(ids).requires_grad and len(model.transformer.wte._forward_hooks) == 1
    model.disable_input_require_grads()
    assert not model.transformer.wte(ids).requires_grad
    hf = hf_twin(model)
    for buffers in (True, False):
        assert model.get_memory_footprint(buffers) == hf.get_memory_footprint(buffers)
    assert model.get_memory_footprint() == 4 * model.num_parameters()  # the tied lm_head counted once


def test_reentrant_checkpointing_trains_blocks_under_frozen_embeddings():
    """As transformers makes the embeddings' output require grad, so frozen embeddings (PEFT) still
    let reentrant checkpointing backpropagate into the blocks."""
    ids = _ids((2, 8), seed=6)
    model = randomize(GPT2LMHeadModel(tiny_config()), seed=6).train()
    model.transformer.wte.requires_grad_(False)
    model.transformer.wpe.requires_grad_(False)
    model.gradient_checkpointing_enable({"use_reentrant": True})
    model(ids, labels=ids).loss.backward()
    assert model.transformer.h[0].attn.c_attn.weight.grad is not None
    assert model.transformer.h[0].attn.c_attn.weight.grad.abs().sum() > 0


# --- generation helpers ----------------------------------------------------------------


def test_prepare_inputs_for_generation_drives_a_decoding_loop(twins):
    """A greedy loop that only calls prepare_inputs_for_generation and forward gives what
    transformers' generate gives, left padding included."""
    ours, theirs = twins
    ids = _ids((2, 5), seed=8)
    mask = torch.ones(2, 5, dtype=torch.long)
    mask[0, :2] = 0  # left padding
    expected = theirs.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)

    seq, past = ids, None
    with torch.no_grad():
        for _ in range(6):
            inputs = ours.prepare_inputs_for_generation(seq, past_key_values=past, attention_mask=mask, use_cache=True)
            assert inputs["input_ids"].shape[1] == (5 if past is None else 1)
            out = ours(**inputs)
            past = out.past_key_values
            seq = torch.cat([seq, out.logits[:, -1].argmax(-1, keepdim=True)], dim=1)
            mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
    assert torch.equal(seq, expected)


def test_prepare_inputs_for_generation_uses_inputs_embeds_first(twins):
    ours, _ = twins
    embeds = torch.randn(1, 3, 32)
    first = ours.prepare_inputs_for_generation(torch.zeros(1, 0, dtype=torch.long), inputs_embeds=embeds)
    assert "input_ids" not in first and first["inputs_embeds"] is embeds
    cache = ours(inputs_embeds=embeds).past_key_values
    later = ours.prepare_inputs_for_generation(torch.tensor([[4, 5, 6, 7]]), past_key_values=cache, inputs_embeds=embeds)
    assert torch.equal(later["input_ids"], torch.tensor([[7]])) and "inputs_embeds" not in later


def test_library_code_reads_outputs_whatever_config_return_dict_says():
    """generate, the parity report and the exported modules ask for outputs by name, so a config
    saved with return_dict=False (transformers allows it) changes only what users' calls get."""
    from gpt2attn.interop.export import DecodeStep, Prefill
    from gpt2attn.parity import compare

    model = randomize(GPT2LMHeadModel(tiny_config())).eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    want = model.generate(ids, max_new_tokens=4, do_sample=False)
    prefill = Prefill(model)(ids)
    twin = hf_twin(model)  # built before the flag: transformers 5's own GPT-2 fails with it
    model.config.return_dict = False
    assert isinstance(model(ids), tuple)
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), want)
    got = Prefill(model)(ids)
    assert all(torch.equal(a, b) for a, b in zip(got, prefill))
    step = DecodeStep(model)(ids[:, :1], *got[1:])
    assert step[0].shape == (1, 1, model.config.vocab_size)
    assert compare(model, twin, ids).passed


def test_resizing_keeps_dtype_and_device_and_the_config_names_the_model(tmp_path):
    """Resized rows stay in the model's dtype (bf16 here) and on its device (meta here: a model built
    before its weights are loaded); name_or_path comes from the config; from_pretrained's device is used."""
    model = GPT2LMHeadModel(tiny_config(tie_word_embeddings=False)).to(torch.bfloat16)
    model.resize_token_embeddings(101)
    assert model.transformer.wte.weight.dtype == model.lm_head.weight.dtype == torch.bfloat16
    with torch.device("meta"):
        model = GPT2LMHeadModel(tiny_config(tie_word_embeddings=False))
    model.resize_token_embeddings(100, mean_resizing=False)
    assert model.transformer.wte.weight.is_meta and model.lm_head.weight.is_meta
    assert model.lm_head.weight.shape == (100, model.config.n_embd)
    assert GPT2LMHeadModel(tiny_config(name_or_path="someone/base")).name_or_path == "someone/base"
    GPT2LMHeadModel(tiny_config()).save_pretrained(tmp_path)
    assert GPT2LMHeadModel.from_pretrained(tmp_path, device="meta").device.type == "meta"


def test_init_weights_draws_every_weight_afresh_and_ties_the_head():
    config = tiny_config(initializer_range=0.02)
    model = randomize(GPT2LMHeadModel(config))
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untied
    model.init_weights()
    assert model.lm_head.weight is model.transformer.wte.weight
    block = model.transformer.h[0]
    assert torch.equal(block.ln_1.weight, torch.ones(config.n_embd)) and not block.ln_1.bias.any()
    assert not block.attn.c_attn.bias.any() and not block.mlp.c_fc.bias.any()
    assert 0.015 < float(block.mlp.c_fc.weight.std()) < 0.025  # N(0, initializer_range)


def test_memory_footprint_buffers_one_token_vocabulary_and_fused_adamw():
    """Edges of the PreTrainedModel helpers, found by mutation testing."""
    model = GPT2LMHeadModel(tiny_config())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # wte and the tied head once
    model.register_buffer("steering", torch.zeros(10, dtype=torch.float64))
    assert model.get_memory_footprint() == weights + 80
    assert model.get_memory_footprint(return_buffers=False) == weights
    assert model.resize_token_embeddings(1).weight.shape == (1, model.config.n_embd)  # one token is a vocabulary
    assert model.config.vocab_size == 1
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
    assert optimizer.defaults["fused"] is True  # torch has a fused AdamW for the CPU
