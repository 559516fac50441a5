"""The bandwidth-bound products of CPU decoding, each a fast kernel beside its pure-torch reference.

A decoding step multiplies a few rows x (B, K) by every weight matrix once, so its time is the
time to read the weights. The kernels in matvec.cpp read each weight once per step, split over
all of torch's threads, and accumulate in fp32:

    cols(x, w, bias)           w (K, N), Conv1D's layout, in fp32, fp16 or bf16     -> (B, N)
    rows(x, w, bias)           w (N, K), nn.Linear's layout (the LM head), same dtypes -> (B, N)
    rows_q8(x, w8, scale, bias) w8 (N, K) int8 with one fp32 scale per row; x quantized per call
                               in blocks of 32 (quantize_q8)                          -> (B, N)

Each has a `_reference` twin in plain torch computing the same sum (to fp32 rounding: the order
of the additions differs; quantize_q8 is exact), used when the kernel is not there.

The kernel is C++ with AVX2, FMA and F16C intrinsics and OpenMP; on a CPU with AVX-512 (F, BW,
VL, DQ and VNNI) it is built with those too, and the rows products then take 16 floats or 64
int8 a step (gpt2attn/kernels/simd.h; GPT2ATTN_AVX512=0 builds the AVX2 kernels alone). It is
compiled on first use with the system's C++ compiler ($CXX, else g++ or c++) into a cache folder
($GPT2ATTN_CACHE, else ~/.cache/gpt2attn) under a name keyed by the source, the flags and this
CPU, so another machine or a changed source builds afresh (seconds; one line on stderr says so),
and loaded with ctypes; a compiler that cannot build the AVX-512 kernels builds the AVX2 ones. It links the OpenMP runtime
torch already loaded (libgomp), so its threads are torch's. Where the CPU lacks AVX2, FMA
or F16C, on non-Linux systems, without a compiler, or with GPT2ATTN_KERNELS=0, every product
takes its reference (a one-line warning says why, once).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings
from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor

SOURCES = [Path(__file__).with_name(name) for name in ("matvec.cpp", "step.cpp")]
HEADERS = [Path(__file__).with_name("simd.h")]  # included by both; part of the build's cache key
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
NEEDS = ("avx2", "fma", "f16c")
AVX512 = {"avx512f": "-mavx512f", "avx512bw": "-mavx512bw", "avx512vl": "-mavx512vl", "avx512dq": "-mavx512dq",
          "avx512_vnni": "-mavx512vnni"}  # /proc/cpuinfo's name -> the compiler's flag
BLOCK = 32  # values per int8 block of x


def available() -> bool:
    """Whether the fast kernels run here (built and loaded); else every product is its reference."""
    return library() is not None


@lru_cache(maxsize=None)
def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; None (with a warning) when they cannot run here."""
    why = _unusable()
    if why is None:
        wanted = flags()
        if not _target(wanted).exists():  # said once: a first build takes seconds with nothing else on screen
            print(f"gpt2attn: compiling the CPU decoding kernels for this CPU, once (cached in {cache_dir()})",
                  file=sys.stderr, flush=True)
        for build_flags in [wanted] + ([FLAGS] if wanted != FLAGS else []):  # a compiler without AVX-512: AVX2 alone
            try:
                lib = _bind(ctypes.CDLL(str(_build(build_flags))))
                lib.build_flags = build_flags  # what instruction_set() reports
                return lib
            except (OSError, subprocess.SubprocessError) as err:
                why = f"building the kernels failed ({str(err).strip().splitlines()[-1] if str(err).strip() else err})"
    if why != "GPT2ATTN_KERNELS=0":
        warnings.warn(f"gpt2attn: CPU decoding kernels unavailable, using plain torch: {why}", RuntimeWarning, 2)
    return None


def _unusable() -> str | None:
    if os.environ.get("GPT2ATTN_KERNELS", "1") == "0":
        return "GPT2ATTN_KERNELS=0"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"they are built for x86-64 Linux, this is {platform.system()} {platform.machine()}"
    missing = [flag for flag in NEEDS if flag not in _cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)}"
    if _compiler() is None:
        return "no C++ compiler found ($CXX, g++ or c++)"
    return None


def flags() -> list[str]:
    """The compiler flags for this CPU: AVX2, FMA and F16C, and AVX-512 where the CPU has all of
    AVX512 (unless GPT2ATTN_AVX512=0)."""
    wide = os.environ.get("GPT2ATTN_AVX512", "1") != "0" and set(AVX512) <= _cpu_flags()
    return FLAGS + (list(AVX512.values()) if wide else [])


def instruction_set() -> str:
    """Which vector instructions the loaded kernels were built with, in words."""
    lib = library()
    if lib is None:
        return "none: plain torch"
    return "AVX-512 (VNNI), AVX2, FMA, F16C" if "-mavx512f" in lib.build_flags else "AVX2, FMA, F16C"


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor()


