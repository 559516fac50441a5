"""The training loop's bookkeeping, each rule checked against what the run actually did: the
learning rate in metrics.jsonl is the one the optimizer used for that update; the last step is
evaluated, checkpointed and published whatever eval_interval is; under torchrun the gradients of
the micro-batches are all-reduced once per update, and two processes give one process's weights;
dtype = "bfloat16" warns only where the CPU lacks native bf16."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from safetensors.torch import load_file
from torch.optim.optimizer import register_optimizer_step_pre_hook

from gpt2attn.training import latest_checkpoint, load_config, read_metrics, train
from gpt2attn.training import loop
from tests.helpers import REPO

TINY = ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=16", "--batch_size=4", "--eval_iters=2",
        "--warmup_iters=3", "--learning_rate=3e-3", "--min_lr=3e-4", "--lr_decay_iters=8", "--progress=false",
        "--plot=false", "--device=cpu"]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "text.txt"
    words = ("moon", "night", "rose", "red", "pale", "dark", "ROMEO", "JULIET")
    path.write_text("".join(f"{words[i % 8]} {words[(i * 5) % 8]} {words[(i * 3 + 1) % 8]}.\n" for i in range(400)))
    return path


def _config(text_file, out_dir, *extra):
    return load_config(None, [f"--data={text_file}", f"--out_dir={out_dir}", *TINY, *extra])


def test_metrics_lr_is_the_lr_the_optimizer_used_for_that_update(text_file, tmp_path):
    used = []  # the learning rate of each optimizer step, as the optimizer saw it

    def record(optimizer, args, kwargs):
        used.append(optimizer.param_groups[0]["lr"])

    handle = register_optimizer_step_pre_hook(record)
    try:
        cfg = _config(text_file, tmp_path, "--max_iters=10", "--eval_interval=10", "--log_interval=1")
        train(cfg)
    finally:
        handle.remove()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 11)) and len(used) == 10
    assert len(set(used)) > 5  # warmup and decay: a row one update off would differ
    for r in rows:
        assert r["lr"] == pytest.approx(used[r["step"] - 1], rel=1e-12), r["step"]
        assert r["lr"] == pytest.approx(loop.lr_at(r["step"] - 1, cfg), rel=1e-12), r["step"]


def test_last_step_is_evaluated_checkpointed_and_published(text_file, tmp_path):
    """max_iters = 7 with eval_interval = 5: evaluated at 5 and 7, the checkpoint left is step 7,
    and model/ holds step 7's weights (equal to the weights the run ended with)."""
    final = {}

    def keep(optimizer, args, kwargs):  # the weights just before each update; the last is kept below
        final["params"] = [p for group in optimizer.param_groups for p in group["params"]]

    handle = register_optimizer_step_pre_hook(keep)
    try:
        result = train(_config(text_file, tmp_path, "--max_iters=7", "--eval_interval=5", "--log_interval=5"))
    finally:
        handle.remove()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [5, 7]
    assert all("val_loss" in r for r in rows)
    assert result["step"] == 7 and result["val_loss"] == rows[-1]["val_loss"]
    assert latest_checkpoint(tmp_path).name == "step_0000007"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_0000007"]
    state = torch.load(tmp_path / "checkpoints" / "step_0000007" / "training_state.pt", weights_only=False)
    assert state["step"] == 7
    published = load_file(tmp_path / "model" / "model.safetensors")
    checkpoint = load_file(tmp_path / "checkpoints" / "step_0000007" / "model.safetensors")
    assert published.keys() == checkpoint.keys()
    assert all(torch.equal(published[k], checkpoint[k]) for k in published)
    # the published weights are the run's last: the optimizer's parameters after its 7th update
    ended = {tuple(p.shape): p.detach() for p in final["params"]}
    wte = published["transformer.wte.weight"]
    assert torch.equal(wte, ended[tuple(wte.shape)])


