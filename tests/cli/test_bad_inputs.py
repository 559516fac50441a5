"""Bad input on the command line: one `gpt2attn CMD: error: ...` line and exit status 2, never a
traceback (table below); warnings as one line; a closed pipe; `python -m gpt2attn`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpt2attn import GPT2LMHeadModel
from gpt2attn.cli import main
from gpt2attn.tokenizer import char_tokenizer
from gpt2attn.training import load_config, read_metrics, train
from tests.helpers import REPO, randomize, tiny_config

TEXT = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n"
TINY = ["--n_layer=1", "--n_head=2", "--n_embd=16", "--block_size=8", "--batch_size=2", "--eval_iters=1",
        "--warmup_iters=0", "--progress=false", "--plot=false", "--device=cpu"]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """A tiny model folder, text files good and bad, a plain file, a folder, a finished run."""
    root = tmp_path_factory.mktemp("bad_inputs")
    model = root / "model"
    randomize(GPT2LMHeadModel(tiny_config(vocab_size=len(set(TEXT)), n_positions=64)), seed=0).save_pretrained(model)
    char_tokenizer(TEXT).save(str(model / "tokenizer.json"))
    small = root / "small_vocab"  # a tokenizer with more tokens (and an eos) than the model has rows
    randomize(GPT2LMHeadModel(tiny_config(vocab_size=8, n_positions=64)), seed=0).save_pretrained(small)
    tok = char_tokenizer(TEXT)
    tok.add_special_tokens(["<|endoftext|>"])
    tok.save(str(small / "tokenizer.json"))
    (root / "text.txt").write_text(TEXT * 10)
    (root / "other.txt").write_text(TEXT.upper() * 10)  # other characters: another vocabulary
    (root / "latin1.txt").write_bytes("Zo é".encode("latin-1") * 50)
    (root / "texts").mkdir()
    (root / "texts" / "a.txt").write_text(TEXT * 5)
    (root / "texts" / "b.txt").write_bytes(b"ok \xff\xfe" * 50)
    (root / "file").write_text("a file, not a folder")
    (root / "folder").mkdir()
    train(load_config(None, [f"--data={root / 'text.txt'}", f"--out_dir={root / 'run'}", *TINY,
                             "--max_iters=2", "--eval_interval=2"]))
    extra = root / "extra_block"  # a 2-layer model's folder whose weights also hold a block 7
    randomize(GPT2LMHeadModel(tiny_config(n_layer=2)), seed=0).save_pretrained(extra)
    state = load_file(extra / "model.safetensors")
    state.update({k.replace(".h.1.", ".h.7."): v.clone() for k, v in state.items() if ".h.1." in k})
    save_file(state, extra / "model.safetensors")
    return root


def fill(arg: str, root: Path) -> str:
    return arg.replace("{root}", str(root))


# (argv with {root} for the fixture folder, message fragment); every one must exit with status 2.
CASES = {
    "png --out is a folder": (["attention", "--model", "{root}/model", "To be", "--out", "{root}/folder"],
                              "--out {root}/folder is a folder; give a file name"),
    "json --out is a folder": (["attention", "--model", "{root}/model", "To be", "--format", "json",
                                "--out", "{root}/folder"], "is a folder; give a file name"),
    "--out inside a file": (["attention", "--model", "{root}/model", "To be", "--out", "{root}/file/attn.png"],
                            "{root}/file is a file, not a folder"),
    "attention: weights file as --model": (["attention", "--model", "{root}/model/model.safetensors", "To be",
                                            "--format", "json"], "is a file; give the model's folder"),
    "generate: weights file as --model": (["generate", "--model", "{root}/model/model.safetensors", "To be"],
                                          "is a file; give the model's folder"),
    "generate: tokenizer bigger than the model": (["generate", "--model", "{root}/small_vocab", "To be"],
                                                  f"the tokenizer has {len(set(TEXT)) + 1} tokens but the model's "
                                                  "vocabulary only 8"),
    "convert into a file": (["convert", "{root}/model", "{root}/file"], "{root}/file is a file, not a folder"),
    "convert below a file": (["convert", "{root}/model", "{root}/file/out"], "{root}/file is a file, not a folder"),
    "train: out_dir is a file": (["train", "--data={root}/text.txt", "--out_dir={root}/file", *TINY],
                                 "out_dir {root}/file is a file, not a folder"),
    "train: out_dir not writable": (["train", "--data={root}/text.txt", "--out_dir=/sys/gpt2attn-test-out", *TINY],
                                    "/sys/gpt2attn-test-out: Operation not permitted"),
    "train: non-UTF-8 data file": (["train", "--data={root}/latin1.txt", "--out_dir={root}/out1", *TINY],
                                   "{root}/latin1.txt is not UTF-8 text: byte 0xe9 at offset 3"),
    "train: non-UTF-8 file in a data folder": (["train", "--data={root}/texts", "--out_dir={root}/out2", *TINY],
                                               "{root}/texts/b.txt is not UTF-8 text: byte 0xff at offset 3"),
    "train: config is a folder": (["train", "--config", "{root}/folder"], "no config file at {root}/folder"),
    "train: resume with another vocabulary": (["train", "--data={root}/other.txt", "--out_dir={root}/run", "--resume",
                                               "--max_iters=4", *TINY], "tokenizes to another vocabulary (22 tokens)"),
    "convert to .onnx": (["convert", "{root}/model", "{root}/m.onnx"],
                         "{root}/m.onnx: ONNX files are written by `gpt2attn export MODEL {root}/m.onnx`, not here"),
    "convert to .safetensors": (["convert", "{root}/model", "{root}/m.safetensors"],
                                "{root}/m.safetensors: a Hugging Face model is written as a folder (config.json, "
                                "model.safetensors, tokenizer files), not one .safetensors file: name the folder, "
                                "e.g. {root}/m"),
    "convert to an unknown suffix": (["convert", "{root}/model", "{root}/m.xyz"],
                                     "{root}/m.xyz: the name looks like a .xyz file, a format gpt2attn does not write"),
    "convert: a checkpoint with an extra block": (["convert", "{root}/extra_block", "{root}/out3"],
                                                  "the config has n_layer = 2 (blocks 0..1); unexpected keys: "
                                                  "transformer.h.7.attn.c_attn.bias"),
    "parity: --tol 0": (["parity", "{root}/model", "--tol", "0"], "--tol must be > 0, got 0.0"),
    "parity: --tol < 0": (["parity", "{root}/model", "--tol=-1e-3"], "--tol must be > 0, got -0.001"),
}


@pytest.mark.parametrize("argv, message", CASES.values(), ids=CASES.keys())
def test_bad_input_is_one_error_line_and_status_2(paths, capsys, argv, message):
    argv = [fill(a, paths) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith(f"gpt2attn {argv[0]}: error: ")]
    assert len(errors) == 1, err
    assert fill(message, paths) in errors[0]
    assert "Traceback" not in err


@pytest.mark.parametrize("name", ["m.onnx", "m.safetensors", "m.xyz"])
def test_convert_to_a_file_name_of_another_format_writes_nothing(paths, tmp_path, capsys, name):
    assert main(["convert", str(paths / "model"), str(tmp_path / name)]) == 2
    assert list(tmp_path.iterdir()) == []  # no folder named like a file


def test_version_prints_the_packages_version():
    import tomllib

    import gpt2attn

    done = run_module("-m", "gpt2attn", "--version")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert (done.returncode, done.stdout, done.stderr) == (0, f"gpt2attn {project}\n", "")
    assert gpt2attn.__version__ == project


def test_train_help_lists_every_setting_a_user_may_override(capsys):
    from dataclasses import fields

    from gpt2attn.training import TrainConfig

    with pytest.raises(SystemExit) as done:
        main(["train", "--help"])
    assert done.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    for field in fields(TrainConfig):
        flag = f"--{field.name}={field.type.upper()}"
        assert any(line.split() == [flag, "default", repr(field.default)] for line in lines), flag


def missing_model_run(tmp_path: Path, **env) -> subprocess.CompletedProcess:
    """`gpt2attn generate --model out/model hi` from an empty folder, with an empty hub cache."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    environment.update(HF_HOME=str(tmp_path / "hf-home"), OMP_NUM_THREADS="1", **env)
    return subprocess.run([sys.executable, "-m", "gpt2attn", "generate", "--model", "out/model", "hi"], cwd=tmp_path,
                          env=environment, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_missing_local_folder_is_named_as_such_before_the_hubs_answer(tmp_path):
    folder_line = f"gpt2attn generate: error: out/model: no such local file or folder (looked in {tmp_path}), and "
    offline = missing_model_run(tmp_path, HF_HUB_OFFLINE="1")
    assert offline.returncode == 2 and offline.stdout == ""
    assert offline.stderr == folder_line + (
        "'out/model' is not in the Hugging Face cache and downloads are off (HF_HUB_OFFLINE=1 or local_files_only): "
        "if it is a hub repo, download it once with network access (`hf download out/model`)\n")
    # online, with a hub that refuses connections (nothing listens on port 9 here): what the hub library said, one line
    online = missing_model_run(tmp_path, HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_ETAG_TIMEOUT="5")
    assert online.returncode == 2 and online.stdout == ""
    assert online.stderr.startswith(folder_line + "could not download 'out/model' from the Hugging Face hub: ")
    assert online.stderr.count("\n") == 1 and "Traceback" not in online.stderr


def test_refused_resume_leaves_the_run_as_it_was(paths, capsys):
    meta = (paths / "run" / "data" / "meta.json").read_text()
    rows = read_metrics(paths / "run" / "metrics.jsonl")
    assert main(["train", f"--data={paths / 'other.txt'}", f"--out_dir={paths / 'run'}", "--resume", *TINY]) == 2
    assert "'T'" in capsys.readouterr().err  # names tokens that differ ('t' became 'T')
    assert (paths / "run" / "data" / "meta.json").read_text() == meta
    assert read_metrics(paths / "run" / "metrics.jsonl") == rows


def test_resume_of_a_finished_run_reports_its_last_losses(paths, capsys):
    rows = read_metrics(paths / "run" / "metrics.jsonl")
    assert main(["train", f"--data={paths / 'text.txt'}", f"--out_dir={paths / 'run'}", "--resume",
                 "--max_iters=2", "--eval_interval=2", *TINY]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"step 2: train loss {rows[-1]['train_loss']:.4f}, val loss {rows[-1]['val_loss']:.4f}")
    assert read_metrics(paths / "run" / "metrics.jsonl") == rows


def test_max_iters_below_warmup_warns(paths, tmp_path):
    cfg = load_config(None, [f"--data={paths / 'text.txt'}", f"--out_dir={tmp_path}", *TINY, "--max_iters=2",
                             "--eval_interval=2", "--warmup_iters=5"])
    with pytest.warns(UserWarning, match=r"max_iters \(2\) < warmup_iters \(5\)"):
        assert train(cfg)["step"] == 2


def test_without_matplotlib_the_run_skips_the_plot_with_one_warning(paths, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    cfg = load_config(None, [f"--data={paths / 'text.txt'}", f"--out_dir={tmp_path}", *TINY, "--max_iters=2",
                             "--eval_interval=2", "--plot=true"])
    with pytest.warns(UserWarning, match="matplotlib is not installed") as caught:
        assert train(cfg)["step"] == 2
    assert len(caught) == 1
    assert (tmp_path / "model" / "model.safetensors").is_file() and not (tmp_path / "loss.png").exists()


def run_module(*args: str, **kwargs) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
                          **kwargs)


def test_python_m_gpt2attn_runs_the_cli():
    done = run_module("-m", "gpt2attn", "--help")
    assert done.returncode == 0
    for command in ("generate", "train", "convert", "parity", "attention"):
        assert f"    {command}" in done.stdout
    done = run_module("-m", "gpt2attn", "parity", "absent-folder/model", "--tol", "0")
    assert done.returncode == 2 and done.stderr == "gpt2attn parity: error: --tol must be > 0, got 0.0\n"


def test_warnings_print_as_one_line(paths, tmp_path):
    """From the command line a warning is one `gpt2attn train: warning: ...` line, each once."""
    argv = ["train", f"--data={paths / 'text.txt'}", f"--out_dir={tmp_path}", *TINY, "--max_iters=2",
            "--eval_interval=2", "--warmup_iters=5", "--plot=true"]
    code = ("import sys; sys.modules['matplotlib'] = None; from gpt2attn.cli import main; "
            f"sys.exit(main({argv!r}))")
    done = run_module("-c", code)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert lines == [
        "gpt2attn train: warning: max_iters (2) < warmup_iters (5): the run ends during the warmup, "
        "before the learning rate reaches 0.001",
        "gpt2attn train: warning: matplotlib is not installed, so loss.png will not be drawn "
        "(pip install 'gpt2attn[plot]', or --plot=false to silence this)",
    ]


def test_generate_into_a_closed_pipe_stops_quietly():
    """`gpt2attn generate ... | head -c 20`: the reader leaves early; no BrokenPipeError traceback."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "gpt2attn", "generate", "ROMEO:", "--max-new-tokens", "2000", "--seed", "0"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout.read(20).startswith(b"ROMEO:")
    proc.stdout.close()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 141  # 128 + SIGPIPE, as `yes | head` gives
    assert err == b""


def test_checkpoint_records_the_vocabulary_it_was_trained_on(paths):
    checkpoint = next((paths / "run" / "checkpoints").glob("step_*"))
    vocab = json.loads((checkpoint / "tokenizer.json").read_text())["model"]["vocab"]
    assert sorted(vocab, key=vocab.get) == sorted(set(TEXT))
    assert torch.load(checkpoint / "training_state.pt", weights_only=True)["step"] == 2
