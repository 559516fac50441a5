"""Decoding gpt2-small (124M, random weights), ours vs transformers.generate, one process.

    python scripts/bench.py generate [--prompt 32] [--new 128] [--batch 8] [--repeats 3] [--only greedy,beam,assisted]

greedy: batch 1 and --batch. beam: 4 beams at batch 1 vs transformers' beam search and vs our
own greedy at batch 4 (the same rows per step), and the time each of ours spends outside the
model's forward per step (search and cache reorder), which machine load hardly moves.
assisted: greedy with prompt lookup (on a prompt that repeats itself) and with a 2-layer
assistant (gpt2-small's first two blocks and its head), ours vs transformers', with tokens per
forward of the big model (1 means no draft was accepted).

fp32, eval. Prints tokens/s at batch 1 and at --batch, the ratio ours/transformers (above 1 means
ours is faster), and the memory-bandwidth floor: the time to read a buffer the size of the fp32
weights once (bench_common.read_sum, several streams a thread, on all threads), the most
batch-1 tokens/s this machine can decode fp32 weights at (torch's own matrix-vector product over
the same bytes reads them about half as fast, so it is no floor).
"""

from __future__ import annotations

import argparse
import time
from unittest import mock

import torch
import transformers
from bench_common import interleaved_medians, machine_line, median_seconds, read_sum

from gpt2attn import GPT2Config, GPT2LMHeadModel
from gpt2attn.generation.decoder import Decoder


def bandwidth_floor_tokens_per_s(n_params: int) -> float:
    """1 / time to read n_params fp32 values once on all threads: reading every weight, as a decode step must."""
    weights = torch.ones(n_params)
    return 1.0 / median_seconds(lambda: read_sum(weights), repeats=20, warmup=3)


def main(argv: list[str]) -> int:
    if "--quantize" in argv:  # int8 decoding vs fp32, transformers and CTranslate2: bench_quantize.py
        import bench_quantize

        return bench_quantize.main(argv)
    parser = argparse.ArgumentParser(prog="bench.py generate")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default="greedy,beam,assisted", help="comma-separated: greedy, beam, assisted")
    args = parser.parse_args(argv)
    parts = set(args.only.split(","))

    torch.manual_seed(0)
    cfg = GPT2Config.from_preset("gpt2")
    ours = GPT2LMHeadModel(cfg).eval()
    hf_cfg = transformers.GPT2Config.from_dict(cfg.to_dict())
    theirs = transformers.GPT2LMHeadModel(hf_cfg).eval()
    theirs.load_state_dict(ours.state_dict())
    print(machine_line())
    floor = bandwidth_floor_tokens_per_s(ours.num_parameters())
    print(f"bandwidth floor (one read of {ours.num_parameters() / 1e6:.0f}M fp32 weights): {floor:.1f} tokens/s")

    if "beam" in parts:
        bench_beam(ours, theirs, args)
    if "assisted" in parts:
        bench_assisted(ours, theirs, args)
    if "greedy" not in parts:
        return 0
    for batch in (1, args.batch):
        prompt = torch.randint(0, cfg.vocab_size, (batch, args.prompt))
        with torch.inference_mode():
            a = ours.generate(prompt, max_new_tokens=args.new, eos_token_id=None)
            b = theirs.generate(prompt, max_new_tokens=args.new, do_sample=False, pad_token_id=0, eos_token_id=None)
            same = torch.equal(a, b)
            times = interleaved_medians(
                {
                    "ours": lambda: ours.generate(prompt, max_new_tokens=args.new, eos_token_id=None),
                    "transformers": lambda: theirs.generate(
                        prompt, max_new_tokens=args.new, do_sample=False, pad_token_id=0, eos_token_id=None
                    ),
                },
                repeats=args.repeats,
                warmup=1,
            )
        rate = {name: batch * args.new / t for name, t in times.items()}
        line = (
            f"batch {batch}, prompt {args.prompt}, {args.new} new: ours {rate['ours']:.1f} tok/s, "
            f"transformers {rate['transformers']:.1f} tok/s, ratio {rate['ours'] / rate['transformers']:.2f}x"
        )
        if batch == 1:
            line += f", {100 * rate['ours'] / floor:.0f}% of the floor"
        print(line + f"; same tokens: {same}")
    return 0


