"""The documentation cannot drift from the code: every ```python and ```bash block of README.md and
docs/*.md runs here, the outputs the blocks claim in comments are checked, the benchmarks page is
the rendering of the result files, and the site builds with `mkdocs build --strict`.

The rules (docs/contributing.md explains them to writers):
- A page is one test. Its blocks run top to bottom in a fresh temporary working directory; the
  Python blocks share one namespace; bash blocks run in `bash -e` with the venv's bin (gpt2attn)
  first on PATH. ```text (and any other language) is shown, never run.
- `<!-- skip: reason -->` directly before a fence skips that block (the reason is in the test's
  report); `<!-- fixture: name, ... -->` there first puts the named stand-ins (FIXTURES below)
  into the working directory; `<!-- slow -->` anywhere on a page marks the page's test slow.
- In Python, a top-level expression line ending in `# -> VALUE` asserts `expr == VALUE` (a tensor
  is compared through .tolist()), and one ending in `# (2, 3, ...)` (a tuple of integer literals)
  asserts `tuple(expr) == (2, 3, ...)`. Other comments are prose.
- In bash, `pip install ...` is not run (the tests run inside such an install): a line
  `pip install X && COMMAND` runs COMMAND only.
"""

from __future__ import annotations

import ast
import linecache
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO as ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.M | re.S)
DIRECTIVE = re.compile(r"<!--\s*(skip|fixture|slow)\s*(?::\s*(.*?))?\s*-->")


@dataclass
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    skip: str | None = None
    fixtures: list[str] = field(default_factory=list)


def blocks_of(path: Path) -> list[Block]:
    """The page's python and bash blocks, with the directives in the comment lines just above each."""
    text = path.read_text(encoding="utf-8")
    found = []
    for match in FENCE.finditer(text):
        lang = match.group(1)
        if lang not in ("python", "bash"):
            continue
        block = Block(path.name, text.count("\n", 0, match.start()) + 1, lang, match.group(2))
        above = text[: match.start()].rstrip("\n").split("\n")
        while above and DIRECTIVE.fullmatch(above[-1].strip()):
            kind, value = DIRECTIVE.fullmatch(above.pop().strip()).groups()
            if kind == "skip":
                block.skip = value or "no reason given"
            elif kind == "fixture":
                block.fixtures += [name.strip() for name in value.split(",")]
        found.append(block)
    return found


# --- fixtures: the stand-ins a block declares ----------------------------------------------------


def gpt2_hf(where: Path) -> None:
    """A tiny GPT-2 with GPT-2's real BPE tokenizer (from the GGUF test fixture), saved as an HF
    folder: what `gpt2attn convert gpt2 gpt2-hf` would give, at 0.1% of the size."""
    from gpt2attn import GPT2Config, GPT2LMHeadModel
    from gpt2attn.formats.gguf import tokenizer_of

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=128, bos_token_id=50256, eos_token_id=50256)
    GPT2LMHeadModel(config).save_pretrained(where / "gpt2-hf")
    tokenizer_of(ROOT / "tests" / "data" / "gguf" / "tiny-f16.gguf").save(str(where / "gpt2-hf" / "tokenizer.json"))


def my_text(where: Path) -> None:
    """A plain-text file of a user's own (about 30 KB), for the training guides."""
    lines = [f"Line {i}: the quick brown fox jumps over the lazy dog, and the dog sleeps on.\n" for i in range(400)]
    (where / "my_text.txt").write_text("".join(lines), encoding="utf-8")


def copy_of(source: str, name: str):
    def make(where: Path) -> None:
        src = ROOT / source
        (shutil.copytree if src.is_dir() else shutil.copy)(src, where / name)
    return make


FIXTURES = {
    "gpt2-hf": gpt2_hf,
    "my_text.txt": my_text,
    "gpt2_124M.bin": copy_of("tests/data/llmc/tiny_fp32.bin", "gpt2_124M.bin"),  # llm.c's format, tiny
    "gpt2.Q8_0.gguf": copy_of("tests/data/gguf/tiny-q8_0.gguf", "gpt2.Q8_0.gguf"),  # llama.cpp's converter wrote it
    "openai-124M": copy_of("tests/data/openai-tf-tiny", "openai-124M"),  # OpenAI's TF layout, tiny
}


# --- running a block ---------------------------------------------------------------------------------

SHAPE = re.compile(r"#\s*(\((?:\s*\d+\s*,)+\s*(?:\d+\s*)?\))")  # a tuple of integer literals
ARROW = re.compile(r"#\s*->\s*(.+?)\s*$")


