"""Hand-planted bugs in the C++ kernels (gpt2attn/kernels/*.cpp, simd.h): does a test notice each?

    python scripts/kernel_mutants.py                 # every mutant in MUTANTS
    python scripts/kernel_mutants.py --only 3 7      # some of them, by number
    python scripts/kernel_mutants.py --list          # print the list and stop

mutmut mutates Python only, so the kernels get a list of textual mutants instead: each replaces one
exact piece of a source file (which must occur there exactly once) with a plausible wrong one: an
off-by-one loop bound, a dropped tail loop, a wrong constant, a swapped operand. For each mutant
the package and tests are copied into a scratch folder, the mutant is applied there, the kernels
are built from it into a cache of their own ($GPT2ATTN_CACHE), and the kernel tests run against
that build. A mutant is "killed" when a test fails, "survived" when they all pass, and "not built"
when the compiler refuses it or the build cannot load (then every kernel test would skip, so it is
not counted either way). Needs a CPU and compiler the kernels build with.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = ["tests/kernels/test_kernels.py", "tests/kernels/test_decode_step.py"]

# (file under gpt2attn/kernels/, the exact original text, its replacement, what the bug is)
MUTANTS = [
    ("decode.cpp", "for (; i < n; i++) t += a[i] * b[i];", "for (; i + 1 < n; i++) t += a[i] * b[i];",
     "dot: the scalar tail skips the last element"),
    ("decode.cpp", "    float inv = 1.0f / std::sqrt((float)(var / C) + eps), m = (float)mean;",
     "    float inv = 1.0f / std::sqrt((float)(var / C)), m = (float)mean;", "layer_norm without eps"),
    ("decode.cpp", "    float inv = 1.0f / std::sqrt((float)(var / C) + eps), m = (float)mean;",
     "    float inv = 1.0f / std::sqrt((float)(var / (C - 1)) + eps), m = (float)mean;",
     "layer_norm: the unbiased variance (C - 1) instead of torch's biased one"),
    ("decode.cpp", "inline float gelu1(float x) { return 0.5f * x * (1.0f + std::tanh(0.7978845608f * (x + 0.044715f * x * x * x))); }",
     "inline float gelu1(float x) { return 0.5f * x * (1.0f + std::tanh(0.7978845608f * (x + 0.44715f * x * x * x))); }",
     "gelu1 (the scalar tail): the cubic coefficient 10x too big"),
    ("decode.cpp", "_mm256_mul_ps(_mm256_set1_ps(0.044715f), x), x));",
     "_mm256_mul_ps(_mm256_set1_ps(0.04715f), x), x));", "gelu8: a wrong cubic coefficient"),
    ("decode.cpp", "    for (int64_t t = 0; t < T; t++) {\n        p[t] = key_mask",
     "    for (int64_t t = 0; t < T - 1; t++) {\n        p[t] = key_mask", "attention: the scores skip the newest key"),
    ("decode.cpp", "dot(q, keys + t * hs, hs) * scale;", "dot(q, keys + t * hs, hs);",
     "attention: scores not scaled by 1/sqrt(head size)"),
    ("decode.cpp", "for (; t < T; t++) p[t] = std::exp(p[t] - top);", "for (; t < T; t++) p[t] = std::exp(p[t]);",
     "softmax tail: no max subtracted (overflows on large scores)"),
    ("decode.cpp", "memcpy(values + pos * hs, v, hs * sizeof(float));", "memcpy(values + pos * hs, k, hs * sizeof(float));",
     "the cache stores the key as the value"),
    ("decode.cpp", "const float* wpe = m.wpe + (positions ? positions[b] : pos) * C;",
     "const float* wpe = m.wpe + (positions ? positions[b] : pos + 1) * C;", "position embedding off by one"),
    ("decode.cpp", "products.product(L.c_fc, h.data(), f.data(), inner, GELU);",
     "products.product(L.c_fc, h.data(), f.data(), inner, STORE);", "the MLP without its GELU"),
    ("decode.cpp", "        if (op == ADD) v = _mm256_add_ps(v, _mm256_loadu_ps(y + i));\n",
     "", "finish: the vector path drops the residual add"),
    ("decode.cpp", "for (int64_t k = 0; k < K; k++) s += x[b * K + k] * widen(w[r * K + k], bf16);",
     "for (int64_t k = 0; k + 1 < K; k++) s += x[b * K + k] * widen(w[r * K + k], bf16);",
     "rows: the scalar rows (the head's last, odd K) skip the last input"),
    ("decode.cpp", "        if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + i));\n",
     "", "finish: the vector path drops the bias"),
    ("decode.cpp", "for (int64_t n = 0; n < N; n++) mine[b * N + n] += xk * w[k * N + n];",
     "for (int64_t n = 0; n < N; n++) mine[b * N + n] = xk * w[k * N + n];",
     "cols: the leftover inputs (K not a multiple of 8) overwrite instead of add"),
    ("decode.cpp", "r[i + 4] = _mm256_permute2f128_ps(quads[i], quads[i + 4], 0x31);",
     "r[i + 4] = _mm256_permute2f128_ps(quads[i], quads[i + 4], 0x21);",
     "transpose8: the last four columns take the wrong halves"),
    ("decode.cpp", "        float* to = packed + s * rows * width + j;",
     "        float* to = packed + s * rows * width;", "a rows weight's transposed copy: every 8 rows into the first 8 columns"),
    ("decode.cpp", "to[(k - k0) * width + i] = gpt2attn::widen(from[i * K + k], bf16);",
     "to[(k - k0) * width + i] = gpt2attn::widen(from[i * K + k0], bf16);",
     "a rows weight's transposed copy: the k's after the last 8 take the block's first"),
    ("decode.cpp", "s = std::fma(x[b * K + k], src.at(k, n), s);", "s = std::fma(x[b * K + k], src.at(k, n), 0.0f);",
     "the cols tiles' last columns keep only the last product"),
    ("decode.cpp", "finish(y + i0, x + i0, nullptr, std::min(CHUNK, n - i0), GELU);",
     "finish(y + i0, x + i0, nullptr, std::min(CHUNK, n - i0) / 8 * 8, GELU);",
     "the prompt's GELU: the values after the last 8 left unwritten"),
]


def apply(root: Path, index: int) -> None:
    name, old, new, _ = MUTANTS[index]
    path = root / "gpt2attn" / "kernels" / name
    text = path.read_text()
    count = text.count(old)
    if count != 1:
        raise SystemExit(f"mutant {index}: its text occurs {count} times in {name}, not once: update MUTANTS")
    path.write_text(text.replace(old, new))


def run_mutant(index: int, workdir: Path, timeout: float) -> dict:
    root = workdir / f"m{index:02d}"
    for part in ("gpt2attn", "tests", "configs", "docs", "scripts"):  # scripts: the read-rate benchmark the tests import
        shutil.copytree(REPO / part, root / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(REPO / "pyproject.toml", root / "pyproject.toml")
    apply(root, index)
    env = dict(os.environ, PYTHONPATH=str(root), GPT2ATTN_CACHE=str(root / "cache"), OMP_NUM_THREADS="2")
    built = subprocess.run([sys.executable, "-W", "ignore", "-c",
                            "import sys; from gpt2attn import kernels; sys.exit(0 if kernels.available() else 3)"],
                           cwd=root, env=env, capture_output=True, text=True)
    if built.returncode != 0:
        return {"outcome": "not built", "seconds": 0.0}
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *TESTS],
                              cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        outcome = "survived" if done.returncode == 0 else "killed"
        first = next((line for line in done.stdout.splitlines() if line.startswith("FAILED")), "")
    except subprocess.TimeoutExpired:
        outcome, first = "killed", f"timed out after {timeout:.0f} s"
    return {"outcome": outcome, "seconds": round(time.perf_counter() - start, 1), "by": first}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", type=int, nargs="+", help="run only these mutants (numbers from --list)")
    ap.add_argument("--list", action="store_true", help="print the mutants and stop")
    ap.add_argument("--timeout", type=float, default=600, help="seconds for one mutant's tests (default 600)")
    ap.add_argument("--workdir", type=Path, help="scratch folder (default: a new temporary one; kept)")
    args = ap.parse_args(argv)
    if args.list:
        for i, (name, _, _, why) in enumerate(MUTANTS):
            print(f"{i:2d}  {name:10}  {why}")
        return 0
    chosen = args.only if args.only is not None else list(range(len(MUTANTS)))
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="gpt2attn-kernel-mutants-"))
    workdir.mkdir(parents=True, exist_ok=True)
    results = {}
    for i in chosen:
        results[i] = {"file": MUTANTS[i][0], "bug": MUTANTS[i][3], **run_mutant(i, workdir, args.timeout)}
        print(f"{i:2d}  {results[i]['outcome']:9}  {MUTANTS[i][0]:10}  {MUTANTS[i][3]}", flush=True)
    counted = [r for r in results.values() if r["outcome"] != "not built"]
    killed = sum(r["outcome"] == "killed" for r in counted)
    print(f"\n{killed} of {len(counted)} killed" + (f" ({len(results) - len(counted)} not built)" if len(counted) < len(results) else ""))
    (workdir / "summary.json").write_text(json.dumps(results, indent=1))
    print(f"details: {workdir / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
