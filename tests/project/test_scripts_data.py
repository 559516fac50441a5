"""The scripts that read the project's shared data (tinyshakespeare) find it as the tests do:
../shared/data beside the checkout, or $GPT2ATTN_SHARED_DATA; without it they end with one line
naming the file and how to give one, not a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO

SCRIPTS = REPO / "scripts"


def run_script(name: str, shared: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "GPT2ATTN_SHARED_DATA": str(shared), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(SCRIPTS / name), *args], env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("name", ["eval_char_model.py", "decode_quality.py"])
def test_without_the_shared_data_a_script_says_where_it_looked_in_one_line(tmp_path, name):
    done = run_script(name, tmp_path / "absent")
    expected = tmp_path / "absent" / "tinyshakespeare" / "input.txt"
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr == (f"{name}: error: {expected}: no such file (the project's shared data: ../shared/data "
                           f"beside the checkout, or $GPT2ATTN_SHARED_DATA); give a text file with --data PATH\n")
    done = run_script(name, tmp_path / "absent", "--data", str(tmp_path / "mine.txt"))
    assert done.returncode == 1 and done.stderr == f"{name}: error: {tmp_path / 'mine.txt'}: no such file; give a " \
                                                   f"text file with --data PATH\n"


def test_eval_char_model_reads_the_text_that_gpt2attn_shared_data_points_to(tmp_path):
    text = "ROMEO:\nBut soft, what light through yonder window breaks?\n" * 20
    (tmp_path / "tinyshakespeare").mkdir()
    (tmp_path / "tinyshakespeare" / "input.txt").write_text(text)
    done = run_script("eval_char_model.py", tmp_path)
    assert done.returncode == 0, done.stderr
    assert f"over the last {int(len(text) * 0.1):,} characters" in done.stdout


def test_decode_quality_adds_a_row_for_each_llama_type_its_llama_quantize_makes(tmp_path):
    # a stand-in llama-quantize: copies the f32 GGUF (so each row decodes as fp32 does) and notes the type asked for
    fake = tmp_path / "llama-quantize"
    fake.write_text(f"#!{sys.executable}\nimport shutil, sys\nshutil.copyfile(sys.argv[1], sys.argv[2])\n"
                    f"open({str(tmp_path / 'asked.txt')!r}, 'a').write(sys.argv[3] + '\\n')\n")
    fake.chmod(0o755)
    text = tmp_path / "text.txt"
    text.write_text("ROMEO:\nBut soft, what light through yonder window breaks?\n" * 60)  # last 10%: 2 blocks of 128
    done = run_script("decode_quality.py", tmp_path, "--data", str(text), "--llama-quantize", str(fake),
                      "--llama-types", "q4_K_M,q4_0")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "asked.txt").read_text().split() == ["Q4_K_M", "Q4_0"]
    rows = {line.split(" | ")[0].strip("| "): line for line in done.stdout.splitlines() if line.startswith("| ")}
    for kind in ("q4_K_M", "q4_0"):  # the same weights as fp32's: no loss
        assert rows[f"llama.cpp {kind} (read as fp32)"].split(" | ")[1] == "+0.000% ± 0.000%"
