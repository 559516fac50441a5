"""Where one batch-1 decode step of gpt2-small (random weights) spends its time, per precision;
with --layers, what each int8 kernel costs on each layer shape.

    python scripts/bench.py step [--cache 64] [--repeats 15] [--modes fp32,fp16,bf16,int8] [--profile] [--layers]

In one process, each timing taken in turns with the others (so machine load hits them alike):
- read: one pass of bench_common.read_sum over a buffer of the mode's bytes per token as one, four
  and eight streams a thread, the fastest in each turn counting (the time the weights take to
  read at this machine's rate: the floor of a step). No one count of streams is fastest everywhere:
  on a 2-core AMD EPYC Zen 5 VM (2026-11-28) eight streams a thread read int8's 124 MB at 46 GB/s
  where four read 79 and one 75, but fp32's 494 MB at 78 where four read 74 and one 72;
- products: every CpuLinear of the model called once on a (1, 1, C) row, as a step calls them
  (the kernels: weight reads plus each call's Python and OpenMP start);
- module step: one decode step through the model's modules (Decoder without its DecodeStep) with
  a cache of --cache tokens: products plus embeddings, LayerNorms, attention, GELU, cache writes;
- step: the same step as generate() takes it, in one call (gpt2attn.decode_step, decode.cpp);
- narrow step: that one-call step of a model of the same depth 64 wide with 256 tokens, whose
  weights are a few kB: what a step costs beyond reading weights;
- generate: model.generate's time per new token (the step plus logits processing and the loop).
Prints each as min and median ms and returns them as the table's rows. --profile adds
torch.profiler's table of ten module steps per mode (the kernels are ctypes calls, which the
profiler does not list: see products). --layers adds the table behind gpt2attn.quantize's choice
of int8 kernel: fp32, fbgemm's dynamic int8, ours and the weight-only int8 kernels (torch's, and
torchao's when it is installed) on every matrix shape of gpt2-small at 1, 8 and 512 rows.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
from bench_common import machine_line, read_buffer, read_sum, weight_bytes

from gpt2attn import GPT2Config, GPT2LMHeadModel
from gpt2attn.generation.decoder import Decoder
from gpt2attn.quantize import CpuLinear

PARTS = ("read weights", "products", "module step", "step (one call)", "narrow step")
READ_STREAMS = (1, 4, 8)  # streams a thread for "read weights": the fastest in each turn counts


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


def main(argv: list[str]) -> list[dict]:
    p = argparse.ArgumentParser(prog="bench.py step")
    p.add_argument("--cache", type=int, default=64)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--modes", default="fp32,fp16,bf16,int8")
    p.add_argument("--profile", action="store_true", help="add torch.profiler's table of ten module steps per mode")
    p.add_argument("--layers", action="store_true", help="add each int8 kernel's time on each layer shape")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    print(machine_line())
    torch.manual_seed(0)
    big, narrow = GPT2Config(), GPT2Config(n_embd=64, n_head=4, vocab_size=256)
    base = GPT2LMHeadModel(big).eval()
    prompt = torch.randint(0, 256, (1, args.cache))
    fns = {}
    with torch.inference_mode():
        for mode in modes:
            m = GPT2LMHeadModel(big).eval()
            m.load_state_dict(base.state_dict())
            m.quantize(mode)
            buffer = read_buffer(weight_bytes(m) // 4)
            linears = [mod for mod in m.modules() if isinstance(mod, CpuLinear)]
            rows = [torch.randn(1, 1, mod.in_features) for mod in linears]
            for streams in READ_STREAMS:
                fns[f"{mode} read weights {streams}"] = lambda buffer=buffer, streams=streams: read_sum(buffer, streams)
            fns[f"{mode} products"] = lambda linears=linears, rows=rows: [mod(x) for mod, x in zip(linears, rows)]
            fns[f"{mode} module step"] = stepper(m, prompt, args.cache, one_call=False)
            fns[f"{mode} step (one call)"] = stepper(m, prompt, args.cache)
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
    rows = []
    for mode in modes:
        row = {"mode": mode}
        times[f"{mode} read weights"] = [min(turn) for turn in zip(*(times[f"{mode} read weights {n}"]
                                                                    for n in READ_STREAMS))]
        for part in PARTS:
            t = sorted(times[f"{mode} {part}"])
            row[part] = f"{t[0]:.1f} / {t[len(t) // 2]:.1f}"
        g, g1 = sorted(times[f"{mode} generate"]), sorted(times[f"{mode} generate 1"])
        row["generate per token"] = f"{(g[0] - g1[0]) / 15:.1f} / {(g[len(g) // 2] - g1[len(g1) // 2]) / 15:.1f}"
        rows.append(row)
    print("| " + " | ".join(rows[0]) + " |")
    print("|" + "---|" * len(rows[0]))
    for row in rows:
        print("| " + " | ".join(row.values()) + " |")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        for mode in modes:
            step = fns[f"{mode} module step"]
            with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(10):
                    step()
            print(f"--- {mode}: 10 decode steps, ops by self CPU time")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    if args.layers:
        layer_table(big)
    return rows  # bench.py writes these, with the machine and date, to docs/benchmarks/results/step.json


# --- the per-layer int8 kernel table -----------------------------------------------------


def layer_table(cfg: GPT2Config) -> None:
    """Time each kernel on each (in, out) matrix shape of gpt2-small at 1, 8 and 512 rows."""
    from gpt2attn.layers import Conv1D, LMHead
    from gpt2attn.quantize import Int8Linear

    C = cfg.n_embd
    shapes = {"attn.c_attn": (C, 3 * C), "attn.c_proj": (C, C), "mlp.c_fc": (C, 4 * C),
              "mlp.c_proj": (4 * C, C), "lm_head": (C, cfg.vocab_size)}
    print("\nper layer, min ms of a call (rows x in -> out); weight-only kernels skipped at 512 rows (too slow)")
    for name, (n_in, n_out) in shapes.items():
        if name == "lm_head":
            fp = LMHead(n_in, n_out, bias=False).eval()
            weight, bias = fp.weight.detach(), None
        else:
            fp = Conv1D(n_out, n_in).eval()
            weight, bias = fp.weight.detach().t().contiguous(), fp.bias.detach()  # (out, in)
        kernels = {"fp32": fp, "ours int8 (gpt2attn.quantize)": Int8Linear(weight, bias),
                   "fbgemm dynamic int8": fbgemm_dynamic(weight, bias)}
        kernels.update(weight_only_kernels(weight, bias))
        for rows in (1, 8, 512):
            x = torch.randn(rows, n_in)
            cells = []
            with torch.inference_mode():
                reference = fp(x)
                for kernel, fn in kernels.items():
                    if rows == 512 and kernel not in ("fp32", "ours int8 (gpt2attn.quantize)", "fbgemm dynamic int8"):
                        continue
                    t = min_seconds(lambda: fn(x), n=3 if rows == 512 or n_out > 10000 else 10)
                    err = (fn(x) - reference).abs().max().item() / reference.abs().max().item()
                    cells.append(f"{kernel} {1000 * t:.3f} (err {err:.3f})")
            print(f"  {name:<11} {rows:>3} x {n_in} -> {n_out}: " + " | ".join(cells))


def fbgemm_dynamic(weight: torch.Tensor, bias: torch.Tensor | None):
    """torch's dynamically quantized int8 Linear (fbgemm: the input quantized per call, per tensor)."""
    linear = torch.nn.Linear(weight.size(1), weight.size(0), bias=bias is not None)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization's deprecation notice
        return torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(linear), {torch.nn.Linear}, torch.qint8)


