"""transformers' own GPT-2 test file, run on gpt2attn by ../shared/hf-tests/run.sh (the import line
changed, nothing else): every test that passes on transformers must pass on gpt2attn, in both runs
(GPT2Config from gpt2attn, and from transformers), except the tests docs/surface.md lists under
"transformers' own tests". A new failure fails this test, naming it; a listed test that passes now
is printed (its row can go).

Needs ../shared/hf-tests (the project's shared folder; a user's clone has none) and transformers
5.24.x, the release those test files were taken from; skips, saying which, otherwise.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from tests.helpers import REPO as ROOT

HF_TESTS = Path(os.environ.get("GPT2ATTN_SHARED_DATA", ROOT.parent / "shared" / "data")).parent / "hf-tests"
SURFACE_PAGE = ROOT / "docs" / "surface.md"
ROW = re.compile(r"^\| `(test_\w+)` \| (both|gpt2attn|hfconfig) \| (.+) \|$")
MODES = {"gpt2attn": "gpt2attn", "hfconfig": "gpt2attn-hfconfig"}
GAP_ROW = re.compile(r"^\S+::(\S+)\t[^\t]*\t[^\t]*\t(.*)$")  # Class::test, outcome, cause, first error line


def listed_gaps() -> dict[str, set[str]]:
    """mode -> the test names docs/surface.md lists for it."""
    gaps: dict[str, set[str]] = {mode: set() for mode in MODES.values()}
    for line in SURFACE_PAGE.read_text().splitlines():
        m = ROW.match(line)
        if m:
            name, where, reason = m.groups()
            assert reason.strip(), f"docs/surface.md: the row for {name} gives no reason"
            for short, mode in MODES.items():
                if where in ("both", short):
                    gaps[mode].add(name)
    return gaps


def found_gaps(path: Path) -> dict[str, str]:
    """test name -> its first error line, from run.sh's gap-<mode>.tsv (a header, then a test a line).
    The harness writes a test's message as it is where it finds no error line, so a message of
    several lines (a tensor's repr) runs on over the lines after its row: they join that row."""
    found: dict[str, str] = {}
    name = None
    for line in path.read_text(encoding="utf-8").splitlines()[1:]:
        row = GAP_ROW.match(line)
        if row:
            name, error = row.groups()
            found[name] = error
        elif name is not None:
            found[name] += "\n" + line
    return found


def test_a_message_of_several_lines_stays_with_its_test(tmp_path):
    gap = tmp_path / "gap-gpt2attn.tsv"
    gap.write_text("test\toutcome\tcause\tfirst error line\n"
                   "GPT2ModelTest::test_a\tfailed\tunclassified\tAssertionError: Output(sequences=tensor([[83, 83],\n"
                   "        [76, 16]]), scores=(tensor([[ 0.1561,\n"
                   "GPT2ModelTest::test_b\tskipped\tskip:fsdp-plan\tSkipped: no plan\n", encoding="utf-8")
    assert found_gaps(gap) == {
        "test_a": "AssertionError: Output(sequences=tensor([[83, 83],\n        [76, 16]]), scores=(tensor([[ 0.1561,",
        "test_b": "Skipped: no plan",
    }


def test_the_gap_table_is_read():
    gaps = listed_gaps()
    assert "test_gradient_checkpointing_enable_disable" in gaps["gpt2attn"]
    assert "test_gradient_checkpointing_enable_disable" in gaps["gpt2attn-hfconfig"]


@pytest.mark.slow
def test_transformers_own_gpt2_tests_pass_on_gpt2attn(tmp_path):
    if not (HF_TESTS / "run.sh").is_file():
        pytest.skip(f"{HF_TESTS} is absent: this test needs the project's shared folder (../shared/hf-tests)")
    if not transformers.__version__.startswith("5.24."):
        pytest.skip(f"transformers {transformers.__version__} is installed; ../shared/hf-tests holds 5.24's tests")
    # Each mode beside its own baseline run of transformers, the two side by side: each pytest there
    # runs on one thread, so on two cores this takes the time of two runs instead of three.
    runs = {}
    for mode in MODES.values():
        env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
        env.update(PROJECT=str(ROOT), PY=sys.executable, HFOWN_WORK=str(tmp_path / mode),
                   HFOWN_MODES=f"transformers {mode}")
        runs[mode] = subprocess.Popen(["bash", str(HF_TESTS / "run.sh")], cwd=ROOT, env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        outputs = {mode: run.communicate(timeout=1500) for mode, run in runs.items()}
    finally:
        for run in runs.values():
            if run.poll() is None:  # a run left when the other timed out: it and its pytest
                os.killpg(run.pid, signal.SIGKILL)
                run.wait()
    listed = listed_gaps()
    problems = []
    for mode, (out, err) in outputs.items():
        last = out.strip().splitlines()[-1] if out.strip() else ""
        assert "hf own tests:" in last, f"run.sh ({mode}) ended without its summary:\n{out[-3000:]}\n{err[-3000:]}"
        found = found_gaps(tmp_path / mode / f"gap-{mode}.tsv")
        problems += [f"{mode}: {name} passes on transformers, not on gpt2attn: {error[:300]}"
                     for name, error in sorted(found.items()) if name not in listed[mode]]
        for name in sorted(listed[mode] - set(found)):
            print(f"{mode}: {name} is listed in docs/surface.md but passes now: its row can go")
        print(f"{mode}: {len(found)} tests pass on transformers and not on gpt2attn")
    assert not problems, "\n".join(problems)
