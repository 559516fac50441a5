"""What this CPU offers, as the kernels, quantize, training and the benchmarks ask it: its flags,
its model name and numbers, whether it multiplies bf16 natively, and whose products suit its prompts.

Read from /proc/cpuinfo on every call (a file in memory: microseconds), so a test that patches
`flags` here changes what every user sees. Where /proc/cpuinfo is absent (not Linux) there are no
flags and the name is platform.processor()'s.
"""

from __future__ import annotations

import platform
from pathlib import Path

import torch


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def _field(*keys: str) -> str | None:
    """The value of the first line of /proc/cpuinfo (the first processor's) whose key is one of keys;
    None where there is none."""
    for line in _cpuinfo():
        key, _, value = line.partition(":")
        if key.strip() in keys:
            return value
    return None


def flags() -> set[str]:
    """The first processor's feature flags (x86's `flags`, ARM's `Features`), e.g. {'avx2', 'fma', ...}."""
    value = _field("flags", "Features")
    return set() if value is None else set(value.split())


def name() -> str:
    """The CPU's model name ('AMD EPYC 9R14 ...'); platform.processor() where /proc/cpuinfo has none."""
    value = _field("model name")
    return platform.processor() if value is None else value.strip()


def vendor_family_model() -> tuple[str, int, int] | None:
    """x86's vendor and CPUID family and model numbers, ('AuthenticAMD', 26, 2) on a Zen 5; None where
    /proc/cpuinfo has none (ARM, not Linux). Two CPUs with one model name can differ here: a virtual
    machine often calls a Zen 4 and a Zen 5 both 'AMD EPYC'."""
    vendor, family, model = _field("vendor_id"), _field("cpu family"), _field("model")
    if vendor is None or family is None or model is None or not family.strip().isdigit() or not model.strip().isdigit():
        return None
    return vendor.strip(), int(family), int(model)


def bf16_prompts_native() -> bool:
    """Whether a bf16 model's prompts are best multiplied by torch's bf16 product (oneDNN) rather
    than by the kernels' fp32 tiles on the weight widened as it is copied: where the CPU has AMX,
    and where it has AVX512-BF16 and is not Intel's. gpt2-small's 128-token prompt, 2 threads: on
    an AMD EPYC Zen 4, oneDNN 1485 tok/s against 906 for the rows tiles then (2026-11-27), and the
    fp32 tiles, which the bf16 weight now takes widened, 859 in the bench (2026-11-28); on an Intel
    Emerald Rapids VM with AVX512-BF16 and no AMX (2026-11-29), oneDNN 729 tok/s against the widened
    weight's tiles' 945, and 807 against 1110 at 512 tokens."""
    has = flags()
    if "amx_bf16" in has:
        return True
    ident = vendor_family_model()
    return "avx512_bf16" in has and (ident is None or ident[0] != "GenuineIntel")


def torch_fp32_prompts() -> bool:
    """Whether a prompt's fp32 products are faster through torch's (MKL's sgemm) than through the
    kernels' register tiles: on Intel's CPUs. generate's prompt pass of gpt2-small, 2 threads, A/B
    in one process: on an Intel Emerald Rapids VM (2026-11-29) MKL took 3-8% less time from 9 to 32
    tokens and 7-14% less at 128 and 512 (with MKL and the kernels held to AVX2, 1-8% less); on an
    AMD EPYC Zen 4 the tiles took 116 ms for the 48 block products at 128 rows against MKL's 129-134
    (2026-11-27), and on a Zen 5 (2026-11-29) MKL's products alone made 909 tok/s at 128 tokens
    against the tiles' whole pass's 1761."""
    ident = vendor_family_model()
    return ident is not None and ident[0] == "GenuineIntel"


def bf16_report() -> tuple[bool, str]:
    """(whether this CPU multiplies bf16 natively, a sentence saying what it has)."""
    native = sorted(flags() & {"amx_bf16", "avx512_bf16"})
    capability = torch.backends.cpu.get_cpu_capability()
    if native:
        return True, f"this CPU has {' and '.join(native)} (torch capability {capability}): bf16 matrix products are native"
    return False, (
        f"this CPU has neither amx_bf16 nor avx512_bf16 (torch capability {capability}), so torch emulates "
        f"bf16 matrix products, tens of times slower than fp32"
    )
