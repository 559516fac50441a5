"""The training loop, gpt2attn/training/loop.py (`gpt2attn train`).

First its rules on a model so small that a run takes a fraction of a second (one layer, n_embd 16,
blocks of 8 characters, a handful of updates). Every figure the loop reports (train loss, eval
losses, tokens per second, learning rate) is recomputed here from the data, the seeds and the saved
model rather than compared with a stored number. Then (sections below) `gpt2attn train` end to end
on a two-layer model, and the loop's bookkeeping checked against what a run did.

The runs that take seconds (subprocesses, torchrun, dozens of updates) are marked slow: with
`-m "not slow"` this file is the fast tier the mutation tool reruns for every planted bug in
loop.py (docs/mutation.md)."""

from __future__ import annotations

import copy
import json
import math
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook

from gpt2attn import GPT2LMHeadModel
from gpt2attn.cli import main as cli_main
from gpt2attn.errors import CheckpointError
from gpt2attn.training import TokenData, distributed, latest_checkpoint, load_config, loop, read_metrics, train
from tests.helpers import REPO, max_diff

TINY = ["--n_layer=1", "--n_head=2", "--n_embd=16", "--block_size=8", "--batch_size=2", "--eval_iters=2",
        "--warmup_iters=2", "--learning_rate=3e-3", "--min_lr=3e-4", "--lr_decay_iters=6", "--progress=false",
        "--plot=false", "--device=cpu"]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "text.txt"
    rng = random.Random(1)
    path.write_text("".join(f"{rng.choice(('ROMEO', 'JULIET'))}: the {rng.choice(('moon', 'rose', 'night'))} is "
                            f"{rng.choice(('red', 'pale', 'dark'))}.\n" for _ in range(120)))
    return path


def config(text_file, out_dir, *extra):
    return load_config(None, [f"--data={text_file}", f"--out_dir={out_dir}", *TINY, *extra])


def model_loss(model, data: TokenData, split: str, offsets: torch.Tensor) -> float:
    x, y = data.batch(split, offsets)
    with torch.no_grad():
        logits = model(x).logits
    return F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1)).item()


def test_first_rows_train_loss_is_the_initial_models_loss_on_the_first_batch(text_file, tmp_path):
    """Row 1's train_loss: the model built from cfg.seed, on the first batch drawn from cfg.seed."""
    cfg = config(text_file, tmp_path, "--max_iters=1", "--eval_interval=1", "--log_interval=1")
    train(cfg)
    data = TokenData(tmp_path / "data", cfg.block_size)
    torch.manual_seed(cfg.seed)
    model = loop.build_model(cfg, data.vocab_size, None).eval()
    offsets = data.offsets("train", cfg.batch_size, torch.Generator().manual_seed(cfg.seed))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert rows[0]["train_loss"] == pytest.approx(model_loss(model, data, "train", offsets), rel=1e-5)


def test_train_loss_is_the_mean_over_the_updates_since_the_last_row(text_file, tmp_path):
    every = config(text_file, tmp_path / "every", "--max_iters=6", "--eval_interval=6", "--log_interval=1")
    third = config(text_file, tmp_path / "third", "--max_iters=6", "--eval_interval=6", "--log_interval=3")
    train(every)
    train(third)
    one = read_metrics(tmp_path / "every" / "metrics.jsonl")
    three = read_metrics(tmp_path / "third" / "metrics.jsonl")
    assert [r["step"] for r in three] == [3, 6]
    assert three[0]["train_loss"] == pytest.approx(sum(r["train_loss"] for r in one[:3]) / 3, rel=1e-5)
    assert three[1]["train_loss"] == pytest.approx(sum(r["train_loss"] for r in one[3:]) / 3, rel=1e-5)
    assert three[1]["val_loss"] == pytest.approx(one[-1]["val_loss"], rel=1e-6)


def test_accumulated_micro_batches_log_the_loss_of_the_whole_batch(text_file, tmp_path):
    """2 micro-batches of 2 and one batch of 4 (the same blocks): the same train loss in every row."""
    small = config(text_file, tmp_path / "a", "--max_iters=3", "--eval_interval=3", "--log_interval=1",
                   "--gradient_accumulation_steps=2")
    big = config(text_file, tmp_path / "b", "--max_iters=3", "--eval_interval=3", "--log_interval=1", "--batch_size=4",
                 "--eval_iters=1")
    train(small)
    train(big)
    a, b = read_metrics(tmp_path / "a" / "metrics.jsonl"), read_metrics(tmp_path / "b" / "metrics.jsonl")
    assert [r["train_loss"] for r in a] == pytest.approx([r["train_loss"] for r in b], rel=1e-5)
    assert a[-1]["val_loss"] == pytest.approx(b[-1]["val_loss"], rel=1e-5)


def test_eval_losses_are_the_final_models_on_the_fixed_eval_batches(text_file, tmp_path):
    """val_loss and eval_train_loss: the published model's mean loss over eval_iters batches of each
    split, drawn from cfg.seed + 1 (train's first, then val's), evaluated without dropout."""
    cfg = config(text_file, tmp_path, "--max_iters=4", "--eval_interval=4", "--log_interval=4", "--dropout=0.3")
    result = train(cfg)
    data = TokenData(tmp_path / "data", cfg.block_size)
    model = GPT2LMHeadModel.from_pretrained(tmp_path / "model").eval()
    rng = torch.Generator().manual_seed(cfg.seed + 1)
    offsets = {split: data.offsets(split, cfg.eval_iters * cfg.batch_size, rng) for split in ("train", "val")}
    expected = {split: sum(model_loss(model, data, split, chunk) for chunk in o.split(cfg.batch_size)) / cfg.eval_iters
                for split, o in offsets.items()}
    row = read_metrics(tmp_path / "metrics.jsonl")[-1]
    assert row["val_loss"] == pytest.approx(expected["val"], rel=1e-5)
    assert row["eval_train_loss"] == pytest.approx(expected["train"], rel=1e-5)
    assert result["val_loss"] == row["val_loss"] and result["train_loss"] == row["train_loss"]
    assert result["step"] == 4 and result["model_dir"] == str(tmp_path / "model")


