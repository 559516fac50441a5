"""transformers' model surface, read from the installed transformers: every public name of its GPT-2
classes beyond nn.Module / object is on ours with a compatible signature, or is a row of the one table
of deliberate omissions (docs/surface.md, parsed here). A name a new transformers adds fails this test,
named in the message; so does a row for a name transformers no longer has.

Then the names this surface work added, each against transformers' own behaviour.
"""

from __future__ import annotations

import inspect
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
from tests.helpers import REPO, hf_twin, max_diff, randomize, tiny_config  # noqa: E402

import gpt2attn  # noqa: E402
from gpt2attn import GPT2LMHeadModel  # noqa: E402

CLASSES = ["GPT2LMHeadModel", "GPT2Model", "GPT2ForSequenceClassification", "GPT2ForTokenClassification",
           "GPT2ForQuestionAnswering", "GPT2DoubleHeadsModel", "GPT2Config"]
SURFACE_PAGE = REPO / "docs" / "surface.md"
ROW = re.compile(r"^\| `(?:(GPT2Config)\.)?(\w+)(?:\(([^)]*)\))?` \| (.+) \|$")
P = inspect.Parameter


def omissions() -> dict[tuple[str, str], set[str] | None]:
    """(scope, name) -> None for a name left out, or the set of its parameters left out; scope is
    "GPT2Config" or "model" (every model class)."""
    table: dict[tuple[str, str], set[str] | None] = {}
    page = SURFACE_PAGE.read_text().split("\n## transformers' own tests")[0]  # that section lists tests, not names
    for line in page.splitlines():
        m = ROW.match(line)
        if m:
            config, name, params, reason = m.groups()
            assert reason.strip(), f"docs/surface.md: the row for {name} gives no reason"
            key = ("GPT2Config" if config else "model", name)
            assert key not in table, f"docs/surface.md: two rows for {name}"
            table[key] = None if params is None else {p.strip() for p in params.split(",")}
    return table


def public_names(cls: type, config: bool) -> list[str]:
    inherited = set(dir(object)) if config else set(dir(torch.nn.Module)) | set(dir(object))
    return sorted(n for n in dir(cls) if not n.startswith("_") and n not in inherited)


def signature_problem(theirs, ours, left_out: set[str]) -> str | None:
    """None when ours takes transformers' parameters (those not left out) under their names and in
    their order, and *args / **kwargs where transformers has them; else what differs."""
    def params(f):
        try:
            return [p for p in inspect.signature(f).parameters.values() if p.name not in ("self", "cls")]
        except (TypeError, ValueError):
            return None

    t, o = params(theirs), params(ours)
    if t is None or o is None:
        return None
    positional = [p.name for p in t if p.kind == P.POSITIONAL_OR_KEYWORD and p.name not in left_out]
    ours_named = [p.name for p in o if p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)]
    it = iter(ours_named)
    if not all(name in it for name in positional):  # a subsequence: the same names in the same order
        return f"transformers takes {positional}, ours {ours_named}"
    ours_kwargs = any(p.kind == P.VAR_KEYWORD for p in o)
    keyword_only = [p.name for p in t if p.kind == P.KEYWORD_ONLY and p.name not in left_out]
    missing = [name for name in keyword_only if name not in ours_named and not ours_kwargs]
    if missing:
        return f"transformers takes keywords {missing}, ours does not"
    for kind, label in ((P.VAR_POSITIONAL, "*args"), (P.VAR_KEYWORD, "**kwargs")):
        name = next((p.name for p in t if p.kind == kind), None)
        if name and name not in left_out and not any(p.kind == kind for p in o):
            return f"transformers takes {label} ({name}), ours does not"
    return None


