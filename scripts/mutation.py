"""Mutation testing with mutmut: plant one small bug at a time, run the tests that cover it.

    python scripts/mutation.py gpt2attn/interop/hooks.py        # one module
    python scripts/mutation.py gpt2attn/formats                 # a package, file by file
    python scripts/mutation.py --base main                      # the files this branch changes
    python scripts/mutation.py gpt2attn/formats --rev fa5d0e6   # the same, at an older commit
    python scripts/mutation.py gpt2attn/formats --only /tmp/run1/summary.json  # rerun its survivors

A mutant is "killed" when at least one test fails (or runs past its time limit) with the bug in
place, and "survived" when every test still passes. The score of a file is killed / (killed +
survived), where "survived" includes mutants in functions no selected test runs ("no tests").

How it stays within minutes on two cores:
- The code and tests are copied to a scratch folder first (from the working tree, or from `--rev`
  with `git archive`), so mutmut never touches the checkout and you may keep editing.
- Only the test files that exercise the target modules run (TEST_MAP below; `--tests` overrides).
  mutmut then traces that subset once and, for each mutant, runs only the tests that entered the
  mutated function.
- Each mutant's tests get a CPU-time limit of (their clean run time + 1 s) x --timeout-factor x 2;
  `--jobs` workers (default 2) run mutants side by side.

Needs the `dev` extra: pip install -e ".[test,dev]".  The per-file table goes to stdout and to
<workdir>/summary.json; the surviving mutants' diffs to <workdir>/survivors.txt.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Which test files exercise which part of the package (the longest matching prefix wins; a module
# with no entry gets the test files that import it by name). The tests lie by subject under tests/
# (tests/formats/, tests/training/, ...), one file per unit.
TEST_MAP = {
    "gpt2attn/formats/gguf.py": ["tests/formats/test_gguf.py", "tests/formats/test_detect.py"],
    "gpt2attn/formats/llmc.py": ["tests/formats/test_llmc.py", "tests/formats/test_detect.py"],
    "gpt2attn/formats/": [
        "tests/formats/test_gguf.py", "tests/formats/test_llmc.py", "tests/formats/test_files.py",
        "tests/formats/test_checkpoint.py", "tests/formats/test_bad_inputs.py", "tests/formats/test_openai_tf.py",
        "tests/formats/test_detect.py", "tests/formats/test_hf.py", "tests/formats/test_nanogpt_and_state_dict.py",
    ],
    "gpt2attn/explore/": ["tests/explore/test_explore.py"],
    # The loop's runs of seconds (end to end, torchrun) are marked slow: pass --pytest-args "-m 'not slow'"
    # for its fast tier (a fraction of a second a test), so that a mutant costs seconds, not minutes.
    "gpt2attn/training/": ["tests/training/test_training.py", "tests/training/test_loop.py"],
    "gpt2attn/interop/hooks.py": ["tests/ecosystem/test_import_hooks.py"],
    "gpt2attn/generation/": [
        "tests/generation/test_generate.py", "tests/generation/test_exact.py",
        "tests/generation/test_processors.py", "tests/generation/test_bad_inputs.py",
        "tests/generation/test_max_length.py",
    ],
    # generate() and its settings also take transformers' GenerationConfig (tests/compat/test_surface.py)
    "gpt2attn/generation/config.py": [
        "tests/generation/test_generate.py", "tests/generation/test_exact.py", "tests/generation/test_bad_inputs.py",
        "tests/generation/test_max_length.py", "tests/compat/test_surface.py",
    ],
    "gpt2attn/generation/generate.py": [
        "tests/generation/test_generate.py", "tests/generation/test_exact.py", "tests/generation/test_processors.py",
        "tests/generation/test_bad_inputs.py", "tests/generation/test_max_length.py", "tests/compat/test_surface.py",
    ],
    "gpt2attn/adapters.py": ["tests/compat/test_surface.py", "tests/ecosystem/test_peft.py"],
    "gpt2attn/errors.py": [
        "tests/formats/test_fuzz.py", "tests/formats/test_bad_inputs.py", "tests/formats/test_hf.py",
        "tests/formats/test_files.py",
    ],
    "gpt2attn/memory.py": ["tests/formats/test_memory.py"],
    "gpt2attn/quantize.py": ["tests/kernels/test_quantize.py", "tests/kernels/test_kernels.py",
                             "tests/kernels/test_decode_step.py"],
    "gpt2attn/decode_step.py": ["tests/kernels/test_decode_step.py", "tests/kernels/test_q4.py",  # q4: the Q4_K rows
                                "tests/kernels/test_kernels.py"],
    "gpt2attn/pretrained.py": [
        "tests/model/test_api.py", "tests/compat/test_surface.py", "tests/formats/test_checkpoint.py",
        "tests/kernels/test_quantize.py",
    ],
    "gpt2attn/bridge.py": ["tests/ecosystem/test_bridge.py", "tests/kernels/test_quantize.py"],
}

# mutmut's exit codes, grouped the way the score counts them.
KILLED = {1, 3, 24, -24, 152, 255, 36, 37}  # a test failed, pytest crashed, or the time limit hit
TIMEOUT = {24, -24, 152, 255, 36}  # the killed ones that only ran out of time: check them on a loaded machine
SURVIVED = {0, 5, 33}  # every test passed, or no test ran the mutated function
SKIPPED = {34}


def target_files(paths: list[str], base: str | None) -> list[str]:
    """The package's .py files named by `paths` (files or folders) or changed since `base`."""
    if base:
        out = subprocess.run(["git", "diff", "--name-only", base, "--", "gpt2attn"], cwd=REPO,
                             check=True, capture_output=True, text=True).stdout
        paths = paths + out.split()
    files = []
    for p in paths:
        full = REPO / p
        if full.is_dir():
            files += [str(f.relative_to(REPO)) for f in sorted(full.rglob("*.py"))]
        elif p.endswith(".py") and p.startswith("gpt2attn/"):
            files.append(p)
    return sorted(set(files))


