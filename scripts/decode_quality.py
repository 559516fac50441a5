"""What each quantize() mode costs in quality, on the shipped character model through the decoding path.

    python scripts/decode_quality.py [--data TEXT]    # default: tinyshakespeare from ../shared/data or $GPT2ATTN_SHARED_DATA

The last 10% of the text, 8 blocks of 128 characters fed one character per forward through the
KV cache (the path generate takes for its new tokens), batch 8. Per mode: the loss relative to
the plain fp32 model's (its forward over whole blocks, no cache), the largest logit difference
from that model's logits over its largest logit, and whether 64 greedy tokens after a
16-character prompt equal the plain model's. Prints a Markdown table with the machine and date.
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_common import SHAKESPEARE, machine_line, read_text_file

from gpt2attn import GPT2LMHeadModel
from gpt2attn.generation import DEFAULT_MODEL_DIR
from gpt2attn.quantize import MODES
from gpt2attn.tokenizer import load_tokenizer

def decoded_logits(model: GPT2LMHeadModel, blocks: torch.Tensor) -> torch.Tensor:
    """Logits (B, T - 1, V) of blocks (B, T), one position per forward through the KV cache."""
    logits, past = [], None
    for t in range(blocks.size(1) - 1):
        out = model(blocks[:, t : t + 1], past_key_values=past, use_cache=True)
        logits.append(out.logits)
        past = out.past_key_values
    return torch.cat(logits, dim=1)


@torch.no_grad()
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=SHAKESPEARE)
    args = parser.parse_args(argv)
    text = read_text_file(args.data)
    tok = load_tokenizer(DEFAULT_MODEL_DIR)
    ids = torch.tensor(tok.encode(text[int(len(text) * 0.9) :]).ids)
    blocks = ids[: 8 * 128].view(8, 128)
    prompt = blocks[:1, :16]

    plain = GPT2LMHeadModel.from_pretrained(DEFAULT_MODEL_DIR).eval()
    reference = plain(blocks[:, :-1]).logits  # (8, 127, V)
    loss_ref = F.cross_entropy(reference.flatten(0, 1), blocks[:, 1:].flatten()).item()
    tokens_ref = plain.generate(prompt, max_new_tokens=64, eos_token_id=None)
    print(machine_line() + f"; {datetime.date.today().isoformat()}")
    print(f"| mode | loss vs fp32 ({loss_ref:.5f}) | largest logit difference / largest logit | 64 greedy tokens = fp32's |")
    print("|---|---|---|---|")
    for mode in MODES:
        model = GPT2LMHeadModel.from_pretrained(DEFAULT_MODEL_DIR, quantize=mode).eval()
        logits = decoded_logits(model, blocks)
        loss = F.cross_entropy(logits.flatten(0, 1), blocks[:, 1:].flatten()).item()
        diff = ((logits - reference).abs().max() / reference.abs().max()).item()
        same = torch.equal(model.generate(prompt, max_new_tokens=64, eos_token_id=None), tokens_ref)
        print(f"| {mode} | {100 * (loss - loss_ref) / loss_ref:+.3f}% | {diff:.1e} | {'yes' if same else 'no'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