@pytest.mark.parametrize("native", [True, False])
def test_bfloat16_warns_only_without_native_bf16(monkeypatch, native):
    monkeypatch.setattr(loop, "cpu_bf16_report", lambda: (native, "this CPU (patched)"))
    cpu = torch.device("cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert loop.autocast_dtype("bfloat16", cpu, say=True) == "bfloat16"
        assert loop.autocast_dtype("float32", cpu, say=True) == "float32"
    messages = [str(w.message) for w in caught]
    if native:
        assert messages == []
    else:
        assert len(messages) == 1 and "this CPU (patched)" in messages[0] and '"auto"' in messages[0]


def test_autocast_auto_follows_the_device(monkeypatch, capsys):
    monkeypatch.setattr(loop, "cpu_bf16_report", lambda: (True, "has it (patched)"))
    assert loop.autocast_dtype("auto", torch.device("cpu"), say=False) == "bfloat16"
    assert capsys.readouterr().out == ""
    monkeypatch.setattr(loop, "cpu_bf16_report", lambda: (False, "lacks it (patched)"))
    assert loop.autocast_dtype("auto", torch.device("cpu"), say=True) == "float32"
    assert "lacks it (patched)" in capsys.readouterr().out


# --- torchrun: several micro-batches per process ----------------------------------------------------

# Runs under torchrun: trains with DDP, and notes at which training forward pass (counted from 1)
# each gradient all-reduce happened, through a DDP communication hook that then all-reduces as usual.
DRIVER = """
import json, os, sys
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from gpt2attn.training import distributed, load_config, train

forwards, synced_at = [0], []
real_wrap = distributed.wrap

def wrap(model, info, device, fsdp):
    wrapped = real_wrap(model, info, device, fsdp)
    def count(module, args):
        if module.training:
            forwards[0] += 1
    model.register_forward_pre_hook(count)
    def hook(state, bucket):
        synced_at.append(forwards[0])
        return allreduce_hook(state, bucket)
    wrapped.register_comm_hook(None, hook)
    return wrapped

distributed.wrap = wrap
train(load_config(None, sys.argv[1:]))
with open(f"synced-{os.environ['RANK']}.json", "w") as f:  # a file per rank: their stdouts interleave
    json.dump(sorted(set(synced_at)), f)
"""


@pytest.mark.slow
def test_torchrun_syncs_once_per_update_and_equals_one_process(text_file, tmp_path):
    """2 gloo processes x 3 micro-batches: the all-reduce runs only in the backward of each update's
    last micro-batch (no_sync on the others), and the weights equal one process accumulating the
    same 6 micro-batches, to float32 rounding."""
    args = [f"--data={text_file}", *TINY, "--max_iters=3", "--eval_interval=3", "--log_interval=3",
            "--gradient_accumulation_steps=6"]
    train(load_config(None, [*args, f"--out_dir={tmp_path / 'one'}"]))
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(DRIVER))
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)  # this checkout's gpt2attn
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(driver),
           *args, f"--out_dir={tmp_path / 'two'}"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    synced = {rank: json.loads((tmp_path / f"synced-{rank}.json").read_text()) for rank in (0, 1)}
    assert synced == {0: [3, 6, 9], 1: [3, 6, 9]}, done.stdout + done.stderr[-2000:]
    one = load_file(tmp_path / "one" / "model" / "model.safetensors")
    two = load_file(tmp_path / "two" / "model" / "model.safetensors")
    assert one.keys() == two.keys()
    for name in one:
        assert (one[name] - two[name]).abs().max().item() < 2e-6, name
    rows_one = read_metrics(tmp_path / "one" / "metrics.jsonl")
    rows_two = read_metrics(tmp_path / "two" / "metrics.jsonl")
    assert rows_two[-1]["train_loss"] == pytest.approx(rows_one[-1]["train_loss"], rel=1e-6)
    assert json.loads(json.dumps(rows_two[-1]["lr"])) == rows_one[-1]["lr"]
