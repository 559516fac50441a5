"""A save killed at any moment, or failing half-way, leaves the old model or the new one.

Kill trials run in a worker process (this module run with `python -m`; it never computes in threads,
so it can fork safely). For each trial the worker forks a child that saves again and again,
alternating two models, until the worker SIGKILLs it: after a random delay, or at its k-th
file-system operation for every k. This process then loads what is left and compares every
tensor with both models: it must be exactly one of them.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gpt2attn import GPT2LMHeadModel, files
from gpt2attn.cli import main as cli_main
from gpt2attn.tokenizer import char_tokenizer
from gpt2attn.training.loop import latest_checkpoint, read_training_state, save_checkpoint
from tests.helpers import REPO, randomize, tiny_config

FORMATS = {
    "safetensors": {},
    "sharded": {"max_shard_size": "1MB"},
    "bin": {"safe_serialization": False},
}
# The small models of the every-operation trials need small shards to have several.
SMALL_FORMATS = {**FORMATS, "sharded": {"max_shard_size": "60KB"}}
VERSIONS = ("old", "new")
KILLS_PER_FORMAT = 10
CHECKPOINT_KILLS = 5


def model_of(version: str, big: bool) -> GPT2LMHeadModel:
    """Two models differing in weights and in config (n_layer), so a mix of their files shows."""
    n_layer = 4 if version == "old" else 3
    cfg = tiny_config(vocab_size=4096, n_positions=128, n_embd=128, n_layer=n_layer) if big else tiny_config(n_layer=n_layer)
    return randomize(GPT2LMHeadModel(cfg), seed=VERSIONS.index(version) + 1).eval()


def training_state(step: int) -> dict:
    return {"step": step, "optimizer": {"state": {}, "param_groups": []}, "scheduler": {"last_epoch": step},
            "batch_rng": torch.Generator().manual_seed(step).get_state(), "torch_rng": [torch.get_rng_state()]}


# --- the worker (this file run as a script) ---------------------------------------------------


def count_operations(limit: int) -> list[int]:
    """Make the k-th file-system write operation of this process (k = limit) kill it, as SIGKILL
    would at that instant; returns the running count."""
    count = [0]

    def counted(fn):
        def wrapper(*args, **kwargs):
            count[0] += 1
            if count[0] == limit:
                os.kill(os.getpid(), signal.SIGKILL)
            return fn(*args, **kwargs)
        return wrapper

    for name in ("rename", "replace", "link", "unlink", "rmdir", "mkdir", "fsync"):
        setattr(os, name, counted(getattr(os, name)))
    files._exchange = counted(files._exchange)
    return count


def child(job: dict, models: dict, report: int) -> None:
    """Save in a loop (or once, for an every-operation trial), writing a byte after each save."""
    folder = Path(job["folder"])
    count = count_operations(job.get("crash_at", 0))
    os.write(report, b"s")
    for i in range(job.get("saves", 10**9)):
        version = VERSIONS[(i + job.get("first", 1)) % 2]
        if job["kind"] == "checkpoint":
            step = job["step"] + i
            save_checkpoint(folder, models[VERSIONS[step % 2]], training_state(step))
        else:
            models[version].save_pretrained(folder, **SMALL_FORMATS[job["kind"]] if job.get("small") else FORMATS[job["kind"]])
        os.write(report, b".")
    os.write(report, json.dumps({"operations": count[0]}).encode())


def worker() -> None:
    """Read one job (JSON) per line; run it in a forked child; answer how many saves it finished
    and how long it ran."""
    torch.set_num_threads(1)
    models = {(big, v): model_of(v, big) for big in (True, False) for v in VERSIONS}
    for line in sys.stdin:
        job = json.loads(line)
        small = job.get("small", False)
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            try:
                child(job, {v: models[(not small, v)] for v in VERSIONS}, write)
            finally:
                os._exit(0)
        os.close(write)
        assert os.read(read, 1) == b"s"
        started = time.perf_counter()
        if "delay" in job:
            time.sleep(job["delay"])
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        seconds = time.perf_counter() - started
        out = b""
        while chunk := os.read(read, 4096):
            out += chunk
        os.close(read)
        saves = len(out) - len(out.lstrip(b"."))
        rest = out[saves:]
        print(json.dumps({"saves": saves, "seconds": seconds, **(json.loads(rest) if rest else {})}), flush=True)


class Worker:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, cwd=REPO)

    def run(self, **job) -> dict:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "the worker died"
        return json.loads(line)

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def worker_process():
    if not hasattr(os, "fork"):
        pytest.skip("kill trials fork a child per trial (POSIX only)")
    w = Worker()
    yield w
    w.close()


# --- checks -----------------------------------------------------------------------------------


@torch.no_grad()
def loads_as(folder: Path, models: dict) -> str:
    """'old' or 'new' when folder loads as exactly that model, else 'broken: why'."""
    if any(name.startswith(".") for name in os.listdir(folder)):
        return f"broken: temporary files inside: {os.listdir(folder)}"
    try:
        loaded = GPT2LMHeadModel.from_pretrained(folder).state_dict()
    except Exception as e:
        return f"broken: {e}"
    for version, model in models.items():
        expected = model.state_dict()
        if expected.keys() == loaded.keys() and all(torch.equal(expected[k], loaded[k]) for k in expected):
            return version
    return "broken: a mix of the two models"


def leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.parent.iterdir() if p.name != folder.name]


# --- the trials -------------------------------------------------------------------------------


@pytest.mark.slow
def test_saves_killed_at_random_moments_leave_the_old_or_the_new_model(tmp_path, worker_process):
    models = {v: model_of(v, big=True) for v in VERSIONS}
    rng = random.Random(0)
    results = {}
    for kind, options in FORMATS.items():
        folder = tmp_path / kind / "model"
        models["old"].save_pretrained(folder, **options)
        one_save = worker_process.run(kind=kind, folder=str(folder), saves=1, first=0)["seconds"]
        outcomes, killed_in, left = [], [], 0
        for _ in range(KILLS_PER_FORMAT):
            # A kill lands anywhere in the first two or three saves of the child's loop.
            killed_in.append(worker_process.run(kind=kind, folder=str(folder), delay=rng.uniform(0, 2.5 * one_save))["saves"] + 1)
            outcomes.append(loads_as(folder, models))
            left += bool(leftovers(folder))
        results[kind] = {v: outcomes.count(v) for v in VERSIONS}
        results[kind]["broken"] = [o for o in outcomes if o not in VERSIONS]
        results[kind]["killed in save #"] = killed_in
        print(f"{kind}: {results[kind]}; {left} of {KILLS_PER_FORMAT} kills left temporaries beside the folder")
        models["new"].save_pretrained(folder, **options)  # cleans what the kills left
        assert leftovers(folder) == [] and loads_as(folder, models) == "new"
    assert all(not r["broken"] for r in results.values()), results
    assert sum(r["old"] + r["new"] for r in results.values()) >= 30
    assert all(max(r["killed in save #"]) > 1 for r in results.values()), results  # after a finished save too


@pytest.mark.slow
def test_checkpoints_killed_at_random_moments_resume_from_the_newest_complete_one(tmp_path, worker_process):
    models = {v: model_of(v, big=True) for v in VERSIONS}
    (tmp_path / "data").mkdir()
    char_tokenizer("abc").save(str(tmp_path / "data" / "tokenizer.json"))
    save_checkpoint(tmp_path, models["old"], training_state(0))
    rng = random.Random(1)
    step, steps = 1, []
    for _ in range(CHECKPOINT_KILLS):
        worker_process.run(kind="checkpoint", folder=str(tmp_path), step=step, delay=rng.uniform(0, 0.6))
        newest = latest_checkpoint(tmp_path)
        assert newest is not None
        step = read_training_state(newest)["step"]
        assert newest.name == f"step_{step:07d}"
        assert loads_as(newest, models) == VERSIONS[step % 2]
        assert (newest / "tokenizer.json").is_file()
        steps.append(step)
        step += 1
    print(f"checkpoints: resumed from steps {steps}")
    assert steps[-1] > 0


@pytest.mark.slow
@pytest.mark.parametrize("kind", SMALL_FORMATS)
def test_a_save_killed_at_each_file_operation_leaves_the_old_or_the_new_model(tmp_path, worker_process, kind):
    """Every instant, at the granularity of file-system calls: the k-th rename, link, unlink,
    mkdir, rmdir or fsync of a save kills it, for every k."""
    models = {v: model_of(v, big=False) for v in VERSIONS}
    folder = tmp_path / "model"
    models["old"].save_pretrained(folder, **SMALL_FORMATS[kind])
    total = worker_process.run(kind=kind, small=True, folder=str(folder), saves=1, first=1)["operations"]
    models["old"].save_pretrained(folder, **SMALL_FORMATS[kind])
    outcomes = []
    for k in range(1, total + 1):
        worker_process.run(kind=kind, small=True, folder=str(folder), saves=1, first=1, crash_at=k)
        outcomes.append(loads_as(folder, models))
        if outcomes[-1] == "new":
            models["old"].save_pretrained(folder, **SMALL_FORMATS[kind])
        files.remove_leftovers(folder)  # so that every trial makes the same operations
    swapped_at = outcomes.index("new") if "new" in outcomes else total
    print(f"{kind}: killed before each of {total} operations: old up to the swap (#{swapped_at}), new after it")
    assert all(o in VERSIONS for o in outcomes), outcomes
    assert outcomes == ["old"] * swapped_at + ["new"] * (total - swapped_at) and 0 < swapped_at < total - 1


@pytest.fixture
def file_size_limit():
    """Set RLIMIT_FSIZE: a write past it fails with EFBIG ("File too large"), as on a full quota."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the signal kills the process

    def limit(n: int) -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (n, hard))

    yield limit
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    signal.signal(signal.SIGXFSZ, handler)


