"""The four task heads against transformers' classes on the same random weights: state dicts,
logits, losses and gradients; padding; save/load both ways; head checkpoints into the body."""

from __future__ import annotations

import warnings

import pytest
import torch

from gpt2attn import (
    GPT2DoubleHeadsModel,
    GPT2ForQuestionAnswering,
    GPT2ForSequenceClassification,
    GPT2ForTokenClassification,
    GPT2LMHeadModel,
    GPT2Model,
    inspect,
)
from tests.helpers import load_report, max_diff, randomize, tiny_config

HEADS = [GPT2ForSequenceClassification, GPT2ForTokenClassification, GPT2ForQuestionAnswering, GPT2DoubleHeadsModel]
PAD = 5


def twin(model):
    """transformers' class of the same name, same config, this model's weights; same train/eval mode and
    attention backend (a padded row that sees no key differs between backends, in transformers too)."""
    import transformers

    hf_config = transformers.GPT2Config.from_dict(model.config.to_dict())
    hf_config._attn_implementation = model.config._attn_implementation
    hf = getattr(transformers, type(model).__name__)(hf_config)
    hf.load_state_dict(model.state_dict(), strict=True)
    return hf.train(model.training)


def pair(cls, seed=0, **task):
    model = randomize(cls(tiny_config(**task)), seed).eval()
    return model, twin(model)


