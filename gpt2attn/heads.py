"""The task heads: a GPT2Model body named `transformer` plus one small head each.

    GPT2ForSequenceClassification   score(hidden at each row's last non-padding token)   (B, num_labels)
    GPT2ForTokenClassification      classifier(dropout(hidden))                          (B, T, num_labels)
    GPT2ForQuestionAnswering        qa_outputs(hidden) -> start, end logits              (B, T) each
    GPT2DoubleHeadsModel            lm_head(hidden) and multiple_choice_head(hidden)     (B, nc, T, V), (B, nc)

Module names, parameter shapes and losses are transformers' (state dicts load both ways). The
pooling and the label checks live once, below the classes.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cache import KVCache, takes_past_key_values
from .config import PROBLEM_TYPES, GPT2Config, config_value
from .generation import GenerationMixin
from .layers import get_activation, init_weights
from .losses import lm_loss
from .model import GPT2LMHeadModel, GPT2Model
from .pretrained import GPT2PreTrainedModel
from .outputs import DoubleHeadsOutput, QuestionAnsweringOutput, SequenceClassifierOutput, TokenClassifierOutput

SUMMARIES = ("last", "first", "mean", "cls_index")  # summary_type "attn" is unimplemented, as in transformers


class GPT2HeadModel(GPT2PreTrainedModel):
    """A GPT2Model body named `transformer`; subclasses add their head and forward."""

    def __init__(self, config: GPT2Config):
        super().__init__(config)
        self.transformer = GPT2Model(config)


def initialised(module: nn.Module, config: GPT2Config) -> nn.Module:
    """A head module with transformers' init: weights N(0, initializer_range), zero biases."""
    init_weights(module, config)
    return module


class GPT2ForSequenceClassification(GPT2HeadModel):
    """Classifies each sequence from the hidden state of its last token that is not padding.

    With `config.pad_token_id` set, that is each row's rightmost token other than pad_token_id
    (left or right padding); without it, the last position, and only one row at a time, as in
    transformers. The loss follows `config.problem_type` (inferred from num_labels and the
    labels' dtype when unset, and then stored in the config, as transformers does).
    """

    def __init__(self, config: GPT2Config):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.score = initialised(nn.Linear(config.n_embd, self.num_labels, bias=False), config)

    @takes_past_key_values
    def forward(
        self,
        input_ids: Tensor | None = None,
        cache: KVCache | tuple | None = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        head_mask: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        labels: Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> SequenceClassifierOutput | tuple:
        out = self.transformer(
            input_ids, cache=cache, attention_mask=attention_mask, token_type_ids=token_type_ids,
            position_ids=position_ids, head_mask=head_mask, inputs_embeds=inputs_embeds, use_cache=use_cache,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states, return_dict=True,
            **kwargs,  # transformers' extra keywords, checked by GPT2Model.forward
        )
        hidden = out.last_hidden_state  # (B, T, C)
        last = last_token_index(input_ids, hidden.shape[:2], self.config.pad_token_id)  # (B,)
        logits = self.score(hidden[torch.arange(hidden.size(0), device=hidden.device), last])  # (B, num_labels)
        loss = None if labels is None else self.sequence_loss(logits, labels)
        result = SequenceClassifierOutput(loss, logits, out.cache, out.hidden_states, out.attentions)
        return _returned(result, return_dict, self.config)

    def sequence_loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        """MSE, cross-entropy or binary cross-entropy on (B, num_labels) logits, by problem_type."""
        problem = self.config.problem_type
        if problem is None:
            if self.num_labels == 1:
                problem = "regression"
            elif labels.dtype in (torch.long, torch.int):
                problem = "single_label_classification"
            else:
                problem = "multi_label_classification"
            self.config.problem_type = problem
        if problem == "regression":
            _check_float_labels("labels", labels, logits.shape if self.num_labels > 1 else None)
            if self.num_labels == 1:
                return F.mse_loss(logits.squeeze(), labels.squeeze().to(logits.dtype))
            return F.mse_loss(logits, labels.to(logits.dtype))
        if problem == "single_label_classification":
            return classification_loss(logits, labels, "labels")
        if problem == "multi_label_classification":
            _check_float_labels("labels", labels, logits.shape)
            return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))
        raise ValueError(f"config.problem_type is {problem!r}; choose one of {', '.join(PROBLEM_TYPES)} or None")


