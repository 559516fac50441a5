"""Decoding gpt2-small (124M, random weights) with generate(), ours vs transformers.generate, one process.

    python scripts/bench.py generate [--prompt 32] [--new 128] [--batch 8] [--repeats 3] [--threads N]
                                     [--only greedy,beam,assisted]

greedy: at batch 1 and --batch, ours in fp32 and in int8 (`model.quantize("int8")`), transformers
in fp32, and CTranslate2 in int8 (a benchmark-only dependency: `pip install ctranslate2`; its rows
are skipped with a message when it is absent), timed in turns. CTranslate2 is converted from the
same weights saved as an HF folder (with the GPT-2 tokenizer files from the shared data) and runs
in a worker process of its own, called in the same turns and stopped (SIGSTOP) between calls: its
threads keep spinning after a call, which would slow torch; its own clock, without the pipe, gives
its time. beam: 4 beams at batch 1 vs transformers' beam search and vs our own greedy at batch 4
(the same rows per step), and the time each of ours spends outside the model's forward per step
(search and cache reorder), which machine load hardly moves. assisted: greedy with prompt lookup
(on a prompt that repeats itself) and with a 2-layer assistant (gpt2-small's first two blocks and
its head), ours vs transformers', with tokens per forward of the big model (1 means no draft was
accepted).

fp32 unless named, eval, greedy. Prints tokens/s, the ratio of ours to each (above 1 means ours is
faster), whether the tokens equal (int8's: the share equal to fp32's), and the memory-bandwidth
floor: the time to read a buffer the size of the fp32 weights once (bench_common.read_sum,
several streams a thread, on all threads), the most batch-1 tokens/s this machine can decode fp32
weights at. Returns the tables' rows. CPU decoding in every precision against llama.cpp is
`bench.py decode`; where a step's time goes, `bench.py step`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from unittest import mock

import torch
import transformers
from bench_common import SHARED_DATA, interleaved_medians, machine_line, median_seconds, read_buffer, read_sum

from gpt2attn import GPT2Config, GPT2LMHeadModel
from gpt2attn.generation.decoder import Decoder

TOKENIZER_FILES = SHARED_DATA / "gpt2-tokenizer"  # CTranslate2's converter wants them beside the weights


def bandwidth_floor_tokens_per_s(n_params: int) -> float:
    """1 / time to read n_params fp32 values once on all threads: reading every weight, as a decode step must."""
    weights = read_buffer(n_params)
    return 1.0 / median_seconds(lambda: read_sum(weights), repeats=20, warmup=3)


def prompt_ids(batch: int, length: int, vocab: int) -> torch.Tensor:
    """The prompt of a batch, the same in this process and in the CTranslate2 worker."""
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(batch))


def main(argv: list[str]) -> dict[str, list[dict]]:
    parser = argparse.ArgumentParser(prog="bench.py generate")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, help="torch's threads and CTranslate2's (default: torch's)")
    parser.add_argument("--only", default="greedy,beam,assisted", help="comma-separated: greedy, beam, assisted")
    args = parser.parse_args(argv)
    parts = set(args.only.split(","))
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    cfg = GPT2Config.from_preset("gpt2")
    ours = GPT2LMHeadModel(cfg).eval()
    hf_cfg = transformers.GPT2Config.from_dict(cfg.to_dict())
    theirs = transformers.GPT2LMHeadModel(hf_cfg).eval()
    theirs.load_state_dict(ours.state_dict())
    print(machine_line())
    floor = bandwidth_floor_tokens_per_s(ours.num_parameters())
    print(f"bandwidth floor (one read of {ours.num_parameters() / 1e6:.0f}M fp32 weights): {floor:.1f} tokens/s")

    tables = {}
    if "greedy" in parts:
        tables["greedy, fp32 unless named"] = bench_greedy(ours, theirs, floor, args)
    if "beam" in parts:
        tables["beam search, 4 beams, batch 1"] = bench_beam(ours, theirs, args)
    if "assisted" in parts:
        tables["assisted greedy decoding, batch 1"] = bench_assisted(ours, theirs, args)
    return tables


def bench_greedy(ours, theirs, floor: float, args) -> list[dict]:
    """Greedy at batch 1 and --batch: ours fp32 and int8, transformers fp32, CTranslate2 int8."""
    int8 = GPT2LMHeadModel(ours.config).eval()
    int8.load_state_dict(ours.state_dict())
    start, cpu = time.perf_counter(), time.process_time()
    int8.quantize("int8")
    print(f"quantizing gpt2-small to int8: {time.perf_counter() - start:.2f} s wall, {time.process_time() - cpu:.2f} s CPU")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ct2 = ct2_worker(ours, Path(tmp), args)
        try:
            for batch in (1, args.batch):
                prompt = prompt_ids(batch, args.prompt, ours.config.vocab_size)
                hf_kwargs = dict(max_new_tokens=args.new, do_sample=False, pad_token_id=0, eos_token_id=None)
                engines = {
                    "ours fp32": lambda: ours.generate(prompt, max_new_tokens=args.new, eos_token_id=None),
                    "ours int8": lambda: int8.generate(prompt, max_new_tokens=args.new, eos_token_id=None),
                    "transformers fp32": lambda: theirs.generate(prompt, **hf_kwargs),
                }
                if ct2 is not None:
                    engines["CTranslate2 int8"] = lambda: ct2_call(ct2, batch)
                with torch.inference_mode():
                    a, a8, b = (engine() for engine in list(engines.values())[:3])
                    times = interleaved_medians(engines, repeats=args.repeats, warmup=1)
                if ct2 is not None:  # CTranslate2's own clock (without the pipe) replaces the wall time around it
                    times["CTranslate2 int8"] = ct2_call(ct2, batch, report_median=True)
                rate = {name: batch * args.new / t for name, t in times.items()}
                same = {"ours fp32": f"= transformers: {torch.equal(a, b)}",
                        "ours int8": f"{(a8[:, args.prompt:] == a[:, args.prompt:]).float().mean().item():.0%} = ours fp32"}
                print(f"\nbatch {batch}, prompt {args.prompt}, {args.new} new greedy tokens")
                for name, r in rate.items():
                    row = {"batch": batch, "engine": name, "tok/s": f"{r:.1f}",
                           "ours fp32 / this": f"{rate['ours fp32'] / r:.2f}x", "ours int8 / this": f"{rate['ours int8'] / r:.2f}x",
                           "of the floor": f"{r / floor:.0%}" if batch == 1 else "", "tokens": same.get(name, "")}
                    print("  " + ", ".join(f"{k} {v}" for k, v in row.items() if k not in ("batch",) and v))
                    rows.append(row)
        finally:
            if ct2 is not None:
                os.kill(ct2.pid, signal.SIGCONT)
                ct2.stdin.close()
                ct2.wait()
    return rows


def bench_beam(ours, theirs, args) -> list[dict]:
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
    outside = {"ours beam": beam_extra, "ours greedy B=4": greedy_extra}
    return [{"engine": name, "steps/s": f"{r:.1f}", "ours beam / this": f"{rate['ours beam'] / r:.2f}x",
             "ms per step outside the forward": f"{1000 * outside[name] / args.new:.2f}" if name in outside else "",
             "tokens": f"= transformers: {same}" if name == "ours beam" else ""} for name, r in rate.items()]


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


def bench_assisted(ours, theirs, args) -> list[dict]:
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
    forwards, rows = [], []
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
            rows += [{"decoding": name, "engine": lib, "tok/s": f"{rate[lib]:.1f}",
                      "tokens per forward": f"{per_forward[lib]:.2f}", "ours / this": f"{rate['ours'] / rate[lib]:.2f}x"}
                     for lib in ("ours", "transformers")]
    for hook in hooks:
        hook.remove()
    return rows


# --- CTranslate2, in a worker process ----------------------------------------------------


def ct2_worker(fp32, tmp: Path, args):
    """A worker process holding a CTranslate2 int8 generator of fp32's weights, or None."""
    try:
        import ctranslate2
    except ImportError:
        print("CTranslate2 is not installed (pip install ctranslate2): its rows are skipped")
        return None
    if not TOKENIZER_FILES.exists():
        print(f"{TOKENIZER_FILES} is absent (CTranslate2's converter needs the tokenizer files): its rows are skipped")
        return None
    hf_dir, ct2_dir = tmp / "hf", tmp / "ct2"
    fp32.save_pretrained(hf_dir)
    for f in TOKENIZER_FILES.iterdir():
        shutil.copy(f, hf_dir)
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ctranslate2.converters.TransformersConverter(str(hf_dir)).convert(str(ct2_dir), quantization="int8")
    print(f"CTranslate2 {ctranslate2.__version__}: converted to int8 in {time.perf_counter() - start:.1f} s")
    spec = json.dumps({"dir": str(ct2_dir), "threads": torch.get_num_threads(), "prompt": args.prompt, "new": args.new,
                       "vocab": fp32.config.vocab_size, "vocab_file": str(hf_dir / "vocab.json")})
    return subprocess.Popen([sys.executable, __file__, "--ct2-worker", spec], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, bufsize=1)


