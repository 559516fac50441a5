"""Benchmarks against transformers: `python scripts/bench.py NAME [options]`.

NAME is one of forward, load, generate, decode, train, recipe, explore, memory; each lives in scripts/bench_NAME.py
(`generate --llama-cpp PATH` is `decode --llama-cpp PATH`: CPU decoding against llama.cpp),
prints its figures and the ratios, and returns its table rows. This script writes those rows with
the date, the machine (CPU model and flags, cores, threads), torch's version and the command to
docs/benchmarks/results/NAME.json (the latest run of each bench on each CPU family; --no-save to keep the old one);
`python scripts/render_benchmarks.py` then renders docs/benchmarks.md from the result files.
Benchmarks are never part of the test suite.
"""

from __future__ import annotations

import datetime
import importlib
import sys

from bench_common import write_results

BENCHES = ("forward", "load", "generate", "decode", "train", "recipe", "explore", "memory")


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHES:
        print(f"usage: python scripts/bench.py {{{','.join(BENCHES)}}} [--no-save] [options]", file=sys.stderr)
        return 2
    bench, args = argv[0], [a for a in argv[1:] if a != "--no-save"]
    if bench == "generate" and "--llama-cpp" in args:  # the same as `decode --llama-cpp PATH`
        bench = "decode"
    started = datetime.datetime.now(datetime.timezone.utc)
    rows = importlib.import_module(f"bench_{bench}").main(args)
    if isinstance(rows, int) or rows is None:  # a bench that prints only (its exit status)
        return rows or 0
    if "--no-save" not in argv:
        print(f"results: {write_results(bench, args, rows, started)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
