"""Shared by the scripts/bench_*.py benchmarks: timing, a matmul roofline, machine facts."""

from __future__ import annotations

import os
import platform
import resource
import statistics
import time
from collections.abc import Callable

import torch


def median_seconds(fn: Callable[[], object], repeats: int = 10, warmup: int = 2) -> float:
    """Median wall time of fn() over `repeats` runs after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def interleaved_medians(
    fns: dict[str, Callable[[], object]], repeats: int = 10, warmup: int = 2, per_turn: int = 1
) -> dict[str, float]:
    """Median wall time of each fn, timed in turns (a, b, c, a, b, c, ...), so that a change in
    machine load during the run affects every contender alike.

    With per_turn > 1 a turn is one untimed call and then per_turn timed ones: what a loop that
    calls one model over and over sees, with the caches and the allocator's free lists holding
    that model's state rather than the previous contender's.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if per_turn > 1:
                fn()
            for _ in range(per_turn):
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def matmul_gflops(n: int = 2048, repeats: int = 5) -> float:
    """Achieved GFLOP/s of an n x n fp32 matmul: the machine's practical compute ceiling."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    with torch.inference_mode():
        t = median_seconds(lambda: a @ b, repeats=repeats)
    return 2 * n**3 / t / 1e9


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def machine_line() -> str:
    return (
        f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