def claimed(line: str) -> str | None:
    """The value a line's comment claims, as Python source, or None."""
    if "#" not in line:
        return None
    comment = line[line.index("#"):]
    for pattern in (ARROW, SHAPE):
        match = pattern.match(comment)
        if match:
            return match.group(1)
    return None


def check(value, expected_src: str, namespace: dict, where: str) -> None:
    expected = eval(expected_src, namespace)
    if isinstance(value, torch.Tensor):
        value = value.tolist() if not isinstance(expected, tuple) else tuple(value.shape)
    if isinstance(expected, tuple) and isinstance(value, torch.Size):
        value = tuple(value)
    assert value == expected, f"{where}: the page claims {expected_src}, the code gives {value!r}"


def run_python(block: Block, namespace: dict) -> None:
    lines = block.code.split("\n")
    filename = f"{block.page}, block at line {block.line}"
    # Tracebacks, and libraries that read their caller's source back (nnsight's traces), find it here.
    linecache.cache[filename] = (len(block.code), None, block.code.splitlines(True), filename)
    tree = ast.parse(block.code, filename)
    for node in tree.body:
        where = f"{block.page} line {block.line + node.lineno}"
        expected = claimed(lines[node.end_lineno - 1]) if isinstance(node, ast.Expr) else None
        if expected is None:
            exec(compile(ast.Module([node], []), filename, "exec"), namespace)
        else:
            check(eval(compile(ast.Expression(node.value), filename, "eval"), namespace), expected, namespace, where)


def without_installs(code: str) -> str:
    """`pip install X && rest` -> `rest`; a line that only installs is dropped (see the module doc)."""
    out = []
    for line in code.split("\n"):
        if line.lstrip().startswith("pip install"):
            _, sep, rest = line.partition("&&")
            line = rest.strip() if sep else ""
        out.append(line)
    return "\n".join(out)


def run_bash(block: Block, cwd: Path) -> None:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", MPLBACKEND="Agg",
               HF_HUB_OFFLINE="1")
    done = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", without_installs(block.code)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (f"{block.page} line {block.line}: bash block failed ({done.returncode})\n"
                                  f"{block.code}\n--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}")