def test_updates_run_in_training_mode_and_evaluations_in_eval_mode(text_file, tmp_path):
    """Each update: gradient_accumulation_steps forward passes with dropout on and autograd on;
    each evaluation: 2 x eval_iters passes with dropout off and no autograd; then training resumes."""
    seen = []

    def note(module, args):
        if isinstance(module, GPT2LMHeadModel):
            seen.append("T" if module.training and torch.is_grad_enabled() else
                        "E" if not module.training and not torch.is_grad_enabled() else "?")

    handle = register_module_forward_pre_hook(note)
    try:
        train(config(text_file, tmp_path, "--max_iters=4", "--eval_interval=2", "--log_interval=2", "--dropout=0.1",
                     "--gradient_accumulation_steps=2"))
    finally:
        handle.remove()
    assert "".join(seen) == "TTTT" + "EEEE" + "TTTT" + "EEEE"


def test_tokens_per_s_and_seconds_follow_the_clock(text_file, tmp_path, monkeypatch):
    """A fake clock that advances 1 s per reading: tokens_per_s is the tokens of the updates since the
    last row over the time since then; seconds is the span from the first to the last reading."""
    readings = []

    def clock() -> float:
        readings.append(100.0 + len(readings))
        return readings[-1]

    monkeypatch.setattr(loop, "time", SimpleNamespace(perf_counter=clock))
    cfg = config(text_file, tmp_path, "--max_iters=5", "--eval_interval=5", "--log_interval=2",
                 "--gradient_accumulation_steps=3")
    result = train(cfg)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [2, 4, 5]
    tokens = cfg.batch_size * cfg.block_size * 3  # per update
    # each row is read 1 s after the previous row's last reading
    assert [r["tokens_per_s"] for r in rows] == [tokens * 2 / 1.0, tokens * 2 / 1.0, tokens * 1 / 1.0]
    assert result["seconds"] == readings[-1] - readings[0] > 0


def test_lr_of_each_row_and_the_optimizer_follow_lr_at(text_file, tmp_path):
    used = []
    handle = register_optimizer_step_pre_hook(lambda opt, args, kwargs: used.append(opt.param_groups[0]["lr"]))
    try:
        cfg = config(text_file, tmp_path, "--max_iters=8", "--eval_interval=8", "--log_interval=1")
        train(cfg)
    finally:
        handle.remove()
    assert used == pytest.approx([loop.lr_at(s, cfg) for s in range(8)], rel=1e-12)
    assert [r["lr"] for r in read_metrics(tmp_path / "metrics.jsonl")] == pytest.approx(used, rel=1e-12)


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_gradient_clipping(text_file, tmp_path, clip):
    norms = []

    def record(optimizer, args, kwargs):
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]]
        norms.append(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item())

    handle = register_optimizer_step_pre_hook(record)
    try:
        train(config(text_file, tmp_path, "--max_iters=3", "--eval_interval=3", f"--grad_clip={clip}"))
    finally:
        handle.remove()
    assert len(norms) == 3
    if clip:
        assert norms == pytest.approx([clip] * 3, rel=1e-4)
    else:
        assert min(norms) > 0.2  # unclipped: far above the clipped run's 0.05


def test_each_update_gets_the_gradients_of_its_own_batch_only(text_file, tmp_path):
    """Update 2's gradients are those of update 2's batch at the weights after update 1 (recomputed
    on a copy of the model), not that plus update 1's left over."""
    models, compared = [], []

    def keep(module, args):
        if isinstance(module, GPT2LMHeadModel) and module.training:
            models[:] = [module]

    def check(optimizer, args, kwargs):
        compared.append(None)
        if len(compared) < 2:
            return
        model = models[0]
        data = TokenData(tmp_path / "data", cfg.block_size)
        rng = torch.Generator().manual_seed(cfg.seed)
        data.offsets("train", cfg.batch_size, rng)  # update 1's batch
        x, y = data.batch("train", data.offsets("train", cfg.batch_size, rng))
        twin = copy.deepcopy(model)
        twin.zero_grad(set_to_none=True)
        logits = twin(x).logits
        F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1)).backward()
        mine, theirs = dict(model.named_parameters()), dict(twin.named_parameters())
        compared[-1] = max((mine[n].grad - theirs[n].grad).abs().max().item() for n in mine)

    cfg = config(text_file, tmp_path, "--max_iters=2", "--eval_interval=2", "--grad_clip=0")
    handles = [register_module_forward_pre_hook(keep), register_optimizer_step_pre_hook(check)]
    try:
        train(cfg)
    finally:
        for handle in handles:
            handle.remove()
    assert compared[0] is None and compared[1] < 1e-6


def test_resume_continues_the_run_exactly(text_file, tmp_path):
    """A run stopped at its step-3 checkpoint (with dropout, so the RNG states matter) and resumed
    to step 6 gives the metrics and weights of a run straight to 6; rows the stopped run wrote after
    its checkpoint are dropped. Resuming a finished run changes nothing and reports its last figures."""
    common = ["--eval_interval=3", "--log_interval=1", "--dropout=0.2"]
    train(config(text_file, tmp_path / "full", "--max_iters=6", *common))
    cut = tmp_path / "cut"
    train(config(text_file, cut, "--max_iters=3", *common))
    with open(cut / "metrics.jsonl", "a") as f:  # as if it had gone on to step 4 and been killed
        f.write(json.dumps({"step": 4, "train_loss": 9.0, "lr": 0.0, "tokens_per_s": 1.0}) + "\n")
    state = loop.read_training_state(latest_checkpoint(cut))
    assert state["step"] == 3 and state["cuda_rng"] is None and len(state["torch_rng"]) == 1
    assert state["train_config"] == config(text_file, cut, "--max_iters=3", *common).to_dict()
    result = train(config(text_file, cut, "--max_iters=6", "--resume", *common))
    full, resumed = read_metrics(tmp_path / "full" / "metrics.jsonl"), read_metrics(cut / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [r["step"] for r in full] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(resumed, full):
        assert a.keys() == b.keys()
        for key in a.keys() - {"tokens_per_s"}:
            assert a[key] == pytest.approx(b[key], rel=1e-6), (a["step"], key)
    a = load_file(cut / "model" / "model.safetensors")
    b = load_file(tmp_path / "full" / "model" / "model.safetensors")
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=1e-6) for k in a)
    assert result["step"] == 6 and result["val_loss"] == full[-1]["val_loss"]

    again = train(config(text_file, cut, "--max_iters=6", "--resume", *common))
    assert read_metrics(cut / "metrics.jsonl") == resumed
    assert (again["step"], again["train_loss"], again["val_loss"]) == (6, full[-1]["train_loss"], full[-1]["val_loss"])