def cache_dir() -> Path:
    return Path(os.environ.get("GPT2ATTN_CACHE") or Path.home() / ".cache" / "gpt2attn") / "kernels"


def _target(build_flags: list[str]) -> Path:
    """The cached library built from these sources with build_flags by this compiler for this CPU."""
    key = hashlib.sha256()
    for part in (*(source.read_bytes() for source in SOURCES + HEADERS), " ".join(build_flags).encode(), _compiler().encode(), _cpu_name().encode(),
                 " ".join(sorted(_cpu_flags())).encode()):
        key.update(part)
    return cache_dir() / f"matvec-{key.hexdigest()[:16]}.so"


def _build(build_flags: list[str] | None = None) -> Path:
    """Compile the kernels for this CPU with build_flags (default: flags()) into the cache (once per
    source, flags and CPU)."""
    compiler = _compiler()
    build_flags = flags() if build_flags is None else build_flags
    target = _target(build_flags)
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            done = subprocess.run([compiler, *build_flags, *map(str, SOURCES), "-o", str(built)], capture_output=True, text=True)
            if done.returncode != 0:
                raise subprocess.SubprocessError(done.stderr or f"{compiler} exited with {done.returncode}")
            os.replace(built, target)  # atomic: a process beside this one never loads half a file
    return target


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    matvec = [p, i64, i64, p, i64, p, p, i32]
    for name, args in {
        "gpt2attn_cols_f32": matvec, "gpt2attn_cols_16": matvec + [i32],
        "gpt2attn_rows_f32": matvec, "gpt2attn_rows_16": matvec + [i32],
        "gpt2attn_quantize_q8": [p, i64, i64, p, p],
        "gpt2attn_rows_q8": [p, p, i64, i64, p, p, i64, p, p, i32],
        "gpt2attn_read_sum": [p, i64, i32, i32],
        "gpt2attn_decode_step": [p, p, i64, i64, p, i64, p, i32],
    }.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = None
    lib.gpt2attn_read_sum.restype = ctypes.c_float
    lib.gpt2attn_decode_step.restype = ctypes.c_int
    return lib


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check(x: Tensor, w: Tensor, bias: Tensor | None) -> None:
    # the kernels read raw memory: everything contiguous, x and bias fp32, all on the CPU
    assert x.dtype == torch.float32 and x.is_contiguous() and x.device.type == "cpu", "x: contiguous fp32 on the CPU"
    assert w.is_contiguous() and w.device.type == "cpu", "weight: contiguous on the CPU"
    assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()), "bias: contiguous fp32"


def _matvec(kind: str, x: Tensor, w: Tensor, bias: Tensor | None, K: int, N: int) -> Tensor:
    lib = library()
    x = x.contiguous()
    _check(x, w, bias)
    y = torch.empty(x.size(0), N, dtype=torch.float32)
    args = [_ptr(x), x.size(0), K, _ptr(w), N, _ptr(bias), _ptr(y), torch.get_num_threads()]
    if w.dtype == torch.float32:
        (lib.gpt2attn_cols_f32 if kind == "cols" else lib.gpt2attn_rows_f32)(*args)
    elif w.dtype in (torch.float16, torch.bfloat16):
        (lib.gpt2attn_cols_16 if kind == "cols" else lib.gpt2attn_rows_16)(*args, int(w.dtype == torch.bfloat16))
    else:
        raise TypeError(f"weight dtype {w.dtype}: the kernels take float32, float16 or bfloat16")
    return y