def surface_report():
    table = omissions()
    implemented, omitted, problems, used = {}, {}, [], set()
    for cname in CLASSES:
        theirs, ours = getattr(transformers, cname), getattr(gpt2attn, cname)
        scope = "GPT2Config" if cname == "GPT2Config" else "model"
        for name in public_names(theirs, scope == "GPT2Config"):
            row = table.get((scope, name), ())
            if row != ():
                used.add((scope, name))
            if row is None and not hasattr(ours, name):
                omitted.setdefault(cname, []).append(name)
                continue
            if not hasattr(ours, name):
                member = inspect.getattr_static(theirs, name)
                shown = inspect.signature(getattr(theirs, name)) if inspect.isfunction(member) else type(member).__name__
                problems.append(f"{cname}.{name} {shown}: new in transformers {transformers.__version__}? "
                                f"implement it or add its row to docs/surface.md")
                continue
            t, o = getattr(theirs, name), getattr(ours, name)
            if callable(t) and not inspect.isclass(t) and callable(o) and not inspect.isclass(o):
                problem = signature_problem(t, o, row or set())
                if problem:
                    problems.append(f"{cname}.{name}: {problem}")
            implemented.setdefault(cname, []).append(name)
    for (scope, name), row in table.items():  # a whole name left out must be missing from some class
        classes = CLASSES[-1:] if scope == "GPT2Config" else CLASSES[:-1]
        if row is None and (scope, name) in used and all(hasattr(getattr(gpt2attn, c), name) for c in classes):
            problems.append(f"{name} is implemented on every class: delete its row in docs/surface.md")
    stale = sorted(set(table) - used)
    problems += [f"docs/surface.md has a row for {scope} {name}, which transformers no longer has" for scope, name in stale]
    return implemented, omitted, problems


def test_every_public_name_is_implemented_or_listed():
    implemented, omitted, problems = surface_report()
    model_names = {n for c in CLASSES[:-1] for n in implemented.get(c, []) + omitted.get(c, [])}
    done = {n for c in CLASSES[:-1] for n in implemented.get(c, [])}
    print(f"\ntransformers {transformers.__version__}: {len(model_names)} distinct model names, "
          f"{len(done)} implemented on at least one class, {len(model_names - done)} omitted")
    for cname in CLASSES:
        i, o = len(implemented.get(cname, [])), len(omitted.get(cname, []))
        print(f"  {cname}: {i} implemented, {o} omitted, {i + o} total")
    assert not problems, "\n".join(problems)
    counted = {c: (len(implemented.get(c, [])), len(omitted.get(c, []))) for c in CLASSES}
    page = {m[1]: (int(m[2]), int(m[3])) for m in re.finditer(r"^\| (GPT2\w+) \| (\d+) \| (\d+) \| \d+ \|$",
                                                             SURFACE_PAGE.read_text(), re.M)}
    assert page == counted, f"docs/surface.md's counts table is stale: the page says {page}, the count is {counted}"


def test_the_table_is_read():
    table = omissions()
    assert table[("model", "push_to_hub")] is None
    assert table[("GPT2Config", "rope_scaling")] is None
    assert "push_to_hub" in table[("model", "save_pretrained")]


def test_signature_problems_are_found():
    def theirs(a, b, *, c=1, **kwargs): ...
    def same(a, b, extra=0, *, c=1, **kwargs): ...
    def renamed(a, x, *, c=1, **kwargs): ...
    def no_kwargs(a, b, *, c=1): ...
    def kwargs_only(a, b, **kwargs): ...
    assert signature_problem(theirs, same, set()) is None
    assert signature_problem(theirs, renamed, set()) is not None
    assert signature_problem(theirs, renamed, {"b"}) is None
    assert signature_problem(theirs, no_kwargs, set()) is not None
    assert signature_problem(theirs, kwargs_only, set()) is None  # c goes through **kwargs


# --- the names this work added, each as transformers' ---------------------------------------


def twins(**config):
    ours = randomize(GPT2LMHeadModel(tiny_config(**config))).eval()
    return ours, hf_twin(ours).eval()


def test_model_parts_tags_and_dummy_inputs_as_transformers():
    ours, theirs = twins()
    assert ours.get_decoder() is ours.transformer and type(theirs.get_decoder()).__name__ == "GPT2Model"
    for modality in (None, "image", "video", "audio"):  # no encoder of that kind: the model itself, in both
        assert ours.get_encoder(modality) is ours and theirs.get_encoder(modality) is theirs
    for modality in ("text", "TEXT", "speech"):  # transformers refuses "text" as it refuses any other name
        with pytest.raises(ValueError, match="Unnrecognized modality"):
            theirs.get_encoder(modality)
        with pytest.raises(ValueError, match=rf"^modality='{modality}': get_encoder takes None, 'image', 'video' "
                                             r"or 'audio', as in transformers$"):
            ours.get_encoder(modality)
    assert torch.equal(ours.dummy_inputs["input_ids"], theirs.dummy_inputs["input_ids"])
    assert ours.input_modalities == theirs.input_modalities and ours.output_modalities == theirs.output_modalities
    assert list(ours.named_non_persistent_buffers()) == list(theirs.named_non_persistent_buffers())
    assert torch.equal(ours.get_parameter_or_buffer("lm_head.weight"), theirs.get_parameter_or_buffer("lm_head.weight"))
    with pytest.raises(AttributeError):
        ours.get_parameter_or_buffer("transformer.nothing")
    for m in (ours, theirs):
        m.add_model_tags("trl")
        m.add_model_tags(["sft", "trl"])
    assert ours.model_tags == theirs.model_tags == ["trl", "sft"]
    assert GPT2LMHeadModel(tiny_config()).model_tags is None  # a class default, not shared between models
    body = gpt2attn.GPT2Model(tiny_config())
    with pytest.raises(ValueError, match="decoder itself"):
        body.set_decoder(body)
    ours.set_decoder(body)
    assert ours.transformer is body


