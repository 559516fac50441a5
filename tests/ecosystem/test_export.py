"""torch.export, torch.compile(fullgraph=True) and ONNX (`gpt2attn export`) of the forward, the prefill
and the decode step: dynamic shapes, no graph break, onnxruntime within 1e-5 of eager."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import max_diff, randomize, tiny_config

from gpt2attn import GPT2LMHeadModel
from gpt2attn.cli import main
from gpt2attn.interop.export import export_program, io_names


@pytest.fixture(scope="module")
def model():
    return randomize(GPT2LMHeadModel(tiny_config())).eval()


def ids(shape, seed=3):
    return torch.randint(0, 97, shape, generator=torch.Generator().manual_seed(seed))


def past_of(model, prompt):
    return [t for kv in model(prompt).past_key_values.to_legacy() for t in kv]


def test_export_forward_and_prefill_dynamic_batch_and_length(model):
    forward, prefill = export_program(model, "forward").module(), export_program(model, "prefill").module()
    for shape in ((1, 1), (3, 11), (5, 32)):  # none of them the export's example (2, 5)
        x = ids(shape)
        want = model(x)
        assert max_diff(forward(x), want.logits) < 1e-5
        logits, *present = prefill(x)
        assert max_diff(logits, want.logits) < 1e-5
        assert len(present) == 2 * model.config.n_layer
        assert all(max_diff(a, b) == 0 for a, b in zip(present, past_of(model, x)))


def test_export_decode_step_with_past_as_inputs(model):
    decode = export_program(model, "decode").module()
    for batch, past_len in ((1, 1), (4, 9), (2, 31)):
        prompt, nxt = ids((batch, past_len)), ids((batch, 1), seed=4)
        logits, *present = decode(nxt, *past_of(model, prompt))
        full = torch.cat([prompt, nxt], dim=1)
        assert max_diff(logits, model(full).logits[:, -1:]) < 1e-5
        assert present[0].shape == (batch, model.config.n_head, past_len + 1, model.config.head_dim)
        assert max_diff(present[-1], past_of(model, full)[-1]) < 1e-5


def test_compile_fullgraph_forward_and_decode_step(model):
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")  # fullgraph: any graph break raises
    x = ids((2, 7))
    assert max_diff(compiled(x).logits, model(x).logits) == 0
    nxt = ids((2, 1), seed=4)
    for past in (model(x).past_key_values, model(x).past_key_values.to_legacy()):  # our cache, HF's tuples
        want = model(nxt, past_key_values=model(x).past_key_values).logits
        assert max_diff(compiled(nxt, past_key_values=past).logits, want) < 1e-6


def test_checks_stay_in_eager_mode(model):
    with pytest.raises(ValueError, match="outside"):
        model(torch.tensor([[1, 97]]))


def ort_session(path):
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install -e '.[ecosystem]')")
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.mark.slow
def test_export_command_with_cache_runs_a_decode_loop_in_onnxruntime(model, tmp_path, capsys):
    pytest.importorskip("onnxscript", reason="onnxscript is not installed (pip install -e '.[ecosystem]')")
    model.save_pretrained(tmp_path / "model")
    assert main(["export", str(tmp_path / "model"), str(tmp_path / "gpt2.onnx"), "--with-cache"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("PASS") == 2, printed
    prefill, decode = ort_session(tmp_path / "gpt2.onnx"), ort_session(tmp_path / "gpt2.decode.onnx")
    past_names, _ = io_names(model.config.n_layer, "decode")
    assert [i.name for i in decode.get_inputs()] == past_names
    seq = ids((3, 6))
    logits, *present = prefill.run(None, {"input_ids": seq.numpy()})
    worst = max_diff(torch.from_numpy(logits), model(seq).logits)
    for _ in range(4):  # greedy steps, the cache going round through onnxruntime
        nxt = torch.from_numpy(logits[:, -1].argmax(-1, keepdims=True))
        seq = torch.cat([seq, nxt], dim=1)
        logits, *present = decode.run(None, {"input_ids": nxt.numpy(), **dict(zip(past_names[1:], present))})
        worst = max(worst, max_diff(torch.from_numpy(logits), model(seq).logits[:, -1:]))
    assert present[0].shape[2] == 10
    assert worst < 1e-5


@pytest.mark.slow
def test_export_command_forward(model, tmp_path, capsys):
    pytest.importorskip("onnxscript", reason="onnxscript is not installed (pip install -e '.[ecosystem]')")
    model.save_pretrained(tmp_path / "model")
    assert main(["export", str(tmp_path / "model"), str(tmp_path / "fwd.onnx")]) == 0
    assert "forward" in capsys.readouterr().out
    session = ort_session(tmp_path / "fwd.onnx")
    x = ids((2, 13))
    (logits,) = session.run(None, {"input_ids": x.numpy()})
    assert max_diff(torch.from_numpy(logits), model(x).logits) < 1e-5
    assert main(["export", str(tmp_path / "model"), str(tmp_path / "fwd.txt")]) == 2  # a clear error, not a trace
