"""Parity report: one checkpoint in gpt2attn and in `transformers`, compared layer by layer; or two
sources (an fp32 original and its bf16 or quantized copy, say), both in gpt2attn, to see where and
how far the second departs from the first.

In float32 a difference passes when max|ours - theirs| <= tol * max(1, max|theirs|): the
tolerance is absolute for values near 1 and relative for large activations (GPT-2's residual
stream reaches the thousands).

In float16/bfloat16 every intermediate is rounded, so a fixed tolerance either fails faithful
models or passes wrong ones (a 5% error in the attention scale hides under 0.1). There both
libraries are judged against transformers run in float32 on the same (rounded) weights: our
error may be at most `tol` times transformers' own rounding error (default 1.5), row by row.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .config import CONFIG_NAME
from .hub import resolve

FP32_TOL = 1e-4  # fp32 kernels differ in summation order only
HALF_FACTOR = 1.5  # half precision: at most this multiple of transformers' own rounding error
HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclass
class Row:
    name: str
    diff: float  # max|ours - reference|
    allowed: float
    attention_diff: float | None = None
    attention_allowed: float | None = None

    @property
    def ok(self) -> bool:
        return self.diff <= self.allowed and (self.attention_diff is None or self.attention_diff <= self.attention_allowed)


@dataclass
class ParityReport:
    rows: list[Row]  # embeddings, each layer, logits
    greedy_agreement: float  # fraction of positions whose argmax token agrees
    greedy_flips: int  # disagreements that are not near-ties (see compare)
    rule: str  # how `allowed` was set
    reference: str  # what was compared with: "transformers loaded ...", or the second source
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.greedy_flips == 0 and all(row.ok for row in self.rows)

    def format(self) -> str:
        lines = [self.reference, *self.notes, ""]
        lines.append(f"{'':<10} {'max|diff| hidden':>17} {'allowed':>10} {'max|diff| attn':>15} {'allowed':>10}  ok")
        for row in self.rows:
            attn = (f"{row.attention_diff:15.3e} {row.attention_allowed:10.3e}" if row.attention_diff is not None
                    else f"{'-':>15} {'-':>10}")
            lines.append(f"{row.name:<10} {row.diff:17.3e} {row.allowed:10.3e} {attn}  {'yes' if row.ok else 'NO'}")
        lines.append(
            f"greedy next-token agreement: {self.greedy_agreement:.1%} ({self.greedy_flips} flips beyond near-ties)"
        )
        lines.append(f"{'PASS' if self.passed else 'FAIL'} ({self.rule})")
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
    folder = resolve(src) if not isinstance(src, dict) else None
    if folder is not None and folder.is_dir() and (folder / CONFIG_NAME).exists():
        hf = transformers.GPT2LMHeadModel.from_pretrained(folder, dtype=dtype, attn_implementation="eager")
        return hf.eval(), f"transformers loaded {folder} itself"
    hf_config = transformers.GPT2Config.from_dict(ours.config.to_dict())
    hf_config._attn_implementation = "eager"
    hf = transformers.GPT2LMHeadModel(hf_config).to(ours.dtype)
    hf.load_state_dict(ours.state_dict())
    return hf.eval(), "transformers loaded gpt2attn's loaded weights (it cannot read this source format itself)"


@torch.no_grad()
def compare(ours, reference, input_ids: Tensor, tol: float | None = None, described: str = "",
            reference_name: str = "transformers") -> ParityReport:
    """Run both models on input_ids (B, T) and compare every hidden state, attention and logit.
    reference is transformers' model or a second gpt2attn one (reference_name says which)."""
    if tol is not None and not tol > 0:
        raise ValueError(f"the tolerance must be > 0, got {tol}")

    def outputs(model):  # embedding, each block (the last after ln_f), logits; attentions beside them
        out = model(input_ids, output_hidden_states=True, output_attentions=True, return_dict=True)
        return [*out.hidden_states, out.logits], [None, *out.attentions, None]

    (a, a_attn), (b, b_attn) = outputs(ours), outputs(reference)
    if ours.dtype in HALF_DTYPES:  # measured against transformers in fp32 on the same weights
        factor = tol if tol is not None else HALF_FACTOR
        target, target_attn = outputs(copy.deepcopy(reference).float())
        owner = reference_name + ("'" if reference_name.endswith("s") else "'s")
        rule = (f"{ours.dtype}: error vs {reference_name} in float32 at most {factor:g}x {owner} own "
                f"error in {ours.dtype}, + {FP32_TOL:g} relative")

        def allowed(theirs: Tensor, exact: Tensor) -> float:
            return factor * max_abs(theirs - exact) + FP32_TOL * max(1.0, max_abs(exact))
    else:
        tol = tol if tol is not None else FP32_TOL
        target, target_attn = b, b_attn
        rule = f"tolerance {tol:g}, relative to max(1, max|ref|)"

        def allowed(theirs: Tensor, exact: Tensor) -> float:
            return tol * max(1.0, max_abs(theirs))

    names = ["embedding", *(f"layer {i}" for i in range(len(a) - 2)), "logits"]
    rows = [Row(name, max_abs(a[i] - target[i]), allowed(b[i], target[i])) for i, name in enumerate(names)]
    for i, row in enumerate(rows[1:-1], start=1):
        row.attention_diff = max_abs(a_attn[i] - target_attn[i])
        row.attention_allowed = allowed(b_attn[i], target_attn[i])
    ours_tokens = a[-1].argmax(-1)  # (B, T)
    agreement = (ours_tokens == b[-1].argmax(-1)).float().mean().item()
    # Our pick loses in the reference by `gap`: within the logits tolerance it is a near-tie
    # that rounding may flip (common in half precision), beyond it a real disagreement.
    gap = b[-1].max(-1).values - b[-1].gather(-1, ours_tokens[..., None])[..., 0]  # (B, T)
    flips = int((gap.float() > rows[-1].allowed).sum())
    return ParityReport(rows, agreement, flips, rule, described)


def check_same_shape(a, b, a_name: str, b_name: str) -> None:
    """Two models whose hidden states can be compared: the same sizes, named when they differ."""
    fields = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")
    differ = [f"{k} {getattr(a.config, k)} vs {getattr(b.config, k)}" for k in fields
              if getattr(a.config, k) != getattr(b.config, k)]
    if differ:
        raise ValueError(f"{a_name} and {b_name} are models of different sizes ({'; '.join(differ)}): "
                         f"parity compares two copies of one model")


def max_abs(t: Tensor) -> float:
    return t.detach().double().abs().max().item()


def tokenize(folder: Path, text: str) -> list[int]:
    """Token ids of text with the tokenizer files in folder (gpt2attn.tokenizer)."""
    names = ("vocab.json", "merges.txt", "tokenizer.json", "encoder.json", "vocab.bpe")
    if not folder.is_dir() or not any((folder / n).exists() for n in names):
        raise ValueError(f"--text needs tokenizer files (vocab.json + merges.txt) in {folder}; use --tokens N instead")
    from .tokenizer import encode, load_tokenizer

    return encode(load_tokenizer(folder), text)
