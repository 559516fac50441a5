"""The language-modelling loss: next-token cross-entropy, as transformers computes it."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .inputs import as_int_tensor


def lm_loss(logits: Tensor, labels: Tensor, vocab_size: int, num_items_in_batch: int | Tensor | None = None,
            shifted: bool = False) -> Tensor:
    """Next-token cross-entropy: position t predicts labels[t+1] (labels[t] when they come
    `shifted` already); label -100 is ignored.

    num_items_in_batch (transformers' Trainer passes it): divide the summed loss by this count
    instead of averaging, so gradient accumulation weighs every token alike, as transformers does."""
    labels = as_int_tensor("labels", labels, logits.device)
    if labels.shape != logits.shape[:2]:
        raise ValueError(f"labels have shape {tuple(labels.shape)}, expected {tuple(logits.shape[:2])}")
    if not torch.compiler.is_compiling():
        bad = (labels != -100) & ((labels < 0) | (labels >= vocab_size))
        if bad.any():
            raise ValueError(f"labels hold {labels[bad][0].item()}: labels must be -100 or in [0, {vocab_size})")
    shift_logits = (logits if shifted else logits[:, :-1]).reshape(-1, logits.size(-1)).float()
    shift_labels = (labels if shifted else labels[:, 1:]).reshape(-1)
    if num_items_in_batch is None:
        return F.cross_entropy(shift_logits, shift_labels, ignore_index=-100)
    return F.cross_entropy(shift_logits, shift_labels, ignore_index=-100, reduction="sum") / num_items_in_batch