def test_published_model_is_the_checkpoint_without_its_training_state(text_file, tmp_path):
    train(config(text_file, tmp_path, "--max_iters=2", "--eval_interval=1"))
    checkpoint = latest_checkpoint(tmp_path)
    assert checkpoint.name == "step_0000002"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_0000002"]
    names = sorted(p.name for p in (tmp_path / "model").iterdir())
    assert "training_state.pt" not in names and "tokenizer.json" in names and "model.safetensors" in names
    assert names == sorted(p.name for p in checkpoint.iterdir() if p.name != "training_state.pt")
    assert (tmp_path / "model" / "tokenizer.json").read_bytes() == (tmp_path / "data" / "tokenizer.json").read_bytes()


def test_latest_checkpoint_is_the_highest_step_folder(tmp_path):
    assert loop.latest_checkpoint(tmp_path) is None  # no checkpoints/ at all
    root = tmp_path / "checkpoints"
    root.mkdir()
    assert loop.latest_checkpoint(tmp_path) is None
    for name in ("step_9", "step_10", "step_2"):
        (root / name).mkdir()
    (root / "step_99").write_text("a file, not a checkpoint")
    (root / "step_50.tmp").mkdir()
    (root / "xstep_70").mkdir()
    assert loop.latest_checkpoint(tmp_path) == root / "step_10"


def test_training_state_errors_name_the_file(tmp_path):
    path = tmp_path / "training_state.pt"
    torch.save({"step": 1, "optimizer": {}, "scheduler": {}, "batch_rng": None}, path)
    with pytest.raises(CheckpointError, match="no torch_rng") as caught:
        loop.read_training_state(tmp_path)
    assert caught.value.file == str(path)
    torch.save([1, 2], path)
    with pytest.raises(CheckpointError, match="no step, optimizer, scheduler, batch_rng, torch_rng"):
        loop.read_training_state(tmp_path)


def test_bad_runs_are_refused_before_training(text_file, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(ValueError, match=f"out_dir {a_file} is a file"):
        train(config(text_file, a_file, "--max_iters=1"))
    with pytest.raises(FileNotFoundError, match="--resume: no checkpoint in"):
        train(config(text_file, tmp_path / "new", "--max_iters=1", "--resume"))
    with pytest.raises(ValueError, match="no training text"):
        train(load_config(None, [f"--out_dir={tmp_path / 'new'}", *TINY, "--max_iters=1"]))
    with pytest.raises(FileNotFoundError):
        train(config(tmp_path / "absent.txt", tmp_path / "new", "--max_iters=1"))
    assert not (tmp_path / "new" / "checkpoints").exists()


def test_warnings_at_the_start(text_file, tmp_path):
    """A run that ends inside its warmup says so; under several processes an accumulation count that
    does not divide among them is rounded up, with the figures (checked up to the first error here:
    out_dir is a file, raised after the warnings)."""
    with pytest.warns(UserWarning, match=r"max_iters \(2\) < warmup_iters \(5\).*reaches 0.003"):
        train(config(text_file, tmp_path / "short", "--max_iters=2", "--eval_interval=2", "--warmup_iters=5"))
    a_file = tmp_path / "file"
    a_file.write_text("")
    cfg = config(text_file, a_file, "--max_iters=8", "--gradient_accumulation_steps=3")
    with warnings.catch_warnings(record=True) as caught, pytest.raises(ValueError, match="is a file"):
        warnings.simplefilter("always")
        loop._train(cfg, distributed.Dist(rank=0, world_size=2), torch.device("cpu"))
    assert [str(w.message) for w in caught] == [
        "gradient_accumulation_steps (3) is not a multiple of the 2 processes: each update takes 4 micro-batches, "
        "2 per process"]
    with warnings.catch_warnings(record=True) as caught, pytest.raises(ValueError, match="is a file"):
        warnings.simplefilter("always")
        loop._train(cfg, distributed.Dist(rank=1, world_size=2), torch.device("cpu"))  # only the main process warns
        loop._train(config(text_file, a_file, "--max_iters=8", "--gradient_accumulation_steps=4"),
                    distributed.Dist(rank=0, world_size=2), torch.device("cpu"))
    assert caught == []


def test_gradient_checkpointing_is_switched_on(text_file, tmp_path, monkeypatch):
    calls = []
    real = GPT2LMHeadModel.gradient_checkpointing_enable
    monkeypatch.setattr(GPT2LMHeadModel, "gradient_checkpointing_enable",
                        lambda self, *a, **k: calls.append(self) or real(self, *a, **k))
    train(config(text_file, tmp_path / "off", "--max_iters=1", "--eval_interval=1"))
    assert calls == []
    train(config(text_file, tmp_path / "on", "--max_iters=1", "--eval_interval=1", "--gradient_checkpointing"))
    assert len(calls) == 1


def test_progress_bar_only_when_asked(text_file, tmp_path, capsys):
    train(config(text_file, tmp_path / "quiet", "--max_iters=3", "--eval_interval=3"))
    assert capsys.readouterr().err == ""
    train(config(text_file, tmp_path / "bar", "--max_iters=3", "--eval_interval=3", "--progress=true"))
    err = capsys.readouterr().err
    assert "3/3" in err and "step" in err and "loss=" in err


def test_no_matplotlib_warns_once_and_skips_the_plot(text_file, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    with pytest.warns(UserWarning, match=r"matplotlib is not installed.*--plot=false") as caught:
        train(config(text_file, tmp_path / "plot", "--max_iters=2", "--eval_interval=2", "--plot=true"))
    assert len(caught) == 1 and not (tmp_path / "plot" / "loss.png").exists()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(config(text_file, tmp_path / "noplot", "--max_iters=2", "--eval_interval=2", "--plot=false"))


def test_build_model_from_scratch_and_from_a_pretrained_folder(text_file, tmp_path):
    cfg = config(text_file, tmp_path, "--max_iters=1", "--dropout=0.25")
    model = loop.build_model(cfg, 40, None)
    c = model.config
    assert (c.vocab_size, c.n_positions, c.n_embd, c.n_layer, c.n_head) == (40, 8, 16, 1, 2)
    assert c.resid_pdrop == c.embd_pdrop == c.attn_pdrop == 0.25
    assert c.bos_token_id is None and c.eos_token_id is None
    model.save_pretrained(tmp_path / "base")

    tuned = config(text_file, tmp_path, "--max_iters=1", "--dropout=0.1", f"--init_from={tmp_path / 'base'}")
    loaded = loop.build_model(tuned, 40, None)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    dropouts = [m.p for m in loaded.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts and set(dropouts) == {0.1}
    c = loaded.config
    assert c.resid_pdrop == c.embd_pdrop == c.attn_pdrop == 0.1
    assert loop.build_model(tuned, 39, None).config.vocab_size == 40  # a smaller vocabulary fits
    with pytest.raises(ValueError, match="the data's tokenizer has 41 tokens, the model only 40"):
        loop.build_model(tuned, 41, None)
    long = config(text_file, tmp_path, "--max_iters=1", "--block_size=9", f"--init_from={tmp_path / 'base'}")
    with pytest.raises(ValueError, match="block_size 9 exceeds the model's n_positions 8"):
        loop.build_model(long, 40, None)
    assert loop.build_model(config(text_file, tmp_path, "--block_size=8", f"--init_from={tmp_path / 'base'}"),
                            40, None).config.n_positions == 8


def test_loss_png_plots_the_logged_losses(text_file, tmp_path, monkeypatch):
    """loss.png (700 x 400 px): train_loss at every logged step, val_loss at every evaluation, axes
    and legend labelled. The figure is caught as it is closed, to read back what was drawn."""
    import matplotlib.pyplot as plt
    from PIL import Image

    figures = []
    real_close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig) or real_close(fig))
    train(config(text_file, tmp_path, "--max_iters=6", "--eval_interval=3", "--log_interval=2", "--plot=true"))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [2, 3, 4, 6]
    with Image.open(tmp_path / "loss.png") as image:
        assert image.format == "PNG" and image.size == (700, 400)
    (ax,) = figures[-1].axes
    train_line, val_line = ax.lines
    assert list(train_line.get_xdata()) == [2, 3, 4, 6]
    assert list(train_line.get_ydata()) == [r["train_loss"] for r in rows]
    assert list(val_line.get_xdata()) == [3, 6] and val_line.get_marker() == "o"
    assert list(val_line.get_ydata()) == [rows[1]["val_loss"], rows[3]["val_loss"]]
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("step", "cross-entropy loss")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["train (batch)", "val"]
    # the figure is closed even when saving fails
    figures.clear()
    with pytest.raises(OSError):
        loop.plot_losses(tmp_path / "metrics.jsonl", tmp_path / "metrics.jsonl" / "loss.png")  # under a file
    assert len(figures) == 1


# --- what the mutation tool found untested (issue 31) ----------------------------------------------


def test_resume_refuses_text_with_another_vocabulary(text_file, tmp_path):
    """A resumed run checks the text against its checkpoint's tokenizer.json: a text with a character
    the checkpoint never saw is refused before anything is written, naming that tokenizer.json."""
    train(config(text_file, tmp_path, "--max_iters=1", "--eval_interval=1"))
    checkpoint = latest_checkpoint(tmp_path)
    other = tmp_path / "other.txt"
    other.write_text(text_file.read_text() + "QZ!\n")
    meta = (tmp_path / "data" / "meta.json").read_bytes()
    with pytest.raises(ValueError, match="tokenizes to another vocabulary") as caught:
        train(config(other, tmp_path, "--max_iters=2", "--eval_interval=1", "--resume"))
    assert str(checkpoint / "tokenizer.json") in str(caught.value)
    assert (tmp_path / "data" / "meta.json").read_bytes() == meta
    assert latest_checkpoint(tmp_path) == checkpoint


def test_batches_come_from_the_runs_own_generator_and_gradients_are_freed(text_file, tmp_path):
    """With dropout drawing from torch's global RNG, every micro-batch is still the next one drawn from
    a generator seeded with cfg.seed (accum x batch_size blocks per update, in order); and each update
    starts with no gradient held (freed, not zeroed)."""
    inputs, fresh = [], []

    def note(module, args, kwargs):
        if isinstance(module, GPT2LMHeadModel) and module.training:
            inputs.append(args[0].clone())
            fresh.append(all(p.grad is None for p in module.parameters()))

    hooks = []
    real_build = loop.build_model

    def build(*a, **k):
        model = real_build(*a, **k)
        hooks.append(model.register_forward_pre_hook(note, with_kwargs=True))
        return model

    cfg = config(text_file, tmp_path, "--max_iters=3", "--eval_interval=3", "--dropout=0.2",
                 "--gradient_accumulation_steps=2")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loop, "build_model", build)
        train(cfg)
    data = TokenData(tmp_path / "data", cfg.block_size)
    rng = torch.Generator().manual_seed(cfg.seed)
    expected = [data.batch("train", chunk)[0] for _ in range(3)
                for chunk in data.offsets("train", 2 * cfg.batch_size, rng).split(cfg.batch_size)]
    assert len(inputs) == len(expected) == 6
    assert all(torch.equal(a, b) for a, b in zip(inputs, expected))
    assert fresh == [True, False] * 3


