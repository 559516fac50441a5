"""accelerate (prepare / save_state / load_state), bertviz's head_view and nnsight's NNsight(model)
take our model as it is: a test each so they keep working. And `import gpt2attn` imports none of
the clients."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.helpers import max_diff, randomize, tiny_config

from gpt2attn import GPT2LMHeadModel, inspect


def batches():
    x = torch.randint(0, 97, (8, 10), generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=4)


def test_import_gpt2attn_imports_no_client():
    code = ("import sys, gpt2attn; clients = ['transformers', 'peft', 'accelerate', 'transformer_lens', "
            "'nnsight', 'bertviz', 'onnx', 'onnxscript', 'onnxruntime']; "
            "print([c for c in clients if c in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_accelerate_prepare_save_state_load_state(tmp_path):
    accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed (pip install -e '.[ecosystem]')")
    acc = accelerate.Accelerator(cpu=True)
    model = randomize(GPT2LMHeadModel(tiny_config()), std=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt, loader = acc.prepare(model, opt, batches())

    def epoch():
        losses = []
        for (x,) in loader:
            loss = model(x, labels=x).loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    epoch()
    acc.save_state(tmp_path / "state")
    after_save = epoch()
    acc.load_state(tmp_path / "state")  # weights and AdamW moments back to the saved point
    assert epoch() == pytest.approx(after_save, abs=1e-6)
    unwrapped = acc.unwrap_model(model)
    assert type(unwrapped) is GPT2LMHeadModel and unwrapped.lm_head.weight is unwrapped.transformer.wte.weight


def test_bertviz_head_view_shows_our_attention():
    bertviz = pytest.importorskip("bertviz", reason="bertviz is not installed (pip install -e '.[ecosystem]')")
    model = randomize(GPT2LMHeadModel(tiny_config())).eval()
    x = torch.tensor([[5, 17, 42, 8, 9]])
    out = model(x, output_attentions=True)
    html = bertviz.head_view(out.attentions, [f"t{i}" for i in x[0].tolist()], html_action="return").data
    start = html.index('"attn": ') + len('"attn": ')
    shown, _ = json.JSONDecoder().raw_decode(html[start:])
    want = torch.stack([a[0] for a in out.attentions])  # (n_layer, nh, T, T)
    assert max_diff(torch.tensor(shown), want) < 1e-6
    assert '"t42"' in html


def test_nnsight_wraps_our_model_reads_and_edits_activations():
    nnsight = pytest.importorskip("nnsight", reason="nnsight is not installed (pip install -e '.[ecosystem]')")
    model = randomize(GPT2LMHeadModel(tiny_config())).eval()
    x = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(1))
    traced = nnsight.NNsight(model)
    with traced.trace(x):
        block0 = traced.transformer.h[0].output.save()
        traced.transformer.h[1].mlp.output[:] = 0  # knock out the last MLP
        logits = traced.output.logits.save()
    with inspect.capture(model, layers=[0], names=["resid_post"]) as acts:
        model(x)
    assert max_diff(block0[0], acts["h.0.resid_post"]) == 0
    with inspect.edit(model, "h.1.mlp.out", lambda t: torch.zeros_like(t)):
        want = model(x).logits
    assert max_diff(logits, want) < 1e-6 and max_diff(logits, model(x).logits) > 1e-3
