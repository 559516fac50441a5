"""transformers.Trainer with default TrainingArguments trains our model as it trains transformers' GPT-2.

`Trainer(model=model)` runs our forward and backward. Its checkpoint writer hands PreTrainedModel to
save_pretrained and anything else to safetensors' save_file, which refuses the tied lm_head / wte
pair and writes no config.json; `import gpt2attn.interop.trainer` sends our models to our own
save_pretrained. The zero-copy bridge, `Trainer(model=model.to_transformers())`, needs no import:
transformers' class, our parameters, saved by transformers' save_pretrained.
"""

from __future__ import annotations

import pytest
import safetensors.torch
import tokenizers
import torch
import transformers

from tests.helpers import hf_twin, max_diff, randomize, tiny_config

import gpt2attn.interop.trainer  # noqa: F401  (the one import for checkpoints of our model itself)
from gpt2attn import GPT2LMHeadModel


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n=16, T=12):
        self.x = torch.randint(0, 97, (n, T), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def fresh():
    return randomize(GPT2LMHeadModel(tiny_config()), std=0.1)


def train(model, out, max_steps=4, resume=None, processing_class=None, eval_dataset=None, **overrides):
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=max_steps, per_device_train_batch_size=4, report_to=[], use_cpu=True,
        logging_steps=1, **overrides,
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), eval_dataset=eval_dataset,
                                   processing_class=processing_class)
    trainer.train(resume_from_checkpoint=resume)
    losses = {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}
    return trainer, losses


def word_tokenizer():
    """A small real transformers tokenizer, so the test sees the Trainer save it beside the model."""
    vocab = {"[UNK]": 0, "to": 1, "be": 2, "[PAD]": 3}
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", pad_token="[PAD]")


def test_trainer_runs_our_forward_and_logs_transformers_losses(tmp_path):
    ours, hf = fresh(), hf_twin(fresh())
    _, want = train(hf, tmp_path / "hf")
    _, got = train(ours, tmp_path / "ours")
    assert len(got) == 4 and got.keys() == want.keys()
    assert list(got.values()) == pytest.approx(list(want.values()), abs=1e-5)
    x = Tokens().x[:2]
    assert max_diff(ours(x).logits, hf(x).logits) < 1e-4  # the same weights after 4 AdamW steps


@pytest.mark.parametrize("given", ["our model", "the bridge"])
def test_trainer_checkpoints_load_in_both_libraries_and_resume(tmp_path, given):
    as_given = (lambda m: m) if given == "our model" else (lambda m: m.to_transformers())
    ours = fresh()
    trainer, losses = train(as_given(ours), tmp_path / "run", save_steps=2, processing_class=word_tokenizer())
    _, want = train(hf_twin(fresh()), tmp_path / "hf", save_strategy="no")
    assert list(losses.values()) == pytest.approx(list(want.values()), abs=1e-5)
    x = Tokens().x[:2]
    trained = ours(x).logits  # the Trainer moved our parameters in place
    trainer.save_model(tmp_path / "final")
    for folder in (tmp_path / "final", tmp_path / "run" / "checkpoint-4"):
        assert max_diff(GPT2LMHeadModel.from_pretrained(folder)(x).logits, trained) < 1e-6
        assert max_diff(transformers.GPT2LMHeadModel.from_pretrained(folder)(x).logits, trained) < 1e-5
        assert transformers.AutoTokenizer.from_pretrained(folder)("to be").input_ids == [1, 2]
        assert (folder / "training_args.bin").is_file()
    # resume from step 2 in a new process' worth of state: steps 3 and 4 come out the same
    again = fresh()
    _, resumed = train(as_given(again), tmp_path / "run", resume=str(tmp_path / "run" / "checkpoint-2"),
                       save_strategy="no")
    assert [resumed[3], resumed[4]] == pytest.approx([losses[3], losses[4]], abs=1e-6)
    assert max_diff(again(x).logits, trained) < 1e-6


def test_evaluation_best_model_and_activation_checkpointing_as_transformers(tmp_path):
    """Evaluation during training, load_best_model_at_end (from our checkpoints), the Trainer's
    activation checkpointing (transformers 5 API) and predict: the same figures on both models."""
    results = {}
    for name, model in (("ours", fresh()), ("hf", hf_twin(fresh()))):
        trainer, losses = train(model, tmp_path / name, eval_strategy="steps", eval_steps=2, save_steps=2,
                                load_best_model_at_end=True, gradient_checkpointing=True, eval_dataset=Tokens(8))
        assert model.is_activation_checkpointing
        logits = trainer.predict(Tokens(4)).predictions
        logits = logits[0] if isinstance(logits, tuple) else logits
        results[name] = losses, trainer.evaluate()["eval_loss"], trainer.state.best_model_checkpoint, logits
    (ours_losses, ours_eval, ours_best, ours_logits), (hf_losses, hf_eval, hf_best, hf_logits) = results.values()
    assert list(ours_losses.values()) == pytest.approx(list(hf_losses.values()), abs=1e-5)
    assert ours_eval == pytest.approx(hf_eval, abs=1e-5)
    assert ours_best.endswith("checkpoint-4") and hf_best.endswith("checkpoint-4")
    assert ours_logits.shape == hf_logits.shape == (4, 12, 97)
    assert abs(ours_logits - hf_logits).max() < 1e-4


def test_other_models_are_saved_as_the_trainer_always_did(tmp_path):
    class Regressor(torch.nn.Module):  # a plain module: the Trainer writes its state dict, as before
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(12, 1)

        def forward(self, input_ids, labels):
            return {"loss": (self.w(input_ids.float()).squeeze(-1) - labels.float().mean(-1)).pow(2).mean()}

    trainer, _ = train(Regressor(), tmp_path / "run", max_steps=2, save_steps=2)
    folder = tmp_path / "run" / "checkpoint-2"
    assert not (folder / "config.json").exists()
    saved = safetensors.torch.load_file(folder / "model.safetensors")
    assert saved.keys() == trainer.model.state_dict().keys()


def test_loss_divided_by_num_items_in_batch_as_transformers():
    ours = fresh()
    hf = hf_twin(ours)
    x = Tokens().x[:4].clone()
    x[0, 5:] = -100  # padding labels do not count
    labels, ids = x, x.clamp(min=0)
    for n in (None, 48, torch.tensor(37)):
        kwargs = {} if n is None else {"num_items_in_batch": n}
        got, want = ours(ids, labels=labels, **kwargs).loss, hf(ids, labels=labels, **kwargs).loss
        assert abs(got.item() - want.item()) < 1e-5