def test_wrap_compile_and_no_gradient_sync_on_one_process(text_file, tmp_path, monkeypatch):
    """torch.compile (recorded by a stand-in that counts the forward passes) gets the model that
    distributed.wrap returned, and every forward pass goes through what it returns; wrap gets the
    run's fsdp flag; the micro-batches before the last of each update run under no_gradient_sync."""
    calls = {"wrap": [], "compile": [], "forward": 0, "sync": []}
    real_wrap = distributed.wrap

    def wrap(model, info, device, fsdp):
        calls["wrap"].append((model, info, device, fsdp))
        return real_wrap(model, info, device, fsdp)

    class Compiled(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.inner = model

        def forward(self, *args, **kwargs):
            calls["forward"] += 1
            return self.inner(*args, **kwargs)

    def compile_(model):
        calls["compile"].append(model)
        return Compiled(model)

    import contextlib

    @contextlib.contextmanager
    def no_sync(wrapped, info, fsdp):
        calls["sync"].append((wrapped, fsdp))
        yield

    monkeypatch.setattr(distributed, "wrap", wrap)
    monkeypatch.setattr(distributed, "no_gradient_sync", no_sync)
    monkeypatch.setattr(torch, "compile", compile_)
    train(config(text_file, tmp_path / "plain", "--max_iters=1", "--eval_interval=1"))
    assert calls["compile"] == [] and calls["forward"] == 0
    assert [c[3] for c in calls["wrap"]] == [False]
    calls["wrap"].clear()
    calls["sync"].clear()
    cfg = config(text_file, tmp_path / "compiled", "--max_iters=2", "--eval_interval=2", "--compile",
                 "--fsdp", "--gradient_accumulation_steps=3")
    train(cfg)
    ((model, info, device, fsdp),) = calls["wrap"]
    assert isinstance(model, GPT2LMHeadModel) and fsdp is True and device == torch.device("cpu")
    assert info.world_size == 1 and info.rank == 0
    assert calls["compile"] == [model]  # one process: wrap returns the model itself
    assert calls["forward"] == 2 * 3 + 2 * cfg.eval_iters  # updates' micro-batches + one evaluation
    assert calls["sync"] == [(model, True)] * (2 * 2)  # 2 of each update's 3 micro-batches


def test_gradient_checkpointing_runs_without_the_cache_warning(text_file, tmp_path):
    """The training forward asks for no cache, so a checkpointed model does not warn at every pass."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(config(text_file, tmp_path, "--max_iters=2", "--eval_interval=2", "--gradient_checkpointing"))
    assert [str(w.message) for w in caught if "cache" in str(w.message)] == []


def test_grad_scaler_unscales_before_clipping(text_file, tmp_path, monkeypatch):
    """The scaler (off on a CPU, for every dtype) unscales the optimizer's gradients before each
    clip, and only when clipping; it steps and updates once per update."""
    made, unscaled, stepped = [], [], []

    class Scaler(torch.amp.GradScaler):
        def __init__(self, device, enabled):
            made.append((device, enabled))
            super().__init__(device, enabled=enabled)

        def unscale_(self, optimizer):
            unscaled.append(optimizer)
            return super().unscale_(optimizer)

        def step(self, optimizer, *args, **kwargs):
            stepped.append(optimizer)
            return super().step(optimizer, *args, **kwargs)

    monkeypatch.setattr(torch.amp, "GradScaler", Scaler)
    train(config(text_file, tmp_path / "clip", "--max_iters=2", "--eval_interval=2", "--grad_clip=0.5"))
    assert made == [("cpu", False)]
    assert len(stepped) == 2 and unscaled == stepped
    made.clear(), unscaled.clear(), stepped.clear()
    train(config(text_file, tmp_path / "noclip", "--max_iters=2", "--eval_interval=2", "--grad_clip=0",
                 "--dtype=float16"))
    assert made == [("cpu", False)] and unscaled == [] and len(stepped) == 2


def test_progress_bar_shows_the_rows_lr_and_tokens_per_s(text_file, tmp_path, capsys, monkeypatch):
    """The bar's postfix: the row's loss, its learning rate (lr_at of the update just taken) and its
    tokens per second (a fake clock that advances 1 s per reading: 3 updates of 2 x 8 tokens in 1 s)."""
    readings = []
    monkeypatch.setattr(loop, "time", SimpleNamespace(perf_counter=lambda: readings.append(0) or float(len(readings))))
    cfg = config(text_file, tmp_path, "--max_iters=3", "--eval_interval=3", "--log_interval=3", "--progress=true")
    train(cfg)
    err = capsys.readouterr().err
    (row,) = read_metrics(tmp_path / "metrics.jsonl")
    assert f"loss={row['train_loss']:.4f}" in err
    assert f"lr={loop.lr_at(2, cfg):.2e}" in err
    assert f"tok_s={3 * cfg.batch_size * cfg.block_size}" in err


def test_no_matplotlib_warning_says_how_to_fix_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert loop._can_plot() is False
    assert [str(w.message) for w in caught] == [
        "matplotlib is not installed, so loss.png will not be drawn (pip install 'gpt2attn[plot]', or "
        "--plot=false to silence this)"]


def test_bfloat16_warning_points_at_the_caller(monkeypatch):
    """The emulated-bf16 warning is attributed to the line that asked for the dtype: stacklevel 2,
    the caller of autocast_dtype. Read from a stand-in for warnings.warn rather than from the
    warning's file, since a wrapper around autocast_dtype (the mutation tool's trampoline) adds a
    frame between the caller and the function."""
    import inspect

    monkeypatch.setattr("gpt2attn.cpu.bf16_report", lambda: (False, "no bf16 here (patched)"))
    seen = []

    def warn(message, category=UserWarning, stacklevel=1):
        caller = inspect.currentframe().f_back  # autocast_dtype itself: stacklevel 1
        seen.append((message, stacklevel, caller.f_code.co_name))

    monkeypatch.setattr(loop, "warnings", SimpleNamespace(warn=warn))
    assert loop.autocast_dtype("bfloat16", torch.device("cpu"), say=False) == "bfloat16"
    ((message, stacklevel, name),) = seen
    assert "no bf16 here (patched)" in message and stacklevel == 2
    assert "autocast_dtype" in name  # warned from autocast_dtype's own frame, so level 2 is its caller


def test_auto_dtype_on_a_device_that_is_neither_cpu_nor_cuda(monkeypatch, capsys):
    """Another device (here "meta") gets float32 under "auto", even where a CUDA GPU supports bf16."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert loop.autocast_dtype("auto", torch.device("meta"), say=True) == "float32"
    assert capsys.readouterr().out == "dtype auto: float32 (meta device)\n"