def tests_for(files: list[str], root: Path) -> list[str]:
    """The test files under `root` that exercise `files`."""
    tests: set[str] = set()
    for f in files:
        prefixes = [k for k in TEST_MAP if f.startswith(k)]
        mapped = [t for t in TEST_MAP[max(prefixes, key=len)] if (root / t).exists()] if prefixes else []
        if mapped:  # none exist in a --rev commit from before the tests' layout: found by import below
            tests.update(mapped)
            continue
        dotted = f[:-3].replace("/", ".").removesuffix(".__init__")
        stem = dotted.rsplit(".", 1)[-1]
        for t in sorted((root / "tests").rglob("test_*.py")):
            text = t.read_text()
            if dotted in text or f"import {stem}" in text:
                tests.add(t.relative_to(root).as_posix())
    return sorted(t for t in tests if (root / t).exists())


def populate(workdir: Path, rev: str | None) -> None:
    """Copy the package, tests, configs, docs (pages some tests read), scripts (helpers some tests
    import, e.g. bench_common) and pyproject.toml into `workdir` (at `rev` if given)."""
    parts = ["gpt2attn", "tests", "configs", "docs", "scripts", "pyproject.toml"]
    if rev:
        archive = subprocess.run(["git", "archive", rev, *parts], cwd=REPO, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(workdir)], input=archive, check=True)
        return
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", *parts], cwd=REPO,
                            check=True, capture_output=True, text=True).stdout.split()
    for name in listed:
        if (REPO / name).is_file():
            (workdir / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, workdir / name)


def toml_list(items: list[str]) -> str:
    return "[" + ", ".join(json.dumps(i) for i in items) + "]"


def configure(workdir: Path, files: list[str], tests: list[str], timeout_factor: float,
              pytest_args: list[str]) -> None:
    """Append a [tool.mutmut] table to the copied pyproject.toml."""
    pyproject = workdir / "pyproject.toml"
    text = pyproject.read_text()
    if "[tool.mutmut]" in text:
        sys.exit("pyproject.toml already has a [tool.mutmut] table; this script writes its own")
    pyproject.write_text(text + f"""
[tool.mutmut]
source_paths = ["gpt2attn"]
only_mutate = {toml_list(files)}
also_copy = ["configs", "docs", "scripts"]
pytest_add_cli_args = {toml_list(["-p", "no:cacheprovider", "-x", "-q", *pytest_args])}
pytest_add_cli_args_test_selection = {toml_list(tests)}
timeout_multiplier = {timeout_factor}
process_isolation = "forkserver"
""")


