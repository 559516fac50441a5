"""Where one batch-1 decode step of gpt2-small (random weights) spends its time, per precision.

    python scripts/profile_decode.py [--cache 64] [--repeats 15] [--modes fp32,fp16,bf16,int8] [--profile]

In one process, each timing taken in turns with the others (so machine load hits them alike):
- read: one pass of bench_common.read_sum over a buffer of the mode's bytes per token (the
  time the weights take to read at this machine's rate: the floor of a step);
- products: every CpuLinear of the model called once on a (1, 1, C) row, as a step calls them
  (the kernels: weight reads plus each call's Python and OpenMP start);
- module step: one decode step through the model's modules (Decoder without its DecodeStep) with
  a cache of --cache tokens: products plus embeddings, LayerNorms, attention, GELU, cache writes;
- step: the same step as generate() takes it, in one call (gpt2attn.decode_step, step.cpp);
- narrow step: that one-call step of a model of the same depth 64 wide with 256 tokens, whose
  weights are a few kB: what a step costs beyond reading weights;
- generate: model.generate's time per new token (the step plus logits processing and the loop).
Prints each as min and median ms. --profile adds torch.profiler's table of ten module steps per
mode (the kernels are ctypes calls, which the profiler does not list: see products).
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_common import machine_line, read_sum

from gpt2attn import GPT2Config, GPT2LMHeadModel
from gpt2attn.generation.decoder import Decoder
from gpt2attn.quantize import CpuLinear


def weight_bytes(model) -> int:
    """Bytes a decode step reads: every CpuLinear's weight (and int8 scales; q4's blocks)."""
    total = 0
    for mod in model.modules():
        if isinstance(mod, CpuLinear):
            for t in (getattr(mod, name, None) for name in ("weight", "weight16", "weight8", "scale", "blocks")):
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
    return total


def stepper(model, prompt: torch.Tensor, cache: int, one_call: bool = True):
    dec = Decoder(model, 1, cache + 4, "cpu")
    if not one_call:
        dec.step = None  # the modules, layer by layer, as before gpt2attn.decode_step
    dec.forward(prompt)
    ids = prompt[:, -1:]

    def step():
        dec.forward(ids)
        dec.rollback(cache)

    return step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--cache", type=int, default=64)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--modes", default="fp32,fp16,bf16,int8")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)
    print(machine_line())
    torch.manual_seed(0)
    big, narrow = GPT2Config(), GPT2Config(n_embd=64, n_head=4, vocab_size=256)
    base = GPT2LMHeadModel(big).eval()
    prompt = torch.randint(0, 256, (1, args.cache))
    fns = {}
    with torch.inference_mode():
        for mode in args.modes.split(","):
            m = GPT2LMHeadModel(big).eval()
            m.load_state_dict(base.state_dict())
            m.quantize(mode)
            buffer = torch.ones(weight_bytes(m) // 4)
            linears = [mod for mod in m.modules() if isinstance(mod, CpuLinear)]
            rows = [torch.randn(1, 1, mod.in_features) for mod in linears]
            fns[f"{mode} read"] = lambda buffer=buffer: read_sum(buffer)
            fns[f"{mode} products"] = lambda linears=linears, rows=rows: [mod(x) for mod, x in zip(linears, rows)]
            fns[f"{mode} module step"] = stepper(m, prompt, args.cache, one_call=False)
            fns[f"{mode} step"] = stepper(m, prompt, args.cache)
            fns[f"{mode} narrow step"] = stepper(GPT2LMHeadModel(narrow).eval().quantize(mode), prompt, args.cache)

            def generate(m=m, n=16):
                m.generate(prompt, max_new_tokens=n, eos_token_id=None)

            fns[f"{mode} generate"] = generate
            fns[f"{mode} generate 1"] = lambda generate=generate: generate(n=1)
        times = {name: [] for name in fns}
        for name, fn in fns.items():  # warm up (builds the kernels, allocations)
            fn()
        for _ in range(args.repeats):
            for name, fn in fns.items():
                t = time.perf_counter()
                fn()
                times[name].append(1e3 * (time.perf_counter() - t))
    print(f"gpt2-small shapes, batch 1, cache {args.cache}; ms, min / median of {args.repeats} turns")
    print("| mode | read weights | products | module step | step (one call) | narrow step | generate per token |")
    print("|---|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        cells = []
        for part in ("read", "products", "module step", "step", "narrow step"):
            t = sorted(times[f"{mode} {part}"])
            cells.append(f"{t[0]:.1f} / {t[len(t) // 2]:.1f}")
        g, g1 = sorted(times[f"{mode} generate"]), sorted(times[f"{mode} generate 1"])
        cells.append(f"{(g[0] - g1[0]) / 15:.1f} / {(g[len(g) // 2] - g1[len(g1) // 2]) / 15:.1f}")
        print(f"| {mode} | " + " | ".join(cells) + " |")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for mode in args.modes.split(","):
            step = fns[f"{mode} module step"]
            with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(10):
                    step()
            print(f"--- {mode}: 10 decode steps, ops by self CPU time")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