def padded_batch(B=3, T=7, seed=0):
    """Ids with right padding on row 1 and left padding on row 2 (pad id PAD), and their mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, 97, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    ids[1, -3:], mask[1, -3:] = PAD, 0
    ids[2, :2], mask[2, :2] = PAD, 0
    return ids, mask


def grad_diff(ours, hf) -> float:
    hf_grads = dict(hf.named_parameters())
    diffs = [max_diff(p.grad, hf_grads[name].grad) for name, p in ours.named_parameters() if p.grad is not None]
    assert len(diffs) == len([p for p in hf.parameters() if p.grad is not None]) > 0
    return max(diffs)


def compare(ours, hf, fields, **inputs) -> dict[str, float]:
    """Run both, backward on the loss (when asked), and return max |diff| per field and for gradients."""
    a, b = ours(**inputs), hf(**inputs)
    assert list(a.keys()) == list(b.keys())
    diffs = {f: max_diff(a[f], b[f]) for f in fields}
    if "loss" in fields or "mc_loss" in fields:
        sum(a[f] for f in fields if "loss" in f).backward()
        sum(b[f] for f in fields if "loss" in f).backward()
        diffs["grad"] = grad_diff(ours, hf)
    return diffs


@pytest.mark.parametrize("cls", HEADS, ids=lambda c: c.__name__)
def test_state_dict_equals_transformers(cls):
    import transformers

    model = cls(tiny_config(num_labels=3))
    hf = getattr(transformers, cls.__name__)(transformers.GPT2Config.from_dict(model.config.to_dict()))
    ours = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    assert ours == theirs
    assert isinstance(model.transformer, GPT2Model) and model.base_model is model.transformer


@pytest.mark.parametrize(
    "task, labels",
    [
        ({"num_labels": 3}, torch.tensor([0, 2, 1])),  # single_label_classification, inferred
        ({"num_labels": 1}, torch.tensor([0.5, -1.0, 2.0])),  # regression, inferred
        ({"num_labels": 3}, torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0], [1.0, 1.0, 0.0]])),  # multi-label
        ({"num_labels": 2, "problem_type": "regression"}, torch.tensor([[0.1, 0.2], [0.3, -1.0], [2.0, 0.0]])),
    ],
    ids=["single_label", "regression", "multi_label", "regression_2"],
)
def test_sequence_classification_parity(task, labels):
    ours, hf = pair(GPT2ForSequenceClassification, pad_token_id=PAD, **task)
    ids, mask = padded_batch()
    diffs = compare(ours, hf, ["logits", "loss"], input_ids=ids, attention_mask=mask, labels=labels)
    assert max(diffs.values()) < 1e-5, diffs
    assert ours.config.problem_type == hf.config.problem_type  # inferred and stored, as transformers


@torch.no_grad()
def test_sequence_classification_pools_the_last_real_token():
    ours, hf = pair(GPT2ForSequenceClassification, pad_token_id=PAD, num_labels=3)
    ids, mask = padded_batch()
    logits = ours(ids, attention_mask=mask).logits
    for row, last in enumerate([6, 3, 6]):  # right padding ends row 1 at position 3
        alone = ours(ids[row : row + 1, : last + 1], attention_mask=mask[row : row + 1, : last + 1]).logits
        assert max_diff(logits[row], alone[0]) < 1e-5
    # Without pad_token_id: the last position, and a batch of several rows is an error in both.
    ours, hf = pair(GPT2ForSequenceClassification, num_labels=3)
    assert max_diff(ours(ids[:1]).logits, hf(ids[:1]).logits) < 1e-5
    with pytest.raises(ValueError, match="pad_token_id"):
        ours(ids)
    with pytest.raises(ValueError):
        hf(ids)


def test_sequence_classification_bad_labels():
    ours, _ = pair(GPT2ForSequenceClassification, pad_token_id=PAD, num_labels=3)
    ids, _ = padded_batch()
    with pytest.raises(ValueError, match="labels hold 3"):
        ours(ids, labels=torch.tensor([0, 1, 3]))
    with pytest.raises(ValueError, match="problem_type is 'ranking'"):
        ours.config.problem_type = "ranking"
        ours(ids, labels=torch.tensor([0, 1, 2]))


def test_token_classification_parity():
    ours, hf = pair(GPT2ForTokenClassification, num_labels=4, classifier_dropout=0.3)
    assert ours.dropout.p == hf.dropout.p == 0.3
    ids, mask = padded_batch()
    labels = torch.randint(0, 4, ids.shape, generator=torch.Generator().manual_seed(1))
    labels[mask == 0] = -100
    diffs = compare(ours, hf, ["logits", "loss"], input_ids=ids, attention_mask=mask, labels=labels)
    assert max(diffs.values()) < 1e-5, diffs
    assert GPT2ForTokenClassification(tiny_config()).dropout.p == 0.1  # classifier_dropout None


def test_question_answering_parity():
    ours, hf = pair(GPT2ForQuestionAnswering)
    ids, mask = padded_batch()
    start = torch.tensor([1, 30, -2])  # 30 is past the end: clamped to T and ignored; -2 clamps to 0
    end = torch.tensor([[4], [5], [6]])  # (B, 1) is squeezed
    diffs = compare(
        ours, hf, ["start_logits", "end_logits", "loss"],
        input_ids=ids, attention_mask=mask, start_positions=start, end_positions=end,
    )
    assert max(diffs.values()) < 1e-5, diffs


def test_question_answering_loss_by_hand_ignores_positions_past_the_end():
    """The loss from the logits by hand: a start or end at or past T counts for nothing, a
    negative one as position 0; each half is the mean over the rows that count."""
    model = randomize(GPT2ForQuestionAnswering(tiny_config()), 3).eval()
    ids = torch.randint(0, 97, (4, 5), generator=torch.Generator().manual_seed(2))
    start = torch.tensor([2, 5, 99, -3])  # rows 1 and 2 past the end (T = 5)
    end = torch.tensor([7, 1, 4, 0])  # row 0 past the end
    out = model(ids, start_positions=start, end_positions=end)
    logp_start, logp_end = out.start_logits.log_softmax(-1), out.end_logits.log_softmax(-1)
    start_loss = -(logp_start[0, 2] + logp_start[3, 0]) / 2
    end_loss = -(logp_end[1, 1] + logp_end[2, 4] + logp_end[3, 0]) / 3
    assert abs(out.loss.item() - (start_loss + end_loss).item() / 2) < 1e-6


@pytest.mark.parametrize(
    "task",
    [{}, {"summary_activation": "tanh", "summary_first_dropout": 0.0}],
    ids=["defaults", "tanh"],
)
def test_double_heads_parity(task):
    ours, hf = pair(GPT2DoubleHeadsModel, **task)
    B, nc, T = 2, 3, 6
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 97, (B, nc, T), generator=g)
    mc_token_ids = torch.randint(0, T, (B, nc), generator=g)
    labels = ids.clone()
    labels[:, :, :2] = -100
    mc_labels = torch.tensor([2, 0])
    diffs = compare(
        ours, hf, ["logits", "mc_logits", "loss", "mc_loss"],
        input_ids=ids, mc_token_ids=mc_token_ids, labels=labels, mc_labels=mc_labels,
    )
    assert max(diffs.values()) < 1e-5, diffs
    with torch.no_grad():
        a, b = ours(ids, output_hidden_states=True), hf(ids, output_hidden_states=True)
    assert a.logits.shape == (B, nc, T, 97) and a.mc_logits.shape == (B, nc)
    assert [h.shape for h in a.hidden_states] == [h.shape for h in b.hidden_states]  # (B * nc, T, C) ... (B, nc, T, C)
    assert list(a.keys()) == list(b.keys())


@torch.no_grad()
@pytest.mark.parametrize(
    "task",
    [{"summary_type": "last"}, {"summary_type": "first"}, {"summary_type": "mean", "summary_proj_to_labels": False},
     {"summary_use_proj": False, "summary_activation": "relu"}],
    ids=["last", "first", "mean_to_hidden", "no_proj_relu"],
)
def test_double_heads_summary_options(task):
    ours, hf = pair(GPT2DoubleHeadsModel, **task)
    ids, _ = padded_batch()
    assert max_diff(ours(ids).mc_logits, hf(ids).mc_logits) < 1e-5


@pytest.mark.parametrize("cls", HEADS, ids=lambda c: c.__name__)
@torch.no_grad()
def test_save_load_both_ways(tmp_path, cls):
    import transformers

    ours = randomize(cls(tiny_config(num_labels=3, pad_token_id=PAD)), 3).eval()
    ids, mask = padded_batch()
    field = "start_logits" if cls is GPT2ForQuestionAnswering else "logits"
    ours.save_pretrained(tmp_path / "ours")
    hf = getattr(transformers, cls.__name__).from_pretrained(tmp_path / "ours")  # sdpa, as ours
    assert max_diff(hf(ids, attention_mask=mask)[field], ours(ids, attention_mask=mask)[field]) < 1e-5
    hf.save_pretrained(tmp_path / "hf")
    back = cls.from_pretrained(tmp_path / "hf")
    assert max_diff(back(ids, attention_mask=mask)[field], hf(ids, attention_mask=mask)[field]) < 1e-5


@torch.no_grad()
def test_head_checkpoint_into_the_body_drops_the_head_with_a_warning(tmp_path):
    head = randomize(GPT2ForSequenceClassification(tiny_config(num_labels=3, pad_token_id=PAD)), 4).eval()
    head.save_pretrained(tmp_path)
    ids, _ = padded_batch()
    body = head.transformer(ids).last_hidden_state
    with load_report() as report:
        base = GPT2Model.from_pretrained(tmp_path)
    assert "does not use these weights of the checkpoint: score.weight" in report.getvalue()
    assert max_diff(base(ids).last_hidden_state, body) < 1e-6
    with load_report() as report:
        lm = GPT2LMHeadModel.from_pretrained(tmp_path)
    assert "does not use these weights of the checkpoint: score.weight" in report.getvalue()
    assert lm.lm_head.weight is lm.transformer.wte.weight
    assert max_diff(lm.transformer(ids).last_hidden_state, body) < 1e-6


@torch.no_grad()
def test_lm_checkpoint_into_a_head_initialises_the_head_with_a_warning(tmp_path):
    lm = randomize(GPT2LMHeadModel(tiny_config(tie_word_embeddings=False)), 5).eval()
    lm.save_pretrained(tmp_path)
    ids, _ = padded_batch()
    with load_report() as report:
        head = GPT2ForTokenClassification.from_pretrained(tmp_path, num_labels=5)  # config keywords, as transformers
    text = report.getvalue()
    assert "lm_head.weight" in text and "classifier.weight" in text and "classifier.bias" in text
    assert head.config.num_labels == 5 and head.classifier.weight.shape == (5, 32)
    assert max_diff(head.transformer(ids).last_hidden_state, lm.transformer(ids).last_hidden_state) < 1e-6
    w = head.classifier.weight
    assert w.device.type == "cpu" and 0.005 < w.std().item() < 0.05  # N(0, 0.02), not left empty
    assert torch.equal(head.classifier.bias, torch.zeros(head.num_labels))


@torch.no_grad()
def test_inspect_through_a_head():
    ours, _ = pair(GPT2ForSequenceClassification, pad_token_id=PAD, num_labels=3)
    ours.set_attn_implementation("eager")  # weights are the textbook formula's: transformers returns them on eager
    hf = twin(ours)
    ids, mask = padded_batch()
    with inspect.capture(ours, layers=[1], names=["weights", "resid_post"]) as acts:
        logits = ours(ids, attention_mask=mask).logits
    hf_out = hf(ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
    assert max_diff(acts["h.1.attn.weights"], hf_out.attentions[1]) < 1e-5
    with inspect.edit(ours, "h.1.attn.weights", inspect.zero_head(0)):
        ablated = ours(ids, attention_mask=mask).logits
    assert max_diff(ablated, logits) > 1e-4


def test_heads_return_tuples_and_keys():
    ours, _ = pair(GPT2ForQuestionAnswering)
    ids, _ = padded_batch()
    out = ours(ids, output_hidden_states=True)
    assert list(out.keys()) == ["start_logits", "end_logits", "hidden_states"]
    assert len(ours(ids, return_dict=False)) == 2  # start and end logits
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GPT2ForQuestionAnswering(tiny_config())  # building a head warns about nothing
