"""The bandwidth-bound products of CPU decoding, each a fast kernel beside its pure-torch reference,
and a whole decoding step in one call (decode.cpp).

A decoding step multiplies a few rows x (B, K) by every weight matrix once, so its time is the
time to read the weights. The kernels read each weight once per step, split over all of torch's
threads, and accumulate in fp32:

    cols(x, w, bias)            w (K, N) fp32, Conv1D's layout                          -> (B, N)
    rows(x, w, bias)            w (N, K), nn.Linear's layout (the LM head), fp32, fp16 or bf16 -> (B, N)
    rows_q8(x, grouped, scale, bias)  int8 rows (N, K) with one fp32 scale per row, by groups of
                                16 rows (group_rows_q8); x quantized per call in blocks of 32
                                (quantize_q8); any B: a prompt's rows too               -> (B, N)
    rows_q4k(x, grouped, bias)  grouped (N, K/256 * 144) uint8, llama.cpp's Q4_K by groups of 16
                                rows (gpt2attn.q4_k.group_rows); x quantized per 256 as
                                llama.cpp's Q8_K                                        -> (B, N)
    decode_step(...)            every product of a GPT-2 step, embeddings to logits (gpt2attn.decode_step)

Each product has a `_reference` twin in plain torch computing the same sum (to fp32 rounding: the
order of the additions differs; the quantization of x is exact), which runs when the kernels cannot.

The kernels are C++ with AVX2, FMA and F16C intrinsics and OpenMP; on a CPU with AVX-512 (F, BW,
VL, DQ and VNNI) they are built with those too, and the rows products then take 16 floats or 64
int8 a step (simd.h); on an Intel CPU they ask for their weights further ahead (PREFETCH_AHEAD).
They are compiled on first use with the system's C++ compiler into a cache folder, under a name
keyed by the sources, the flags, the compiler and this CPU, and loaded with ctypes; they link the
OpenMP runtime torch already loaded (libgomp), so their threads are torch's.
A build (seconds) says so in one line on stderr.

The cache cannot take the process down: a library is published under its name only once complete
(written aside, then renamed), and the name carries a digest of its bytes, checked before it is
loaded, so a truncated, overwritten or foreign file is rebuilt (once), never loaded. The compiler
runs under a time limit (BUILD_SECONDS). Whatever stops the kernels (not x86-64 Linux, a CPU without
AVX2/FMA/F16C, no compiler, a compiler that fails or hangs, no cache folder, a read-only one) every
product takes its reference, with one warning saying why.

The environment (read once, at first use):
    GPT2ATTN_KERNELS  0/false/no/off: plain torch, silently; 1/true/yes/on or unset: the kernels
    GPT2ATTN_AVX512   0/false/no/off: build the AVX2 kernels even on an AVX-512 CPU; else as the CPU allows
    GPT2ATTN_CACHE    the cache folder's parent (kernels/ goes inside); unset: ~/.cache/gpt2attn
    CXX               the compiler; unset: g++, else c++
Another value of a switch is warned about and taken as unset.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings
from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor

from .. import cpu, q4_k

SOURCES = [Path(__file__).with_name("decode.cpp")]
HEADERS = [Path(__file__).with_name("simd.h")]  # included by decode.cpp: part of the cache key
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
NEEDS = ("avx2", "fma", "f16c")
AVX512 = {"avx512f": "-mavx512f", "avx512bw": "-mavx512bw", "avx512vl": "-mavx512vl", "avx512dq": "-mavx512dq",
          "avx512_vnni": "-mavx512vnni"}  # /proc/cpuinfo's name -> the compiler's flag
BLOCK = 32  # values per int8 block of x
BUILD_SECONDS = 120  # the compiler is stopped after this long (a build takes 2-8 s)
# How far ahead the rows products ask for their weights (simd.h's PREFETCH_AHEAD, 256 bytes unless set
# here), by CPU vendor, from A/B runs of generate's steps alternating in one process. AMD: 256 (Zen 4,
# 2026-11-27; on Zen 5, 2026-11-29, 512 and 1024 made fp16 steps 17% and 8% slower with memory
# fast). Intel: 1024, measured on an Emerald Rapids VM (2026-11-29): fp16 and bf16 steps 9-16%
# faster than with 256 at gpt2-small shapes and 7% at gpt2-medium's, 1536 and 2048 within 3% of
# 1024 either way, the plain fp32 model 2% faster; other Intel cores untried.
PREFETCH_AHEAD = {"GenuineIntel": 1024}
SWITCHES = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


class Unavailable(Exception):
    """Why the kernels cannot run here."""


def available() -> bool:
    """Whether the fast kernels run here (built and loaded); else every product is its reference."""
    return library() is not None


@lru_cache(maxsize=None)
def library() -> ctypes.CDLL | None:
    """The compiled kernels, built on first use; None (with one warning, unless GPT2ATTN_KERNELS
    switched them off) when they cannot run here."""
    notes: list[str] = []  # what went wrong on the way, said in the one warning
    lib = None
    if _switch("GPT2ATTN_KERNELS", notes):
        try:
            lib = _load(notes)
        except Unavailable as why:
            notes.append(f"CPU decoding kernels unavailable, using plain torch: {why}")
    if notes:
        warnings.warn("gpt2attn: " + "; ".join(notes), RuntimeWarning, 2)
    return lib


def _switch(name: str, notes: list[str]) -> bool:
    """An on/off environment variable, on unless set to 0/false/no/off (another value: a note)."""
    value = os.environ.get(name, "").strip().lower()
    if value and value not in SWITCHES:
        notes.append(f"{name}={os.environ[name]!r} is none of {'/'.join(SWITCHES)}: taken as unset")
    return SWITCHES.get(value, True)


def _load(notes: list[str]) -> ctypes.CDLL:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise Unavailable(f"they are built for x86-64 Linux, this is {platform.system()} {platform.machine()}")
    missing = [flag for flag in NEEDS if flag not in cpu.flags()]
    if missing:
        raise Unavailable(f"this CPU lacks {', '.join(missing)}")
    compiler = _compiler()
    if compiler is None:
        raise Unavailable("no C++ compiler found ($CXX, g++ or c++)")
    wanted = flags(notes)
    why = None
    for build_flags in [wanted] + ([FLAGS] if wanted != FLAGS else []):  # a compiler without AVX-512: AVX2 alone
        try:
            lib = _bind(ctypes.CDLL(str(build(SOURCES, build_flags, notes))))
        except (OSError, AttributeError, subprocess.SubprocessError) as err:
            lines = str(err).strip().splitlines()
            why = f"building the kernels failed ({lines[-1] if lines else type(err).__name__})"
            continue
        lib.build_flags = build_flags  # what instruction_set() reports
        return lib
    raise Unavailable(why)


def flags(notes: list[str] | None = None) -> list[str]:
    """The compiler flags for this CPU: AVX2, FMA and F16C, AVX-512 where the CPU has all of AVX512
    (unless GPT2ATTN_AVX512 is off), and the prefetch distance where its vendor has one (PREFETCH_AHEAD)."""
    wide = _switch("GPT2ATTN_AVX512", [] if notes is None else notes) and set(AVX512) <= cpu.flags()
    return FLAGS + (list(AVX512.values()) if wide else []) + prefetch_flags()


def prefetch_flags() -> list[str]:
    """The define that sets the rows products' prefetch distance for this CPU's vendor; none (simd.h's
    256 bytes) for a vendor PREFETCH_AHEAD lacks."""
    ident = cpu.vendor_family_model()
    ahead = PREFETCH_AHEAD.get(ident[0]) if ident else None
    return [f"-DGPT2ATTN_PREFETCH_AHEAD={ahead}"] if ahead else []


def instruction_set() -> str:
    """Which vector instructions the loaded kernels were built with, in words."""
    lib = library()
    if lib is None:
        return "none: plain torch"
    return "AVX-512 (VNNI), AVX2, FMA, F16C" if "-mavx512f" in lib.build_flags else "AVX2, FMA, F16C"


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def cache_dir() -> Path:
    """$GPT2ATTN_CACHE/kernels, else ~/.cache/gpt2attn/kernels; Unavailable where there is no home."""
    if os.environ.get("GPT2ATTN_CACHE"):
        return Path(os.environ["GPT2ATTN_CACHE"]) / "kernels"
    try:
        return Path.home() / ".cache" / "gpt2attn" / "kernels"
    except (RuntimeError, KeyError) as err:  # HOME unset and a uid with no passwd entry
        raise Unavailable(f"no folder for the kernel cache ({err}); set GPT2ATTN_CACHE") from None


def cache_key(sources: list[Path], build_flags: list[str]) -> str:
    """What a build depends on: the sources and headers, the flags, the compiler and this CPU."""
    key = hashlib.sha256()
    for part in (*(path.read_bytes() for path in sources + HEADERS), " ".join(build_flags), _compiler() or "",
                 cpu.name(), " ".join(sorted(cpu.flags()))):
        key.update(part if isinstance(part, bytes) else part.encode())
        key.update(b"\0")
    return key.hexdigest()[:16]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def build(sources: list[Path], build_flags: list[str], notes: list[str]) -> Path:
    """The library of `sources` built with build_flags, from the cache or compiled into it:
    `<stem>-<key>-<digest of its bytes>.so`. A cached file whose bytes do not match its digest is
    removed and rebuilt (a note says so)."""
    folder = cache_dir()
    prefix = f"{sources[0].stem}-{cache_key(sources, build_flags)}-"
    for path in sorted(folder.glob(prefix + "*.so")):
        try:
            if _digest(path) == path.stem.removeprefix(prefix):
                return path
            notes.append(f"the cached library {path} was damaged; building it afresh")
            path.unlink()
        except OSError:
            pass
    return _compile(sources, build_flags, folder, prefix)


def _compile(sources: list[Path], build_flags: list[str], folder: Path, prefix: str) -> Path:
    """Compile into a folder of its own beside the cache, then rename: the cache never holds half a file."""
    compiler = _compiler()
    folder.mkdir(parents=True, exist_ok=True)
    # said once: a first build takes seconds with nothing else on screen (a cached one says nothing)
    print(f"gpt2attn: compiling the CPU decoding kernels for this CPU, once (cached in {folder})",
          file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        built, log = Path(tmp) / "lib.so", Path(tmp) / "log"
        with open(log, "w") as out:  # a file, not a pipe: a compiler's children cannot keep it open on us
            process = subprocess.Popen([compiler, *build_flags, *map(str, sources), "-o", str(built)], stdout=out,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            try:
                process.wait(timeout=BUILD_SECONDS)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)  # the compiler and everything it started
                process.wait()
                raise subprocess.SubprocessError(f"{compiler} did not finish in {BUILD_SECONDS} s") from None
        if process.returncode != 0:
            raise subprocess.SubprocessError(log.read_text() or f"{compiler} exited with {process.returncode}")
        target = folder / f"{prefix}{_digest(built)}.so"
        os.replace(built, target)  # atomic: a process beside this one never sees half a file
    return target


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for name, args, result in [
        ("gpt2attn_product", [ctypes.POINTER(Matrix), p, i64, p, i32], i32),
        ("gpt2attn_quantize_q8", [p, i64, i64, p, p], None),
        ("gpt2attn_argmax", [p, i64, i64, p], None),
        ("gpt2attn_gelu", [p, i64, p, i32], None),
        ("gpt2attn_decode_step", [ctypes.POINTER(Model), p, p, p, i64, i64, p, i64, p, i32], i32),
        ("gpt2attn_decode_greedy", [ctypes.POINTER(Model), p, p, p, i64, i64, p, i64, p, i32, i64, p, i64, i64, p,
                                    p, i64, p], i64),
    ]:
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = result
    return lib


TILE_ROWS = 8  # a product of more rows than this is a prompt's, in decode.cpp's register tiles (its TILE_ROWS)

# The weights as decode.cpp reads them: each matrix a Matrix of one kind (decode.cpp's Kind).
COLS_F32 = 0  # (K, N), Conv1D's layout
ROWS = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}  # (N, K), nn.Linear's layout
ROWS_Q8 = 4  # (N, K) uint8: int8 rows, one scale per row, by groups of 16 (group_rows_q8)
ROWS_Q4K = 5  # (N, K/256 * 144) uint8: the rows' Q4_K super-blocks by groups of 16 (q4_k.group_rows)


class Matrix(ctypes.Structure):
    _fields_ = [("weight", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("K", ctypes.c_int64), ("N", ctypes.c_int64), ("kind", ctypes.c_int32)]


class Layer(ctypes.Structure):
    _fields_ = [("ln_1_weight", ctypes.c_void_p), ("ln_1_bias", ctypes.c_void_p), ("c_attn", Matrix),
                ("attn_proj", Matrix), ("ln_2_weight", ctypes.c_void_p), ("ln_2_bias", ctypes.c_void_p),
                ("c_fc", Matrix), ("mlp_proj", Matrix), ("attn_scale", ctypes.c_float)]


class Model(ctypes.Structure):
    _fields_ = [("n_layer", ctypes.c_int64), ("n_embd", ctypes.c_int64), ("n_head", ctypes.c_int64),
                ("n_inner", ctypes.c_int64), ("vocab_size", ctypes.c_int64), ("n_positions", ctypes.c_int64),
                ("eps", ctypes.c_float), ("wte", ctypes.c_void_p), ("wpe", ctypes.c_void_p),
                ("ln_f_weight", ctypes.c_void_p), ("ln_f_bias", ctypes.c_void_p), ("lm_head", Matrix),
                ("layers", ctypes.POINTER(Layer))]


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def matrix(weight: Tensor, bias: Tensor | None, kind: int, scale: Tensor | None = None) -> Matrix:
    """A Matrix over these tensors (no copy: they must outlive its use)."""
    assert weight.is_contiguous() and weight.device.type == "cpu", "weight: contiguous on the CPU"
    assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()), "bias: contiguous fp32"
    assert scale is None or (scale.dtype == torch.float32 and scale.is_contiguous()), "scale: contiguous fp32"
    N, K = weight.shape[::-1] if kind == COLS_F32 else weight.shape
    if kind == ROWS_Q4K:
        K = K // q4_k.BYTES * q4_k.SUPER  # bytes per row -> weights per row
    return Matrix(_ptr(weight), _ptr(scale), _ptr(bias), K, N, kind)


def product(w: Matrix, x: Tensor) -> Tensor:
    """x (B, K) fp32 times the Matrix w (whatever its kind) plus its bias -> (B, N) fp32."""
    x = x.contiguous()
    assert x.dtype == torch.float32 and x.device.type == "cpu" and x.size(1) == w.K, "x: (B, K) fp32 on the CPU"
    y = torch.empty(x.size(0), w.N, dtype=torch.float32)
    if library().gpt2attn_product(ctypes.byref(w), _ptr(x), x.size(0), _ptr(y), torch.get_num_threads()) != 0:
        raise ValueError(f"the kernels take no matrix of kind {w.kind} with K={w.K}")
    return y


def cols(x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    """x (B, K) fp32 times w (K, N) fp32 plus bias (N,) -> (B, N) fp32."""
    if library() is None:
        return cols_reference(x, w, bias)
    if w.dtype != torch.float32:
        raise TypeError(f"weight dtype {w.dtype}: the (K, N) kernel takes float32")
    return product(matrix(w, bias, COLS_F32), x)


def cols_reference(x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    w = w.float()
    return x @ w if bias is None else torch.addmm(bias, x, w)


def rows(x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    """x (B, K) fp32 times w (N, K)ᵀ (fp32/fp16/bf16) plus bias (N,) -> (B, N) fp32."""
    if library() is None:
        return rows_reference(x, w, bias)
    if w.dtype not in ROWS:
        raise TypeError(f"weight dtype {w.dtype}: the (N, K) kernels take float32, float16 or bfloat16")
    return product(matrix(w, bias, ROWS[w.dtype]), x)


def rows_reference(x: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    return torch.nn.functional.linear(x, w.float(), bias)


def argmax(scores: Tensor) -> Tensor:
    """scores (N, V).argmax(dim=-1) as torch gives it (the first of equal values; the first NaN in
    a row that holds one), read eight values a step by the kernels where they run: generate's
    greedy pick of every new token."""
    lib = library()
    if lib is None or scores.dim() != 2 or scores.dtype != torch.float32 or scores.device.type != "cpu" or not scores.size(1):
        return scores.argmax(dim=-1)
    x = scores.contiguous()
    out = torch.empty(x.size(0), dtype=torch.int64)
    lib.gpt2attn_argmax(_ptr(x), x.size(0), x.size(1), _ptr(out))
    return out


def gelu(x: Tensor) -> Tensor:
    """gelu_new of fp32 x (any shape) into a new tensor: the decoding step's GELU (within a few fp32
    roundings of torch's tanh GELU), on torch's thread count."""
    lib = library()
    if lib is None:
        return gelu_reference(x)
    x = x.contiguous()
    assert x.dtype == torch.float32 and x.device.type == "cpu", "x: fp32 on the CPU"
    y = torch.empty_like(x)
    lib.gpt2attn_gelu(_ptr(x), x.numel(), _ptr(y), torch.get_num_threads())
    return y


def gelu_reference(x: Tensor) -> Tensor:
    return torch.nn.functional.gelu(x, approximate="tanh")


def quantize_q8(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (B, K), K a multiple of 32 -> int8 values (B, K) and fp32 scales (B, K/32): each block of
    32 values scaled by its largest magnitude / 127 and rounded half to even."""
    if library() is None:
        return quantize_q8_reference(x)
    x = x.contiguous()
    assert x.dtype == torch.float32 and x.device.type == "cpu" and x.size(1) % BLOCK == 0
    B, K = x.shape
    xq, xs = torch.empty(B, K, dtype=torch.int8), torch.empty(B, K // BLOCK, dtype=torch.float32)
    library().gpt2attn_quantize_q8(_ptr(x), B, K, _ptr(xq), _ptr(xs))
    return xq, xs


def quantize_q8_reference(x: Tensor) -> tuple[Tensor, Tensor]:
    blocks = x.reshape(x.size(0), -1, BLOCK)  # (B, K/32, 32)
    scale = blocks.abs().amax(dim=-1) / 127  # (B, K/32)
    q = torch.round(blocks / torch.where(scale == 0, 1.0, scale)[..., None])
    return q.to(torch.int8).view(x.shape), scale


GROUP_ROWS = q4_k.GROUP  # rows a group holds in the int8 layout as in Q4_K's (simd.h's GROUP_ROWS)


def group_rows_q8(w8: Tensor, out: Tensor | None = None) -> Tensor:
    """int8 rows (N, K) -> the same weights as the int8 kernel reads them, (N, K) uint8 (into `out`
    where given): by groups of 16 rows, the last holding the N mod 16 rows left, each group of n
    rows K/4 quads of 4n bytes, quad p holding bytes 4p .. 4p + 3 of row r at 4r (then, where K is
    not a multiple of 4, each of the last K mod 4 bytes of the n rows in turn), and each weight w stored as
    the byte w + 128 (simd.h's dot_q8g). So one 64-byte load holds the same four weights of 16
    rows. Grouped 256 rows at a time: no copy of the whole."""
    assert w8.dtype == torch.int8
    N, K = w8.shape
    out = torch.empty(N, K, dtype=torch.uint8) if out is None else out
    for r0 in range(0, N, GROUP_ROWS * 16):  # temporaries of at most 256 rows, which malloc reuses
        rows = w8[r0 : r0 + GROUP_ROWS * 16].view(torch.uint8) ^ 0x80  # (n, K): w + 128
        _regroup(rows, out[r0 : r0 + rows.size(0)], to_groups=True)
    return out


def ungroup_rows_q8(grouped: Tensor) -> Tensor:
    """The int8 rows (N, K) that group_rows_q8 laid out as `grouped`."""
    w8 = torch.empty(grouped.shape, dtype=torch.uint8)
    _regroup(w8, grouped, to_groups=False)
    return (w8 ^ 0x80).view(torch.int8)


def _regroup(rows: Tensor, grouped: Tensor, to_groups: bool) -> None:
    """Copy rows (n, K) into `grouped`, their bytes as group_rows_q8 lays them out (its first row
    starting a group), or back."""
    n, K = rows.shape
    whole, quads = n // GROUP_ROWS * GROUP_ROWS, K // 4 * 4
    for r0, G, g in ((0, whole // GROUP_ROWS, GROUP_ROWS), (whole, 1, n - whole)):  # whole groups, then the last
        r1 = r0 + G * g
        if r1 == r0:
            continue
        by_row = rows[r0:r1].view(G, g, K)
        by_group = grouped[r0:r1].reshape(G, g * K)
        pairs = ((by_row[..., :quads].reshape(G, g, K // 4, 4).transpose(1, 2), by_group[:, : g * quads].view(G, K // 4, g, 4)),
                 (by_row[..., quads:].transpose(1, 2), by_group[:, g * quads :].view(G, K - quads, g)))
        for in_rows, in_groups in pairs:
            if to_groups:
                in_groups.copy_(in_rows)
            else:
                in_rows.copy_(in_groups)


def rows_q8(x: Tensor, grouped: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    """x (B, K) fp32 times (the int8 rows `grouped` (N, K), laid out by group_rows_q8, · scale
    (N,))ᵀ plus bias -> (B, N) fp32, with x quantized as quantize_q8 does first. K must be a
    multiple of 32."""
    if library() is None:
        return rows_q8_reference(x, ungroup_rows_q8(grouped), scale, bias)
    assert grouped.dtype == torch.uint8
    return product(matrix(grouped, bias, ROWS_Q8, scale), x)


def rows_q8_reference(x: Tensor, w8: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    xq, xs = quantize_q8_reference(x)
    y = torch.zeros(x.size(0), w8.size(0))  # (B, N)
    for j in range(x.size(1) // BLOCK):  # block by block: no (B, N, K/32) tensor of every block's sums
        block = slice(j * BLOCK, (j + 1) * BLOCK)
        # the block's 32 products summed exactly (integers below 2^24 in fp32), then scaled
        y += (xq[:, block].float() @ w8[:, block].float().t()) * xs[:, j, None]
    y *= scale
    return y if bias is None else y + bias


def rows_q4k(x: Tensor, grouped: Tensor, bias: Tensor | None) -> Tensor:
    """x (B, K) fp32 times the Q4_K rows `grouped` (N, K/256 * 144) uint8, laid out by groups of 16
    rows (gpt2attn.q4_k.group_rows), transposed, plus bias -> (B, N) fp32, with x quantized as
    quantize_q8k_reference does first."""
    if library() is None:
        return rows_q4k_reference(x, q4_k.ungroup_rows(grouped), bias)
    assert grouped.dtype == torch.uint8 and grouped.size(1) % q4_k.BYTES == 0
    return product(matrix(grouped, bias, ROWS_Q4K), x)


def quantize_q8k_reference(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (B, K), K a multiple of 256 -> int8 values (B, K) and fp32 scales (B, K/256), as llama.cpp's
    Q8_K (the input of its Q4_K products): each super-block of 256 values scaled by its largest
    magnitude / 127 and rounded half to even."""
    blocks = x.reshape(x.size(0), -1, q4_k.SUPER)  # (B, K/256, 256)
    scale = blocks.abs().amax(dim=-1) / 127  # (B, K/256)
    q = torch.round(blocks / torch.where(scale == 0, 1.0, scale)[..., None])
    return q.to(torch.int8).view(x.shape), scale


def rows_q4k_reference(x: Tensor, blocks: Tensor, bias: Tensor | None, rows: int = 8) -> Tensor:
    K = x.size(1)
    q, d, dmin, sc, m = q4_k.fields(blocks, K)  # (N, K); (N, K/256) twice; (N, K/256, 8) twice
    N = q.size(0)
    levels = q.view(N, K // q4_k.SUPER, 8, BLOCK).float()  # (N, K/256, 8, 32)
    out = []
    for chunk in x.split(rows):  # `rows` rows at a time: the (rows, N, K/256, 8) sums stay small
        xq, xd = quantize_q8k_reference(chunk)
        xb = xq.view(chunk.size(0), K // q4_k.SUPER, 8, BLOCK).float()  # (B, K/256, 8, 32)
        # per super-block, sum over sub-blocks s of sc[s] (x . q over s) and of m[s] (sum of x over
        # s): integers below 2^24, so exact in fp32; then d and dmin, and x's scale
        dots = (torch.einsum("bjsk,njsk->bnjs", xb, levels) * sc.float()).sum(-1)  # (B, N, K/256)
        mins = (xb.sum(-1)[:, None] * m.float()).sum(-1)  # (B, N, K/256)
        out.append((xd[:, None, :] * (d * dots - dmin * mins)).sum(-1))
    y = torch.cat(out)  # (B, N)
    return y if bias is None else y + bias


STEP_ERRORS = {-1: "a weight matrix's sizes or kind do not fit the model's", -2: "a token id outside the vocabulary",
               -3: "a position past the model's n_positions or the cache's capacity"}


def _check_buffers(*pairs: tuple[Tensor | None, torch.dtype]) -> None:
    """Each tensor (or None) contiguous on the CPU in its dtype, as decode.cpp's pointers read it."""
    for t, dtype in pairs:
        assert t is None or (t.dtype == dtype and t.is_contiguous() and t.device.type == "cpu")


def decode_step(model: Model, ids: Tensor, positions: Tensor | None, key_mask: Tensor | None, pos: int, kv: Tensor,
                logits: Tensor) -> None:
    """Run decode.cpp's step: logits (B, V) of the tokens after ids (B,) int64, at positions (B,)
    int64 (None: pos for every row), attending to the cached entries key_mask (B, capacity) int64
    marks 1 (None: all); their keys and values written into kv (n_layer, 2, B, nh, capacity, hs) at
    index pos. Every pointer in `model` must stay alive for the call (gpt2attn.decode_step keeps
    the tensors). Raises ValueError, having computed nothing, for sizes, ids or positions out of range."""
    _check_buffers((ids, torch.int64), (positions, torch.int64), (key_mask, torch.int64), (kv, torch.float32),
                   (logits, torch.float32))
    assert key_mask is None or key_mask.shape == (ids.numel(), kv.size(4))
    status = library().gpt2attn_decode_step(ctypes.byref(model), _ptr(ids), _ptr(positions), _ptr(key_mask), ids.numel(),
                                            pos, _ptr(kv), kv.size(4), _ptr(logits), torch.get_num_threads())
    if status != 0:
        raise ValueError(f"decode_step: {STEP_ERRORS[status]} (nothing computed)")


def decode_greedy(model: Model, tokens: Tensor, positions: Tensor | None, key_mask: Tensor | None, pos: int,
                  kv: Tensor, logits: Tensor, steps: int, eos: Tensor, pad: int, unfinished: Tensor,
                  out: Tensor) -> tuple[int, str | None]:
    """generate's greedy loop in decode.cpp, up to `steps` tokens in one call: each time decode_step
    of tokens (B,) at pos (and on), then each row's argmax (as `argmax`), or pad for a row that
    unfinished (B,) bool marks False when eos (n,) int64 holds ids, into out (B, steps) (any row
    stride); a row whose token is in eos is finished; the loop ends early when none is unfinished.
    tokens, positions and unfinished are updated in place (the last tokens written, the next
    positions, the finished rows). Returns how many tokens each row got (the cache holds that many more entries) and
    None, or with the step that could not be taken (sizes, ids or positions out of range; the loop
    ended before it) what decode_step would have raised for it."""
    _check_buffers((tokens, torch.int64), (positions, torch.int64), (key_mask, torch.int64), (kv, torch.float32),
                   (logits, torch.float32), (eos, torch.int64), (unfinished, torch.bool))
    B = tokens.numel()
    assert out.dtype == torch.int64 and out.size(0) == B and out.size(1) >= steps and out.stride(1) == 1
    assert key_mask is None or key_mask.shape == (B, kv.size(4))
    status = ctypes.c_int32(0)
    done = library().gpt2attn_decode_greedy(ctypes.byref(model), _ptr(tokens), _ptr(positions), _ptr(key_mask), B, pos,
                                            _ptr(kv), kv.size(4), _ptr(logits), torch.get_num_threads(), steps, _ptr(eos),
                                            eos.numel(), pad, _ptr(unfinished), _ptr(out), out.stride(0),
                                            ctypes.byref(status))
    return done, None if status.value == 0 else f"decode_step: {STEP_ERRORS[status.value]} (after {done} tokens)"