class TwoProcesses:
    """Stand-ins for the collective calls, so that one process can play one rank of a 2-process run
    (what torchrun would start): each collective behaves as if the other rank had sent the same
    values, and every call is recorded."""

    def __init__(self, monkeypatch):
        import contextlib

        self.calls: list[tuple] = []
        calls = self.calls

        def wrap(model, info, device, fsdp):
            calls.append(("wrap", model, info.world_size, device, fsdp))
            return model

        @contextlib.contextmanager
        def no_sync(wrapped, info, fsdp):
            calls.append(("no_sync", wrapped, fsdp))
            yield

        def gather_full_state(wrapped, optimizer, like):
            calls.append(("gather", wrapped, optimizer, like))
            full = type(like)(like.config)
            full.load_state_dict(like.state_dict())
            return full, optimizer.state_dict()

        def load_sharded_optimizer(wrapped, optimizer, state):
            calls.append(("load_sharded", wrapped, optimizer))
            optimizer.load_state_dict(state)

        def all_gather_object(out, obj):
            calls.append(("all_gather_object", len(out)))
            out[:] = [obj.clone() for _ in out]

        def raise_together(error, info):
            if error is not None:
                raise error

        monkeypatch.setattr(distributed, "wrap", wrap)
        monkeypatch.setattr(distributed, "no_gradient_sync", no_sync)
        monkeypatch.setattr(distributed, "gather_full_state", gather_full_state)
        monkeypatch.setattr(distributed, "load_sharded_optimizer", load_sharded_optimizer)
        monkeypatch.setattr(distributed, "raise_together", raise_together)
        monkeypatch.setattr(distributed, "mean_over_processes", lambda value, info: value)
        monkeypatch.setattr(distributed, "barrier", lambda info: calls.append(("barrier",)))
        monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)

    def named(self, name):
        return [c for c in self.calls if c[0] == name]