def largest_file(folder: Path) -> int:
    return max(p.stat().st_size for p in folder.iterdir())


@pytest.mark.parametrize("kind", SMALL_FORMATS)
def test_a_write_failing_half_way_keeps_the_old_model(tmp_path, kind, file_size_limit):
    import transformers  # here, not at the top: the worker process runs this file and needs none of it
    models = {v: model_of(v, big=False) for v in VERSIONS}
    options = SMALL_FORMATS[kind]
    models["new"].save_pretrained(tmp_path / "probe", **options)
    limit = largest_file(tmp_path / "probe") // 2
    folder = tmp_path / "run" / "model"
    models["old"].save_pretrained(folder, **options)
    file_size_limit(limit)
    with pytest.raises(OSError) as err:
        models["new"].save_pretrained(folder, **options)
    file_size_limit(resource.RLIM_INFINITY)
    assert err.value.errno == errno.EFBIG
    assert loads_as(folder, models) == "old"
    assert leftovers(folder) == []
    theirs = transformers.GPT2LMHeadModel.from_pretrained(folder).state_dict()  # transformers reads the old one too
    assert all(torch.equal(theirs[k], t) for k, t in models["old"].state_dict().items())


def test_a_failing_checkpoint_save_keeps_the_previous_checkpoint(tmp_path, file_size_limit):
    models = {v: model_of(v, big=False) for v in VERSIONS}
    (tmp_path / "data").mkdir()
    char_tokenizer("abc").save(str(tmp_path / "data" / "tokenizer.json"))
    save_checkpoint(tmp_path, models["old"], training_state(10))
    file_size_limit(largest_file(tmp_path / "checkpoints" / "step_0000010") // 2)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, models["new"], training_state(20))
    file_size_limit(resource.RLIM_INFINITY)
    assert os.listdir(tmp_path / "checkpoints") == ["step_0000010"]
    assert read_training_state(latest_checkpoint(tmp_path))["step"] == 10
    assert loads_as(latest_checkpoint(tmp_path), models) == "old"


def test_bad_training_states_are_named(tmp_path):
    models = {v: model_of(v, big=False) for v in VERSIONS}
    (tmp_path / "data").mkdir()
    char_tokenizer("abc").save(str(tmp_path / "data" / "tokenizer.json"))
    checkpoint = save_checkpoint(tmp_path, models["old"], training_state(10))
    path = checkpoint / "training_state.pt"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=rf"{path}: cannot read .*truncated"):
        read_training_state(checkpoint)
    torch.save({"step": 10}, path)
    with pytest.raises(ValueError, match=rf"{path}: not a gpt2attn training state \(no optimizer, scheduler"):
        read_training_state(checkpoint)
    path.unlink()
    with pytest.raises(FileNotFoundError, match=str(path)):
        read_training_state(checkpoint)


