"""scripts/handmade_aab.py: the hand-written one-layer GPT-2 continues "aab" perfectly."""

import importlib.util

import pytest
import torch
from torch import nn

from tests.helpers import REPO

SCRIPT = REPO / "scripts" / "handmade_aab.py"


@pytest.fixture(scope="module")
def handmade():
    spec = importlib.util.spec_from_file_location("handmade_aab", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_scores_100_percent_on_aab(handmade):
    model = handmade.build_model()
    assert handmade.accuracy(model, "aab" * 10) == 1.0
    inputs, targets = handmade.windows("aab" * 10)
    assert inputs.shape == (25, 5) and targets.shape == (25, 5)


def test_generates_the_pattern_with_sliding_window(handmade):
    model = handmade.build_model()
    text = "aa"
    with torch.no_grad():
        while len(text) < 30:
            window = handmade.encode(text[-handmade.CONTEXT:]).unsqueeze(0)
            text += handmade.VOCAB[model(window).logits[0, -1].argmax()]
    assert text == ("aab" * 10)[:30]


def test_each_position_attends_to_itself_and_the_previous_one(handmade):
    from gpt2attn import inspect

    model = handmade.build_model()
    with torch.no_grad(), inspect.capture(model, names=["weights"]) as acts:
        model(handmade.encode("abaab").unsqueeze(0))
    expected = torch.zeros(5, 5)
    expected[0, 0] = 1.0
    for p in range(1, 5):
        expected[p, p] = expected[p, p - 1] = 0.5
    assert torch.allclose(acts["h.0.attn.weights"][0, 0], expected, atol=1e-6)


def test_built_from_our_modules_with_identity_norms_and_tied_head(handmade):
    model = handmade.build_model()
    block = model.transformer.h[0]
    assert isinstance(block.ln_1, nn.Identity) and isinstance(model.transformer.ln_f, nn.Identity)
    assert model.lm_head.weight is model.transformer.wte.weight
    assert model.transformer.wte.weight.shape == (2, 8) and block.attn.c_attn.weight.shape == (8, 24)


def test_script_prints_accuracy_and_attention(handmade, capsys):
    handmade.main()
    out = capsys.readouterr().out
    assert "100%" in out and "0.50" in out


def test_capture_names_a_replaced_module(handmade):
    from gpt2attn import inspect

    model = handmade.build_model()
    with pytest.raises(ValueError, match="h.0.mlp is a NoMLP"):
        with inspect.capture(model, names=["mlp.hidden"]):
            pass