@pytest.mark.parametrize("rank", [0, 1])
def test_one_rank_of_two_takes_its_half_of_each_batch_and_saves_full_state(text_file, tmp_path, monkeypatch, rank):
    """Rank r of 2 under FSDP, gradient_accumulation_steps 4: each update draws 4 x batch_size blocks
    from the seed's generator and rank r takes micro-batches 2r and 2r + 1, the first without gradient
    sync; at the checkpoint every rank gathers the full state (the model itself as the pattern) and
    the dropout RNG states of both ranks (each seeded with cfg.seed + rank); only rank 0 writes the
    data, metrics, checkpoint and model."""
    if rank == 1:  # the data rank 0 prepares
        train(config(text_file, tmp_path, "--max_iters=1", "--eval_interval=1"))
        before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    fake = TwoProcesses(monkeypatch)
    inputs, models, rng_states = [], [], []

    def note(module, args):
        if isinstance(module, GPT2LMHeadModel) and module.training:
            if not inputs:  # nothing draws from the global RNG between its seeding and the first pass
                rng_states.append(torch.get_rng_state())
            inputs.append(args[0].clone())
            models[:] = [module]

    cfg = config(text_file, tmp_path, "--max_iters=2", "--eval_interval=2", "--log_interval=1",
                 "--gradient_accumulation_steps=4", "--fsdp", "--dropout=0.1")
    handle = register_module_forward_pre_hook(note)
    try:
        result = loop._train(cfg, distributed.Dist(rank=rank, world_size=2), torch.device("cpu"))
    finally:
        handle.remove()
    data = TokenData(tmp_path / "data", cfg.block_size)
    rng = torch.Generator().manual_seed(cfg.seed)
    expected = []
    for _ in range(2):
        chunks = data.offsets("train", 4 * cfg.batch_size, rng).split(cfg.batch_size)
        expected += [data.batch("train", chunks[2 * rank + i])[0] for i in range(2)]
    assert len(inputs) == 4 and all(torch.equal(a, b) for a, b in zip(inputs, expected))
    # each rank its own dropout masks: its global RNG seeded with cfg.seed + rank
    assert torch.equal(rng_states[0], torch.Generator().manual_seed(cfg.seed + rank).get_state())
    (model,) = models
    assert [c[1:] for c in fake.named("wrap")] == [(model, 2, torch.device("cpu"), True)]
    assert [c[1:] for c in fake.named("no_sync")] == [(model, True)] * 2
    ((_, wrapped, optimizer, like),) = fake.named("gather")
    assert wrapped is model and like is model and isinstance(optimizer, torch.optim.Optimizer)
    assert fake.named("all_gather_object") == [("all_gather_object", 2)]
    assert result["step"] == 2
    if rank == 1:
        assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
        return
    state = loop.read_training_state(latest_checkpoint(tmp_path))
    assert len(state["torch_rng"]) == 2 and torch.equal(state["torch_rng"][0], state["torch_rng"][1])
    assert state["optimizer"]["param_groups"][0]["lr"] == pytest.approx(loop.lr_at(2, cfg), rel=1e-12)
    saved = load_file(tmp_path / "model" / "model.safetensors")
    assert torch.equal(saved["transformer.wte.weight"], model.transformer.wte.weight.detach())
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    # resumed under FSDP, each rank loads its shard of the saved optimizer state
    fake.calls.clear()
    cfg = config(text_file, tmp_path, "--max_iters=3", "--eval_interval=3", "--log_interval=1",
                 "--gradient_accumulation_steps=4", "--fsdp", "--dropout=0.1", "--resume")
    assert loop._train(cfg, distributed.Dist(rank=0, world_size=2), torch.device("cpu"))["step"] == 3
    ((_, wrapped, optimizer),) = fake.named("load_sharded")
    assert isinstance(wrapped, GPT2LMHeadModel) and optimizer is fake.named("gather")[0][2]
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_progress_bar_counts_steps_from_the_resumed_one_and_follows_the_terminal_width(text_file, tmp_path,
                                                                                      monkeypatch):
    """The bar (a tqdm, recorded here) runs from the starting step to max_iters in steps, is drawn only
    by the main process of a run that asks for it, and resizes with the terminal."""
    import tqdm

    made = []
    monkeypatch.setattr(tqdm, "tqdm", lambda **kwargs: made.append(kwargs))
    shown = config(text_file, tmp_path, "--max_iters=7", "--progress=true")
    loop._progress_bar(shown, 3, True)
    loop._progress_bar(shown, 3, False)
    loop._progress_bar(config(text_file, tmp_path, "--max_iters=7", "--progress=false"), 0, True)
    common = {"total": 7, "unit": "step", "dynamic_ncols": True}
    assert made == [{**common, "initial": 3, "disable": False}, {**common, "initial": 3, "disable": True},
                    {**common, "initial": 0, "disable": True}]


def test_read_metrics_reads_utf8_whatever_the_locale(tmp_path, monkeypatch):
    """metrics.jsonl is UTF-8: a row with a non-ASCII note (as a user might add) reads back the same
    where the locale's encoding is Latin-1 (simulated: io.text_encoding answers latin-1 for "no
    encoding given", as it answers the locale's encoding there)."""
    import io

    path = tmp_path / "metrics.jsonl"
    path.write_bytes('{"step": 1, "note": "r\u00e9sum\u00e9 \u2192 ok"}\n\n'.encode("utf-8"))
    real = io.text_encoding
    monkeypatch.setattr(io, "text_encoding", lambda encoding, *a: "latin-1" if encoding is None else real(encoding, *a))
    assert path.read_text() != path.read_bytes().decode("utf-8")  # the stand-in locale is in effect
    assert read_metrics(path) == [{"step": 1, "note": "r\u00e9sum\u00e9 \u2192 ok"}]
    assert read_metrics(tmp_path / "absent.jsonl") == []


def test_loss_png_size_does_not_follow_the_users_dpi_setting(text_file, tmp_path):
    """loss.png is 700 x 400 px even under a matplotlibrc with another figure and savefig dpi."""
    import matplotlib
    from PIL import Image

    train(config(text_file, tmp_path, "--max_iters=2", "--eval_interval=2", "--log_interval=1"))
    with matplotlib.rc_context({"figure.dpi": 50, "savefig.dpi": 50}):
        loop.plot_losses(tmp_path / "metrics.jsonl", tmp_path / "loss.png")
    with Image.open(tmp_path / "loss.png") as image:
        assert image.format == "PNG" and image.size == (700, 400)


