"""Fuzz every file format gpt2attn reads, for a release: thousands of mutated files per format,
each loaded in a worker process under a CPU-time, wall-time and memory limit (tests/fuzzing.py).
Run it from the checkout's root, as a module (it imports the fuzzer as `tests.fuzzing`):

    python -m scripts.fuzz_formats                      # 1000 cases per format, seed 0
    python -m scripts.fuzz_formats --cases 3000 --seed 7 --formats gguf llmc --jobs 2

Prints the count of each outcome per format (loaded / ours / other / slow / memory / crash), then
a reproducer for every failing case; exits 1 if any case failed. A case is replayed with
`python -m tests.fuzzing FORMAT SEED INDEX`.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone

from tests import fuzzing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=1000, help="cases per format (default 1000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--formats", nargs="+", choices=fuzzing.FORMATS, default=list(fuzzing.FORMATS))
    parser.add_argument("--jobs", type=int, default=1, help="worker processes run side by side (default 1)")
    parser.add_argument("--wall", type=float, default=10.0,
                        help="seconds before a case is killed as a hang (default 10; the CPU limit is 2 s)")
    args = parser.parse_args()

    cases = [{"fmt": fmt, "seed": args.seed, "index": i} for i in range(args.cases) for fmt in args.formats]
    chunks = [cases[j:: args.jobs] for j in range(args.jobs)]
    done = [0]
    start = time.monotonic()

    def progress(result: dict) -> None:
        done[0] += 1
        if done[0] % 200 == 0:
            print(f"  {done[0]}/{len(cases)} cases, {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)

    with ThreadPoolExecutor(args.jobs) as pool:
        results = [r for part in pool.map(lambda c: fuzzing.run_cases(c, args.wall, progress), chunks) for r in part]
    seconds = time.monotonic() - start
    print(f"gpt2attn format fuzzer: {len(results)} cases (seed {args.seed}, {args.jobs} job(s)) in {seconds:.0f} s "
          f"on {platform.node()} ({platform.processor() or platform.machine()}, {os.cpu_count()} CPUs), "
          f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC")
    print(fuzzing.summary(results))
    failures = [r for r in results if r["outcome"] in fuzzing.FAILURES]
    for r in failures:
        print(fuzzing.reproducer(r))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
