"""The import hooks, gpt2attn/interop/hooks.py. Their rules, in this process on stand-in modules (a
client package with a data file and its bridge, written to tmp_path), and once on the real peft and
transformers in a fresh interpreter: a watched module gets its bridge right after its own code ran
and keeps its own loader (so importlib.resources and is_package work); GPT2ATTN_NO_IMPORT_HOOKS
turns it off; a failing bridge warns and never breaks the user's import. Then (section below) the
import line alone, end to end: PEFT's LoRA and the Trainer's checkpoints with no other import."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.resources
import json
import os
import subprocess
import sys
import textwrap
from importlib.machinery import ModuleSpec

import pytest

from gpt2attn.interop import hooks
from tests.helpers import REPO

CLIENT, BRIDGE = "gpt2attn_test_client", "gpt2attn_test_bridge"


@pytest.fixture
def stand_ins(tmp_path, monkeypatch):
    """A client package (with data.txt) and a bridge that records what it saw when it ran."""
    package = tmp_path / CLIENT
    package.mkdir()
    (package / "__init__.py").write_text("ready = True\n")
    (package / "data.txt").write_text("shipped with the client")
    (tmp_path / f"{BRIDGE}.py").write_text(textwrap.dedent(f"""
        import sys
        client = sys.modules["{CLIENT}"]
        client.bridged_after_own_code = getattr(client, "ready", False)
        client.bridge_runs = getattr(client, "bridge_runs", 0) + 1
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(hooks.BRIDGES, CLIENT, BRIDGE)
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if not isinstance(f, hooks._BridgeFinder)])
    monkeypatch.delenv("GPT2ATTN_NO_IMPORT_HOOKS", raising=False)
    importlib.invalidate_caches()
    yield tmp_path
    for name in (CLIENT, BRIDGE):
        sys.modules.pop(name, None)


def finders() -> list:
    return [f for f in sys.meta_path if isinstance(f, hooks._BridgeFinder)]


def test_a_watched_module_gets_its_bridge_and_keeps_its_own_loader(stand_ins):
    hooks.install()
    client = importlib.import_module(CLIENT)
    assert client.bridged_after_own_code is True and client.bridge_runs == 1
    assert BRIDGE in sys.modules
    assert type(client.__loader__) is importlib.machinery.SourceFileLoader
    assert client.__spec__.loader is client.__loader__
    assert client.__loader__.is_package(CLIENT)
    assert importlib.resources.files(CLIENT).joinpath("data.txt").read_text() == "shipped with the client"


@pytest.mark.parametrize("value, on", [("", True), ("0", True), ("1", False), ("yes", False)])
def test_gpt2attn_no_import_hooks_turns_the_hook_off(stand_ins, monkeypatch, value, on):
    monkeypatch.setenv("GPT2ATTN_NO_IMPORT_HOOKS", value)
    hooks.install()
    assert len(finders()) == (1 if on else 0)
    client = importlib.import_module(CLIENT)
    assert hasattr(client, "bridge_runs") == on


def test_install_twice_puts_one_finder_first(stand_ins):
    hooks.install()
    hooks.install()
    assert len(finders()) == 1 and isinstance(sys.meta_path[0], hooks._BridgeFinder)
    assert importlib.import_module(CLIENT).bridge_runs == 1


def test_a_client_imported_before_gpt2attn_is_bridged_at_once(stand_ins):
    client = importlib.import_module(CLIENT)  # no finder yet: no bridge
    assert not hasattr(client, "bridge_runs")
    hooks.install()
    assert client.bridge_runs == 1


def test_a_failing_bridge_warns_and_the_client_still_imports(stand_ins):
    (stand_ins / f"{BRIDGE}.py").write_text("raise RuntimeError('unknown client version')\n")
    importlib.invalidate_caches()
    hooks.install()
    with pytest.warns(UserWarning, match=rf"{BRIDGE}.*RuntimeError: unknown client version"):
        client = importlib.import_module(CLIENT)
    assert client.ready is True


def test_the_finder_finds_nothing_itself(stand_ins):
    finder = hooks._BridgeFinder()
    assert finder.find_spec("json", None) is None  # not watched
    monkeypatch_name = "gpt2attn_test_absent_client"
    hooks.BRIDGES[monkeypatch_name] = BRIDGE
    try:
        assert finder.find_spec(monkeypatch_name, None) is None  # watched, but no finder has it
    finally:
        del hooks.BRIDGES[monkeypatch_name]
    spec = finder.find_spec(CLIENT, None)
    assert isinstance(spec.loader, hooks._ThenBridge) and spec.loader.bridge == BRIDGE
    assert type(spec.loader.loader) is importlib.machinery.SourceFileLoader


def test_a_spec_without_loader_passes_through(stand_ins, monkeypatch):
    """A namespace-like spec with no loader is given back untouched."""
    bare = ModuleSpec(CLIENT, None)

    class Bare:
        def find_spec(self, name, path, target=None):
            return bare if name == CLIENT else None

    class NoFindSpec:  # an old-style finder: skipped, not called
        pass

    monkeypatch.setattr(sys, "meta_path", [NoFindSpec(), Bare(), *sys.meta_path])
    assert hooks._BridgeFinder().find_spec(CLIENT, None) is bare
    assert bare.loader is None


def test_then_bridge_delegates_module_creation():
    class Loader(importlib.abc.Loader):
        def create_module(self, spec):
            return ("made for", spec)

    spec = ModuleSpec("x", None)
    assert hooks._ThenBridge(Loader(), BRIDGE).create_module(spec) == ("made for", spec)