def cols(x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    """x (B, K) fp32 times w (K, N) (fp32/fp16/bf16) plus bias (N,) -> (B, N) fp32."""
    if library() is None:
        return cols_reference(x, w, bias)
    return _matvec("cols", x, w, bias, w.size(0), w.size(1))


def cols_reference(x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    w = w.float()
    return x @ w if bias is None else torch.addmm(bias, x, w)


def rows(x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    """x (B, K) fp32 times w (N, K)ᵀ (fp32/fp16/bf16) plus bias (N,) -> (B, N) fp32."""
    if library() is None:
        return rows_reference(x, w, bias)
    return _matvec("rows", x, w, bias, w.size(1), w.size(0))


def rows_reference(x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    return torch.nn.functional.linear(x, w.float(), bias)


def quantize_q8(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (B, K), K a multiple of 32 -> int8 values (B, K) and fp32 scales (B, K/32): each block of
    32 values scaled by its largest magnitude / 127 and rounded half to even."""
    if library() is None:
        return quantize_q8_reference(x)
    x = x.contiguous()
    _check(x, x, None)
    B, K = x.shape
    xq, xs = torch.empty(B, K, dtype=torch.int8), torch.empty(B, K // BLOCK, dtype=torch.float32)
    library().gpt2attn_quantize_q8(_ptr(x), B, K, _ptr(xq), _ptr(xs))
    return xq, xs


def quantize_q8_reference(x: Tensor) -> tuple[Tensor, Tensor]:
    blocks = x.reshape(x.size(0), -1, BLOCK)  # (B, K/32, 32)
    scale = blocks.abs().amax(dim=-1) / 127  # (B, K/32)
    q = torch.round(blocks / torch.where(scale == 0, 1.0, scale)[..., None])
    return q.to(torch.int8).view(x.shape), scale


def rows_q8(x: Tensor, w8: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    """x (B, K) fp32 times (w8 (N, K) int8 · scale (N,))ᵀ plus bias -> (B, N) fp32, with x
    quantized by quantize_q8 first. K must be a multiple of 32."""
    if library() is None:
        return rows_q8_reference(x, w8, scale, bias)
    xq, xs = quantize_q8(x)
    _check(xs, w8, bias)
    assert scale.dtype == torch.float32 and scale.is_contiguous() and w8.dtype == torch.int8
    N, K = w8.shape
    y = torch.empty(x.size(0), N, dtype=torch.float32)
    library().gpt2attn_rows_q8(_ptr(xq), _ptr(xs), x.size(0), K, _ptr(w8), _ptr(scale), N, _ptr(bias), _ptr(y),
                               torch.get_num_threads())
    return y


def read_sum(x: Tensor, streams: int = 8) -> float:
    """The sum of a contiguous fp32 tensor, read once on all of torch's threads, each thread's share
    as `streams` runs read in step (how fast this machine reads memory: the benchmarks' bandwidth
    limit; one stream a thread reads slower)."""
    if library() is None:
        return x.sum().item()
    assert x.dtype == torch.float32 and x.is_contiguous() and streams >= 1
    return library().gpt2attn_read_sum(_ptr(x), x.numel(), torch.get_num_threads(), streams)


def rows_q8_reference(x: Tensor, w8: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    xq, xs = quantize_q8_reference(x)
    B, N = x.size(0), w8.size(0)
    # each block's 32 products summed exactly (integers below 2^24 in fp32), then scaled
    sums = torch.einsum("bjk,njk->bnj", xq.view(B, -1, BLOCK).float(), w8.view(N, -1, BLOCK).float())  # (B, N, K/32)
    y = (sums * xs[:, None, :]).sum(-1) * scale  # (B, N)
    return y if bias is None else y + bias


# One decoding step of a whole model (step.cpp): the model's weights described once, as C structs.
# Kinds of weight matrix, as step.cpp numbers them: (K, N) Conv1D layout (fp32, the model's own
# parameters) or (N, K) rows, by dtype.
COLS = {torch.float32: 0}
ROWS = {torch.float32: 3, torch.float16: 4, torch.bfloat16: 5}
Q8_ROWS = 6


class Matrix(ctypes.Structure):
    _fields_ = [("weight", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("kind", ctypes.c_int32), ("unused", ctypes.c_int32), ("K", ctypes.c_int64), ("N", ctypes.c_int64)]


class Layer(ctypes.Structure):
    _fields_ = [("ln_1_weight", ctypes.c_void_p), ("ln_1_bias", ctypes.c_void_p), ("c_attn", Matrix),
                ("attn_proj", Matrix), ("ln_2_weight", ctypes.c_void_p), ("ln_2_bias", ctypes.c_void_p),
                ("c_fc", Matrix), ("mlp_proj", Matrix), ("attn_scale", ctypes.c_float), ("unused", ctypes.c_float)]


class Model(ctypes.Structure):
    _fields_ = [("n_layer", ctypes.c_int64), ("n_embd", ctypes.c_int64), ("n_head", ctypes.c_int64),
                ("n_inner", ctypes.c_int64), ("vocab_size", ctypes.c_int64), ("eps", ctypes.c_float),
                ("unused", ctypes.c_float), ("wte", ctypes.c_void_p), ("wpe", ctypes.c_void_p),
                ("ln_f_weight", ctypes.c_void_p), ("ln_f_bias", ctypes.c_void_p), ("lm_head", Matrix),
                ("layers", ctypes.POINTER(Layer))]


def decode_step(model: Model, ids: Tensor, pos: int, kv: Tensor, logits: Tensor) -> None:
    """Run step.cpp: logits (B, V) of the tokens after ids (B,) int64, at position pos; their keys
    and values written into kv (n_layer, 2, B, nh, capacity, hs) at pos. Every pointer in `model`
    must stay alive for the call (gpt2attn.decode_step keeps the tensors)."""
    assert ids.dtype == torch.int64 and ids.is_contiguous() and kv.is_contiguous() and logits.is_contiguous()
    assert kv.dtype == torch.float32 and logits.dtype == torch.float32 and 0 <= pos < kv.size(4)
    status = library().gpt2attn_decode_step(ctypes.byref(model), _ptr(ids), ids.numel(), pos, _ptr(kv), kv.size(4),
                                            _ptr(logits), torch.get_num_threads())
    if status != 0:
        raise ValueError("decode_step: a weight matrix's sizes or kind do not fit the model's (nothing computed)")
