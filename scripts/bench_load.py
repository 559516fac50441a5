"""Loading a gpt2-small-sized safetensors checkpoint: gpt2attn vs transformers; and gpt2attn
loading the same weights from an llm.c model file (gpt2_124M.bin, fp32) and from an F16 GGUF with
GPT-2's tokenizer embedded (as llama.cpp's converter writes it), plus how fast each GGML quantized
type dequantizes (MB/s of float32 weights out, and of the quantized bytes in).

`python scripts/bench.py load [--repeats N]` writes a random 124M-parameter checkpoint to a
temporary folder, then times `GPT2LMHeadModel.from_pretrained` in fresh processes (ours and
transformers' in turns, after one untimed warm-up each so both read from the page cache) and
records each process's peak RSS. Imports are not timed. Because gpt2attn maps the file and
reads pages only when used, "load + forward" (one 8-token forward pass after loading) is
reported too: it touches every weight.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from bench_common import machine_line

CHILD = r"""
import json, sys, time
import torch
lib, folder = sys.argv[1:3]
if lib.startswith("gpt2attn"):
    from gpt2attn import GPT2LMHeadModel
else:
    from transformers import GPT2LMHeadModel
def rss():  # peak resident MiB of this process image (ru_maxrss would include the parent's, from fork)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024
before = rss()
t0 = time.perf_counter()
model = GPT2LMHeadModel.from_pretrained(folder)
t1 = time.perf_counter()
loaded = rss()
with torch.no_grad():
    model(torch.zeros(1, 8, dtype=torch.long))