def mutant_names(workdir: Path, file: str) -> list[str]:
    meta = workdir / "mutants" / (file + ".meta")
    return list(json.loads(meta.read_text())["exit_code_by_key"]) if meta.exists() else []


def tally(workdir: Path, files: list[str], sample: set[str] | None) -> dict[str, dict]:
    """Per file: killed, survived (names), skipped, read from mutmut's .meta files."""
    no_test_at_all = "could not find any test case for any mutant" in (workdir / "mutmut.log").read_text()
    table = {}
    for f in files:
        meta = workdir / "mutants" / (f + ".meta")
        codes = json.loads(meta.read_text())["exit_code_by_key"] if meta.exists() else {}
        if sample is not None:
            codes = {name: code for name, code in codes.items() if name in sample}
        if no_test_at_all:  # mutmut stopped before running any: none was reached by a test
            codes = {name: 33 for name in codes}
        killed = sorted(k for k, c in codes.items() if c in KILLED)
        survived = sorted(k for k, c in codes.items() if c in SURVIVED)
        other = sorted(k for k, c in codes.items() if c not in KILLED | SURVIVED | SKIPPED)
        counted = len(killed) + len(survived)
        timeouts = sorted(k for k, c in codes.items() if c in TIMEOUT)
        table[f] = {
            "mutants": len(codes), "killed": len(killed), "timeouts": timeouts, "survived": survived, "other": other,
            "score": round(100 * len(killed) / counted, 1) if counted else None,
        }
    return table


