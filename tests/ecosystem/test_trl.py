"""TRL's trainers on gpt2attn's models with the import line changed and nothing else.

Each trainer runs twice from the same weights and seed, once on our model and once on transformers'
twin, in fp32 on the CPU (`use_cpu=True, bf16=False`, as TRL defaults to bf16): every number TRL logs
at every step (losses, rewards, margins, grad norms, ...) agrees within 1e-5 relative, and the
checkpoint TRL writes for our model opens in both libraries with our trained weights.

The runs use SGD: Adam's first steps move every weight by about the learning rate whatever the size
of its gradient, so a gradient of 1e-9 in one run and -1e-9 in the other (float rounding, as between
two attention kernels of transformers itself) becomes a step apart of twice the learning rate, and
the runs drift by more than 1e-5 within three steps for reasons that are not the model's.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
import tokenizers  # noqa: E402
import transformers  # noqa: E402

from tests.helpers import randomize, tiny_config  # noqa: E402

import gpt2attn  # noqa: E402

pytestmark = pytest.mark.slow

TEXT = "abcdefghijklmnopqrstuvwxyz .,!?"
RTOL = 1e-5
FLOOR = 0.1


def char_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """A character-level transformers tokenizer, built here (the machine has no model hub)."""
    vocab = {"<pad>": 0, "<eos>": 1, **{ch: i + 2 for i, ch in enumerate(TEXT)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = tokenizers.decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                                bos_token="<eos>")


def twins(cls_name: str, **config):
    """Our model and transformers' with the same random weights."""
    tok = char_tokenizer()
    cfg = tiny_config(vocab_size=len(tok), n_positions=64, pad_token_id=0, bos_token_id=1, eos_token_id=1, **config)
    ours = randomize(getattr(gpt2attn, cls_name)(cfg), seed=1, std=0.1)
    hf = getattr(transformers, cls_name)(transformers.GPT2Config.from_dict(cfg.to_dict()))
    hf.load_state_dict(ours.state_dict())
    return ours, hf, tok


def args(config_cls, out, **overrides):
    return config_cls(output_dir=str(out), max_steps=3, per_device_train_batch_size=4, optim="sgd", learning_rate=1e-2,
                      logging_steps=1, report_to=[], use_cpu=True, bf16=False, seed=0, save_strategy="no",
                      **overrides)


def per_step(trainer) -> list[dict[str, float]]:
    """What the trainer logged at each step (numbers only, the run-time figures left out)."""
    return [{k: v for k, v in h.items() if isinstance(v, (int, float)) and "time" not in k
             and "per_second" not in k} for h in trainer.state.log_history if "step" in h]


def assert_same_run(ours, theirs) -> float:
    """Every logged number equal within RTOL relative; returns the largest relative difference.

    Numbers under FLOOR in size are measured against FLOOR: DPO's rewards are differences of two
    near-equal sums of log-probabilities (policy minus reference), so their last bits are the sums'
    rounding, not the model's (the sums themselves, logps/*, are compared relative as they are)."""
    assert len(ours) == len(theirs) and len(ours) >= 3
    worst = 0.0
    for a, b in zip(ours, theirs):
        assert a.keys() == b.keys()
        for key in a:
            x, y = float(a[key]), float(b[key])
            rel = abs(x - y) / max(abs(y), FLOOR)
            assert rel <= RTOL, f"step {a.get('step')}: {key} {x} vs transformers' {y}"
            worst = max(worst, rel)
    return worst


def compare_runs(tmp_path, cls_name, make_trainer) -> list[dict[str, float]]:
    """Train with make_trainer(0, folder) (our model) and make_trainer(1, folder) (transformers'):
    every logged number agrees, and our checkpoint opens in both libraries. Returns our log."""
    runs = []
    for side in (0, 1):
        trainer = make_trainer(side, tmp_path / str(side))
        trainer.train()
        runs.append((trainer, per_step(trainer)))
    (ours, log), (_, theirs) = runs
    worst = assert_same_run(log, theirs)
    print(f"{type(ours).__name__}: {len(log)} steps, max relative difference {worst:.2e}")
    check_checkpoint(ours, tmp_path / "ckpt", cls_name)
    return log


def check_checkpoint(trainer_ours, folder, cls_name):
    """save_model's folder opens in both libraries with the trained weights."""
    trainer_ours.save_model(str(folder))
    model = trainer_ours.model
    mine = getattr(gpt2attn, cls_name).from_pretrained(folder)
    theirs = getattr(transformers, cls_name).from_pretrained(folder)
    for name, p in model.state_dict().items():
        assert torch.equal(mine.state_dict()[name], p), name
        assert torch.equal(theirs.state_dict()[name], p), name


def test_sft_trainer(tmp_path):
    ours, hf, tok = twins("GPT2LMHeadModel")
    data = datasets.Dataset.from_dict({"text": ["hello world.", "to be or not to be", "abc abc abc", "the end!"] * 3})
    compare_runs(tmp_path, "GPT2LMHeadModel", lambda side, out: trl.SFTTrainer(
        model=(ours, hf)[side], args=args(trl.SFTConfig, out, max_length=32), train_dataset=data,
        processing_class=tok))


def test_dpo_trainer(tmp_path):
    ours, hf, tok = twins("GPT2LMHeadModel")
    data = datasets.Dataset.from_dict({
        "prompt": ["the sky is", "two and two", "hello", "cats say"] * 3,
        "chosen": [" blue.", " four.", " world!", " meow."] * 3,
        "rejected": [" green.", " five.", " moon?", " woof."] * 3,
    })
    references = copy.deepcopy(ours), copy.deepcopy(hf)  # (TRL would load one from the model's folder)
    log = compare_runs(tmp_path, "GPT2LMHeadModel", lambda side, out: trl.DPOTrainer(
        model=(ours, hf)[side], ref_model=references[side], args=args(trl.DPOConfig, out, max_length=32),
        train_dataset=data, processing_class=tok))
    assert any("rewards/margins" in k for k in log[0])


def test_reward_trainer(tmp_path):
    ours, hf, tok = twins("GPT2ForSequenceClassification", num_labels=1)
    data = datasets.Dataset.from_dict({
        "chosen": ["a kind answer.", "four.", "blue sky", "yes, thanks!"] * 3,
        "rejected": ["rude!", "five?", "green sky", "no."] * 3,
    })
    compare_runs(tmp_path, "GPT2ForSequenceClassification", lambda side, out: trl.RewardTrainer(
        model=(ours, hf)[side], args=args(trl.RewardConfig, out, max_length=32), train_dataset=data,
        processing_class=tok))


def count_vowels(completions, **kwargs):
    """A trivial reward: the share of vowels in each completion."""
    return [sum(ch in "aeiou" for ch in c) / max(len(c), 1) for c in completions]


def test_grpo_trainer(tmp_path):
    ours, hf, tok = twins("GPT2LMHeadModel")
    data = datasets.Dataset.from_dict({"prompt": ["the sky is", "two and two", "hello", "cats say"] * 3})
    log = compare_runs(tmp_path, "GPT2LMHeadModel", lambda side, out: trl.GRPOTrainer(
        model=(ours, hf)[side], reward_funcs=count_vowels,
        args=args(trl.GRPOConfig, out, num_generations=2, max_completion_length=6), train_dataset=data,
        processing_class=tok))
    assert any("reward" in k for k in log[0]) and all(math.isfinite(v) for v in log[0].values())