@pytest.mark.parametrize("keep", [0, 1, 3, 9, "positions", "rows", "positions mask", "mask"])
def test_logits_to_keep_as_transformers(keep):
    """Every documented form: an int (the last n positions; 0 all), 1-D and 2-D index tensors, 1-D and 2-D bool masks."""
    ours, theirs = twins()
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    keep = {"positions": torch.tensor([0, 4, 8]), "rows": torch.tensor([[1, 2], [3, 8]]),
            "positions mask": torch.arange(9) % 2 == 0, "mask": torch.arange(18).view(2, 9) % 3 == 0}.get(keep, keep)
    a, b = ours(ids, logits_to_keep=keep).logits, theirs(ids, logits_to_keep=keep).logits
    assert a.shape == b.shape and max_diff(a, b) < 1e-5


def test_forward_takes_transformers_extra_keywords():
    ours, theirs = twins()
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    a = ours(ids, labels=ids, num_items_in_batch=7, output_router_logits=False).loss
    b = theirs(ids, labels=ids, num_items_in_batch=7).loss
    assert abs(a.item() - b.item()) < 1e-5
    head = gpt2attn.GPT2ForSequenceClassification(tiny_config(num_labels=2, pad_token_id=0))
    head(ids, num_items_in_batch=3)  # the heads take (and ignore) it, as transformers'
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        ours(ids, cu_seq_lens_q=torch.tensor([0, 9]))
    with pytest.raises(TypeError, match="'colour'"):
        ours(ids, colour=1)
    with pytest.raises(ValueError, match="logits_to_keep"):
        ours(ids, logits_to_keep=-1)


def test_transformers_generation_config_everywhere(tmp_path):
    ours, theirs = twins(eos_token_id=5)
    ids = torch.randint(6, 97, (2, 5), generator=torch.Generator().manual_seed(1))
    greedy = transformers.GenerationConfig(max_new_tokens=8, do_sample=False, pad_token_id=0, eos_token_id=5)
    assert torch.equal(ours.generate(ids, generation_config=greedy), theirs.generate(ids, generation_config=greedy))
    sampled = transformers.GenerationConfig(max_new_tokens=8, do_sample=True, top_k=0, top_p=0.9, temperature=0.8,
                                            pad_token_id=0, disable_compile=True)
    ours.generation_config = sampled
    theirs.generation_config = sampled
    torch.manual_seed(3)
    a = ours.generate(ids)
    torch.manual_seed(3)
    assert torch.equal(a, theirs.generate(ids))
    beams = transformers.GenerationConfig(max_new_tokens=4, num_beams=3, pad_token_id=0, eos_token_id=5)
    theirs.save_pretrained(tmp_path)
    beams.save_pretrained(tmp_path)  # generation_config.json as transformers writes it
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert torch.equal(loaded.generate(ids), transformers.GPT2LMHeadModel.from_pretrained(tmp_path).generate(ids))
    with pytest.raises(ValueError, match="diversity_penalty"):
        ours.generate(ids, generation_config=transformers.GenerationConfig(num_beams=2, num_beam_groups=2,
                                                                           diversity_penalty=1.0))


def test_a_transformers_generation_config_keeps_the_models_eos_where_it_sets_none():
    """transformers fills the fields a passed GenerationConfig leaves unset from the model's own:
    the model's eos still ends the run."""
    ours, _ = twins()
    ids = torch.randint(6, 97, (1, 5), generator=torch.Generator().manual_seed(1))
    free = ours.generate(ids, max_new_tokens=8, eos_token_id=None)
    eos = int(free[0, 7])  # the third new token: with it as eos the run stops there
    ours, theirs = twins(eos_token_id=eos)
    passed = transformers.GenerationConfig(max_new_tokens=8, do_sample=False)
    assert passed.eos_token_id is None
    stopped = ours.generate(ids, generation_config=passed)
    assert torch.equal(stopped, theirs.generate(ids, generation_config=passed))
    assert stopped.size(1) <= 8 and int(stopped[0, -1]) == eos
    assert ours.generation_config.eos_token_id == eos and passed.eos_token_id is None  # neither is changed


