"""Peak memory: one process loading a GPT-2 and generating, in each quantize mode, writing GGUF
files, and llama.cpp running those files; gpt2-medium, -large and -xl shapes, random weights.

    python scripts/bench.py memory [--sizes gpt2-medium,gpt2-large,gpt2-xl] [--modes fp32,bf16,int8]
                                   [--gguf f16,q8_0] [--from-gguf f16:fp16,q8_0:int8]
                                   [--llama-cpp PATH/TO/llama-bench] [--tokens 8]

Each size's random model is written once to a temporary folder (safetensors, with a synthetic
byte-level tokenizer so that llama.cpp can load the GGUF files), by a child process that then
exits. Every case then runs in a fresh process, one at a time, and reports its peak resident
memory (the kernel's high-water mark, VmHWM) and what it holds at the end (VmRSS):
  - `GPT2LMHeadModel.from_pretrained(folder, quantize=MODE)` and greedy generation of --tokens new
    tokens after a 16-token prompt, for each of --modes (any mode quantize() takes; a mode it
    refuses is reported as such);
  - `gpt2attn convert folder model-KIND.gguf --dtype KIND` for each of --gguf (f32 too when
    llama.cpp runs, for its f32 row);
  - `GPT2LMHeadModel.from_pretrained(model-KIND.gguf, quantize=MODE)` and the same generation, for
    each KIND:MODE of --from-gguf whose KIND was written (the file's tensors widened or
    dequantized to fp32 one matrix at a time as they are packed);
  - with --llama-cpp: llama.cpp's llama-bench (a 16-token prompt and --tokens new ones, one
    repetition) on each GGUF file, its peak read by a wrapper process (getrusage of its child).
The ratios are each case's peak over the fp32 load's peak of the same size. Memory-mapped file
pages count as resident once read, for llama.cpp as for us. The files are deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_common import machine_line

GIB = 2**30
SIZES = ("gpt2-medium", "gpt2-large", "gpt2-xl")

# The children: each prints one JSON line last. Memory is read from /proc/self/status (KiB).
STATUS = r"""
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) * 1024
"""
WRITE_MODEL = STATUS + r"""
import sys, torch
from gpt2attn import GPT2Config, GPT2LMHeadModel
sys.path.insert(0, sys.argv[3])
from bench_decode import synthetic_tokenizer
size, folder = sys.argv[1:3]
torch.manual_seed(0)
config = GPT2Config.from_preset(size)
GPT2LMHeadModel(config).save_pretrained(folder)
synthetic_tokenizer(config.vocab_size).save(f"{folder}/tokenizer.json")
print("{}")
"""
GENERATE = STATUS + r"""
import json, sys, torch
from gpt2attn import GPT2LMHeadModel
folder, mode, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
try:
    model = GPT2LMHeadModel.from_pretrained(folder, quantize=mode)
except ValueError as e:  # a mode this version of quantize() does not take
    print(json.dumps({"refused": str(e)}))
    sys.exit(0)
loaded = status("VmRSS")
prompt = torch.arange(16).unsqueeze(0) * 997 % model.config.vocab_size
model.generate(prompt, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
print(json.dumps({"peak": status("VmHWM"), "loaded": loaded, "end": status("VmRSS")}))
"""
CONVERT = STATUS + r"""
import json, sys
from gpt2attn.cli import main
folder, out, kind = sys.argv[1:4]
code = main(["convert", folder, out, "--dtype", kind])
print(json.dumps({"peak": status("VmHWM"), "end": status("VmRSS"), "code": code}))
"""
# llama.cpp's peak: this wrapper's only child is llama-bench, so RUSAGE_CHILDREN's maxrss is its peak (KiB).
LLAMA = r"""
import json, resource, subprocess, sys
done = subprocess.run(sys.argv[1:], capture_output=True, text=True)
if done.returncode:
    sys.exit(done.stderr[-2000:])
print(json.dumps({"peak": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
"""


def child(code: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"child {args} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> dict[str, list[dict]]:
    parser = argparse.ArgumentParser(prog="bench.py memory")
    parser.add_argument("--sizes", default=",".join(SIZES), help="comma-separated presets (their shapes, random weights)")
    parser.add_argument("--modes", default="fp32,bf16,int8", help="comma-separated quantize modes; fp32 first "
                        "(the ratios' reference)")
    parser.add_argument("--gguf", default="f16,q8_0", help="comma-separated GGUF types to write")
    parser.add_argument("--from-gguf", default="f16:fp16,q8_0:int8",
                        help="comma-separated KIND:MODE: load the KIND GGUF written with quantize=MODE")
    parser.add_argument("--llama-cpp", help="path of llama.cpp's llama-bench binary: run it on the GGUF files")
    parser.add_argument("--tokens", type=int, default=8, help="new tokens generated")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    modes, kinds = args.modes.split(","), args.gguf.split(",")
    if modes[0] != "fp32":
        parser.error("--modes must start with fp32, the reference of the ratios")
    if args.llama_cpp and "f32" not in kinds:
        kinds = ["f32", *kinds]
    scripts = Path(__file__).resolve().parent
    print(machine_line())
    tables: dict[str, list[dict]] = {}
    for size in args.sizes.split(","):
        rows = []
        with tempfile.TemporaryDirectory(prefix=f"bench-memory-{size}-") as tmp:
            folder = Path(tmp) / size
            child(WRITE_MODEL, size, folder, scripts)
            checkpoint = (folder / "model.safetensors").stat().st_size
            print(f"{size}: {folder / 'model.safetensors'}, {checkpoint / GIB:.2f} GiB")

            def add(case: str, result: dict) -> None:
                reference = rows[0]["peak GiB"] if rows else result["peak"] / GIB
                rows.append({
                    f"{size} shapes (random weights)": case,
                    "peak GiB": round(result["peak"] / GIB, 3),
                    "at the end GiB": round(result["end"] / GIB, 3) if "end" in result else "",
                    "peak / fp32 load": f"{result['peak'] / GIB / reference:.2f}x",
                })
                print(f"  {case}: peak {result['peak'] / GIB:.2f} GiB ({rows[-1]['peak / fp32 load']})", flush=True)

            for mode in modes:
                result = child(GENERATE, folder, mode, args.tokens)
                if "refused" in result:
                    print(f"  quantize={mode!r}: {result['refused']}")
                    continue
                add(f"gpt2attn from_pretrained(quantize={mode!r}) + generate {args.tokens}", result)
            files = {}
            for kind in kinds:
                files[kind] = Path(tmp) / f"{size}-{kind}.gguf"
                add(f"gpt2attn convert to a {kind} GGUF", child(CONVERT, folder, files[kind], kind))
            for kind, mode in (pair.split(":") for pair in args.from_gguf.split(",") if pair):
                if kind in files:
                    add(f"gpt2attn from_pretrained({kind} GGUF, quantize={mode!r}) + generate {args.tokens}",
                        child(GENERATE, files[kind], mode, args.tokens))
            if args.llama_cpp:
                for kind, path in files.items():
                    cmd = [args.llama_cpp, "-m", path, "-p", "16", "-n", str(args.tokens), "-r", "1",
                           "-t", str(args.threads)]
                    add(f"llama.cpp llama-bench on the {kind} GGUF ({path.stat().st_size / GIB:.2f} GiB)",
                        child(LLAMA, *cmd))
        tables[f"{size} shapes: peak resident memory of one process, fresh processes one at a time"] = rows
    return tables
