"""PEFT LoRA on our model equals PEFT LoRA on transformers' GPT-2 with the same weights."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import hf_twin, max_diff, randomize, tiny_config

from gpt2attn import GPT2LMHeadModel

peft = pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[ecosystem]')")
import gpt2attn.interop.peft  # noqa: E402,F401  (the one import that teaches PEFT our Conv1D)

TARGETS = ["c_attn", "c_proj", "c_fc"]
TASKS = [None, "CAUSAL_LM"]


def lora_pair(task_type, seed=0):
    """(PEFT on ours, PEFT on transformers'): same base weights, same random (non-zero) LoRA weights."""
    ours = randomize(GPT2LMHeadModel(tiny_config()), seed=seed)
    hf = hf_twin(ours)
    make = lambda: peft.LoraConfig(  # noqa: E731
        target_modules=TARGETS, r=4, lora_alpha=8, init_lora_weights=False, task_type=task_type
    )
    p_ours, p_hf = peft.get_peft_model(ours, make()), peft.get_peft_model(hf, make())
    assert p_ours.state_dict().keys() == p_hf.state_dict().keys()
    p_ours.load_state_dict(p_hf.state_dict(), strict=True)
    return p_ours, p_hf


def ids(seed=1, shape=(2, 9)):
    return torch.randint(0, 97, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("task_type", TASKS)
def test_lora_logits_equal_transformers(task_type):
    p_ours, p_hf = lora_pair(task_type)
    x = ids()
    n_lora = sum("lora_" in n for n, _ in p_ours.named_parameters())
    assert n_lora == 2 * 4 * 2  # lora_A and lora_B on c_attn, attn.c_proj, c_fc, mlp.c_proj, in 2 layers
    got, want = p_ours(input_ids=x).logits, p_hf(input_ids=x).logits
    assert max_diff(got, want) < 1e-5
    with p_ours.disable_adapter():  # the adapters do change the output
        assert max_diff(p_ours(input_ids=x).logits, got) > 1e-2


@pytest.mark.parametrize("task_type", TASKS)
def test_lora_training_steps_equal_transformers(task_type):
    p_ours, p_hf = lora_pair(task_type)
    base = p_ours.get_base_model().transformer.h[0].attn.c_attn.base_layer.weight.detach().clone()
    losses, x = {}, ids()
    for name, model in (("ours", p_ours), ("hf", p_hf)):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses[name] = []
        for _ in range(3):
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[name].append(loss.item())
    assert losses["ours"] == pytest.approx(losses["hf"], abs=1e-5)
    assert losses["ours"][2] < losses["ours"][0]  # it learns the batch
    assert torch.equal(p_ours.get_base_model().transformer.h[0].attn.c_attn.base_layer.weight, base)  # frozen base


@pytest.mark.parametrize("task_type", TASKS)
def test_adapter_files_cross_between_libraries(task_type, tmp_path):
    p_ours, p_hf = lora_pair(task_type)
    x = ids()
    want = p_hf(input_ids=x).logits
    for src, dst_base in ((p_hf, randomize(GPT2LMHeadModel(tiny_config()))), (p_ours, None)):
        folder = tmp_path / type(src.get_base_model()).__module__.split(".")[0]
        src.save_pretrained(folder)
        fresh = randomize(GPT2LMHeadModel(tiny_config()))  # same base weights (seed 0)
        dst_base = dst_base if dst_base is not None else hf_twin(fresh)
        loaded = peft.PeftModel.from_pretrained(dst_base, folder)
        assert type(loaded.get_base_model()).__module__.split(".")[0] != folder.name  # crossed over
        assert max_diff(loaded(input_ids=x).logits, want) < 1e-5


@pytest.mark.parametrize("task_type", TASKS)
def test_merge_and_unload_equal(task_type):
    p_ours, p_hf = lora_pair(task_type)
    x = ids()
    before = p_ours(input_ids=x).logits.detach()
    ours, hf = p_ours.merge_and_unload(), p_hf.merge_and_unload()
    assert type(ours) is GPT2LMHeadModel
    assert not any("lora" in n for n, _ in ours.named_parameters())
    assert type(ours.transformer.h[0].attn.c_attn) is gpt2attn.layers.Conv1D
    assert max_diff(ours(x).logits, hf(x).logits) < 1e-5
    assert max_diff(ours(x).logits, before) < 1e-5
    for (name, a), (_, b) in zip(ours.state_dict().items(), hf.state_dict().items()):
        assert max_diff(a, b) < 1e-6, name
