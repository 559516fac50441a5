"""The CPU recipe end to end: `gpt2attn train` on configs/train/shakespeare_char_cpu.toml against
nanoGPT's own train.py with its documented shakespeare_char CPU settings, wall time and final
validation loss, runs alternating (nanoGPT, ours, nanoGPT, ours, ...) so that both meet the same
machine.

    python scripts/bench.py recipe --nanogpt PATH/TO/nanoGPT [--runs 3] [--data input.txt]
        [--ours=--max_iters=2000 ...] [--theirs=--learning_rate=3e-3 ...]

nanoGPT (github.com/karpathy/nanoGPT) is copied to a temporary folder and its
data/shakespeare_char/prepare.py run there once on --data (not timed: it is nanoGPT's separate
step, while our wall time includes tokenizing). Each run is a fresh process with a fresh out_dir;
wall time is from process start to exit, both sides.

Validation loss is shown twice: as each trainer logs it at its last step (eval_iters random
batches, each its own sample), and for both final models by one scorer, scripts/eval_char_model.py:
the last 10% of the text, every character scored once. --ours / --theirs pass extra settings to
one side (repeat them), e.g. --ours=--max_iters=2000 --ours=--learning_rate=1e-3 for nanoGPT's
schedule on our loop.
"""

from __future__ import annotations

import argparse
import json
import pickle
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_common import SHAKESPEARE
from eval_char_model import last_part, validation_loss

from gpt2attn import GPT2LMHeadModel
from gpt2attn.tokenizer import encode, load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
NANOGPT_CPU_ARGS = [  # nanoGPT's README, "I only have a macbook" / CPU
    "config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20", "--log_interval=1",
    "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128", "--max_iters=2000",
    "--lr_decay_iters=2000", "--dropout=0.0",
]


def timed(cmd: list[str], cwd: Path) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return seconds, done.stdout


def run_nanogpt(folder: Path, out_dir: Path, text: str, extra: list[str]) -> tuple[float, float, float]:
    """Wall seconds, the last logged val loss, and the scorer's loss of the checkpoint it kept."""
    seconds, out = timed([sys.executable, "train.py", *NANOGPT_CPU_ARGS, *extra, f"--out_dir={out_dir}"], folder)
    last_step, logged = re.findall(r"step (\d+): train loss [\d.]+, val loss ([\d.]+)", out)[-1]
    last_step, logged = int(last_step), float(logged)
    meta = pickle.loads((folder / "data/shakespeare_char/meta.pkl").read_bytes())
    checkpoint = torch.load(out_dir / "ckpt.pt", map_location="cpu", weights_only=False)
    if checkpoint["iter_num"] != last_step:  # nanoGPT keeps a checkpoint only when its val loss improved
        print(f"  (nanoGPT kept step {checkpoint['iter_num']}'s checkpoint, not step {last_step}'s)")
    model = GPT2LMHeadModel.from_pretrained(checkpoint).eval()
    return seconds, logged, validation_loss(model, last_part(torch.tensor([meta["stoi"][c] for c in text])))


def run_ours(config: Path, data: Path, out_dir: Path, text: str, extra: list[str]) -> tuple[float, float, float]:
    """Wall seconds, the last logged val loss, and the scorer's loss of the final model."""
    seconds, _ = timed([sys.executable, "-m", "gpt2attn", "train", "--config", str(config), f"--data={data}",
                        *extra, f"--out_dir={out_dir}", "--progress=false"], ROOT)
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "val_loss" in r][-1]["val_loss"]
    model = GPT2LMHeadModel.from_pretrained(out_dir / "model").eval()
    return seconds, logged, validation_loss(model, last_part(torch.tensor(encode(load_tokenizer(out_dir / "model"), text))))


def main(argv: list[str]) -> list[dict]:
    parser = argparse.ArgumentParser(prog="bench.py recipe", description=__doc__.splitlines()[0])
    parser.add_argument("--nanogpt", required=True, help="a checkout of karpathy/nanoGPT")
    parser.add_argument("--data", default=str(SHAKESPEARE))
    parser.add_argument("--config", default=str(ROOT / "configs/train/shakespeare_char_cpu.toml"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--ours", action="append", default=[], metavar="--KEY=VALUE", help="extra gpt2attn train setting")
    parser.add_argument("--theirs", action="append", default=[], metavar="--KEY=VALUE", help="extra nanoGPT setting")
    args = parser.parse_args(argv)
    data = Path(args.data).resolve()
    if not data.is_file():
        parser.error(f"no data at {data}: pass --data=PATH/TO/tinyshakespeare/input.txt")

    text = data.read_text(encoding="utf-8")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        nanogpt = shutil.copytree(args.nanogpt, tmp / "nanoGPT", ignore=shutil.ignore_patterns(".git"))
        prepared = nanogpt / "data/shakespeare_char"
        shutil.copy(data, prepared / "input.txt")
        timed([sys.executable, "prepare.py"], prepared)
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.runs} runs each, alternating")
        print(f"nanoGPT: train.py {' '.join(NANOGPT_CPU_ARGS + args.theirs)}")
        print(f"gpt2attn: train --config {Path(args.config).name} {' '.join(args.ours)}")
        print("val loss: logged = the trainer's own last estimate; scored = scripts/eval_char_model.py on the final model")
        print("| run | nanoGPT wall s | logged | scored | gpt2attn wall s | logged | scored | wall ratio |")
        print("|---|---|---|---|---|---|---|---|")
        theirs, ours, rows = [], [], []
        for run in range(1, args.runs + 1):
            theirs.append(run_nanogpt(nanogpt, tmp / f"nanogpt-{run}", text, args.theirs))
            ours.append(run_ours(Path(args.config), data, tmp / f"gpt2attn-{run}", text, args.ours))
            rows.append(table_row(str(run), theirs[-1], ours[-1]))
        medians = [tuple(statistics.median(r[i] for r in runs) for i in range(3)) for runs in (theirs, ours)]
        rows.append(table_row("median", *medians))
    return rows  # bench.py writes these, with the machine and date, to docs/benchmarks/results/recipe.json


def table_row(run: str, theirs: tuple, ours: tuple) -> dict:
    """One run (or the medians) as a row of the table, printed as it comes."""
    cells = {"run": run}
    for name, (seconds, logged, scored) in (("nanoGPT", theirs), ("gpt2attn", ours)):
        cells |= {f"{name} wall s": f"{seconds:.1f}", f"{name} logged": f"{logged:.4f}", f"{name} scored": f"{scored:.4f}"}
    cells["wall ratio"] = f"{ours[0] / theirs[0]:.2f}x"
    print("| " + " | ".join(cells.values()) + " |", flush=True)
    return cells
