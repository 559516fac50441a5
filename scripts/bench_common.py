"""Shared by the scripts/bench_*.py benchmarks: timing, a matmul roofline, the read rate, bytes per token, machine facts, result files."""

from __future__ import annotations

import ctypes
import datetime
import functools
import json
import os
import platform
import resource
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from gpt2attn import cpu, kernels

# The project's shared data (../shared/data beside the checkout), or $GPT2ATTN_SHARED_DATA, as the tests find it.
SHARED_DATA = Path(os.environ.get("GPT2ATTN_SHARED_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))
SHAKESPEARE = SHARED_DATA / "tinyshakespeare" / "input.txt"


def read_text_file(path: Path, flag: str = "--data") -> str:
    """The UTF-8 text at path; a missing file ends the script with one line naming the way to give
    one (`flag`, or GPT2ATTN_SHARED_DATA for the shared data), not a traceback."""
    if not Path(path).is_file():
        shared = " (the project's shared data: ../shared/data beside the checkout, or $GPT2ATTN_SHARED_DATA)" \
            if Path(path).is_relative_to(SHARED_DATA) else ""
        raise SystemExit(f"{Path(sys.argv[0]).name}: error: {path}: no such file{shared}; give a text file with {flag} PATH")
    return Path(path).read_text(encoding="utf-8")


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


@functools.lru_cache(maxsize=None)
def _read_rate_library() -> ctypes.CDLL | None:
    """scripts/read_rate.cpp, built with the kernels' flags into their cache; None where the
    kernels cannot be built here."""
    if not kernels.available():
        return None
    lib = ctypes.CDLL(str(kernels.build([Path(__file__).with_name("read_rate.cpp")], kernels.FLAGS, [])))
    lib.read_sum.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    lib.read_sum.restype = ctypes.c_float
    return lib


def read_sum(x: torch.Tensor, streams: int = 8) -> float:
    """The sum of a contiguous fp32 tensor, read once on all of torch's threads, each thread's share
    as `streams` runs read in step (how fast this machine reads memory: the decoding benchmarks'
    limit); torch's sum where the kernels cannot be built."""
    lib = _read_rate_library()
    if lib is None:
        return x.sum().item()
    assert x.dtype == torch.float32 and x.is_contiguous() and streams >= 1
    return lib.read_sum(x.data_ptr(), x.numel(), torch.get_num_threads(), streams)


def read_buffer(n: int) -> torch.Tensor:
    """n fp32 values to measure the read rate on: in memory asked for 2 MiB pages where the system
    gives them (gpt2attn.quantize.WeightArena, where quantize() keeps its weights), since on 4 kB
    pages this machine's memory read up to 30% slower (one stream a thread, a 2-core AMD EPYC Zen 4
    VM, 2026-11-28); torch's own memory where it cannot."""
    from gpt2attn.quantize import WeightArena

    return WeightArena().empty(torch.Size([n]), torch.float32).fill_(1.0)


def weight_bytes(model) -> int:
    """Bytes a decode step of a quantize()d model reads: every CpuLinear's weight (and int8 scales;
    q4's blocks)."""
    from gpt2attn.quantize import CpuLinear

    total = 0
    for mod in model.modules():
        if isinstance(mod, CpuLinear):
            for t in (getattr(mod, name, None) for name in ("weight", "weight16", "scale", "grouped")):
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
    return total


def machine_line() -> str:
    facts = machine_facts()
    return (
        f"machine: {facts['cpu']} ({platform.machine()}; {facts['core'] + '; ' if facts['core'] else ''}{', '.join(facts['cpu_flags']) or 'no listed SIMD flags'}), "
        f"{facts['cores']} cores, torch {facts['torch']}, {facts['threads']} threads"
    )


# --- result files ----------------------------------------------------------------------------
# A bench module's main(argv) returns its rows (a list of dicts, one table row each, the same keys
# in every row), or several such tables as {caption: rows}; scripts/bench.py writes them with the
# facts below to RESULTS_DIR/<bench>.json, which keeps the latest run on each CPU family the bench
# has met (a run replaces only its own family's), and scripts/render_benchmarks.py turns those files
# into docs/benchmarks.md, one section per family.

RESULTS_DIR = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "results"
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8", "neon", "asimd")


# CPUID family and model numbers -> core design, for the x86 server cores a bench may meet. A virtual
# machine's model name is often just 'AMD EPYC' or 'Intel(R) Xeon(R) Processor', the same for a Zen 4
# and a Zen 5, whose caches, vector units and memory differ: the numbers tell them apart.
AMD_CORES = {23: [(0x00, 0x2F, "Zen/Zen+"), (0x30, 0xAF, "Zen 2")],
             25: [(0x00, 0x0F, "Zen 3"), (0x10, 0x1F, "Zen 4"), (0x20, 0x5F, "Zen 3"), (0x60, 0x7F, "Zen 4"),
                  (0xA0, 0xAF, "Zen 4")],
             26: [(0x00, 0x4F, "Zen 5")]}
INTEL_CORES = {0x55: "Skylake-SP/Cascade Lake", 0x6A: "Ice Lake-SP", 0x6C: "Ice Lake-SP", 0x8F: "Sapphire Rapids",
               0xCF: "Emerald Rapids", 0xAD: "Granite Rapids", 0xAE: "Granite Rapids", 0xAF: "Sierra Forest"}


def core_design(vendor: str, family: int, model: int) -> str:
    """'Zen 5' for ('AuthenticAMD', 26, 2); 'family F model M' for numbers the tables above lack."""
    if vendor == "AuthenticAMD":
        for low, high, core in AMD_CORES.get(family, []):
            if low <= model <= high:
                return core
    if vendor == "GenuineIntel" and family == 6 and model in INTEL_CORES:
        return INTEL_CORES[model]
    return f"family {family} model {model}"


def cpu_family(machine: dict) -> str:
    """The CPU model, its core design where the run recorded one, and the widest instruction family it
    offers the kernels: 'AMD EPYC (Zen 5), AVX-512'."""
    flags = set(machine["cpu_flags"])
    widest = ("AMX" if "amx_tile" in flags else "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags
              else "NEON" if flags & {"neon", "asimd"} else "no AVX2")
    core = f" ({machine['core']})" if machine.get("core") else ""
    return f"{machine['cpu']}{core}, {widest}"


def same_family(run: dict, record: dict) -> bool:
    """Whether a stored run is of the new record's CPU family. A run from before the core design was
    recorded counts as the same family when its model name and widest instructions match."""
    if run.get("family", cpu_family(run["machine"])) == record["family"]:
        return True
    return "core" not in run["machine"] and cpu_family(run["machine"]) == cpu_family(
        {**record["machine"], "core": None})


def code_version() -> str:
    """The commit the bench ran on, with '-dirty' for uncommitted changes to anything but the
    benchmarks' own result files (an earlier bench's fresh results are not a change to the code
    measured); 'unknown' outside git."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=10)
        outside_results = f":(exclude){RESULTS_DIR.relative_to(root)}"
        changed = subprocess.run(["git", "status", "--porcelain", "--", ".", outside_results], cwd=root,
                                 capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if head.returncode != 0 or not head.stdout.strip():
        return "unknown"
    return head.stdout.strip() + ("-dirty" if changed.returncode != 0 or changed.stdout.strip() else "")


def read_runs(path: Path) -> list[dict]:
    """The runs a result file holds, newest first (a file from before families were kept holds one)."""
    if not path.is_file():
        return []
    data = json.loads(path.read_text(encoding="utf-8"))
    runs = data["runs"] if "runs" in data else [data]
    return sorted(runs, key=lambda run: run["date"], reverse=True)


def machine_facts() -> dict:
    """What a figure depends on: CPU model, core design and the SIMD flags that pick torch's kernels, cores,
    threads, torch and Python versions, and how busy the machine was (read when the run ends)."""
    model, flags, numbers = cpu.name() or platform.machine(), cpu.flags(), cpu.vendor_family_model()
    return {
        "cpu": model,
        "core": core_design(*numbers) if numbers else None,
        "cpu_flags": [flag for flag in CPU_FLAGS if flag in flags],
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
        "load_average_1min": round(os.getloadavg()[0], 2),  # others' work on a shared machine slows every contender
    }


def write_results(bench: str, argv: list[str], rows: list[dict] | dict[str, list[dict]],
                  started: datetime.datetime, results_dir: Path = RESULTS_DIR) -> Path:
    """Record this run (date, machine, commit, command, tables) in results_dir/<bench>.json in place of
    the previous run on the same CPU family; the other families' runs stay as they were."""
    tables = rows if isinstance(rows, dict) else {"": rows}
    for caption, table in tables.items():
        if not table or not all(isinstance(row, dict) and row.keys() == table[0].keys() for row in table):
            raise ValueError(f"bench {bench!r}, table {caption!r}: want a non-empty list of dicts with the same keys, "
                             f"got {table!r}")
    machine = machine_facts()
    record = {
        "bench": bench,
        "date": started.isoformat(timespec="seconds"),
        "family": cpu_family(machine),
        "commit": code_version(),
        "command": shlex.join(["python", "scripts/bench.py", bench, *argv]),
        "machine": machine,
        "tables": tables,
    }
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{bench}.json"
    others = [run for run in read_runs(path) if not same_family(run, record)]
    tmp = path.with_suffix(".json.tmp")
    text = json.dumps({"bench": bench, "runs": [record, *others]}, indent=1, ensure_ascii=False)
    tmp.write_text(text + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path