@pytest.mark.slow  # importing peft takes most of its 15 s
def test_adapter_methods_as_transformers_and_files_cross_load(tmp_path):
    """transformers 5.24's own adapter methods need peft >= 0.22 (unreleased), so the reference is
    PEFT's PeftModel on transformers' GPT-2: the same outputs, state dict keys and files."""
    peft = pytest.importorskip("peft")
    ours, theirs = twins()
    base = {k: v.clone() for k, v in ours.state_dict().items()}
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    lora = dict(r=4, target_modules=["c_attn", "c_proj"], init_lora_weights=False)
    torch.manual_seed(0)
    ours.add_adapter(peft.LoraConfig(**lora))
    torch.manual_seed(0)
    wrapped = peft.get_peft_model(theirs, peft.LoraConfig(**lora)).eval()
    assert ours.active_adapters() == ["default"]
    assert max_diff(ours(ids).logits, wrapped(ids).logits) < 1e-5
    assert max_diff(ours(ids).logits, hf_twin(GPT2LMHeadModel(tiny_config())).eval()(ids).logits) > 1e-2
    ours.disable_adapters()
    with wrapped.disable_adapter():
        assert max_diff(ours(ids).logits, wrapped(ids).logits) < 1e-5
    ours.enable_adapters()
    theirs_keys = {k.removeprefix("base_model.model.") for k in peft.get_peft_model_state_dict(wrapped)}
    assert set(ours.get_adapter_state_dict()) == theirs_keys

    ours.save_pretrained(tmp_path / "ours")  # the adapter alone, as transformers' save_pretrained
    assert sorted(p.name for p in (tmp_path / "ours").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    wrapped.save_pretrained(tmp_path / "theirs")
    fresh = GPT2LMHeadModel(tiny_config()).eval()
    fresh.load_state_dict(base)
    fresh.load_adapter(tmp_path / "theirs")
    assert not fresh.training and not any(p.requires_grad for n, p in fresh.named_parameters() if "lora" in n)
    assert max_diff(fresh(ids).logits, ours(ids).logits) == 0
    hf_base = transformers.GPT2LMHeadModel(theirs.config)
    hf_base.load_state_dict(base)
    reloaded = peft.PeftModel.from_pretrained(hf_base.eval(), tmp_path / "ours")
    assert max_diff(reloaded(ids).logits, ours(ids).logits) < 1e-5

    ours.add_adapter(peft.LoraConfig(r=2, target_modules=["c_fc"]), adapter_name="two")
    assert ours.active_adapters() == ["two"]
    ours.set_adapter("default")
    assert ours.active_adapters() == ["default"]
    with pytest.raises(ValueError, match="already exists"):
        ours.add_adapter(peft.LoraConfig(r=2, target_modules=["c_fc"]), adapter_name="two")
    ours.delete_adapter("two")
    assert list(ours.peft_config) == ["default"]
    with pytest.raises(ValueError, match="not found"):
        ours.set_adapter("two")


@pytest.mark.slow  # peft's import
def test_disable_and_enable_adapters_switch_a_trained_modules_to_save_copy_too():
    peft = pytest.importorskip("peft")
    ours, _ = twins()
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    base = ours(ids).logits
    ours.add_adapter(peft.LoraConfig(r=4, target_modules=["c_attn"], modules_to_save=["lm_head"]))
    with torch.no_grad():  # "train" the head's copy; LoRA's B starts at zero, so the copy alone moves the logits
        ours.lm_head.modules_to_save["default"].weight.add_(0.5)
    adapted = ours(ids).logits
    assert max_diff(adapted, base) > 1e-2
    ours.disable_adapters()
    assert max_diff(ours(ids).logits, base) == 0
    ours.enable_adapters()
    assert max_diff(ours(ids).logits, adapted) == 0


@pytest.mark.slow  # peft's import
def test_an_adapter_without_a_modules_to_save_copy_runs_the_original_module_as_in_peft():
    """After an adapter with a trained modules_to_save copy of lm_head, a second one without a copy
    can be added; while it is active lm_head runs its original module, as PEFT's PeftModel (on
    transformers' twin, the same adapter weights) does."""
    peft = pytest.importorskip("peft")
    ours, theirs = twins()
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    with_copy = dict(r=4, target_modules=["c_attn"], modules_to_save=["lm_head"], init_lora_weights=False)
    without = dict(r=2, target_modules=["c_fc"], init_lora_weights=False)
    torch.manual_seed(0)
    ours.add_adapter(peft.LoraConfig(**with_copy))
    torch.manual_seed(0)
    wrapped = peft.get_peft_model(theirs, peft.LoraConfig(**with_copy)).eval()
    with torch.no_grad():  # "train" the head's copy, the same on both sides
        ours.lm_head.modules_to_save["default"].weight.add_(0.5)
        wrapped.base_model.model.lm_head.modules_to_save["default"].weight.add_(0.5)
    adapted = ours(ids).logits
    torch.manual_seed(1)
    ours.add_adapter(peft.LoraConfig(**without), adapter_name="two")
    torch.manual_seed(1)
    wrapped.add_adapter("two", peft.LoraConfig(**without))
    wrapped.set_adapter("two")

    assert ours.active_adapters() == ["two"]
    two = ours(ids).logits
    assert max_diff(two, wrapped(ids).logits) < 1e-5
    head = ours.transformer(ids).last_hidden_state @ ours.lm_head.original_module.weight.T  # the copy unused
    assert max_diff(two, head) < 1e-5 and max_diff(two, adapted) > 1e-2
    ours.disable_adapters()
    ours.enable_adapters()
    assert max_diff(ours(ids).logits, two) == 0
    ours.set_adapter("default")
    wrapped.set_adapter("default")
    assert max_diff(ours(ids).logits, adapted) == 0 and max_diff(adapted, wrapped(ids).logits) < 1e-5


@pytest.mark.slow
def test_deleting_the_last_adapter_gives_back_the_base_model_and_saves_it_whole(tmp_path):
    peft = pytest.importorskip("peft")
    ours, _ = twins()
    keys = list(ours.state_dict())
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    base = ours(ids).logits
    ours.add_adapter(peft.LoraConfig(r=4, target_modules=["c_attn"], modules_to_save=["lm_head"],
                                     init_lora_weights=False))
    ours.add_adapter(peft.LoraConfig(r=2, target_modules=["c_fc"], init_lora_weights=False), adapter_name="two")
    assert max_diff(ours(ids).logits, base) > 1e-2
    ours.delete_adapter(["default", "two"])  # a list: both go, the last one with them
    assert not hasattr(ours, "peft_config") and list(ours.state_dict()) == keys
    assert ours._hf_peft_config_loaded is False  # as transformers leaves it
    assert max_diff(ours(ids).logits, base) == 0
    ours.save_pretrained(tmp_path)  # the whole model again, not an adapter
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    assert max_diff(GPT2LMHeadModel.from_pretrained(tmp_path).eval()(ids).logits, base) == 0
    with pytest.raises(ValueError, match="No adapter loaded"):
        ours.active_adapters()


@pytest.mark.slow
@pytest.mark.parametrize("trainable", [False, True])
def test_a_loaded_adapter_is_frozen_for_inference_unless_trainable(tmp_path, trainable):
    peft = pytest.importorskip("peft")
    ours, _ = twins()
    ours.add_adapter(peft.LoraConfig(r=4, target_modules=["c_attn"]))
    ours.save_pretrained(tmp_path)
    fresh, _ = twins()
    fresh.train()
    fresh.load_adapter(tmp_path, is_trainable=trainable)
    assert fresh.peft_config["default"].inference_mode is (not trainable)
    assert fresh.training is trainable  # transformers puts a model loaded for inference in eval mode
    lora = [p.requires_grad for n, p in fresh.named_parameters() if "lora_" in n]
    assert lora and all(g is trainable for g in lora)


@pytest.mark.slow
def test_load_adapter_asks_the_hub_unless_told_not_to(monkeypatch):
    """local_files_only defaults to False, as in transformers: a hub name is looked up online (PEFT's
    loader stands in for the hub here, recording what it is asked)."""
    peft = pytest.importorskip("peft")
    asked = []

    def from_pretrained(name, **options):
        asked.append((name, options))
        raise OSError("stand-in hub")

    monkeypatch.setattr(peft.PeftConfig, "from_pretrained", from_pretrained)
    ours, _ = twins()
    for kwargs in ({}, {"local_files_only": True}, {"adapter_kwargs": {"revision": "v2"}}):
        with pytest.raises(OSError, match="stand-in hub"):
            ours.load_adapter("someone/adapter", **kwargs)
    assert asked == [("someone/adapter", {"local_files_only": False}), ("someone/adapter", {"local_files_only": True}),
                     ("someone/adapter", {"local_files_only": False, "revision": "v2"})]


@pytest.mark.slow
def test_adapter_weights_are_read_onto_the_cpu_and_unknown_options_named(tmp_path, monkeypatch):
    """Whatever device PEFT's loader would pick by itself (a GPU where there is one: a stand-in
    device here), the adapter's weights are read onto the CPU, beside the model's."""
    peft = pytest.importorskip("peft")
    import peft.utils.save_and_load as peft_loading

    ours, _ = twins()
    ours.add_adapter(peft.LoraConfig(r=4, target_modules=["c_attn"], init_lora_weights=False))
    ours.save_pretrained(tmp_path)
    monkeypatch.setattr(peft_loading, "infer_device", lambda: "meta")
    fresh, _ = twins()
    fresh.load_adapter(tmp_path)
    want, got = ours.get_adapter_state_dict(), fresh.get_adapter_state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(TypeError) as err:
        fresh.load_adapter(tmp_path, adapter_name="two", token="x", device_map="auto")
    assert str(err.value) == "load_adapter got ['device_map', 'token'], which gpt2attn does not take"
    with pytest.raises(TypeError) as err:
        fresh.load_adapter(tmp_path, adapter_name="two", load_config=object())
    assert str(err.value) == "load_adapter got ['load_config'], which gpt2attn does not take"


@pytest.mark.slow
def test_adapter_files_names_and_refusals_in_detail(tmp_path):
    """What the adapter methods write and refuse, message by message (found by mutation testing)."""
    import json

    from safetensors import safe_open

    peft = pytest.importorskip("peft")
    ours, _ = twins()
    ours.save_pretrained(tmp_path / "base")
    model = GPT2LMHeadModel.from_pretrained(tmp_path / "base").eval()
    model.name_or_path = "someone/base"  # as transformers' models carry it
    model.add_adapter(peft.LoraConfig(r=4, target_modules=["c_attn"], init_lora_weights=False))
    assert model.peft_config["default"].base_model_name_or_path == "someone/base"  # the model it adapts
    model.save_pretrained(tmp_path / "one")
    assert json.loads((tmp_path / "one" / "adapter_config.json").read_text())["base_model_name_or_path"] == "someone/base"
    with safe_open(tmp_path / "one" / "adapter_model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}  # what transformers' and PEFT's loaders look for

    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(0))
    adapted = model(ids).logits
    fresh = GPT2LMHeadModel.from_pretrained(tmp_path / "base").eval()
    fresh.load_adapter(tmp_path / "one")
    fresh.load_adapter(tmp_path / "one", adapter_name="second")  # the weights go to the adapter named
    fresh.set_adapter("second")
    assert max_diff(fresh(ids).logits, adapted) == 0
    with pytest.raises(ValueError, match="^Adapter with name second already exists. Please use a different name.$"):
        fresh.load_adapter(tmp_path / "one", adapter_name="second")
    with pytest.raises(ValueError, match=r"^hotswap=True: replacing an adapter's weights in place is not supported; "
                                         r"delete_adapter and load it again$"):
        fresh.load_adapter(tmp_path / "one", adapter_name="third", hotswap=True)
    with pytest.raises(ValueError, match="^load_adapter needs peft_model_id, or peft_config and adapter_state_dict$"):
        fresh.load_adapter(adapter_name="third", peft_config=model.peft_config["default"])

    fresh.set_adapter(["default", "second"])
    with pytest.raises(ValueError, match=r"adapters \['default', 'second'\] are active together; save them one at a time"):
        fresh.save_pretrained(tmp_path / "two")

    weights = {f"base_model.model.transformer.h.{i}.attn.c_attn.lora_A.weight": torch.zeros(4, 32) for i in range(5, 9)}
    with pytest.raises(ValueError) as err:  # four keys that fit no module: three are named
        fresh.load_adapter(adapter_name="bad", peft_config=peft.LoraConfig(r=4, target_modules=["c_attn"]),
                           adapter_state_dict=weights)
    named = [f"transformer.h.{i}.attn.c_attn.lora_A.weight" for i in range(5, 8)]
    assert str(err.value) == f"adapter_state_dict: adapter weights {named} fit no module"
