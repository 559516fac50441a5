"""Greedy decoding of gpt2-small (124M, random weights), ours vs transformers.generate, one process.

    python scripts/bench.py generate [--prompt 32] [--new 128] [--batch 8] [--repeats 3]

fp32, eval. Prints tokens/s at batch 1 and at --batch, the ratio ours/transformers (above 1 means
ours is faster), and the memory-bandwidth floor: one matrix-vector product over a buffer the
size of the weights, the most batch-1 tokens/s this machine can decode.
"""

from __future__ import annotations

import argparse

import torch
import transformers
from bench_common import interleaved_medians, machine_line, median_seconds

from gpt2attn import GPT2Config, GPT2LMHeadModel


def bandwidth_floor_tokens_per_s(n_params: int, width: int) -> float:
    """1 / time of (n_params/width, width) @ (width,): reading every weight once, as a decode step must."""
    weights = torch.randn(n_params // width, width)
    x = torch.randn(width)
    with torch.inference_mode():
        return 1.0 / median_seconds(lambda: torch.mv(weights, x), repeats=20, warmup=3)


def main(argv: list[str]) -> int:
    if "--quantize" in argv:  # int8 decoding vs fp32, transformers and CTranslate2: bench_quantize.py
        import bench_quantize

        return bench_quantize.main(argv)
    parser = argparse.ArgumentParser(prog="bench.py generate")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    cfg = GPT2Config.from_preset("gpt2")
    ours = GPT2LMHeadModel(cfg).eval()
    hf_cfg = transformers.GPT2Config.from_dict(cfg.to_dict())
    theirs = transformers.GPT2LMHeadModel(hf_cfg).eval()
    theirs.load_state_dict(ours.state_dict())
    print(machine_line())
    floor = bandwidth_floor_tokens_per_s(ours.num_parameters(), cfg.n_embd)
    print(f"bandwidth floor (mat-vec over {ours.num_parameters() / 1e6:.0f}M fp32 weights): {floor:.1f} tokens/s")

    for batch in (1, args.batch):
        prompt = torch.randint(0, cfg.vocab_size, (batch, args.prompt))
        with torch.inference_mode():
            a = ours.generate(prompt, max_new_tokens=args.new)
            b = theirs.generate(prompt, max_new_tokens=args.new, do_sample=False, pad_token_id=0, eos_token_id=None)
            same = torch.equal(a, b)
            times = interleaved_medians(
                {
                    "ours": lambda: ours.generate(prompt, max_new_tokens=args.new),
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