def bench_beam(ours, theirs, args) -> None:
    """4 beams, batch 1: steps/s of ours, transformers', and our greedy at batch 4 (same rows per step)."""
    prompt = torch.randint(0, ours.config.vocab_size, (1, args.prompt))
    beam = dict(max_new_tokens=args.new, num_beams=4, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        same = torch.equal(ours.generate(prompt, **beam), theirs.generate(prompt, **beam))
        greedy4 = prompt.expand(4, -1).contiguous()
        times = interleaved_medians(
            {
                "ours beam": lambda: ours.generate(prompt, **beam),
                "transformers beam": lambda: theirs.generate(prompt, **beam),
                "ours greedy B=4": lambda: ours.generate(greedy4, max_new_tokens=args.new, eos_token_id=None),
            },
            repeats=args.repeats,
            warmup=1,
        )
        beam_extra = time_outside_forward(lambda: ours.generate(prompt, **beam), args.repeats)
        greedy_extra = time_outside_forward(
            lambda: ours.generate(greedy4, max_new_tokens=args.new, eos_token_id=None), args.repeats
        )
    rate = {name: args.new / t for name, t in times.items()}
    print(
        f"beam search, 4 beams, prompt {args.prompt}, {args.new} new: ours {rate['ours beam']:.1f} steps/s, "
        f"transformers {rate['transformers beam']:.1f} steps/s ({rate['ours beam'] / rate['transformers beam']:.2f}x), "
        f"our greedy B=4 {rate['ours greedy B=4']:.1f} steps/s (beam/greedy {rate['ours beam'] / rate['ours greedy B=4']:.3f}); "
        f"same tokens: {same}"
    )
    step_ms = 1000 * times["ours greedy B=4"] / args.new
    print(
        f"  time outside the model's forward, per step: beam {1000 * beam_extra / args.new:.2f} ms "
        f"(search, cache reorder), greedy B=4 {1000 * greedy_extra / args.new:.2f} ms; the difference is "
        f"{100 * (beam_extra - greedy_extra) / args.new / (step_ms / 1000):.1f}% of a {step_ms:.1f} ms greedy step"
    )


def time_outside_forward(run, repeats: int) -> float:
    """Median seconds a generate() call spends outside Decoder.forward (the model's forward):
    the search's own work. Unlike the wall times above it hardly moves with the machine's load."""
    inside = [0.0]
    forward = Decoder.forward

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return forward(self, *args, **kwargs)
        finally:
            inside[0] += time.perf_counter() - t0

    outside = []
    with mock.patch.object(Decoder, "forward", timed):
        for _ in range(repeats):
            inside[0] = 0.0
            t0 = time.perf_counter()
            run()
            outside.append(time.perf_counter() - t0 - inside[0])
    return sorted(outside)[len(outside) // 2]


def bench_assisted(ours, theirs, args) -> None:
    """Assisted greedy decoding, batch 1: tokens/s and tokens per big-model forward, ours vs transformers."""
    small = GPT2LMHeadModel(GPT2Config.from_dict({**ours.config.to_dict(), "n_layer": 2})).eval()
    small.load_state_dict({k: v for k, v in ours.state_dict().items() if k in small.state_dict()})
    small_hf = transformers.GPT2LMHeadModel(transformers.GPT2Config.from_dict(small.config.to_dict())).eval()
    small_hf.load_state_dict(small.state_dict())
    g = torch.Generator().manual_seed(1)
    block = torch.randint(0, ours.config.vocab_size, (args.prompt // 4,), generator=g)
    prompt = block.repeat(4)[None]  # a prompt that repeats itself
    plain = dict(max_new_tokens=args.new, eos_token_id=None, pad_token_id=0)
    runs = {
        "greedy": ({}, {}),
        "prompt lookup 10": (dict(prompt_lookup_num_tokens=10), dict(prompt_lookup_num_tokens=10)),
        "assistant (2 layers)": (dict(assistant_model=small), dict(assistant_model=small_hf)),
    }
    forwards = []
    hooks = [m.transformer.register_forward_hook(lambda *_: forwards.append(1)) for m in (ours, theirs)]
    with torch.inference_mode():
        reference = ours.generate(prompt, **plain)
        for name, (kw_ours, kw_theirs) in runs.items():
            per_forward = {}
            for lib, model, kw in (("ours", ours, kw_ours), ("transformers", theirs, kw_theirs)):
                forwards.clear()
                out = model.generate(prompt, **plain, **kw)
                per_forward[lib] = (out.size(1) - prompt.size(1)) / len(forwards)
                assert torch.equal(out, reference), f"{lib} {name} differs from greedy"
            times = interleaved_medians(
                {
                    "ours": lambda kw=kw_ours: ours.generate(prompt, **plain, **kw),
                    "transformers": lambda kw=kw_theirs: theirs.generate(prompt, **plain, **kw),
                },
                repeats=args.repeats,
                warmup=1,
            )
            rate = {lib: args.new / t for lib, t in times.items()}
            print(
                f"{name}, batch 1, prompt {prompt.size(1)}, {args.new} new: ours {rate['ours']:.1f} tok/s "
                f"({per_forward['ours']:.2f} tokens/forward), transformers {rate['transformers']:.1f} tok/s "
                f"({per_forward['transformers']:.2f} tokens/forward), ratio {rate['ours'] / rate['transformers']:.2f}x; "
                "same tokens as greedy: True"
            )
    for hook in hooks:
        hook.remove()
