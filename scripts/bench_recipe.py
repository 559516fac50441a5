"""The CPU recipe end to end: `gpt2attn train` on configs/train/shakespeare_char_cpu.toml against
nanoGPT's own train.py with its documented shakespeare_char CPU settings, wall time and final
validation loss, runs alternating (nanoGPT, ours, nanoGPT, ours, ...) so that both meet the same
machine.

    python scripts/bench.py recipe --nanogpt PATH/TO/nanoGPT [--runs 3] [--data input.txt]

nanoGPT (github.com/karpathy/nanoGPT) is copied to a temporary folder and its
data/shakespeare_char/prepare.py run there once on --data (not timed: it is nanoGPT's separate
step, while our wall time includes tokenizing). Each run is a fresh process with a fresh out_dir;
wall time is from process start to exit, both sides.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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


def run_nanogpt(folder: Path, out_dir: Path) -> tuple[float, float]:
    seconds, out = timed([sys.executable, "train.py", *NANOGPT_CPU_ARGS, f"--out_dir={out_dir}"], folder)
    last = re.findall(r"step (\d+): train loss [\d.]+, val loss ([\d.]+)", out)[-1]
    return seconds, float(last[1])


def run_ours(config: Path, data: Path, out_dir: Path) -> tuple[float, float]:
    seconds, _ = timed([sys.executable, "-m", "gpt2attn", "train", "--config", str(config), f"--data={data}",
                        f"--out_dir={out_dir}", "--progress=false"], ROOT)
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return seconds, [r for r in rows if "val_loss" in r][-1]["val_loss"]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench.py recipe", description=__doc__.splitlines()[0])
    parser.add_argument("--nanogpt", required=True, help="a checkout of karpathy/nanoGPT")
    parser.add_argument("--data", default=str(ROOT.parent / "shared/data/tinyshakespeare/input.txt"))
    parser.add_argument("--config", default=str(ROOT / "configs/train/shakespeare_char_cpu.toml"))
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    data = Path(args.data).resolve()
    if not data.is_file():
        parser.error(f"no data at {data}: pass --data=PATH/TO/tinyshakespeare/input.txt")

    import torch

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        nanogpt = shutil.copytree(args.nanogpt, tmp / "nanoGPT", ignore=shutil.ignore_patterns(".git"))
        prepared = nanogpt / "data/shakespeare_char"
        shutil.copy(data, prepared / "input.txt")
        timed([sys.executable, "prepare.py"], prepared)
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.runs} runs each, alternating")
        print("| run | nanoGPT wall | nanoGPT val loss | gpt2attn wall | gpt2attn val loss | wall ratio |")
        print("|---|---|---|---|---|---|")
        theirs, ours = [], []
        for run in range(1, args.runs + 1):
            theirs.append(run_nanogpt(nanogpt, tmp / f"nanogpt-{run}"))
            ours.append(run_ours(Path(args.config), data, tmp / f"gpt2attn-{run}"))
            (t_s, t_loss), (o_s, o_loss) = theirs[-1], ours[-1]
            print(f"| {run} | {t_s:.1f} s | {t_loss:.4f} | {o_s:.1f} s | {o_loss:.4f} | {o_s / t_s:.2f}x |", flush=True)
        t_med, o_med = statistics.median(s for s, _ in theirs), statistics.median(s for s, _ in ours)
        print(f"| median | {t_med:.1f} s | {statistics.median(v for _, v in theirs):.4f} | {o_med:.1f} s | "
              f"{statistics.median(v for _, v in ours):.4f} | {o_med / t_med:.2f}x |")
    return 0