def test_a_watched_submodule_is_found_in_its_package_and_bridged(stand_ins, monkeypatch):
    """transformers.trainer is a submodule: its spec is found on the package's __path__."""
    (stand_ins / CLIENT / "sub.py").write_text("ready = True\n")
    monkeypatch.delitem(hooks.BRIDGES, CLIENT)
    monkeypatch.setitem(hooks.BRIDGES, f"{CLIENT}.sub", BRIDGE)
    (stand_ins / f"{BRIDGE}.py").write_text(f"import sys\nsys.modules['{CLIENT}.sub'].bridged = True\n")
    importlib.invalidate_caches()
    hooks.install()
    sub = importlib.import_module(f"{CLIENT}.sub")
    assert sub.bridged is True and sub.__loader__ is sub.__spec__.loader
    assert type(sub.__loader__) is importlib.machinery.SourceFileLoader
    sys.modules.pop(f"{CLIENT}.sub", None)


@pytest.mark.slow
def test_peft_and_transformers_keep_their_loaders_with_the_hook():
    code = textwrap.dedent("""
        import importlib.resources, json
        import gpt2attn, peft, transformers.trainer, transformers.pipelines.base
        out = {}
        for name in ("peft", "transformers.trainer", "transformers.pipelines.base"):
            module = importlib.import_module(name)
            out[name] = [type(module.__loader__).__name__, module.__spec__.loader is module.__loader__,
                         module.__loader__.is_package(name)]
        out["resources"] = importlib.resources.files("peft").is_dir()
        out["bridged"] = sorted(m for m in ("gpt2attn.interop.peft", "gpt2attn.interop.trainer",
                                            "gpt2attn.interop.pipeline") if m in __import__("sys").modules)
        print(json.dumps(out))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["peft"] == ["SourceFileLoader", True, True]
    assert out["transformers.trainer"] == ["SourceFileLoader", True, False]
    assert out["transformers.pipelines.base"] == ["SourceFileLoader", True, False]
    assert out["resources"] is True
    assert out["bridged"] == ["gpt2attn.interop.peft", "gpt2attn.interop.pipeline", "gpt2attn.interop.trainer"]


# ==================================================================================================
# The import line alone, end to end
#
# The import line alone: with `from gpt2attn import GPT2LMHeadModel`, PEFT's LoRA and the Trainer's
# checkpoints work with no other import, in either import order (each case a fresh interpreter), and
# GPT2ATTN_NO_IMPORT_HOOKS=1 turns that off. `import gpt2attn` itself imports neither client
# (tests/ecosystem/test_tools.py).
# ==================================================================================================


CLIENTS_FIRST = "import peft, transformers.trainer\nfrom gpt2attn import GPT2Config, GPT2LMHeadModel\n"
GPT2ATTN_FIRST = "from gpt2attn import GPT2Config, GPT2LMHeadModel\nimport peft, transformers.trainer\n"

# A user's transformers code with the import line changed: LoRA through PEFT, then the Trainer with a
# checkpoint, on a small model built from GPT-2's default config. Prints what it saw as JSON.
USER_CODE = """
import json, sys, tempfile
import torch, transformers
from peft import LoraConfig, get_peft_model

def small():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=32, n_layer=1, n_head=2))

seen = {}
try:
    lora = get_peft_model(small(), LoraConfig(target_modules=["c_attn", "c_proj", "c_fc"], task_type="CAUSAL_LM"))
    lora(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    seen["lora_layers"] = sorted({type(m).__name__ for m in lora.modules() if hasattr(m, "lora_A")})
    seen["lora_grads"] = all(p.grad is not None for n, p in lora.named_parameters() if "lora_" in n)
except Exception as e:
    seen["lora_error"] = str(e)

class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 4
    def __getitem__(self, i):
        x = torch.arange(i, i + 8) % 100
        return {"input_ids": x, "labels": x}

out = tempfile.mkdtemp()
model = small()
args = transformers.TrainingArguments(out, max_steps=1, save_steps=1, per_device_train_batch_size=2,
                                      report_to=[], use_cpu=True)
try:
    transformers.Trainer(model=model, args=args, train_dataset=Tokens()).train()
    back = GPT2LMHeadModel.from_pretrained(f"{out}/checkpoint-1")
    hf = transformers.GPT2LMHeadModel.from_pretrained(f"{out}/checkpoint-1")
    ids = torch.tensor([[5, 6, 7]])
    seen["checkpoint_equal"] = torch.equal(back.eval()(ids).logits, model.eval()(ids).logits)
    seen["transformers_equal"] = torch.allclose(hf.eval()(ids).logits, model(ids).logits, atol=1e-5)
except Exception as e:
    seen["trainer_error"] = str(e)
print(json.dumps(seen))
"""


def run_user_code(imports: str, **env) -> dict:
    code = imports + textwrap.dedent(USER_CODE)
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("imports", [CLIENTS_FIRST, GPT2ATTN_FIRST], ids=["peft and trainer first", "gpt2attn first"])
def test_lora_and_trainer_checkpoints_need_only_the_import_line(imports):
    seen = run_user_code(imports)
    assert seen == {"lora_layers": ["LoraConv1D"], "lora_grads": True, "checkpoint_equal": True,
                    "transformers_equal": True}


@pytest.mark.slow
def test_the_hooks_can_be_turned_off():
    seen = run_user_code(GPT2ATTN_FIRST, GPT2ATTN_NO_IMPORT_HOOKS="1")
    assert "Conv1D" in seen["lora_error"] and "is not supported" in seen["lora_error"]
    assert "trainer_error" in seen  # safetensors refuses the tied lm_head / wte pair
