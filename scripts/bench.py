"""Every benchmark, one way in: `python scripts/bench.py NAME [--no-save] [options]`.

NAME is one of BENCHES (below; `python scripts/bench.py` alone lists them), each in
scripts/bench_NAME.py (`python scripts/bench.py NAME --help`: its options). A bench prints its
figures and the ratios, and returns its table rows; this script writes those rows with the date,
the machine (CPU model and flags, cores, threads), torch's version and the command to
docs/benchmarks/results/NAME.json (the latest run of each bench on each CPU family; --no-save to
keep the old one); `python scripts/render_benchmarks.py` then renders docs/benchmarks.md from the
result files. A bench that returns an exit status instead prints only. Benchmarks are never part
of the test suite.
"""

from __future__ import annotations

import datetime
import importlib
import sys

from bench_common import write_results

# name -> what it measures (scripts/bench_NAME.py's docstring says how)
BENCHES = {
    "forward": "the forward pass of gpt2-small, ours vs transformers",
    "load": "from_pretrained and every format's reader, ours vs transformers",
    "generate": "generate() vs transformers' (greedy fp32 and int8, also vs CTranslate2; beam search; assisted)",
    "decode": "CPU decoding and prefill in every precision vs llama.cpp on the same weights, against the read rate",
    "step": "where a batch-1 decode step's time goes, per precision (--layers: each int8 kernel per layer shape)",
    "train": "one training step against its matrix products and kernels alone",
    "recipe": "the CPU training recipe end to end vs nanoGPT's train.py",
    "memory": "peak memory of loading, generating and converting, and of llama.cpp on the same files",
    "explore": "building and opening `gpt2attn explore`'s page",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHES:
        names = "\n".join(f"  {name:<9} {what}" for name, what in BENCHES.items())
        print(f"usage: python scripts/bench.py NAME [--no-save] [options]\n\nNAME:\n{names}", file=sys.stderr)
        return 2
    bench, args = argv[0], [a for a in argv[1:] if a != "--no-save"]
    started = datetime.datetime.now(datetime.timezone.utc)
    rows = importlib.import_module(f"bench_{bench}").main(args)
    if isinstance(rows, int) or rows is None:  # a bench that prints only (its exit status)
        return rows or 0
    if "--no-save" not in argv:
        print(f"results: {write_results(bench, args, rows, started)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
