"""The zero-copy bridge (model.to_transformers / from_transformers) and what it opens: transformers'
generate and pipeline, nnsight's LanguageModel, on our very parameters."""

from __future__ import annotations

import importlib

import pytest
import torch
import transformers

from tests.helpers import max_diff, randomize, tiny_config

from gpt2attn import GPT2Config, GPT2LMHeadModel, GPT2Model
from gpt2attn.bridge import BRIDGED
from gpt2attn.tokenizer import char_tokenizer

ALPHABET = "abcdefghijklmnopqrstuvwxyz ,.!?"


def char_hf_tokenizer():
    """A transformers tokenizer over a character vocabulary (ids < tiny vocab), no files needed."""
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=char_tokenizer(ALPHABET))
    tok.pad_token = tok.eos_token = ALPHABET[0]
    return tok


def ids(seed=1, shape=(2, 9)):
    return torch.randint(0, 97, shape, generator=torch.Generator().manual_seed(seed))


def same_storage(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    pa, pb = dict(a.named_parameters(remove_duplicate=False)), dict(b.named_parameters(remove_duplicate=False))
    return pa.keys() == pb.keys() and all(pa[k] is pb[k] for k in pa)


def bridged_classes():
    """Every class of the bridge's table that gpt2attn has (the task heads arrive in gpt2attn.heads)."""
    found = []
    for name, module in BRIDGED.items():
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return found


def tensors(out):
    return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("cls", bridged_classes(), ids=lambda c: c.__name__)
def test_to_transformers_shares_parameters_and_computes_the_same(cls):
    ours = randomize(cls(tiny_config())).eval()
    hf = ours.to_transformers(attn_implementation="eager")
    assert type(hf) is getattr(transformers, cls.__name__)
    assert same_storage(ours, hf)
    assert not any(p.is_meta for p in hf.parameters()) and not any(b.is_meta for b in hf.buffers())
    x = ids(shape=(1, 9)) if cls.__name__ != "GPT2DoubleHeadsModel" else ids(shape=(1, 2, 9))  # (B, choices, T)
    got, want = tensors(ours(x)), tensors(hf(x))
    assert got.keys() == want.keys() and got
    assert all(max_diff(got[k], want[k]) < 1e-5 for k in got)
    back = cls.from_transformers(hf)
    assert type(back) is cls and same_storage(back, hf)
    assert all(max_diff(v, got[k]) == 0 for k, v in tensors(back(x)).items())


def test_bridge_covers_the_lm_and_the_base_model():
    assert {GPT2Model, GPT2LMHeadModel} <= set(bridged_classes())


def test_from_transformers_of_a_transformers_model():
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config.from_dict(tiny_config().to_dict())).eval()
    ours = GPT2LMHeadModel.from_transformers(hf)
    assert same_storage(ours, hf) and ours.lm_head.weight is ours.transformer.wte.weight
    x = ids()
    assert max_diff(ours(x).logits, hf(x).logits) < 1e-5
    with pytest.raises(TypeError, match="GPT2LMHeadModel"):
        GPT2Model.from_transformers(hf)


def test_changes_through_one_side_are_seen_by_the_other():
    ours = randomize(GPT2LMHeadModel(tiny_config()))
    hf = ours.to_transformers(attn_implementation="eager")
    x = ids()
    with torch.no_grad():  # an in-place edit through transformers' names
        hf.transformer.h[1].mlp.c_fc.weight.mul_(2)
    assert max_diff(ours(x).logits, hf(x).logits) < 1e-5
    # a training step through ours moves transformers' weights
    before = hf.transformer.h[0].attn.c_attn.weight.detach().clone()
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    ours(x, labels=x).loss.backward()
    opt.step()
    assert max_diff(hf.transformer.h[0].attn.c_attn.weight, before) > 1e-4
    assert max_diff(ours(x).logits, hf(x).logits) < 1e-5
    # and one through transformers' loss moves ours
    hf.zero_grad()
    hf(x, labels=x).loss.backward()
    torch.optim.SGD(hf.parameters(), lr=0.1).step()
    assert max_diff(ours(x).logits, hf(x).logits) < 1e-5


def test_bridge_table_and_errors():
    assert {"GPT2Model", "GPT2LMHeadModel"} <= set(BRIDGED)
    for name in BRIDGED:  # every bridged name is a transformers class
        assert hasattr(transformers, name)
    from gpt2attn.bridge import to_transformers

    with pytest.raises(TypeError) as err:
        to_transformers(torch.nn.Linear(2, 2))
    assert str(err.value) == f"no bridge for Linear; bridged classes: {', '.join(BRIDGED)}"


def test_the_bridge_takes_the_attention_backend_asked_for():
    ours = GPT2LMHeadModel(tiny_config())
    for name in ("eager", "sdpa"):
        assert ours.to_transformers(attn_implementation=name).config._attn_implementation == name


