"""Render docs/benchmarks.md from the result files that scripts/bench.py writes.

    python scripts/render_benchmarks.py          # rewrite docs/benchmarks.md
    python scripts/render_benchmarks.py --check  # exit 1 if docs/benchmarks.md is out of date

Every figure on the page comes from docs/benchmarks/results/<bench>.json (the latest run of each
bench on each CPU family it has met) and is printed under its CPU family, beside that run's date,
machine, commit and command; nothing on the page is typed in by hand except what each bench measures. tests/project/test_docs.py fails when the page and the result
files disagree.
"""

from __future__ import annotations

import sys
from pathlib import Path

from bench_common import cpu_family, read_runs

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "docs" / "benchmarks" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"

# What each bench measures and how, for every bench of bench.BENCHES in its order (tests/project/test_docs.py checks
# both list the same). Figures never go here: they come from the run.
ABOUT = {
    "forward": "The forward pass of gpt2-small (124M parameters, random weights), fp32, eval, batch 1, no "
               "cache, against transformers' sdpa and eager attention in the same process, timed in turns. "
               "A ratio above 1 means gpt2attn is faster. The last column relates our achieved GFLOP/s to a "
               "2048 × 2048 fp32 matmul timed in the same run: the machine's practical ceiling.",
    "load": "`from_pretrained` of a random gpt2-small checkpoint in fresh processes, ours and transformers' in "
            "turns after one untimed warm-up each (both read from the page cache); imports are not timed. "
            "gpt2attn maps the file and reads a page only when a weight is used, so \"load + first forward\" "
            "(one 8-token pass, touching every weight) is the fair comparison. Then the same weights from an "
            "llm.c model file and from an F16 GGUF with GPT-2's tokenizer, whose weights must be widened to "
            "float32, and the speed of each GGML type's dequantizer (the `gguf` package's reference code).",
    "generate": "`generate()` against transformers' `generate` on gpt2-small (random weights): greedy at "
                "batch 1 and 8 in fp32 and int8 (with CTranslate2's int8 when it is installed), beam search "
                "and assisted decoding (prompt lookup, a 2-layer assistant), with the memory-bandwidth floor "
                "(one read of all the weights; see [Fast CPU decoding](cpu-decoding.md)).",
    "decode": "CPU decoding at batch 1 of the plain fp32 model as loaded (no quantize() call) and in fp32, fp16, bf16, int8 and q4 (`model.quantize(mode)`) against llama.cpp's "
              "`llama-bench` on the same weights written as GGUF by gpt2attn (f32, f16, bf16, q8_0; q4 against "
              "q4_K_M, which `llama-quantize` makes from the f32 file), alternating "
              "in every round, gpt2-small shapes, random weights, prompt 32, 64 new tokens; prefill (generate's prompt pass) at "
              "128 and 512 tokens; and the machine's read rate measured in the same run. \"of limit\" is decode tok/s × bytes "
              "read per token / the read rate measured just before and after it, median over rounds [min-max] (runs "
              "before 2026-11-28: the median decode over the median of the rounds' read rates; \"read rate GB/s\", from "
              "2026-11-28 21:31 UTC on, gives the rates it divided by: on the 2-core VMs memory moves between a slower "
              "and a faster state from one minute to the next, and a run's \"of limit\" is lower in the faster); \"of sustained read\" "
              "(runs from 2026-11-29 04:00 UTC on) divides by a read held as long as the decode instead: 63 passes over the "
              "buffer in a row timed as one, just before and after each decode (the faster; \"sustained read GB/s\"), "
              "since the best of short passes can catch memory at its fastest moments, which a decode of hundreds of "
              "milliseconds averages over; bytes per token are the "
              "weight matrices', and in \"weights + KV\" (runs from 2026-11-28 14:00 UTC on) also the cached keys and "
              "values each timed step reads (ours fp32 after a 32-token prompt, llama-bench's f16 without one); the read "
              "rate is that of a buffer the size of the fp32 weights (so a smaller precision whose weights partly stay in "
              "the CPU's last-level cache between steps can exceed 100%), measured on "
              "2 MiB pages from the run of 2026-11-28 05:56 UTC on, on 4 kB pages before (which read up to 30% slower; see "
              "[Fast CPU decoding](cpu-decoding.md)). Runs on other CPU families "
              "are older code (their commit is named): they show each family's ratios, not today's code's.",
    "step": "Where one batch-1 decode step of gpt2-small's shapes spends its time, per precision: reading "
            "the weights once, the products alone, the step through the modules, the one-call step, a "
            "narrow model's step (what a step costs beyond its weights) and generate's time per token "
            "(see [Fast CPU decoding](cpu-decoding.md#where-a-decode-steps-time-goes)).",
    "train": "One training step at the CPU recipe's shapes (and gpt2-small's with `--preset gpt2`), with the "
             "step's matrix products alone and every kernel a step needs alone, timed in the same turns: "
             "how far the step is from its floor.",
    "recipe": "The CPU recipe end to end against nanoGPT's own `train.py` (`--nanogpt PATH`), fresh processes, "
              "alternating, both final models scored by `scripts/eval_char_model.py`.",
    "memory": "Peak resident memory (the kernel's high-water mark) of one fresh process at a time, at gpt2-medium, "
              "-large and -xl shapes with random weights: `from_pretrained(folder, quantize=mode)` and generating a "
              "few tokens, `gpt2attn convert` writing GGUF files, `from_pretrained` of the f16 and q8_0 files with "
              "`quantize=`, and llama.cpp's `llama-bench` on the same files "
              "(`--llama-cpp PATH`); each peak is also given over the fp32 load's (see [Fast CPU decoding]"
              "(cpu-decoding.md#memory)).",
    "explore": "Building `gpt2attn explore`'s page at gpt2-small shapes (forward, 144 ablations, packing) and "
               "opening it in headless Chromium; `--bertviz` adds bertviz's pages of the same model.",
}


