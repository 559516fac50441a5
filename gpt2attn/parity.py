"""Parity report: one checkpoint in gpt2attn and in `transformers`, compared layer by layer.

A difference passes when max|ours - theirs| <= tol * max(1, max|theirs|): the tolerance is
absolute for values near 1 and relative for large activations (GPT-2's residual stream
reaches the thousands).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

# Default tolerance per dtype: fp32 kernels differ in summation order only; half precisions
# round every intermediate.
DEFAULT_TOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}


@dataclass
class Row:
    name: str
    diff: float
    scale: float  # max |theirs|
    attention_diff: float | None = None

    def ok(self, tol: float) -> bool:
        worst = self.diff / max(1.0, self.scale)
        return worst <= tol and (self.attention_diff is None or self.attention_diff <= tol)


@dataclass
class ParityReport:
    rows: list[Row]  # embeddings, each layer, logits
    greedy_agreement: float  # fraction of positions whose argmax token agrees
    greedy_flips: int  # disagreements that are not near-ties (see compare)
    tol: float
    hf_source: str  # how transformers got the weights
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.greedy_flips == 0 and all(row.ok(self.tol) for row in self.rows)

    def format(self) -> str:
        lines = [f"transformers loaded {self.hf_source}", *self.notes, ""]
        lines.append(f"{'':<10} {'max|diff| hidden':>17} {'max|ref|':>10} {'max|diff| attn':>15}  ok")
        for row in self.rows:
            attn = f"{row.attention_diff:15.3e}" if row.attention_diff is not None else f"{'-':>15}"
            ok = "yes" if row.ok(self.tol) else "NO"
            lines.append(f"{row.name:<10} {row.diff:17.3e} {row.scale:10.3g} {attn}  {ok}")
        lines.append(
            f"greedy next-token agreement: {self.greedy_agreement:.1%} ({self.greedy_flips} flips beyond near-ties)"
        )
        verdict = "PASS" if self.passed else "FAIL"
        lines.append(f"{verdict} (tolerance {self.tol:g}, relative to max(1, max|ref|))")
        return "\n".join(lines)


def import_transformers():
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "gpt2attn parity compares against Hugging Face transformers, which is not installed: "
            "pip install transformers"
        ) from None
    return transformers


def load_reference(transformers, src: Any, ours, dtype: torch.dtype | None):
    """transformers' GPT2LMHeadModel (eager attention, so it returns attention weights): from
    the folder itself when it is an HF folder, else (TF checkpoint, single file, state dict)
    from our loaded weights, as transformers cannot read those sources."""
    from .checkpoint import CONFIG_NAME, resolve

    folder = resolve(src) if not isinstance(src, dict) else None
    if folder is not None and folder.is_dir() and (folder / CONFIG_NAME).exists():
        hf = transformers.GPT2LMHeadModel.from_pretrained(folder, dtype=dtype, attn_implementation="eager")
        return hf.eval(), f"{folder} itself"
    hf_config = transformers.GPT2Config.from_dict(ours.config.to_dict())
    hf_config._attn_implementation = "eager"
    hf = transformers.GPT2LMHeadModel(hf_config).to(ours.dtype)
    hf.load_state_dict(ours.state_dict())
    return hf.eval(), "gpt2attn's loaded weights (it cannot read this source format itself)"


@torch.no_grad()
def compare(ours, reference, input_ids: Tensor, tol: float | None = None, hf_source: str = "") -> ParityReport:
    """Run both models on input_ids (B, T) and compare every hidden state, attention and logit."""
    a = ours(input_ids, output_hidden_states=True, output_attentions=True)
    b = reference(input_ids, output_hidden_states=True, output_attentions=True)
    tol = tol if tol is not None else DEFAULT_TOL.get(ours.dtype, 1e-4)
    n_layer = len(a.attentions)
    rows = [Row("embedding", max_abs(a.hidden_states[0] - b.hidden_states[0]), max_abs(b.hidden_states[0]))]
    for i in range(n_layer):
        # hidden_states[i + 1] is block i's output (the last one after ln_f, in both libraries).
        hidden_a, hidden_b = a.hidden_states[i + 1], b.hidden_states[i + 1]
        attn = max_abs(a.attentions[i] - b.attentions[i])
        rows.append(Row(f"layer {i}", max_abs(hidden_a - hidden_b), max_abs(hidden_b), attn))
    rows.append(Row("logits", max_abs(a.logits - b.logits), max_abs(b.logits)))
    ours_tokens = a.logits.argmax(-1)  # (B, T)
    agreement = (ours_tokens == b.logits.argmax(-1)).float().mean().item()
    # Our pick loses in the reference by `gap`: within the logits tolerance it is a near-tie
    # that rounding may flip (common in half precision), beyond it a real disagreement.
    gap = b.logits.max(-1).values - b.logits.gather(-1, ours_tokens[..., None])[..., 0]  # (B, T)
    flips = int((gap.float() > tol * max(1.0, rows[-1].scale)).sum())
    return ParityReport(rows, agreement, flips, tol, hf_source)


def max_abs(t: Tensor) -> float:
    return t.detach().double().abs().max().item()


def tokenize(folder: Path, text: str) -> list[int]:
    """Token ids of text with the tokenizer files in folder (gpt2attn.tokenizer)."""
    names = ("vocab.json", "merges.txt", "tokenizer.json", "encoder.json", "vocab.bpe")
    if not folder.is_dir() or not any((folder / n).exists() for n in names):
        raise ValueError(f"--text needs tokenizer files (vocab.json + merges.txt) in {folder}; use --tokens N instead")
    from .tokenizer import load_tokenizer

    ids = load_tokenizer(folder).encode(text)
    return list(getattr(ids, "ids", ids))
