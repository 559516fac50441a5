"""Forward pass of gpt2-small (124M, random weights), ours vs transformers, one process.

    python scripts/bench.py forward [--lengths 128 512] [--repeats 10]

fp32, eval, batch 1, no cache. Prints median times, the ratio transformers/ours (above 1 means
ours is faster) against transformers' sdpa and eager attention, and achieved GFLOP/s as a
fraction of a 2048x2048 fp32 matmul measured in the same run.
"""

from __future__ import annotations

import argparse

import torch
import transformers
from bench_common import interleaved_medians, machine_line, matmul_gflops

from gpt2attn import GPT2Config, GPT2LMHeadModel


def forward_flops(cfg: GPT2Config, T: int) -> float:
    """Matmul FLOPs of one forward over T tokens: projections, attention scores/mixing, head."""
    C = cfg.n_embd
    per_layer = 2 * T * (3 * C * C + C * C + 2 * C * cfg.inner_dim) + 2 * 2 * T * T * C
    return cfg.n_layer * per_layer + 2 * T * C * cfg.vocab_size


def main(argv: list[str]) -> list[dict]:
    parser = argparse.ArgumentParser(prog="bench.py forward")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    cfg = GPT2Config.from_preset("gpt2")
    ours = GPT2LMHeadModel(cfg).eval()
    theirs = {}
    for impl in ("sdpa", "eager"):
        hf_cfg = transformers.GPT2Config.from_dict(cfg.to_dict())
        hf_cfg._attn_implementation = impl
        theirs[impl] = transformers.GPT2LMHeadModel(hf_cfg).eval()
        theirs[impl].load_state_dict(ours.state_dict())

    peak = matmul_gflops()
    print(machine_line())
    print(f"2048x2048 fp32 matmul: {peak:.1f} GFLOP/s")
    print(f"{'T':>5} {'ours ms':>9} {'hf sdpa ms':>11} {'hf eager ms':>12} {'sdpa/ours':>10} {'eager/ours':>11} {'ours GFLOP/s':>13} {'of matmul':>10}")
    rows = []
    with torch.inference_mode():
        for T in args.lengths:
            ids = torch.randint(0, cfg.vocab_size, (1, T))
            times = interleaved_medians(
                {
                    "ours": lambda: ours(ids, use_cache=False),
                    "sdpa": lambda: theirs["sdpa"](ids, use_cache=False),
                    "eager": lambda: theirs["eager"](ids, use_cache=False),
                },
                args.repeats,
            )
            t_ours, t_sdpa, t_eager = times["ours"], times["sdpa"], times["eager"]
            gflops = forward_flops(cfg, T) / t_ours / 1e9
            print(
                f"{T:>5} {t_ours * 1e3:>9.1f} {t_sdpa * 1e3:>11.1f} {t_eager * 1e3:>12.1f} "
                f"{t_sdpa / t_ours:>9.2f}x {t_eager / t_ours:>10.2f}x {gflops:>13.1f} {gflops / peak:>9.0%}"
            )
            rows.append({
                "gpt2-small forward, B=1": f"T={T}", "gpt2attn ms": round(t_ours * 1e3, 1),
                "transformers sdpa ms": round(t_sdpa * 1e3, 1), "transformers eager ms": round(t_eager * 1e3, 1),
                "sdpa / ours": f"{t_sdpa / t_ours:.2f}x", "eager / ours": f"{t_eager / t_ours:.2f}x",
                "ours, of a 2048² matmul's GFLOP/s": f"{gflops / peak:.0%}",
            })
    return rows
