"""int8 decoding on the CPU: ours int8 vs ours fp32, transformers fp32 and CTranslate2 int8.

    python scripts/bench.py generate --quantize int8 [--prompt 32] [--new 128] [--batch 8] [--repeats 3]
                                     [--prefill 512] [--threads 2] [--layers] [--quality]

gpt2-small shapes, random weights (seed 0), greedy, eval. Our engines and transformers are timed
in turns in this process; CTranslate2 (a benchmark-only dependency: `pip install ctranslate2`;
skipped with a message when absent) is converted from the same weights saved as an HF folder
and runs in a worker process of its own, called in the same turns and stopped (SIGSTOP) between
calls: its threads keep spinning after a call, which would slow torch.
Prints tokens/s at batch 1 and --batch with ratios, then a forward pass of --prefill tokens in
int8 and fp32 (and bf16 where the CPU multiplies bf16 natively; elsewhere a same-run matmul shows
why not). --layers adds the per-layer kernel table behind gpt2attn.quantize's choice of kernel:
fp32, fbgemm's dynamic int8 and the weight-only int8 kernels (torch's, and torchao's when it is
installed) for every matrix shape of gpt2-small. --quality adds the max relative logit error on
the random gpt2-small, and on the shipped char model the validation loss and greedy text of
int8 beside fp32.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from bench_common import SHAKESPEARE, SHARED_DATA, interleaved_medians, machine_line, median_seconds

from gpt2attn import GPT2Config, GPT2LMHeadModel
from gpt2attn.cpu import bf16_report as cpu_bf16_report

TOKENIZER_FILES = SHARED_DATA / "gpt2-tokenizer"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench.py generate --quantize")
    parser.add_argument("--quantize", choices=["int8"], default="int8")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2, help="torch's threads and CTranslate2's (default 2)")
    parser.add_argument("--layers", action="store_true", help="also time each kernel on each layer shape")
    parser.add_argument("--quality", action="store_true", help="also report logit error, loss and greedy text")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    cfg = GPT2Config.from_preset("gpt2")
    fp32 = GPT2LMHeadModel(cfg).eval()
    print(machine_line() + f", quantized engine {torch.backends.quantized.engine}")
    print("bf16:", cpu_bf16_report()[1])
    int8 = GPT2LMHeadModel(cfg).eval()
    int8.load_state_dict(fp32.state_dict())
    start, cpu = time.perf_counter(), time.process_time()
    int8.quantize("int8")
    print(f"quantizing gpt2-small: {time.perf_counter() - start:.2f} s wall, {time.process_time() - cpu:.2f} s CPU")
    if args.layers:
        layer_table(cfg)
    if args.quality:
        quality(fp32, int8)

    with tempfile.TemporaryDirectory() as tmp:
        ct2 = ct2_worker(fp32, Path(tmp), args)
        try:
            for batch in (1, args.batch):
                decoding(fp32, int8, ct2, batch, args)
        finally:
            if ct2 is not None:
                os.kill(ct2.pid, signal.SIGCONT)
                ct2.stdin.close()
                ct2.wait()
    prefill(fp32, int8, args.prefill, args.repeats)
    return 0


# --- decoding ----------------------------------------------------------------------------


def prompt_ids(batch: int, length: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(batch))


def decoding(fp32, int8, ct2, batch: int, args) -> None:
    import transformers

    cfg = fp32.config
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config.from_dict(cfg.to_dict())).eval()
    hf.load_state_dict(fp32.state_dict())
    prompt = prompt_ids(batch, args.prompt, cfg.vocab_size)
    hf_kwargs = dict(max_new_tokens=args.new, do_sample=False, pad_token_id=0, eos_token_id=None)
    engines = {
        "ours int8": lambda: int8.generate(prompt, max_new_tokens=args.new),
        "ours fp32": lambda: fp32.generate(prompt, max_new_tokens=args.new),
        "transformers fp32": lambda: hf.generate(prompt, **hf_kwargs),
    }
    if ct2 is not None:
        engines["CTranslate2 int8"] = lambda: ct2_call(ct2, batch)
    with torch.inference_mode():
        ours8, ours32 = int8.generate(prompt, max_new_tokens=args.new), fp32.generate(prompt, max_new_tokens=args.new)
        times = interleaved_medians(engines, repeats=args.repeats, warmup=1)
    # CTranslate2's own clock (without the pipe) replaces the wall time of the call around it
    if ct2 is not None:
        times["CTranslate2 int8"] = ct2_call(ct2, batch, report_median=True)
    rate = {name: batch * args.new / t for name, t in times.items()}
    same = (ours8[:, args.prompt :] == ours32[:, args.prompt :]).float().mean().item()
    print(f"\nbatch {batch}, prompt {args.prompt}, {args.new} new greedy tokens (int8 tokens equal to fp32's: {same:.0%})")
    for name, r in rate.items():
        ratio = f"   ours int8 / this: {rate['ours int8'] / r:.2f}x" if name != "ours int8" else ""
        print(f"  {name:<18} {r:7.1f} tok/s{ratio}")


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
    spec = json.dumps({"dir": str(ct2_dir), "threads": args.threads, "prompt": args.prompt, "new": args.new, "vocab": fp32.config.vocab_size,
                       "vocab_file": str(hf_dir / "vocab.json")})
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
    import statistics

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


# --- prefill -----------------------------------------------------------------------------


def prefill(fp32, int8, length: int, repeats: int) -> None:
    ids = prompt_ids(1, length, fp32.config.vocab_size)
    engines = {"fp32": lambda: fp32(ids), "int8": lambda: int8(ids)}
    fast_bf16, report = cpu_bf16_report()
    if fast_bf16:
        bf16 = GPT2LMHeadModel(fp32.config).eval()
        bf16.load_state_dict(fp32.state_dict())
        bf16.quantize("bf16")
        engines["bf16"] = lambda: bf16(ids)
    with torch.inference_mode():
        times = interleaved_medians(engines, repeats=repeats, warmup=1)
    print(f"\nprefill: forward of B=1, T={length} (logits for every position)")
    for name, t in times.items():
        print(f"  {name:<5} {1000 * t:8.0f} ms   fp32 / this: {times['fp32'] / t:.2f}x")
    if not fast_bf16:
        a, b = torch.randn(length, 768), torch.randn(768, 3072)
        with torch.inference_mode():
            t32 = median_seconds(lambda: a @ b, repeats=3, warmup=1)
            t16 = median_seconds(lambda: a.bfloat16() @ b.bfloat16(), repeats=3, warmup=1)
        print(f"  bf16 not run: {report}; same run, ({length}x768) @ (768x3072): "
              f"fp32 {1000 * t32:.1f} ms, bf16 {1000 * t16:.1f} ms ({t16 / t32:.0f}x slower)")


# --- the per-layer kernel table ----------------------------------------------------------


def layer_table(cfg: GPT2Config) -> None:
    """Time each kernel on each (in, out) matrix shape of gpt2-small at 1, 8 and 512 rows."""
    from gpt2attn.layers import Conv1D
    from gpt2attn.model import LMHead
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
        dynamic = Int8Linear(weight, bias)
        kernels = {"fp32": fp, "fbgemm dynamic int8": dynamic}
        kernels.update(weight_only_kernels(weight, bias))
        for rows in (1, 8, 512):
            x = torch.randn(rows, n_in)
            cells = []
            with torch.inference_mode():
                reference = fp(x)
                for kernel, fn in kernels.items():
                    if rows == 512 and kernel not in ("fp32", "fbgemm dynamic int8"):
                        continue
                    t = min_seconds(lambda: fn(x), n=3 if rows == 512 or n_out > 10000 else 10)
                    err = (fn(x) - reference).abs().max().item() / reference.abs().max().item()
                    cells.append(f"{kernel} {1000 * t:.3f} (err {err:.3f})")
            print(f"  {name:<11} {rows:>3} x {n_in} -> {n_out}: " + " | ".join(cells))


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


# --- quality -----------------------------------------------------------------------------


@torch.no_grad()
def quality(fp32, int8) -> None:
    ids = prompt_ids(1, 128, fp32.config.vocab_size)
    a, b = fp32(ids).logits, int8(ids).logits
    err = (b - a).abs().max().item() / a.abs().max().item()
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    print(f"\nrandom gpt2-small, B=1, T=128: max |int8 - fp32| / max |fp32| logit = {err:.4f}; "
          f"same argmax at {agree:.0%} of positions")
    text_file = SHAKESPEARE
    from gpt2attn.shipped import DEFAULT_MODEL_DIR
    from gpt2attn.tokenizer import load_tokenizer

    tok = load_tokenizer(DEFAULT_MODEL_DIR)
    char32 = GPT2LMHeadModel.from_pretrained(DEFAULT_MODEL_DIR)
    char8 = GPT2LMHeadModel.from_pretrained(DEFAULT_MODEL_DIR, quantize="int8")
    if text_file.exists():
        text = text_file.read_text()
        val = torch.tensor(tok.encode(text[int(len(text) * 0.9) :]).ids)
        blocks = val[: 64 * 128].view(64, 128)
        l32, l8 = char32(blocks, labels=blocks).loss.item(), char8(blocks, labels=blocks).loss.item()
        print(f"char model, validation loss on 64 x 128 characters: fp32 {l32:.4f}, int8 {l8:.4f} "
              f"({100 * (l8 - l32) / l32:+.2f}%)")
    else:
        print(f"{text_file} is absent: validation loss skipped")
    from gpt2attn.commands.generate import continue_ids  # the generate command's sliding window

    for prompt in ("ROMEO:", "To be, or not to be", "The king"):
        for name, model in (("fp32", char32), ("int8", char8)):
            new = list(continue_ids(model, tok.encode(prompt).ids, 200, do_sample=False))
            print(f"--- {name}, greedy, 200 new characters:\n{prompt}{tok.decode(new)}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--ct2-worker":
        ct2_serve(sys.argv[2])
    else:
        sys.exit(main(sys.argv[1:]))