def ct2_call(worker, batch: int, report_median: bool = False) -> float:
    """One greedy generation of the batch in the worker (or the median of its timed calls so far).
    Between calls the worker is stopped (SIGSTOP), so its spinning threads cannot slow torch."""
    os.kill(worker.pid, signal.SIGCONT)
    worker.stdin.write(f"{'median' if report_median else 'run'} {batch}\n")
    worker.stdin.flush()
    seconds = float(worker.stdout.readline())
    os.kill(worker.pid, signal.SIGSTOP)
    return seconds


def ct2_serve(spec: str) -> None:
    """The worker: reads 'run B' / 'median B' lines, answers seconds."""
    import ctranslate2

    spec = json.loads(spec)
    generator = ctranslate2.Generator(spec["dir"], device="cpu", compute_type="int8", intra_threads=spec["threads"])
    token_of = {i: t for t, i in json.loads(Path(spec["vocab_file"]).read_text()).items()}
    times: dict[int, list[float]] = {}
    for line in sys.stdin:
        what, batch = line.split()
        batch = int(batch)
        if what == "median":
            print(statistics.median(times[batch][1:]), flush=True)  # the first call is the warm-up
            continue
        tokens = [[token_of[i] for i in row] for row in prompt_ids(batch, spec["prompt"], spec["vocab"]).tolist()]
        start = time.perf_counter()
        results = generator.generate_batch(tokens, max_length=spec["new"], min_length=spec["new"],
                                           include_prompt_in_result=False, sampling_topk=1)
        elapsed = time.perf_counter() - start
        assert all(len(r.sequences_ids[0]) == spec["new"] for r in results)
        times.setdefault(batch, []).append(elapsed)
        print(elapsed, flush=True)


if __name__ == "__main__":  # the CTranslate2 worker (bench.py runs the bench itself)
    if len(sys.argv) == 3 and sys.argv[1] == "--ct2-worker":
        ct2_serve(sys.argv[2])
    else:
        sys.exit("run the benchmark as python scripts/bench.py generate [options]")