def test_no_training_text_says_how_to_give_it(tmp_path):
    with pytest.raises(ValueError) as caught:
        train(load_config(None, [f"--out_dir={tmp_path}", *TINY, "--max_iters=1"]))
    assert str(caught.value) == "no training text: set data = PATH in the config or pass --data=PATH"


def test_a_new_run_starts_a_new_metrics_file_whatever_the_old_one_holds(text_file, tmp_path):
    """Without --resume the old metrics.jsonl is replaced unread, even one that is not JSON lines."""
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "metrics.jsonl").write_text("not json\n{\"step\": 0, \"train_loss\": 1.0}\n")
    train(config(text_file, tmp_path, "--max_iters=2", "--eval_interval=2", "--log_interval=1"))
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


def test_loss_png_draws_a_thin_train_line_over_a_faint_grid(tmp_path, monkeypatch):
    """The per-step train curve is drawn 1 pt wide (it is noisy; the val points stand out over it)
    and the grid at alpha 0.3, on both axes (read back from the figure, caught as it is closed)."""
    import matplotlib.pyplot as plt

    figures = []
    real_close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig) or real_close(fig))
    rows = [{"step": 1, "train_loss": 3.0}, {"step": 2, "train_loss": 2.5, "val_loss": 2.75}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    loop.plot_losses(tmp_path / "metrics.jsonl", tmp_path / "loss.png")
    (ax,) = figures[0].axes
    train_line, val_line = ax.lines
    assert train_line.get_linewidth() == 1.0
    assert list(val_line.get_ydata()) == [2.75]
    grid = ax.xaxis.get_gridlines() + ax.yaxis.get_gridlines()
    assert grid and all(line.get_visible() and line.get_alpha() == 0.3 for line in grid)


# ==================================================================================================
# End to end on a two-layer model
#
# `gpt2attn train` end to end on a tiny model: outputs, resume after a kill, DDP, the default model.
# ==================================================================================================


DEFAULT_MODEL = REPO / "gpt2attn" / "default_model"
TINY_END_TO_END = ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=16", "--batch_size=4", "--eval_iters=2",
                   "--log_interval=5", "--warmup_iters=5", "--learning_rate=3e-3", "--min_lr=3e-4", "--progress=false"]


@pytest.fixture(scope="module")
def lines_file(tmp_path_factory):
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


def end_to_end_config(lines_file, out_dir, *extra):
    return load_config(None, [f"--data={lines_file}", f"--out_dir={out_dir}", *TINY_END_TO_END, *extra])


@pytest.mark.slow
def test_train_writes_metrics_checkpoints_model_and_plot(lines_file, tmp_path):
    import transformers

    result = train(end_to_end_config(lines_file, tmp_path, "--max_iters=40", "--eval_interval=20"))
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


def test_grad_accumulation_equals_bigger_batch(lines_file, tmp_path, optimizer_steps):
    """Two micro-batches of 4 accumulated give the gradients and the update of one batch of 8
    (same blocks); gradient checkpointing in the second run changes nothing either. Clipping is
    off: it would rescale both to the same norm, as AdamW's update is blind to the gradients' scale."""
    common = ["--max_iters=3", "--eval_interval=3", "--plot=false", "--grad_clip=0", "--warmup_iters=0"]
    train(end_to_end_config(lines_file, tmp_path / "a", *common, "--batch_size=4", "--gradient_accumulation_steps=2"))
    accumulated = optimizer_steps[:]
    optimizer_steps.clear()
    train(end_to_end_config(lines_file, tmp_path / "b", *common, "--batch_size=8", "--gradient_accumulation_steps=1",
                            "--eval_iters=1", "--gradient_checkpointing"))
    assert len(accumulated) == len(optimizer_steps) == 3
    for mine, big in zip(accumulated[0], optimizer_steps[0]):  # same weights at the first step
        assert max_diff(mine, big) < 1e-6
    a = load_file(tmp_path / "a" / "model" / "model.safetensors")
    b = load_file(tmp_path / "b" / "model" / "model.safetensors")
    for name in a:
        assert max_diff(a[name], b[name]) < 1e-5, name


def test_gradient_clipping_bounds_what_the_optimizer_gets(lines_file, tmp_path, optimizer_steps):
    train(end_to_end_config(lines_file, tmp_path / "free", "--max_iters=3", "--eval_interval=3",
                            "--plot=false", "--grad_clip=0", "--warmup_iters=0"))
    free = [grad_norm(g) for g in optimizer_steps]
    optimizer_steps.clear()
    train(end_to_end_config(lines_file, tmp_path / "clip", "--max_iters=3", "--eval_interval=3",
                            "--plot=false", "--grad_clip=0.05", "--warmup_iters=0"))
    clipped = [grad_norm(g) for g in optimizer_steps]
    assert free[0] > 0.5  # so the clipping below has work to do
    assert clipped == pytest.approx([0.05] * 3, rel=1e-4)


