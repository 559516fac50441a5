"""The kernel cache and the environment switches (gpt2attn.kernels): every fault ends in the right
tokens, with at most one warning, no crash and no hang.

Each test runs with a cache folder of its own (GPT2ATTN_CACHE in tmp_path), seeded with a copy of
the library this machine builds where a test needs one, and clears kernels.library() before and
after. A damaged library on disk would take a process down if it were loaded, so those faults run
in a fresh process."""

import ctypes
import errno
import json
import os
import platform
import pwd
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest
import torch

from gpt2attn import GPT2LMHeadModel, cpu, kernels
from tests.helpers import kernel_builds, needs_kernels, randomize, tiny_config



def tokens() -> list[list[int]]:
    """Greedy tokens of a small model: the modules' (a hook keeps generate off the fused step)."""
    model = randomize(GPT2LMHeadModel(tiny_config(n_embd=64)), seed=1, std=0.1).eval()
    return model.generate(torch.tensor([[1, 2, 3], [4, 5, 6]]), max_new_tokens=8, min_new_tokens=8).tolist()


@pytest.fixture(scope="module")
def expected_tokens():
    model = randomize(GPT2LMHeadModel(tiny_config(n_embd=64)), seed=1, std=0.1).eval()
    model.register_forward_pre_hook(lambda *args: None)
    return model.generate(torch.tensor([[1, 2, 3], [4, 5, 6]]), max_new_tokens=8, min_new_tokens=8).tolist()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache folder of this test's own; kernels.library() asked afresh."""
    monkeypatch.setenv("GPT2ATTN_CACHE", str(tmp_path))
    for name in ("GPT2ATTN_KERNELS", "GPT2ATTN_AVX512", "CXX"):
        monkeypatch.delenv(name, raising=False)
    kernels.library.cache_clear()
    yield tmp_path / "kernels"
    kernels.library.cache_clear()


def test_the_shipped_sources_build_wherever_the_kernels_can_run(monkeypatch, tmp_path):
    """A compile error in decode.cpp or simd.h fails here, in each build this CPU runs, rather than
    turning every kernel test (their builds come from kernel_builds(), empty where none loads) into
    a skip. The builds go to the default cache, where kernel_builds() finds them: a library there
    is keyed by the sources' bytes, so one found for these sources was compiled from them."""
    if (platform.system(), platform.machine()) != ("Linux", "x86_64") or not set(kernels.NEEDS) <= cpu.flags():
        pytest.skip("the kernels are built for x86-64 Linux with AVX2, FMA and F16C")
    if kernels._compiler() is None:
        pytest.skip("no C++ compiler here")
    try:
        default = kernels.cache_dir()
        default.mkdir(parents=True, exist_ok=True)
        writable = os.access(default, os.W_OK)
    except (kernels.Unavailable, OSError):
        writable = False
    if not writable:  # no default cache to share: a folder of this test's own
        monkeypatch.setenv("GPT2ATTN_CACHE", str(tmp_path))
    wide = set(kernels.AVX512) <= cpu.flags()
    for flags in [kernels.FLAGS] + ([kernels.FLAGS + list(kernels.AVX512.values())] if wide else []):
        lib = kernels._bind(ctypes.CDLL(str(kernels.build(kernels.SOURCES, flags + kernels.prefetch_flags(), []))))
        monkeypatch.setattr(kernels, "library", lambda lib=lib: lib)
        x, w, b = torch.randn(3, 40), torch.randn(40, 24), torch.randn(24)
        assert torch.allclose(kernels.cols(x, w, b), torch.addmm(b, x, w), rtol=1e-5, atol=1e-5), flags


@pytest.fixture(scope="module")
def built() -> Path | None:
    """The library this machine loads with the switches unset, as `cache` leaves them for the tests and
    their child processes (whatever GPT2ATTN_AVX512 the suite runs under), in the default cache."""
    builds = kernel_builds()
    return Path(builds["avx512" if "avx512" in builds else "avx2"]._name) if builds else None


def seed(folder: Path, built: Path) -> Path:
    """Copy this machine's library into folder, under its name; return the copy."""
    folder.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy(built, folder / built.name))


def library_with_warnings():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lib = kernels.library()
        kernels.library()  # asked again: no second warning
    return lib, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def check_fallback(expected_tokens, match: str):
    lib, said = library_with_warnings()
    assert lib is None and len(said) == 1 and match in said[0], said
    assert tokens() == expected_tokens


# faults on disk, each in a fresh process -------------------------------------------------

CHILD = """
import json, sys, warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from gpt2attn import kernels
    from {module} import tokens
    lib = kernels.library()
    out = tokens()
print(json.dumps({{"loaded": lib is not None, "warnings": [str(w.message) for w in caught
                  if issubclass(w.category, RuntimeWarning)], "tokens": out}}))
"""


