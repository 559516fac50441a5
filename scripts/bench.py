"""Benchmarks against transformers, run in one process: `python scripts/bench.py NAME [options]`.

NAME is one of forward, load, generate, train, recipe, explore; each lives in scripts/bench_NAME.py and
prints its figures and the ratios. Benchmarks are never part of the test suite.
"""

from __future__ import annotations

import importlib
import sys

BENCHES = ("forward", "load", "generate", "train", "recipe", "explore")


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHES:
        print(f"usage: python scripts/bench.py {{{','.join(BENCHES)}}} [options]", file=sys.stderr)
        return 2
    module = importlib.import_module(f"bench_{argv[0]}")
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