def test_val_loss_is_the_validation_splits(lines_file, tmp_path):
    """A validation split of exactly block_size + 2 tokens has one block, so val_loss can be
    recomputed by hand from val.bin and the final model; the first training block (which a bug
    evaluating the wrong split would use) gives another loss on this non-periodic text."""
    n = len(lines_file.read_text())
    cfg = end_to_end_config(lines_file, tmp_path, "--max_iters=10", "--eval_interval=10", "--plot=false",
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


@pytest.mark.slow
def test_bf16_autocast_run_learns(lines_file, tmp_path):
    result = train(end_to_end_config(lines_file, tmp_path, "--max_iters=30", "--eval_interval=30",
                                     "--dtype=bfloat16", "--plot=false"))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    vocab = GPT2LMHeadModel.from_pretrained(tmp_path / "model").config.vocab_size
    assert rows[-1]["train_loss"] < rows[0]["train_loss"] and result["val_loss"] < 0.8 * math.log(vocab)
    assert GPT2LMHeadModel.from_pretrained(tmp_path / "model").dtype == torch.float32  # fp32 master weights


@pytest.mark.slow
def test_init_from_pretrained_fine_tunes(lines_file, tmp_path):
    train(end_to_end_config(lines_file, tmp_path / "base", "--max_iters=10", "--eval_interval=10", "--plot=false"))
    before = load_file(tmp_path / "base" / "model" / "model.safetensors")
    cfg = end_to_end_config(lines_file, tmp_path / "tuned", "--max_iters=5", "--eval_interval=5", "--plot=false",
                            f"--init_from={tmp_path / 'base' / 'model'}", "--tokenizer=", "--learning_rate=1e-4",
                            "--warmup_iters=0", "--min_lr=1e-5")
    result = train(cfg)
    after = load_file(tmp_path / "tuned" / "model" / "model.safetensors")
    first = read_metrics(tmp_path / "tuned" / "metrics.jsonl")[0]
    assert first["train_loss"] < 3.0  # starts from the trained weights, not ln(vocab)
    assert result["step"] == 5
    assert 0 < max_diff(after["transformer.wte.weight"], before["transformer.wte.weight"]) < 0.01


def test_cli_train_and_its_errors(lines_file, tmp_path, capsys):
    recipe = REPO / "configs" / "train" / "shakespeare_char_cpu.toml"
    args = ["train", "--config", str(recipe), f"--data={lines_file}", f"--out_dir={tmp_path}", *TINY_END_TO_END,
            "--max_iters=10", "--eval_interval=10", "--plot=false"]
    assert cli_main(args) == 0
    assert "val loss" in capsys.readouterr().out
    assert cli_main(["train", "--config", str(recipe), "--max_iter=3"]) == 2
    assert "unknown setting --max_iter" in capsys.readouterr().err
    assert cli_main(["train", "--config", str(recipe), f"--data={tmp_path / 'absent.txt'}",
                     f"--out_dir={tmp_path}"]) == 2
    assert "no data file" in capsys.readouterr().err
    assert cli_main(["train", "--config", str(recipe), f"--data={lines_file}",
                     f"--out_dir={tmp_path / 'new'}", "--resume"]) == 2
    assert "no checkpoint" in capsys.readouterr().err


@pytest.mark.slow
def test_resume_after_kill_gives_the_uninterrupted_curve(lines_file, tmp_path):
    """SIGKILL a run right after its first checkpoint, resume it, compare with one that ran through."""
    args = [f"--data={lines_file}", *TINY_END_TO_END, "--max_iters=150", "--eval_interval=25",
            "--dropout=0.1", "--plot=false"]
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
def test_two_gloo_processes_equal_one_process(lines_file, tmp_path, sharding):
    """torchrun with 2 CPU processes (DDP or FSDP, gloo) and the recipe's gradient_accumulation_steps
    = 1, rounded up to 1 micro-batch per process (with one warning), against 1 process
    accumulating the same 2 micro-batches: the weights agree after a few steps."""
    args = [f"--data={lines_file}", *TINY_END_TO_END, "--max_iters=6", "--eval_interval=6", "--plot=false",
            "--device=cpu", sharding]
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
    done = torchrun("train", f"--data={bad}", f"--out_dir={tmp_path / 'out'}", *TINY_END_TO_END, "--device=cpu")
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


# ==================================================================================================
# Bookkeeping checked against what the run did
#
# The training loop's bookkeeping, each rule checked against what the run actually did: the
# learning rate in metrics.jsonl is the one the optimizer used for that update; the last step is
# evaluated, checkpointed and published whatever eval_interval is; under torchrun the gradients of
# the micro-batches are all-reduced once per update, and two processes give one process's weights;
# dtype = "bfloat16" warns only where the CPU lacks native bf16.
# ==================================================================================================


TINY_TWO_LAYER = ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=16", "--batch_size=4", "--eval_iters=2",
                  "--warmup_iters=3", "--learning_rate=3e-3", "--min_lr=3e-4", "--lr_decay_iters=8", "--progress=false",
                  "--plot=false", "--device=cpu"]


@pytest.fixture(scope="module")
def words_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "text.txt"
    words = ("moon", "night", "rose", "red", "pale", "dark", "ROMEO", "JULIET")
    path.write_text("".join(f"{words[i % 8]} {words[(i * 5) % 8]} {words[(i * 3 + 1) % 8]}.\n" for i in range(400)))
    return path


def two_layer_config(words_file, out_dir, *extra):
    return load_config(None, [f"--data={words_file}", f"--out_dir={out_dir}", *TINY_TWO_LAYER, *extra])


def test_metrics_lr_is_the_lr_the_optimizer_used_for_that_update(words_file, tmp_path):
    used = []  # the learning rate of each optimizer step, as the optimizer saw it

    def record(optimizer, args, kwargs):
        used.append(optimizer.param_groups[0]["lr"])

    handle = register_optimizer_step_pre_hook(record)
    try:
        cfg = two_layer_config(words_file, tmp_path, "--max_iters=10", "--eval_interval=10", "--log_interval=1")
        train(cfg)
    finally:
        handle.remove()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 11)) and len(used) == 10
    assert len(set(used)) > 5  # warmup and decay: a row one update off would differ
    for r in rows:
        assert r["lr"] == pytest.approx(used[r["step"] - 1], rel=1e-12), r["step"]
        assert r["lr"] == pytest.approx(loop.lr_at(r["step"] - 1, cfg), rel=1e-12), r["step"]


def test_last_step_is_evaluated_checkpointed_and_published(words_file, tmp_path):
    """max_iters = 7 with eval_interval = 5: evaluated at 5 and 7, the checkpoint left is step 7,
    and model/ holds step 7's weights (equal to the weights the run ended with)."""
    final = {}

    def keep(optimizer, args, kwargs):  # the weights just before each update; the last is kept below
        final["params"] = [p for group in optimizer.param_groups for p in group["params"]]

    handle = register_optimizer_step_pre_hook(keep)
    try:
        result = train(two_layer_config(words_file, tmp_path, "--max_iters=7", "--eval_interval=5", "--log_interval=5"))
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
    monkeypatch.setattr("gpt2attn.cpu.bf16_report", lambda: (native, "this CPU (patched)"))
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
    monkeypatch.setattr("gpt2attn.cpu.bf16_report", lambda: (True, "has it (patched)"))
    assert loop.autocast_dtype("auto", torch.device("cpu"), say=False) == "bfloat16"
    assert capsys.readouterr().out == ""
    monkeypatch.setattr("gpt2attn.cpu.bf16_report", lambda: (False, "lacks it (patched)"))
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
def test_torchrun_syncs_once_per_update_and_equals_one_process(words_file, tmp_path):
    """2 gloo processes x 3 micro-batches: the all-reduce runs only in the backward of each update's
    last micro-batch (no_sync on the others), and the weights equal one process accumulating the
    same 6 micro-batches, to float32 rounding."""
    args = [f"--data={words_file}", *TINY_TWO_LAYER, "--max_iters=3", "--eval_interval=3", "--log_interval=3",
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