t2 = time.perf_counter()
print(json.dumps({"load": t1 - t0, "load_forward": t2 - t0, "rss_before": before, "rss_loaded": loaded, "rss_peak": rss()}))
"""


def run_child(lib: str, folder: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, lib, str(folder)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{lib} child failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> dict[str, list[dict]]:
    parser = argparse.ArgumentParser(prog="bench.py load")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)

    from gpt2attn import GPT2Config, GPT2LMHeadModel
    from gpt2attn.formats import save

    print(machine_line())
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        torch.manual_seed(0)
        GPT2LMHeadModel(GPT2Config()).save_pretrained(folder)  # gpt2-small shapes, random weights
        save(GPT2LMHeadModel.from_pretrained(folder), folder / "gpt2_124M.bin", dtype="fp32")
        save(GPT2LMHeadModel.from_pretrained(folder), folder / "gpt2-f16.gguf", dtype="f16", tokenizer=gpt2_tokenizer())
        ckpt_mib = (folder / "model.safetensors").stat().st_size / 2**20
        print(f"checkpoint: {folder / 'model.safetensors'}, {ckpt_mib:.0f} MiB (fp32, gpt2-small shapes)")
        sources = {"gpt2attn": folder, "transformers": folder, "gpt2attn llm.c": folder / "gpt2_124M.bin",
                   "gpt2attn gguf": folder / "gpt2-f16.gguf"}
        libs = tuple(sources)
        for lib in libs:
            run_child(lib, sources[lib])  # warm-up: page cache, .pyc files
        runs: dict[str, list[dict]] = {lib: [] for lib in libs}
        for _ in range(args.repeats):
            for lib in libs:
                runs[lib].append(run_child(lib, sources[lib]))

    med = {lib: {key: statistics.median(r[key] for r in runs[lib]) for key in runs[lib][0]} for lib in libs}
    print(f"\nmedian of {args.repeats} fresh processes each (imports not timed):")
    print(f"{'':<14} {'load s':>8} {'load+fwd s':>11} {'RSS after import':>17} {'peak RSS':>10} {'peak/ckpt':>10} {'(peak-import)/ckpt':>19}")
    for lib in libs:
        m = med[lib]
        print(
            f"{lib:<14} {m['load']:8.3f} {m['load_forward']:11.3f} {m['rss_before']:13.0f} MiB {m['rss_peak']:6.0f} MiB "
            f"{m['rss_peak'] / ckpt_mib:10.2f} {(m['rss_peak'] - m['rss_before']) / ckpt_mib:19.2f}"
        )
    ours, theirs = med["gpt2attn"], med["transformers"]
    print(f"\nspeed-up (transformers / gpt2attn): load {theirs['load'] / ours['load']:.2f}x, "
          f"load+forward {theirs['load_forward'] / ours['load_forward']:.2f}x  (target >= 2x)")
    print(f"peak RSS gpt2attn / checkpoint bytes: {ours['rss_peak'] / ckpt_mib:.2f}  (target <= 1.3); "
          f"transformers: {theirs['rss_peak'] / ckpt_mib:.2f}")
    llmc = med["gpt2attn llm.c"]
    print(f"gpt2attn, llm.c .bin / safetensors: load {llmc['load'] / ours['load']:.2f}x, "
          f"load+forward {llmc['load_forward'] / ours['load_forward']:.2f}x")
    gguf = med["gpt2attn gguf"]
    print(f"gpt2attn, F16 GGUF (tokenizer embedded) / safetensors: load {gguf['load'] / ours['load']:.2f}x "
          f"(target <= 2x), load+forward {gguf['load_forward'] / ours['load_forward']:.2f}x")
    loading = [
        {"gpt2-small (fp32, random weights), fresh process": {
            "gpt2attn": "gpt2attn, safetensors folder", "transformers": "transformers, same folder",
            "gpt2attn llm.c": "gpt2attn, llm.c gpt2_124M.bin (fp32)",
            "gpt2attn gguf": "gpt2attn, F16 GGUF with tokenizer"}[lib],
         "load s": round(med[lib]["load"], 3), "load + first forward s": round(med[lib]["load_forward"], 3),
         "load / gpt2attn safetensors": f"{med[lib]['load'] / ours['load']:.2f}x",
         "peak RSS / checkpoint bytes": round(med[lib]["rss_peak"] / ckpt_mib, 2)}
        for lib in libs
    ]
    return {f"loading, median of {args.repeats} fresh processes each (imports not timed)": loading,
            "dequantizing a 3072 x 768 weight read from a GGUF file": dequantize_speeds()}


def gpt2_tokenizer():
    """GPT-2's BPE, from the GGUF fixture that llama.cpp's converter wrote (tests/data/gguf)."""
    from gpt2attn.formats.gguf import tokenizer_of

    return tokenizer_of(Path(__file__).resolve().parent.parent / "tests" / "data" / "gguf" / "tiny-f16.gguf")


def dequantize_speeds(rows: int = 3072, cols: int = 768, repeats: int = 5) -> list[dict]:
    """Each GGML type we read: one gpt2-small MLP weight (3072 x 768) in a GGUF file, read back by
    GGUFFile.tensor (the path from_pretrained takes); median of `repeats`."""
    import time

    import gguf
    import numpy as np

    from gpt2attn.formats.gguf import GGUFFile, READ_TYPES

    weights = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    print(f"\ndequantizing a {rows} x {cols} weight (read from a GGUF file, to float32), median of {repeats}:")
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in READ_TYPES:
            kind = gguf.GGMLQuantizationType[name]
            try:
                data = gguf.quants.quantize(weights, kind)
            except NotImplementedError:  # the K-quants: gguf-py dequantizes them only; random blocks, sane scales
                block, size = gguf.GGML_QUANT_SIZES[kind]
                data = np.random.default_rng(1).integers(0, 256, (rows, cols // block * size), dtype=np.uint8)
                for offset in {"Q6_K": (208,)}.get(name, (0, 2)):  # each block's f16 scales (d, dmin)
                    data.reshape(rows, -1, size)[:, :, offset : offset + 2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
            path = Path(tmp) / f"{name}.gguf"
            writer = gguf.GGUFWriter(path, "gpt2")
            writer.add_tensor("w", data, raw_dtype=kind)
            writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
            file = GGUFFile(path)
            if name == "F32":  # read as a view of the mapped file: nothing is copied, so there is no rate to time
                print("    F32: a view of the file, nothing copied")
                table.append({"GGML type": name, "MB/s of float32 out": "a view (no copy)",
                              "MB/s of quantized bytes in": "a view (no copy)"})
                continue
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                file.tensor("w")
                times.append(time.perf_counter() - start)
            seconds = statistics.median(times)
            print(f"  {name:>5}: {weights.nbytes / seconds / 1e6:8.0f} MB/s out, {data.nbytes / seconds / 1e6:7.0f} MB/s in"
                  f"  (target >= 200 MB/s)")
            table.append({"GGML type": name, "MB/s of float32 out": round(weights.nbytes / seconds / 1e6),
                          "MB/s of quantized bytes in": round(data.nbytes / seconds / 1e6)})
    return table


if __name__ == "__main__":
    main(sys.argv[1:])  # prints only; scripts/bench.py load also writes the result file