def in_a_fresh_process(cache_root: Path) -> dict:
    env = {**os.environ, "GPT2ATTN_CACHE": str(cache_root), "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", CHILD.format(module=__name__)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_kernels
@pytest.mark.parametrize("damage", ["truncated", "garbage", "another library"])
def test_a_damaged_cached_library_is_rebuilt_once_with_one_warning(built, cache, damage, expected_tokens):
    library = seed(cache, built)
    if damage == "truncated":
        library.write_bytes(library.read_bytes()[: library.stat().st_size // 3])
    elif damage == "garbage":
        library.write_bytes(os.urandom(4096))
    else:  # a valid shared library, but not this one: it lacks the kernels' symbols
        shutil.copy(Path(torch.__file__).parent / "lib" / "libc10.so", library)
    first = in_a_fresh_process(cache.parent)
    assert first["loaded"] and first["tokens"] == expected_tokens
    assert len(first["warnings"]) == 1 and "was damaged; building it afresh" in first["warnings"][0]
    again = in_a_fresh_process(cache.parent)  # the rebuilt library stays
    assert again["loaded"] and again["warnings"] == [] and again["tokens"] == expected_tokens
    assert len(list(cache.glob("*.so"))) == 1


# faults of the build and of the environment, in this process ------------------------------


@needs_kernels
def test_a_hanging_compiler_is_stopped_and_plain_torch_runs(cache, tmp_path, monkeypatch, expected_tokens):
    hangs = tmp_path / "cxx"
    hangs.write_text("#!/bin/sh\nsleep 600 &\nwait\n")  # and a child of its own, as g++ starts cc1plus
    hangs.chmod(0o755)
    monkeypatch.setenv("CXX", str(hangs))
    monkeypatch.setattr(kernels, "BUILD_SECONDS", 1)
    check_fallback(expected_tokens, f"{hangs} did not finish in 1 s")
    assert not list(cache.glob("*.so"))


@needs_kernels
@pytest.mark.parametrize("compiler", ["missing", "failing", "none"])
def test_no_working_compiler_means_plain_torch_and_one_warning(cache, compiler, monkeypatch, expected_tokens):
    if compiler == "missing":
        monkeypatch.setenv("CXX", "/nonexistent/g++")
    elif compiler == "failing":
        monkeypatch.setenv("CXX", shutil.which("false"))
    else:
        monkeypatch.setattr(kernels.shutil, "which", lambda name: None)
    check_fallback(expected_tokens, "no C++ compiler found" if compiler == "none" else "building the kernels failed")


@needs_kernels
def test_no_home_folder_means_plain_torch_and_one_warning(cache, monkeypatch, expected_tokens):
    monkeypatch.delenv("GPT2ATTN_CACHE")
    monkeypatch.delenv("HOME", raising=False)

    def no_entry(uid):  # a uid with no passwd entry, as in many containers
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    check_fallback(expected_tokens, "no folder for the kernel cache")


def read_only(monkeypatch):
    """Writes into the cache fail as on a read-only file system (for any user, root included)."""
    def refuse(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(Path, "mkdir", refuse)
    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    monkeypatch.setattr(Path, "unlink", refuse)


@needs_kernels
def test_a_read_only_cache_is_read_and_never_written(built, cache, monkeypatch, expected_tokens):
    seed(cache, built)
    read_only(monkeypatch)
    lib, said = library_with_warnings()
    assert lib is not None and said == []  # the library it holds loads
    kernels.library.cache_clear()
    # and with nothing valid in it. The damaged file is a new one renamed over the old: writing into the
    # library this process has mapped would end the process with SIGBUS (at exit, in pytest).
    name = next(cache.iterdir()).name
    cache.joinpath(name + ".new").write_bytes(b"damaged")
    os.replace(cache / (name + ".new"), cache / name)
    check_fallback(expected_tokens, "Read-only file system")


@needs_kernels
@pytest.mark.parametrize("value", ["0", "false", "False", "no", "off", " OFF "])
def test_the_kernels_switched_off_means_plain_torch_silently(cache, monkeypatch, value, expected_tokens):
    monkeypatch.setenv("GPT2ATTN_KERNELS", value)
    lib, said = library_with_warnings()
    assert lib is None and said == [] and kernels.instruction_set() == "none: plain torch"
    assert tokens() == expected_tokens


@needs_kernels
@pytest.mark.parametrize("value, said", [("1", []), ("true", []), ("on", []), ("", []),
                                         ("maybe", ["GPT2ATTN_KERNELS='maybe' is none of"])])
def test_the_kernels_switched_on(built, cache, monkeypatch, value, said):
    seed(cache, built)
    monkeypatch.setenv("GPT2ATTN_KERNELS", value)
    lib, warned = library_with_warnings()
    assert lib is not None and len(warned) == len(said) and all(s in w for s, w in zip(said, warned))


@pytest.mark.parametrize("value", ["0", "false", "no", "off"])
def test_avx512_switched_off_builds_the_avx2_kernels(monkeypatch, value):
    monkeypatch.setattr(cpu, "flags", lambda: {"avx2", "fma", "f16c", *kernels.AVX512})
    monkeypatch.setattr(cpu, "vendor_family_model", lambda: ("AuthenticAMD", 26, 2))
    monkeypatch.setenv("GPT2ATTN_AVX512", value)
    assert kernels.flags() == kernels.FLAGS
    monkeypatch.setenv("GPT2ATTN_AVX512", "yes")
    assert kernels.flags() == kernels.FLAGS + ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni"]


def test_avx512_is_built_only_where_the_cpu_has_all_of_it(monkeypatch):
    monkeypatch.delenv("GPT2ATTN_AVX512", raising=False)
    monkeypatch.setattr(cpu, "flags", lambda: {"avx2", "fma", "f16c", "avx512f", "avx512bw"})
    monkeypatch.setattr(cpu, "vendor_family_model", lambda: ("AuthenticAMD", 26, 2))
    assert kernels.flags() == kernels.FLAGS


@pytest.mark.parametrize("ident, ahead", [(("GenuineIntel", 6, 207), ["-DGPT2ATTN_PREFETCH_AHEAD=1024"]),
                                          (("AuthenticAMD", 25, 17), []), (("AuthenticAMD", 26, 2), []), (None, [])])
def test_the_prefetch_distance_follows_the_cpu_vendor(monkeypatch, ident, ahead):
    # Intel's rows products ask for their weights 1024 bytes ahead, AMD's and an unknown CPU's 256 (simd.h's default)
    monkeypatch.setattr(cpu, "flags", lambda: {"avx2", "fma", "f16c"})
    monkeypatch.setattr(cpu, "vendor_family_model", lambda: ident)
    assert kernels.flags() == kernels.FLAGS + ahead


def test_the_cache_key_follows_everything_a_build_depends_on(monkeypatch, tmp_path):
    base = kernels.cache_key(kernels.SOURCES, kernels.FLAGS)
    header = tmp_path / "simd.h"
    header.write_text(kernels.HEADERS[0].read_text() + "\n// changed\n")
    monkeypatch.setattr(kernels, "HEADERS", [header])
    assert kernels.cache_key(kernels.SOURCES, kernels.FLAGS) != base
    monkeypatch.undo()
    assert kernels.cache_key(kernels.SOURCES, kernels.FLAGS) == base
    assert kernels.cache_key(kernels.SOURCES, kernels.FLAGS + ["-mavx512f"]) != base
    monkeypatch.setattr(cpu, "flags", lambda: {"avx2", "fma", "f16c"})
    assert kernels.cache_key(kernels.SOURCES, kernels.FLAGS) != base
    monkeypatch.undo()
    monkeypatch.setattr(cpu, "name", lambda: "another CPU")
    assert kernels.cache_key(kernels.SOURCES, kernels.FLAGS) != base
    monkeypatch.undo()
    monkeypatch.setenv("CXX", "/usr/bin/another-c++")
    assert kernels.cache_key(kernels.SOURCES, kernels.FLAGS) != base


@needs_kernels
def test_a_compiler_without_avx512_builds_the_avx2_kernels(cache, monkeypatch, tmp_path):
    refuses = tmp_path / "cxx"  # g++ that refuses every AVX-512 flag, as an old compiler would
    refuses.write_text(f'#!/bin/sh\nfor a in "$@"; do case "$a" in -mavx512*) exit 1;; esac; done\nexec {kernels._compiler()} "$@"\n')
    refuses.chmod(0o755)
    monkeypatch.setenv("CXX", str(refuses))
    monkeypatch.setattr(cpu, "flags", lambda: {"avx2", "fma", "f16c", *kernels.AVX512})
    lib, said = library_with_warnings()
    assert lib is not None and said == []
    assert [path.name for path in cache.glob("*.so")] == [kernels.build(kernels.SOURCES, kernels.FLAGS, []).name]
    assert kernels.instruction_set() == "AVX2, FMA, F16C"  # what was built, not what was asked for


@needs_kernels
def test_every_build_this_cpu_runs_is_loaded_by_the_tests():
    """The kernel and step tests run each of these; an AVX-512 CPU has two."""
    assert sorted(kernel_builds()) == (["avx2", "avx512"] if set(kernels.AVX512) <= cpu.flags() else ["avx2"])