# --- gpt2attn convert -------------------------------------------------------------------------


def test_convert_into_a_folder_holding_a_model_needs_overwrite(tmp_path, capsys):
    models = {v: model_of(v, big=False) for v in VERSIONS}
    src, dst = tmp_path / "src", tmp_path / "dst"
    models["new"].save_pretrained(src)  # no tokenizer files
    models["old"].save_pretrained(dst)
    char_tokenizer("old tokenizer").save(str(dst / "tokenizer.json"))
    (dst / "README.md").write_text("notes")
    before = sorted(os.listdir(dst))
    assert cli_main(["convert", str(src), str(dst)]) == 2
    assert sorted(os.listdir(dst)) == before and loads_as(dst, models) == "old"
    assert cli_main(["convert", str(src), str(dst), "--overwrite"]) == 0
    assert loads_as(dst, models) == "new"
    assert sorted(os.listdir(dst)) == ["README.md", "config.json", "generation_config.json", "model.safetensors"]  # no old tokenizer.json
    assert leftovers(dst) == ["src"]


def test_convert_refusal_message_and_a_file_as_destination(tmp_path, capsys):
    model = model_of("old", big=False)
    model.save_pretrained(tmp_path / "src")
    model.save_pretrained(tmp_path / "dst")
    assert cli_main(["convert", str(tmp_path / "src"), str(tmp_path / "dst")]) == 2
    err = capsys.readouterr().err
    assert f"gpt2attn convert: error: {tmp_path / 'dst'} already holds a model (config.json, generation_config.json, model.safetensors)" in err
    assert "pass --overwrite" in err
    (tmp_path / "file").write_text("x")
    assert cli_main(["convert", str(tmp_path / "src"), str(tmp_path / "file")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def test_convert_failing_half_way_keeps_the_old_model_and_tokenizer(tmp_path, file_size_limit):
    models = {v: model_of(v, big=False) for v in VERSIONS}
    src, dst = tmp_path / "src", tmp_path / "dst"
    models["new"].save_pretrained(src)
    char_tokenizer("new").save(str(src / "tokenizer.json"))
    models["old"].save_pretrained(dst)
    char_tokenizer("old").save(str(dst / "tokenizer.json"))
    old_tokenizer = (dst / "tokenizer.json").read_bytes()
    file_size_limit(largest_file(src) // 2)
    with contextlib.suppress(OSError):  # raised, or an error line where cli.py reports OS errors
        assert cli_main(["convert", str(src), str(dst), "--overwrite"]) == 2
    file_size_limit(resource.RLIM_INFINITY)
    assert loads_as(dst, models) == "old"
    assert (dst / "tokenizer.json").read_bytes() == old_tokenizer
    assert cli_main(["convert", str(src), str(dst), "--overwrite"]) == 0
    assert loads_as(dst, models) == "new"
    assert (dst / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()


if __name__ == "__main__":
    worker()