class GPT2ForTokenClassification(GPT2HeadModel):
    """A label per token: classifier(dropout(hidden)); dropout p is config.classifier_dropout
    (0.1 when None, as transformers)."""

    def __init__(self, config: GPT2Config):
        super().__init__(config)
        self.num_labels = config.num_labels
        p = config_value(config, "classifier_dropout")
        self.dropout = nn.Dropout(0.1 if p is None else p)
        self.classifier = initialised(nn.Linear(config.n_embd, self.num_labels), config)

    @takes_past_key_values
    def forward(
        self,
        input_ids: Tensor | None = None,
        cache: KVCache | tuple | None = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        head_mask: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        labels: Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> TokenClassifierOutput | tuple:
        out = self.transformer(
            input_ids, cache=cache, attention_mask=attention_mask, token_type_ids=token_type_ids,
            position_ids=position_ids, head_mask=head_mask, inputs_embeds=inputs_embeds, use_cache=use_cache,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states, return_dict=True,
            **kwargs,  # transformers' extra keywords, checked by GPT2Model.forward
        )
        logits = self.classifier(self.dropout(out.last_hidden_state))  # (B, T, num_labels)
        loss = None if labels is None else classification_loss(logits, labels, "labels")
        result = TokenClassifierOutput(loss, logits, out.hidden_states, out.attentions)
        return _returned(result, return_dict, self.config)


class GPT2ForQuestionAnswering(GPT2HeadModel):
    """Extractive QA: start and end logits per token from qa_outputs, Linear(n_embd, 2).

    The loss is the mean of the start and end cross-entropies; as in transformers, positions
    past the end are clamped to T and ignored, negative ones clamped to 0.
    """

    def __init__(self, config: GPT2Config):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.qa_outputs = initialised(nn.Linear(config.n_embd, 2), config)

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        head_mask: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        start_positions: Tensor | None = None,
        end_positions: Tensor | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> QuestionAnsweringOutput | tuple:
        out = self.transformer(
            input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids, position_ids=position_ids,
            head_mask=head_mask, inputs_embeds=inputs_embeds, use_cache=False,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states, return_dict=True,
            **kwargs,  # transformers' extra keywords, checked by GPT2Model.forward
        )
        start_logits, end_logits = self.qa_outputs(out.last_hidden_state).unbind(dim=-1)  # (B, T) each
        loss = None
        if start_positions is not None and end_positions is not None:
            T = start_logits.size(1)
            start = _positions("start_positions", start_positions, T)
            end = _positions("end_positions", end_positions, T)
            start_loss = F.cross_entropy(start_logits, start, ignore_index=T)
            loss = (start_loss + F.cross_entropy(end_logits, end, ignore_index=T)) / 2
        result = QuestionAnsweringOutput(loss, start_logits.contiguous(), end_logits.contiguous(),
                                         out.hidden_states, out.attentions)
        return _returned(result, return_dict, self.config)


class SequenceSummary(nn.Module):
    """One vector per sequence (transformers' GPT2SequenceSummary, driven by the summary_* fields):
    pick a token ("cls_index": mc_token_ids, default the last; "last"; "first") or average them
    ("mean"), then first_dropout -> summary (a Linear to num_labels or n_embd, or nothing) ->
    activation -> last_dropout."""

    def __init__(self, config: GPT2Config, num_labels: int):
        super().__init__()
        self.summary_type = config.summary_type
        if self.summary_type not in SUMMARIES:
            choices = ", ".join(SUMMARIES)
            raise ValueError(f"summary_type {self.summary_type!r} is not supported; choose one of {choices}")
        self.summary = nn.Identity()
        if config.summary_use_proj:
            to_labels = config.summary_proj_to_labels and num_labels > 0
            self.summary = nn.Linear(config.n_embd, num_labels if to_labels else config.n_embd)
        activation = config.summary_activation
        self.activation = get_activation(activation) if activation else nn.Identity()
        first = config.summary_first_dropout
        last = getattr(config, "summary_last_dropout", None)  # not a GPT2Config field, honoured when set
        self.first_dropout = nn.Dropout(first) if first else nn.Identity()
        self.last_dropout = nn.Dropout(last) if last else nn.Identity()

    def forward(self, hidden: Tensor, cls_index: Tensor | None = None) -> Tensor:
        """hidden (..., T, C) -> (..., C'); cls_index (...) picks each sequence's token."""
        if self.summary_type == "mean":
            x = hidden.mean(dim=-2)
        elif self.summary_type == "first":
            x = hidden[..., 0, :]
        elif self.summary_type == "last" or cls_index is None:
            x = hidden[..., -1, :]
        else:
            T = hidden.size(-2)
            if cls_index.shape != hidden.shape[:-2]:
                expected = tuple(hidden.shape[:-2])
                raise ValueError(f"mc_token_ids has shape {tuple(cls_index.shape)}, expected {expected}")
            _check_range("mc_token_ids", cls_index, T)
            index = cls_index[..., None, None].expand(*cls_index.shape, 1, hidden.size(-1))  # (..., 1, C)
            x = hidden.gather(-2, index).squeeze(-2)
        return self.last_dropout(self.activation(self.summary(self.first_dropout(x))))


class GPT2DoubleHeadsModel(GPT2LMHeadModel, GenerationMixin):
    """The LM head plus a multiple-choice head over `n_choices` candidate sequences per example.

    input_ids (B, n_choices, T) (or (B, T)); mc_token_ids (B, n_choices) marks each choice's
    classification token (default: its last). Returns LM logits (B, n_choices, T, vocab) and
    mc_logits (B, n_choices); `loss` is the LM loss over all choices, `mc_loss` the choice loss.
    """

    def __init__(self, config: GPT2Config):
        super().__init__(config)
        self.multiple_choice_head = initialised(SequenceSummary(config, num_labels=1), config)  # a score per choice

    @takes_past_key_values
    def forward(
        self,
        input_ids: Tensor | None = None,
        cache: KVCache | tuple | None = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        head_mask: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        mc_token_ids: Tensor | None = None,
        labels: Tensor | None = None,
        mc_labels: Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> DoubleHeadsOutput | tuple:
        lead = (input_ids if input_ids is not None else inputs_embeds[..., 0]).shape[:-1]  # (B, n_choices) or (B,)

        def flat(t: Tensor | None) -> Tensor | None:  # (B, n_choices, T, ...) -> (B * n_choices, T, ...)
            return t.flatten(0, 1) if t is not None and len(lead) == 2 and t.shape[:2] == lead else t

        out = self.transformer(
            flat(input_ids), cache=cache, attention_mask=flat(attention_mask),
            token_type_ids=flat(token_type_ids), position_ids=flat(position_ids), head_mask=head_mask,
            inputs_embeds=flat(inputs_embeds), use_cache=use_cache,
            output_attentions=output_attentions, output_hidden_states=output_hidden_states, return_dict=True,
            **kwargs,  # transformers' extra keywords, checked by GPT2Model.forward
        )
        hidden = out.last_hidden_state.unflatten(0, lead)  # (B, n_choices, T, C)
        logits = self.lm_head(hidden)  # (B, n_choices, T, vocab)
        mc_logits = self.multiple_choice_head(hidden, mc_token_ids).squeeze(-1)  # (B, n_choices)
        loss = mc_loss = None
        if labels is not None:
            if labels.shape != logits.shape[:-1]:
                raise ValueError(f"labels have shape {tuple(labels.shape)}, expected {tuple(logits.shape[:-1])}")
            loss = lm_loss(logits.flatten(0, -3), labels.flatten(0, -2), self.config.vocab_size)
        if mc_labels is not None:
            mc_loss = classification_loss(mc_logits, mc_labels, "mc_labels")
        hidden_states = out.hidden_states
        if hidden_states is not None:  # the last one (after ln_f) shaped like the input, as in transformers
            hidden_states = (*hidden_states[:-1], hidden)
        result = DoubleHeadsOutput(loss, mc_loss, logits, mc_logits, out.cache, hidden_states, out.attentions)
        return _returned(result, return_dict, self.config)


# --- pooling and losses shared by the heads -------------------------------------------------


def last_token_index(input_ids: Tensor | None, shape: torch.Size, pad_token_id: int | None) -> Tensor | int:
    """Each row's last token that is not padding (B,), as transformers picks it.

    The rightmost position whose id is not pad_token_id (so left and right padding both work; a
    row of padding alone gives 0); the last position when there is no pad_token_id (one row only:
    padding could not be told apart) or no input_ids (embeddings hide the padding).
    """
    B, T = shape
    if pad_token_id is None:
        if B != 1:
            raise ValueError(
                f"cannot pick each row's last token in a batch of {B} without config.pad_token_id: "
                f"set it (e.g. to the tokenizer's pad or eos id), or pass one row at a time"
            )
        return -1
    if input_ids is None:
        warnings.warn("GPT2ForSequenceClassification cannot find padding in inputs_embeds: using the last position")
        return -1
    positions = torch.arange(T, device=input_ids.device)
    return (positions * (input_ids != pad_token_id)).argmax(dim=-1)


def classification_loss(logits: Tensor, labels: Tensor, name: str) -> Tensor:
    """Cross-entropy of (..., n_classes) logits against integer labels (...); -100 is ignored."""
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"{name} must be integer class indices, got {labels.dtype}")
    if labels.numel() != logits[..., 0].numel():
        raise ValueError(f"{name} have shape {tuple(labels.shape)}, expected {tuple(logits.shape[:-1])}")
    labels = labels.reshape(-1)
    _check_range(name, labels[labels != -100], logits.size(-1), "or -100")
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels, ignore_index=-100)


