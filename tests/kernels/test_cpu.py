"""gpt2attn.cpu: what /proc/cpuinfo says of this CPU, read the way the kernels, quantize, training
and the benchmarks ask it (on fake cpuinfo texts, so the test does not depend on this machine)."""

import platform
from pathlib import Path

import pytest
import torch

from gpt2attn import cpu

X86 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu avx2 fma f16c avx512f avx512_bf16
processor\t: 1
model name\t: another name
flags\t\t: fpu sse2
"""
ARM = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes crc32
CPU implementer\t: 0x41
"""


def one_cpu(vendor: str, extra_flags: str = "") -> str:
    """/proc/cpuinfo of one x86 processor of this vendor, with AVX2, FMA and F16C and extra_flags."""
    return f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: 25\nmodel\t\t: 17\nflags\t\t: fpu avx2 fma f16c {extra_flags}\n"


@pytest.fixture
def cpuinfo(monkeypatch):
    def use(text: str | None) -> None:
        monkeypatch.setattr(cpu, "_cpuinfo", lambda: [] if text is None else text.splitlines())
    return use


def test_x86_flags_and_name_are_the_first_processor_s(cpuinfo):
    cpuinfo(X86)
    assert cpu.flags() == {"fpu", "avx2", "fma", "f16c", "avx512f", "avx512_bf16"}
    assert cpu.name() == "AMD EPYC 9R14 96-Core Processor"
    assert cpu.bf16_report()[0] is True


def test_arm_features_are_its_flags_and_its_name_falls_back_to_the_platform(cpuinfo):
    cpuinfo(ARM)
    assert cpu.flags() == {"fp", "asimd", "evtstrm", "aes", "crc32"}
    assert cpu.name() == platform.processor()
    assert cpu.bf16_report()[0] is False


def test_without_cpuinfo_there_are_no_flags(cpuinfo):
    cpuinfo(None)
    assert cpu.flags() == set()
    assert cpu.name() == platform.processor()
    native, sentence = cpu.bf16_report()
    assert native is False and "neither amx_bf16 nor avx512_bf16" in sentence


@pytest.mark.parametrize("vendor, extra, native", [
    ("AuthenticAMD", "avx512_bf16", True),  # Zen 4, Zen 5: oneDNN's bf16 beat the tiles
    ("GenuineIntel", "avx512_bf16", False),  # without AMX: the tiles beat oneDNN's bf16
    ("GenuineIntel", "avx512_bf16 amx_bf16", True),
    ("AuthenticAMD", "", False),  # no bf16 products at all: torch would emulate them
])
def test_bf16_prompts_take_the_cpu_s_own_products_where_they_beat_the_tiles(cpuinfo, vendor, extra, native):
    cpuinfo(one_cpu(vendor, extra))
    assert cpu.bf16_prompts_native() is native


@pytest.mark.parametrize("vendor, by_torch", [("GenuineIntel", True), ("AuthenticAMD", False), ("HygonGenuine", False)])
def test_fp32_prompts_take_torch_s_products_on_intel(cpuinfo, vendor, by_torch):
    cpuinfo(one_cpu(vendor))
    assert cpu.torch_fp32_prompts() is by_torch


def test_without_cpuinfo_fp32_prompts_take_the_tiles(cpuinfo):
    cpuinfo(None)
    assert cpu.torch_fp32_prompts() is False


ZEN5 = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\n"


@pytest.mark.parametrize("text, ident", [
    (ZEN5, ("AuthenticAMD", 26, 2)),
    (ZEN5.replace("cpu family\t: 26\n", ""), None),  # each of the three missing
    (ZEN5.replace("model\t\t: 2\n", ""), None),
    (ZEN5.replace("vendor_id\t: AuthenticAMD\n", ""), None),
    (ZEN5.replace("cpu family\t: 26", "cpu family\t: 1a"), None),  # a number that is not decimal
    (ZEN5.replace("model\t\t: 2\n", "model\t\t: two\n"), None),
])
def test_vendor_family_and_model_come_whole_or_not_at_all(cpuinfo, text, ident):
    cpuinfo(text)
    assert cpu.vendor_family_model() == ident


def test_this_machine_s_own_cpuinfo_is_the_one_read():
    info = Path("/proc/cpuinfo")
    if not info.exists():
        pytest.skip("no /proc/cpuinfo here (not Linux)")
    lines = [line for line in info.read_text().splitlines() if line.split(":")[0].strip() in ("flags", "Features")]
    assert lines and cpu.flags() == set(lines[0].partition(":")[2].split())


@pytest.mark.parametrize("flags", [{"avx2"}, {"avx2", "avx512_bf16"}])
def test_the_bf16_sentence_names_torch_s_cpu_capability(monkeypatch, flags):
    monkeypatch.setattr(cpu, "flags", lambda: flags)
    assert f"(torch capability {torch.backends.cpu.get_cpu_capability()})" in cpu.bf16_report()[1]
