"""`gpt2attn train` end to end on a tiny model: outputs, resume after a kill, DDP, the default model."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.optim.optimizer import register_optimizer_step_pre_hook

from gpt2attn import GPT2LMHeadModel
from gpt2attn.cli import main as cli_main
from gpt2attn.training import latest_checkpoint, load_config, read_metrics, train
from tests.helpers import REPO, max_diff

DEFAULT_MODEL = REPO / "gpt2attn" / "default_model"
TINY = ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=16", "--batch_size=4", "--eval_iters=2",
        "--log_interval=5", "--warmup_iters=5", "--learning_rate=3e-3", "--min_lr=3e-4", "--progress=false"]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    """540 lines drawn at random (not one block repeated): no stretch of the validation split
    recurs in the training split."""
    path = tmp_path_factory.mktemp("text") / "text.txt"
    rng = random.Random(0)
    lines = [f"{rng.choice(('ROMEO', 'JULIET', 'NURSE'))}: the {rng.choice(('moon', 'night', 'rose'))} is "
             f"{rng.choice(('red', 'pale', 'dark'))}.\n" for _ in range(540)]
    path.write_text("".join(lines))
    return path


@pytest.fixture
def optimizer_steps():
    """What every optimizer step receives: the gradients, in parameter order, one list per step."""
    steps = []

    def record(optimizer, args, kwargs):
        steps.append([p.grad.clone() for group in optimizer.param_groups for p in group["params"]])

    handle = register_optimizer_step_pre_hook(record)
    yield steps
    handle.remove()


def grad_norm(grads) -> float:
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()


def _config(text_file, out_dir, *extra):
    return load_config(None, [f"--data={text_file}", f"--out_dir={out_dir}", *TINY, *extra])


def test_train_writes_metrics_checkpoints_model_and_plot(text_file, tmp_path):
    import transformers

    result = train(_config(text_file, tmp_path, "--max_iters=40", "--eval_interval=20"))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(5, 41, 5))
    for r in rows:
        assert {"step", "train_loss", "lr", "tokens_per_s"} <= r.keys() and r["tokens_per_s"] > 0
    assert [r["step"] for r in rows if "val_loss" in r] == [20, 40]
    assert rows[-1]["train_loss"] < rows[0]["train_loss"] - 0.5
    assert result["val_loss"] == rows[-1]["val_loss"]
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert latest_checkpoint(tmp_path).name == "step_0000040"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_0000040"]
    umask = os.umask(0)
    os.umask(umask)
    for file in [*tmp_path.glob("*.*"), *(tmp_path / "data").iterdir(), *(tmp_path / "model").iterdir()]:
        assert file.stat().st_mode & 0o777 == 0o666 & ~umask, file.name  # not mkstemp's 0600

    # The final model folder is HF's layout: transformers and we give the same logits.
    ours = GPT2LMHeadModel.from_pretrained(tmp_path / "model").eval()
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "model").eval()
    ids = torch.randint(0, ours.config.vocab_size, (2, 16))
    with torch.no_grad():
        assert max_diff(ours(ids).logits, hf(ids).logits) < 1e-5


def test_grad_accumulation_equals_bigger_batch(text_file, tmp_path, optimizer_steps):
    """Two micro-batches of 4 accumulated give the gradients and the update of one batch of 8
    (same blocks); gradient checkpointing in the second run changes nothing either. Clipping is
    off: it would rescale both to the same norm, as AdamW's update is blind to the gradients' scale."""
    common = ["--max_iters=3", "--eval_interval=3", "--plot=false", "--grad_clip=0", "--warmup_iters=0"]
    train(_config(text_file, tmp_path / "a", *common, "--batch_size=4", "--gradient_accumulation_steps=2"))
    accumulated = optimizer_steps[:]
    optimizer_steps.clear()
    train(_config(text_file, tmp_path / "b", *common, "--batch_size=8", "--gradient_accumulation_steps=1",
                  "--eval_iters=1", "--gradient_checkpointing"))
    assert len(accumulated) == len(optimizer_steps) == 3
    for mine, big in zip(accumulated[0], optimizer_steps[0]):  # same weights at the first step
        assert max_diff(mine, big) < 1e-6
    a = load_file(tmp_path / "a" / "model" / "model.safetensors")
    b = load_file(tmp_path / "b" / "model" / "model.safetensors")
    for name in a:
        assert max_diff(a[name], b[name]) < 1e-5, name


def test_gradient_clipping_bounds_what_the_optimizer_gets(text_file, tmp_path, optimizer_steps):
    train(_config(text_file, tmp_path / "free", "--max_iters=3", "--eval_interval=3", "--plot=false", "--grad_clip=0",
                  "--warmup_iters=0"))
    free = [grad_norm(g) for g in optimizer_steps]
    optimizer_steps.clear()
    train(_config(text_file, tmp_path / "clip", "--max_iters=3", "--eval_interval=3", "--plot=false", "--grad_clip=0.05",
                  "--warmup_iters=0"))
    clipped = [grad_norm(g) for g in optimizer_steps]
    assert free[0] > 0.5  # so the clipping below has work to do
    assert clipped == pytest.approx([0.05] * 3, rel=1e-4)


def test_val_loss_is_the_validation_splits(text_file, tmp_path):
    """A validation split of exactly block_size + 2 tokens has one block, so val_loss can be
    recomputed by hand from val.bin and the final model; the first training block (which a bug
    evaluating the wrong split would use) gives another loss on this non-periodic text."""
    n = len(text_file.read_text())
    cfg = _config(text_file, tmp_path, "--max_iters=10", "--eval_interval=10", "--plot=false",
                  f"--val_fraction={18.5 / n}")  # block_size 16: 18 tokens of validation text
    result = train(cfg)
    val = np.fromfile(tmp_path / "data" / "val.bin", dtype=np.uint16).astype(np.int64)
    first_train = np.fromfile(tmp_path / "data" / "train.bin", dtype=np.uint16)[:17].astype(np.int64)
    assert len(val) == 18
    model = GPT2LMHeadModel.from_pretrained(tmp_path / "model").eval()

    def loss(block) -> float:
        block = torch.from_numpy(block)
        with torch.no_grad():
            return F.cross_entropy(model(block[None, :16]).logits[0], block[1:17]).item()

    assert result["val_loss"] == pytest.approx(loss(val[:17]), abs=1e-5)
    assert abs(loss(val[:17]) - loss(first_train)) > 0.05


def test_bf16_autocast_run_learns(text_file, tmp_path):
    result = train(_config(text_file, tmp_path, "--max_iters=30", "--eval_interval=30", "--dtype=bfloat16", "--plot=false"))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    vocab = GPT2LMHeadModel.from_pretrained(tmp_path / "model").config.vocab_size
    assert rows[-1]["train_loss"] < rows[0]["train_loss"] and result["val_loss"] < 0.8 * math.log(vocab)
    assert GPT2LMHeadModel.from_pretrained(tmp_path / "model").dtype == torch.float32  # fp32 master weights


def test_init_from_pretrained_fine_tunes(text_file, tmp_path):
    train(_config(text_file, tmp_path / "base", "--max_iters=10", "--eval_interval=10", "--plot=false"))
    before = load_file(tmp_path / "base" / "model" / "model.safetensors")
    cfg = _config(text_file, tmp_path / "tuned", "--max_iters=5", "--eval_interval=5", "--plot=false",
                  f"--init_from={tmp_path / 'base' / 'model'}", "--tokenizer=", "--learning_rate=1e-4",
                  "--warmup_iters=0", "--min_lr=1e-5")
    result = train(cfg)
    after = load_file(tmp_path / "tuned" / "model" / "model.safetensors")
    first = read_metrics(tmp_path / "tuned" / "metrics.jsonl")[0]
    assert first["train_loss"] < 3.0  # starts from the trained weights, not ln(vocab)
    assert result["step"] == 5
    assert 0 < max_diff(after["transformer.wte.weight"], before["transformer.wte.weight"]) < 0.01


def test_cli_train_and_its_errors(text_file, tmp_path, capsys):
    recipe = REPO / "configs" / "train" / "shakespeare_char_cpu.toml"
    args = ["train", "--config", str(recipe), f"--data={text_file}", f"--out_dir={tmp_path}", *TINY,
            "--max_iters=10", "--eval_interval=10", "--plot=false"]
    assert cli_main(args) == 0
    assert "val loss" in capsys.readouterr().out
    assert cli_main(["train", "--config", str(recipe), "--max_iter=3"]) == 2
    assert "unknown setting --max_iter" in capsys.readouterr().err
    assert cli_main(["train", "--config", str(recipe), f"--data={tmp_path / 'absent.txt'}", f"--out_dir={tmp_path}"]) == 2
    assert "no data file" in capsys.readouterr().err
    assert cli_main(["train", "--config", str(recipe), f"--data={text_file}", f"--out_dir={tmp_path / 'new'}", "--resume"]) == 2
    assert "no checkpoint" in capsys.readouterr().err


@pytest.mark.slow
def test_resume_after_kill_gives_the_uninterrupted_curve(text_file, tmp_path):
    """SIGKILL a run right after its first checkpoint, resume it, compare with one that ran through."""
    args = [f"--data={text_file}", *TINY, "--max_iters=150", "--eval_interval=25", "--dropout=0.1", "--plot=false"]
    full = tmp_path / "full"
    train(load_config(None, [*args, f"--out_dir={full}"]))

    cut = tmp_path / "cut"
    cmd = [sys.executable, "-m", "gpt2attn.cli", "train", *args, f"--out_dir={cut}"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while latest_checkpoint(cut) is None and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed mid-way"
    killed_at = int(latest_checkpoint(cut).name.removeprefix("step_"))
    assert killed_at < 150 and not (cut / "model").exists()

    train(load_config(None, [*args, f"--out_dir={cut}", "--resume"]))
    expected, got = read_metrics(full / "metrics.jsonl"), read_metrics(cut / "metrics.jsonl")
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    for a, b in zip(got, expected):
        assert a.keys() == b.keys(), a["step"]  # eval steps have val_loss in both runs, others in neither
        for key in a.keys() - {"step", "tokens_per_s"}:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (a["step"], key)
    a = load_file(cut / "model" / "model.safetensors")
    b = load_file(full / "model" / "model.safetensors")
    assert all(max_diff(a[k], b[k]) < 1e-6 for k in a)


def torchrun(*args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node=N -m gpt2attn.cli ...`, as the README writes it (CPU, gloo)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "gpt2attn.cli", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["--fsdp=false", "--fsdp=true"])
def test_two_gloo_processes_equal_one_process(text_file, tmp_path, sharding):
    """torchrun with 2 CPU processes (DDP or FSDP, gloo) and the recipe's gradient_accumulation_steps
    = 1, rounded up to 1 micro-batch per process (with one warning), against 1 process
    accumulating the same 2 micro-batches: the weights agree after a few steps."""
    args = [f"--data={text_file}", *TINY, "--max_iters=6", "--eval_interval=6", "--plot=false", "--device=cpu", sharding]
    train(load_config(None, [*args, "--gradient_accumulation_steps=2", f"--out_dir={tmp_path / 'one'}"]))
    done = torchrun("train", *args, "--gradient_accumulation_steps=1", f"--out_dir={tmp_path / 'two'}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("val loss") == 1  # one report, from the main process
    warning = "gpt2attn train: warning: gradient_accumulation_steps (1) is not a multiple of the 2 processes"
    assert done.stderr.count(warning) == 1, done.stderr[-3000:]
    one = load_file(tmp_path / "one" / "model" / "model.safetensors")
    two = load_file(tmp_path / "two" / "model" / "model.safetensors")
    assert one.keys() == two.keys()
    for name in one:
        assert max_diff(one[name], two[name]) < 1e-5, name
    first = torch.load(tmp_path / "one" / "checkpoints" / "step_0000006" / "training_state.pt", weights_only=False)
    assert first["step"] == 6
    rows_one, rows_two = read_metrics(tmp_path / "one" / "metrics.jsonl"), read_metrics(tmp_path / "two" / "metrics.jsonl")
    assert rows_two[-1]["train_loss"] == pytest.approx(rows_one[-1]["train_loss"], rel=1e-5)


@pytest.mark.slow
def test_an_error_under_torchrun_is_printed_once(tmp_path):
    """Every process meets the same bad input (here, data that only the main process reads):
    the error line appears once, not once per process."""
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("é".encode("latin-1") * 100)
    done = torchrun("train", f"--data={bad}", f"--out_dir={tmp_path / 'out'}", *TINY, "--device=cpu")
    assert done.returncode != 0
    line = f"gpt2attn train: error: {bad} is not UTF-8 text: byte 0xe9 at offset 0"
    assert done.stderr.count("gpt2attn train: error:") == 1 and line in done.stderr, done.stderr[-3000:]


def test_default_model_loads_in_transformers_with_our_logits():
    import transformers
    from tokenizers import Tokenizer

    if not (DEFAULT_MODEL / "model.safetensors").is_file():
        pytest.fail(f"the shipped default model is missing from {DEFAULT_MODEL}")
    config = json.loads((DEFAULT_MODEL / "config.json").read_text())
    assert config["model_type"] == "gpt2"
    tok = Tokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json"))
    ids = tok.encode("ROMEO:\nWhat light through yonder window breaks?").ids
    assert tok.decode(ids) == "ROMEO:\nWhat light through yonder window breaks?"
    ours = GPT2LMHeadModel.from_pretrained(DEFAULT_MODEL).eval()
    hf = transformers.GPT2LMHeadModel.from_pretrained(DEFAULT_MODEL).eval()
    x = torch.tensor([ids[: ours.config.n_positions]])
    with torch.no_grad():
        assert max_diff(ours(x).logits, hf(x).logits) < 1e-4
        # It learned Shakespeare: the next character is far better than uniform guessing.
        loss = ours(x, labels=x).loss.item()
    assert loss < 0.6 * torch.log(torch.tensor(float(ours.config.vocab_size))).item()
    assert os.path.getsize(DEFAULT_MODEL / "model.safetensors") < 20_000_000