def _positions(name: str, positions: Tensor, T: int) -> Tensor:
    """QA start/end positions (B,) or (B, 1), clamped to [0, T]; T means 'ignore'."""
    if positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise ValueError(f"{name} must be integer token positions, got {positions.dtype}")
    if positions.dim() > 1:
        positions = positions.squeeze(-1)
    return positions.clamp(0, T)


def _check_range(name: str, values: Tensor, n: int, extra: str = "") -> None:
    if torch.compiler.is_compiling():  # the check reads values back; eager mode only
        return
    if values.numel() and (values.min() < 0 or values.max() >= n):
        bad = values[(values < 0) | (values >= n)][0].item()
        raise ValueError(f"{name} hold {bad}, outside [0, {n}){' ' + extra if extra else ''}")


def _check_float_labels(name: str, labels: Tensor, shape: torch.Size | None) -> None:
    if not labels.dtype.is_floating_point:
        raise ValueError(f"{name} must be floating point for this problem_type, got {labels.dtype}")
    if shape is not None and labels.shape != shape:
        raise ValueError(f"{name} have shape {tuple(labels.shape)}, expected {tuple(shape)}")


def _returned(result, return_dict: bool | None, config: GPT2Config):
    """The output object, or its tuple for return_dict=False (config.return_dict by default)."""
    return_dict = config.return_dict if return_dict is None else return_dict
    return result if return_dict else result.to_tuple()