def page_param(path: Path):
    slow = "<!-- slow -->" in path.read_text(encoding="utf-8")
    return pytest.param(path, id=path.name, marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("page", [page_param(p) for p in PAGES if any(True for _ in blocks_of(p))])
def test_page_snippets_run(page: Path, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    namespace: dict = {"__name__": "__docs__"}
    made, skipped, ran = set(), [], 0
    for block in blocks_of(page):
        if block.skip:
            skipped.append(f"line {block.line}: {block.skip}")
            continue
        for name in block.fixtures:
            if name not in FIXTURES:
                raise KeyError(f"{block.page} line {block.line}: unknown fixture {name!r}; known: {', '.join(FIXTURES)}")
            if name not in made:
                FIXTURES[name](tmp_path)
                made.add(name)
        if block.lang == "python":
            run_python(block, namespace)
        else:
            run_bash(block, tmp_path)
        ran += 1
    with capsys.disabled():  # skipped blocks are reported, never counted as run
        print(f"\n[{page.name}] {ran} blocks run, {len(skipped)} skipped", end="")
        for reason in skipped:
            print(f"\n[{page.name}] block skipped, {reason}", end="")


# --- the runner's own rules ----------------------------------------------------------------------


def test_runner_finds_directives_and_checks_claims(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("x\n<!-- fixture: gpt2-hf, my_text.txt -->\n```python\na = 1\n```\n\n"
                    "<!-- skip: needs a network -->\n```bash\nexit 1\n```\n```text\nnot run\n```\n")
    first, second = blocks_of(page)
    assert (first.lang, first.fixtures, first.skip, first.line) == ("python", ["gpt2-hf", "my_text.txt"], None, 3)
    assert (second.lang, second.skip) == ("bash", "needs a network")
    namespace: dict = {}
    run_python(Block("p", 1, "python", "import torch\nt = torch.zeros(2, 3)\nt.shape  # (2, 3)\nt.sum()  # -> 0.0"), namespace)
    with pytest.raises(AssertionError, match=r"claims \(2, 4\)"):
        run_python(Block("p", 1, "python", "t.shape  # (2, 4)"), namespace)
    with pytest.raises(AssertionError, match="claims 1"):
        run_python(Block("p", 1, "python", "len(t)  # -> 1"), namespace)
    run_python(Block("p", 1, "python", "t.shape  # (B, T): prose, not checked"), namespace)
    assert without_installs("pip install torch -e . && gpt2attn generate x  # c\npip install y") == "gpt2attn generate x  # c\n"


def test_readme_setup_lines_keep_the_form_ci_reads():
    """.ci/run greps these two lines out of the README and runs the second as CI."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert 'pip install torch==2.13.0 -e . && gpt2attn generate "ROMEO:"  # the main job, offline\n' in text
    assert 'pip install torch==2.13.0 -e ".[test]" && python -m pytest -q  # the tests\n' in text
    assert len(text.splitlines()) <= 200, "the README is for a two-minute read: move detail into docs/"


TESTS_PATH = re.compile(r"(?<![\w./-])tests/[\w/.-]*\w")  # tests/formats/test_gguf.py, tests/data/llmc, ...
THEIR_TESTS = {"tests/models/gpt2/test_modeling_gpt2.py"}  # transformers' own test file (docs/surface.md)


def test_every_test_path_a_page_names_exists():
    """A test file or folder the README or a docs page names is there: moving tests updates the pages."""
    named = {m.group(0) for page in PAGES for m in TESTS_PATH.finditer(page.read_text(encoding="utf-8"))}
    assert "tests/project/test_docs.py" in named  # the pattern finds paths at all
    assert sorted(path for path in named - THEIR_TESTS if not (ROOT / path).exists()) == []


# --- the benchmarks page and the site ------------------------------------------------------------------


def scripts_module(name: str):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(ROOT / "scripts"))


def test_benchmarks_page_is_rendered_from_the_result_files():
    render_benchmarks = scripts_module("render_benchmarks")
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert page == render_benchmarks.render(), "docs/benchmarks.md is stale: run python scripts/render_benchmarks.py"


def test_every_bench_is_a_name_of_bench_py_and_described_on_the_page():
    """One way into the benchmarks: each scripts/bench_NAME.py runs as `bench.py NAME`, and the page
    describes the same benches in the same order."""
    bench, render_benchmarks = scripts_module("bench"), scripts_module("render_benchmarks")
    modules = [path.stem.removeprefix("bench_") for path in (ROOT / "scripts").glob("bench_*.py")]
    assert sorted(bench.BENCHES) == sorted(name for name in modules if name != "common")
    assert list(render_benchmarks.ABOUT) == list(bench.BENCHES)


def test_a_bench_run_becomes_a_table_with_its_machine_date_and_command(tmp_path):
    import datetime

    bench_common, render_benchmarks = scripts_module("bench_common"), scripts_module("render_benchmarks")
    started = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)
    rows = [{"case": "T=128", "gpt2attn ms": 1.5, "ratio": "1.10x"}, {"case": "T=512", "gpt2attn ms": 6.25, "ratio": "1.20x"}]
    bench_common.write_results("forward", ["--repeats", "3"], rows, started, results_dir=tmp_path)
    page = render_benchmarks.render(tmp_path)
    facts = bench_common.machine_facts()
    section = page.split("## forward")[1].split("\n## ")[0]
    assert f"### {bench_common.cpu_family(facts)}" in section and f"torch {facts['torch']}" in section
    assert f"Run 2026-01-02T03:04:05+00:00 (code at {bench_common.code_version()}) on {facts['cpu']}" in section
    assert "`python scripts/bench.py forward --repeats 3`" in section
    assert "| case | gpt2attn ms | ratio |" in section and "| T=512 | 6.25 | 1.20x |" in section
    assert "**load**" in page.split("## Not yet recorded")[1]  # a bench without a result file is named, without figures
    with pytest.raises(ValueError, match="same keys"):
        bench_common.write_results("load", [], [{"a": 1}, {"b": 2}], started, results_dir=tmp_path)


def test_a_bench_keeps_the_latest_run_on_each_cpu_family(tmp_path, monkeypatch):
    import datetime
    import json

    bench_common, render_benchmarks = scripts_module("bench_common"), scripts_module("render_benchmarks")
    real = bench_common.machine_facts()
    avx512 = ["avx2", "avx512f", "avx512_vnni", "avx512_bf16"]
    machines = {"zen3": dict(real, cpu="AMD EPYC 7B13", core="Zen 3", cpu_flags=["avx2"]),
                "spr": dict(real, cpu="Intel Xeon 8481C", core="Sapphire Rapids", cpu_flags=["avx2", "avx512f", "amx_tile"]),
                # a virtual machine names both 'AMD EPYC': only the core design tells them apart
                "zen4": dict(real, cpu="AMD EPYC", core="Zen 4", cpu_flags=avx512),
                "zen5": dict(real, cpu="AMD EPYC", core="Zen 5", cpu_flags=avx512)}

    def run(machine: str, day: int, value: str) -> None:
        monkeypatch.setattr(bench_common, "machine_facts", lambda: machines[machine])
        started = datetime.datetime(2026, 1, day, tzinfo=datetime.timezone.utc)
        bench_common.write_results("decode", [], [{"mode": "fp32", "tok/s": value}], started, results_dir=tmp_path)

    def stored() -> list[tuple[str, str]]:
        runs = json.loads((tmp_path / "decode.json").read_text())["runs"]
        return [(r["family"], r["tables"][""][0]["tok/s"]) for r in runs]

    run("zen3", 1, "10.5")
    run("spr", 2, "20.5")
    run("zen3", 3, "11.5")  # replaces the first Zen 3 run, keeps the Xeon's
    assert stored() == [("AMD EPYC 7B13 (Zen 3), AVX2", "11.5"), ("Intel Xeon 8481C (Sapphire Rapids), AMX", "20.5")]
    section = render_benchmarks.render(tmp_path).split("## decode")[1].split("\n## ")[0]
    assert section.index("### AMD EPYC 7B13 (Zen 3), AVX2") < section.index("| fp32 | 11.5 |") < section.index(
        "### Intel Xeon 8481C (Sapphire Rapids), AMX") < section.index("| fp32 | 20.5 |")
    assert "10.5" not in section and "Run 2026-01-02T00:00:00+00:00" in section

    run("zen4", 4, "30.5")
    run("zen5", 5, "40.5")
    assert stored()[:2] == [("AMD EPYC (Zen 5), AVX-512", "40.5"), ("AMD EPYC (Zen 4), AVX-512", "30.5")]

    # a run stored before the core design was recorded is replaced by the next run with its name and flags
    path = tmp_path / "decode.json"
    data = json.loads(path.read_text())
    legacy = next(r for r in data["runs"] if r["machine"]["core"] == "Sapphire Rapids")
    del legacy["machine"]["core"]
    legacy["family"] = "Intel Xeon 8481C, AMX"
    path.write_text(json.dumps(data))
    run("spr", 6, "21.5")
    assert sorted(stored()) == [("AMD EPYC (Zen 4), AVX-512", "30.5"), ("AMD EPYC (Zen 5), AVX-512", "40.5"),
                                ("AMD EPYC 7B13 (Zen 3), AVX2", "11.5"), ("Intel Xeon 8481C (Sapphire Rapids), AMX", "21.5")]


def test_the_core_design_comes_from_the_cpuid_numbers(monkeypatch):
    from gpt2attn import cpu

    bench_common = scripts_module("bench_common")
    lines = ["processor\t: 0", "vendor_id\t: AuthenticAMD", "cpu family\t: 26", "model\t\t: 2", "model name\t: AMD EPYC"]
    monkeypatch.setattr(cpu, "_cpuinfo", lambda: lines)
    assert cpu.vendor_family_model() == ("AuthenticAMD", 26, 2)
    assert bench_common.machine_facts()["core"] == "Zen 5"
    assert [bench_common.core_design("AuthenticAMD", 25, model) for model in (0x01, 0x11, 0x21, 0x61, 0xA0)] == [
        "Zen 3", "Zen 4", "Zen 3", "Zen 4", "Zen 4"]
    assert bench_common.core_design("GenuineIntel", 6, 0x8F) == "Sapphire Rapids"
    assert bench_common.core_design("GenuineIntel", 6, 0x01) == "family 6 model 1"  # unknown numbers still tell CPUs apart
    monkeypatch.setattr(cpu, "_cpuinfo", lambda: [*lines[:3], "model\t\t: unknown"])  # numbers it cannot read: none
    assert cpu.vendor_family_model() is None
    monkeypatch.setattr(cpu, "_cpuinfo", lambda: ["Features\t: neon asimd"])  # ARM: no x86 numbers, no core named
    assert cpu.vendor_family_model() is None and bench_common.machine_facts()["core"] is None


@pytest.mark.slow
def test_site_builds_strict_offline(tmp_path):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[docs]')")
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               HF_HUB_OFFLINE="1", NO_MKDOCS_2_WARNING="1")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    assert (tmp_path / "site" / "api" / "index.html").is_file()