def machine_line(machine: dict) -> str:
    flags = ", ".join(machine["cpu_flags"]) or "none of AVX2/AVX-512/AMX"
    busy = f", load average {machine['load_average_1min']}" if "load_average_1min" in machine else ""
    core = f"{machine['core']}; " if machine.get("core") else ""
    return (f"{machine['cpu']} ({core}{flags}), {machine['cores']} cores, {machine['threads']} threads, "
            f"torch {machine['torch']}, Python {machine['python']}, {machine['os']}{busy}")


def table(rows: list[dict]) -> list[str]:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(row[key]) for key in keys) + " |" for row in rows]
    return lines


def render(results_dir: Path = RESULTS_DIR) -> str:
    lines = [
        "# Benchmarks",
        "",
        "<!-- Generated by scripts/render_benchmarks.py from docs/benchmarks/results/*.json: do not edit. -->",
        "",
        "Speed is measured by `python scripts/bench.py NAME`, never by the tests. Each bench runs gpt2attn "
        "and its reference in the same run (timed in turns, so a change in machine load affects both), "
        "prints its figures and ratios, and writes them with the date, the machine and the command to "
        "`docs/benchmarks/results/NAME.json`; this page is rendered from those files by "
        "`python scripts/render_benchmarks.py`, and a test fails when the two disagree. Each table below "
        "is the latest run of its bench on one CPU family (a bench that has run on several keeps the latest "
        "on each, under the family's name): absolute times belong to the machine named above the table, "
        "and the ratios move much less from machine to machine than the times do.",
        "",
    ]
    missing = []
    for bench, about in ABOUT.items():
        runs = read_runs(results_dir / f"{bench}.json")
        if not runs:
            missing.append(bench)
            continue
        lines += [f"## {bench}", "", about, ""]
        if len(runs) > 1:
            lines += ["One section per CPU family this bench has run on, newest first: a figure belongs to its "
                      "family's machine and to the code of its commit.", ""]
        for run in runs:
            commit = f" (code at {run['commit']})" if "commit" in run else ""
            lines += [f"### {run.get('family', cpu_family(run['machine']))}", "",
                      f"Run {run['date']}{commit} on {machine_line(run['machine'])}:", "", f"`{run['command']}`", ""]
            for caption, rows in run["tables"].items():
                if caption:
                    lines += [f"{caption}:", ""]
                lines += table(rows) + [""]
    if missing:
        lines += ["## Not yet recorded", "",
                  "These benches have no result file yet (each takes minutes and was not run into one); "
                  "`python scripts/bench.py NAME` prints their figures and writes the file:", ""]
        lines += [f"- **{bench}**: {ABOUT[bench]}" for bench in missing] + [""]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    page = render()
    if argv == ["--check"]:
        if not PAGE.is_file() or PAGE.read_text(encoding="utf-8") != page:
            print(f"{PAGE} is out of date: run python scripts/render_benchmarks.py", file=sys.stderr)
            return 1
        return 0
    if argv:
        print(__doc__, file=sys.stderr)
        return 2
    PAGE.write_text(page, encoding="utf-8")
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