def weight_only_kernels(weight: torch.Tensor, bias: torch.Tensor | None) -> dict:
    """torch's weight-only int8 matmul, and torchao's two int8 configs when torchao is installed."""
    scale = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12)
    w8 = torch.round(weight / scale[:, None]).to(torch.int8)
    b = bias if bias is not None else torch.zeros(weight.size(0))
    out = {"torch _weight_int8pack_mm (weight-only)": lambda x: torch._weight_int8pack_mm(x, w8, scale) + b}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.quantization import Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig, quantize_
    except Exception as e:  # absent, or built for another torch
        print(f"  (torchao not usable here: {type(e).__name__}: {str(e)[:80]}; its columns are skipped)")
        return out
    for label, config in (("torchao weight-only", Int8WeightOnlyConfig()),
                          ("torchao dynamic", Int8DynamicActivationInt8WeightConfig())):
        linear = torch.nn.Linear(weight.size(1), weight.size(0), bias=bias is not None)
        with torch.no_grad():
            linear.weight.copy_(weight)
            if bias is not None:
                linear.bias.copy_(bias)
        quantize_(linear, config)
        out[label] = linear
    return out


def min_seconds(fn, n: int) -> float:
    """The fastest of n calls after one warm-up: on a shared machine, the least disturbed one."""
    fn()
    best = float("inf")
    for _ in range(n):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