def chosen_mutants(items: list[str]) -> list[str]:
    """Mutant names or patterns from `--only`: as given (`*` matches any text), or the survivors
    listed in a summary.json."""
    names = []
    for item in items:
        if item.endswith(".json"):
            files = json.loads(Path(item).read_text())["files"]
            names += [name for row in files.values() for name in row["survived"]]
        else:
            names.append(item)
    if not names:
        sys.exit(f"--only {' '.join(items)}: no mutant named (no survivors?)")
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="*", help="files or folders under gpt2attn/ to mutate")
    ap.add_argument("--base", help="also mutate the gpt2attn/ files changed since this git ref")
    ap.add_argument("--rev", help="measure the code and tests of this commit instead of the working tree")
    ap.add_argument("--tests", nargs="+", help="test files to run (default: TEST_MAP)")
    ap.add_argument("--jobs", type=int, default=2, help="mutants run side by side (default 2)")
    ap.add_argument("--timeout-factor", type=float, default=5.0,
                    help="time limit per mutant, in multiples of its tests' clean time (default 5)")
    ap.add_argument("--sample", type=int, help="run only this many mutants, drawn at random (seeded)")
    ap.add_argument("--seed", type=int, default=0, help="the sample's seed (default 0)")
    ap.add_argument("--only", nargs="+", metavar="NAME_OR_SUMMARY",
                    help="run only these mutants: mutmut names or patterns ('*x_write__mutmut_*'), or an "
                         "earlier run's summary.json (its survivors), e.g. to check that new tests kill them")
    ap.add_argument("--pytest-args", default="",
                    help='extra pytest arguments for every run, e.g. "-m \'not slow\'"')
    ap.add_argument("--workdir", type=Path, help="scratch folder (default: a new temporary one; kept)")
    args = ap.parse_args()

    files = target_files(args.paths, args.base)
    if not files:
        sys.exit("nothing to mutate: name files or folders under gpt2attn/, or --base with changes there")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="gpt2attn-mutation-"))
    if workdir.exists() and any(workdir.iterdir()):
        sys.exit(f"{workdir} is not empty; give a new --workdir")
    workdir.mkdir(parents=True, exist_ok=True)
    populate(workdir, args.rev)
    tests = args.tests or tests_for(files, workdir)
    absent = [t for t in tests if not (workdir / t).is_file()]
    if absent:  # e.g. a test file named with --tests that the --rev commit does not have yet
        print(f"  left out (not in {args.rev or 'the working tree'}): {' '.join(absent)}", flush=True)
        tests = [t for t in tests if t not in absent]
    if not tests:
        sys.exit(f"no test file found for {files}; name them with --tests")
    print(f"mutating {len(files)} file(s) with {len(tests)} test file(s) in {workdir}", flush=True)
    print("  files:", " ".join(files), "\n  tests:", " ".join(tests), flush=True)
    configure(workdir, files, tests, args.timeout_factor, shlex.split(args.pytest_args))
    # The tests (and the subprocesses they start) must import the mutated copy, not the checkout or
    # an editable install. The folder must exist before Python starts, or its import system
    # remembers it as absent and never looks there.
    (workdir / "mutants").mkdir()
    env = dict(os.environ, PYTHONPATH=str(workdir / "mutants"))
    mutmut = shutil.which("mutmut") or sys.exit('mutmut is not installed: pip install -e ".[dev]"')
    shared = REPO.parent / "shared" / "data"  # tests that need the project's shared data
    if shared.is_dir():
        env.setdefault("GPT2ATTN_SHARED_DATA", str(shared))
    command = [mutmut, "run", "--max-children", str(args.jobs)]
    with open(workdir / "mutmut.log", "w") as log:
        if args.sample or args.only:
            # Make the mutants and the test map without running any, then run the chosen ones.
            subprocess.run([*command, "no-such-mutant*"], cwd=workdir, env=env, stdout=log,
                           stderr=subprocess.STDOUT)
            names = sorted(n for f in files for n in mutant_names(workdir, f))
            if args.only:
                patterns = chosen_mutants(args.only)
                chosen = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
                if not chosen:  # mutmut would run every mutant
                    sys.exit(f"--only: no mutant of {', '.join(files)} matches {' '.join(patterns)}")
                command += chosen
            else:
                command += random.Random(args.seed).sample(names, min(args.sample, len(names)))
        run = subprocess.run(command, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
    table = tally(workdir, files, set(command[4:]) if args.sample or args.only else None)
    with open(workdir / "survivors.txt", "w") as out:
        for row in table.values():
            for name in row["survived"]:
                diff = subprocess.run([mutmut, "show", name], cwd=workdir, env=env,
                                      capture_output=True, text=True).stdout
                out.write(diff + "\n")
    (workdir / "summary.json").write_text(json.dumps(
        {"rev": args.rev or "working tree", "tests": tests, "files": table}, indent=1))

    print(f"\n{'file':44} {'mutants':>7} {'killed':>6} {'(timeouts)':>10} {'survived':>8} {'score':>6}")
    for f, row in table.items():
        score = "-" if row["score"] is None else f"{row['score']:.1f}%"
        print(f"{f:44} {row['mutants']:7d} {row['killed']:6d} {len(row['timeouts']):10d} {len(row['survived']):8d} {score:>6}")
        if row["other"]:
            print(f"    not counted (suspicious/segfault/not run): {len(row['other'])}")
    if any(row["timeouts"] for row in table.values()):
        print("timeouts count as killed; on a loaded machine some are only slow: rerun them with "
              f"--only NAMES --timeout-factor 15 (names in {workdir / 'summary.json'})")
    print(f"\nsurvivors' diffs: {workdir / 'survivors.txt'}   log: {workdir / 'mutmut.log'}")
    if run.returncode != 0:
        if "failed to collect stats" in (workdir / "mutmut.log").read_text():
            # mutmut traces the tests in a child process whose output does not reach the log
            print("the selected tests failed in the mutated copy with no mutant active; to see why: cd "
                  f"{workdir / 'mutants'} && PYTHONPATH=. python -m pytest -x -q {' '.join(tests)}")
        sys.exit(f"mutmut exited with {run.returncode}; see {workdir / 'mutmut.log'}")


if __name__ == "__main__":
    main()
