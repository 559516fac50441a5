"""The import line alone: with `from gpt2attn import GPT2LMHeadModel`, PEFT's LoRA and the Trainer's
checkpoints work with no other import, in either import order (each case a fresh interpreter), and
GPT2ATTN_NO_IMPORT_HOOKS=1 turns that off. `import gpt2attn` itself imports neither client
(tests/test_ecosystem_tools.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import REPO


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
