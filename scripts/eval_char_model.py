"""Validation loss of a character model as the default model's recipe reports it: the last 10% of
a text (tinyshakespeare from ../shared/data or $GPT2ATTN_SHARED_DATA by default), every character scored once, each with up to n_positions
characters of context (windows of n_positions moved by half of it; after the first window, each
scored character sees at least n_positions / 2 before it).

    python scripts/eval_char_model.py [MODEL_DIR] [--data TEXT]    # default: gpt2attn/default_model
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_common import SHAKESPEARE, read_text_file

from gpt2attn import GPT2LMHeadModel
from gpt2attn.shipped import DEFAULT_MODEL_DIR
from gpt2attn.tokenizer import encode, load_tokenizer

def last_part(ids: torch.Tensor, fraction: float = 0.1) -> torch.Tensor:
    """The validation split: the last `fraction` of a text's ids."""
    return ids[len(ids) - int(len(ids) * fraction) :]


@torch.no_grad()
def validation_loss(model: GPT2LMHeadModel, ids: torch.Tensor, batch_size: int = 32) -> float:
    """Mean next-character cross-entropy over ids[1:], each target scored once."""
    window = model.config.n_positions
    stride = window // 2
    starts = list(range(0, max(len(ids) - window, 0) + 1, stride))
    if starts[-1] + window < len(ids):
        starts.append(len(ids) - window)
    total, count, scored_until = 0.0, 0, 0  # targets ids[1 : scored_until + 1] are done
    for i in range(0, len(starts), batch_size):
        batch = starts[i : i + batch_size]
        x = torch.stack([ids[s : s + window] for s in batch])  # (B, window)
        logprobs = F.log_softmax(model(x).logits.float(), dim=-1)  # (B, window, V)
        for row, s in enumerate(batch):
            first = max(scored_until - s, 0)  # position in the window whose target is new
            targets = ids[s + 1 + first : s + window]
            picked = logprobs[row, first : first + len(targets)].gather(1, targets[:, None])
            total -= picked.sum().item()
            count += len(targets)
            scored_until = s + window - 1
    assert count == len(ids) - 1, (count, len(ids))
    return total / count


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=str(DEFAULT_MODEL_DIR))
    parser.add_argument("--data", default=str(SHAKESPEARE))
    parser.add_argument("--val-fraction", type=float, default=0.1)
    args = parser.parse_args(argv)
    model = GPT2LMHeadModel.from_pretrained(args.model).eval()
    text = read_text_file(Path(args.data))
    ids = torch.tensor(encode(load_tokenizer(args.model), text))
    val = last_part(ids, args.val_fraction)
    loss = validation_loss(model, val)
    print(f"{args.model}: validation loss {loss:.4f} (perplexity {math.exp(loss):.2f}) over the last "
          f"{len(val):,} characters, each scored once with up to {model.config.n_positions} of context")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