def test_parameters_the_two_models_do_not_share_or_hold_in_other_shapes_are_named():
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config.from_dict(tiny_config().to_dict()))
    hf.transformer.h[0].ln_1.bias = None  # one ours has that transformers' lacks
    hf.extra = torch.nn.Parameter(torch.zeros(1))  # and one the other way round
    with pytest.raises(ValueError) as err:
        GPT2LMHeadModel.from_transformers(hf)
    assert str(err.value) == ("GPT2LMHeadModel -> GPT2LMHeadModel: names differ "
                              "(missing ['transformer.h.0.ln_1.bias'], extra ['extra'])")
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config.from_dict(tiny_config().to_dict()))
    hf.transformer.ln_f.weight = torch.nn.Parameter(torch.ones(5))
    with pytest.raises(ValueError) as err:
        GPT2LMHeadModel.from_transformers(hf)
    assert str(err.value) == f"transformer.ln_f.weight: shape (5,), expected ({tiny_config().n_embd},)"


def test_a_buffer_the_bridge_cannot_fill_is_named():
    from gpt2attn.bridge import _share_parameters

    src = torch.nn.Linear(2, 2)
    with torch.device("meta"):
        dst = torch.nn.Linear(2, 2)
    dst.register_buffer("running", torch.empty(2, device="meta"))
    with pytest.raises(ValueError, match="^Linear has a buffer running the bridge does not fill$"):
        _share_parameters(src, dst)
    assert dst.weight is src.weight  # the parameters were shared before the buffer was found


def test_transformers_generate_on_our_weights_equals_ours():
    ours = randomize(GPT2LMHeadModel(tiny_config()), std=0.5).eval()
    hf = ours.to_transformers()
    x = ids(shape=(1, 5))
    want = ours.generate(x, max_new_tokens=8)
    got = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)


def test_pipeline_text_generation_on_our_weights():
    tok = char_hf_tokenizer()
    ours = randomize(GPT2LMHeadModel(tiny_config(vocab_size=len(tok))), std=0.5).eval()
    pipe = transformers.pipeline("text-generation", model=ours.to_transformers(), tokenizer=tok)
    out = pipe("to be or", max_new_tokens=6, do_sample=False, return_tensors=True)[0]["generated_token_ids"]
    prompt = torch.tensor([tok("to be or")["input_ids"]])
    want = ours.generate(prompt, max_new_tokens=6)[0]
    assert len(want) == prompt.size(1) + 6 and list(out) == want.tolist()
    text = pipe("to be or", max_new_tokens=6, do_sample=False)[0]["generated_text"]
    assert text == tok.decode(want)


@pytest.mark.parametrize("config", ["tiny", "default"])
def test_pipeline_takes_our_model_itself(config):
    """pipeline(model=ours) runs on ours.to_transformers(): the same tokens, greedy and seeded sampling,
    with our generation config (here no_repeat_ngram_size=2), also for a default-config model."""
    tok = char_hf_tokenizer()
    cfg = tiny_config(vocab_size=len(tok)) if config == "tiny" else GPT2Config(vocab_size=len(tok), n_embd=32,
                                                                                n_layer=1, n_head=2)
    ours = randomize(GPT2LMHeadModel(cfg), std=0.5).eval()
    ours.generation_config = ours.generation_config.update(no_repeat_ngram_size=2)
    pipe = transformers.pipeline("text-generation", model=ours, tokenizer=tok)
    bridge = transformers.pipeline("text-generation", model=ours.to_transformers(), tokenizer=tok)
    assert same_storage(pipe.model, ours)
    for settings in (dict(do_sample=False), dict(do_sample=True, top_k=5)):
        got, want = [], []
        for p, tokens in ((pipe, got), (bridge, want)):
            torch.manual_seed(0)
            tokens.extend(p("to be or", max_new_tokens=12, return_tensors=True, **settings)[0]["generated_token_ids"])
        assert got == want, settings
    prompt = torch.tensor([tok("to be or")["input_ids"]])
    assert got[: prompt.size(1)] == prompt[0].tolist() and len(got) == prompt.size(1) + 12
    greedy = pipe("to be or", max_new_tokens=12, do_sample=False, return_tensors=True)[0]["generated_token_ids"]
    assert list(greedy) == ours.generate(prompt, max_new_tokens=12)[0].tolist()


def test_nnsight_language_model_on_our_weights():
    nnsight = pytest.importorskip("nnsight", reason="nnsight is not installed (pip install -e '.[ecosystem]')")
    ours = randomize(GPT2LMHeadModel(tiny_config())).eval()
    lm = nnsight.LanguageModel(ours.to_transformers(attn_implementation="eager"), tokenizer=char_hf_tokenizer())
    prompt = "to be"
    with lm.trace(prompt):
        hidden = lm.transformer.h[0].output.save()
        logits = lm.lm_head.output.save()
    hidden = hidden[0] if isinstance(hidden, tuple) else hidden
    x = torch.tensor([char_hf_tokenizer()(prompt)["input_ids"]])
    out = ours(x, output_hidden_states=True)
    assert max_diff(logits, out.logits) < 1e-5
    assert max_diff(hidden, out.hidden_states[1]) < 1e-5
