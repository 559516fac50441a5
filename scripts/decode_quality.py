"""What each quantize() mode costs in quality, on the shipped character model through the decoding path.

    python scripts/decode_quality.py [--data TEXT] [--llama-quantize PATH [--llama-types q4_K_M,q4_0]]
    # default data: tinyshakespeare from ../shared/data or $GPT2ATTN_SHARED_DATA

The last 10% of the text, every whole block of 128 characters (871 of tinyshakespeare's), fed one
character per forward through the KV cache (the path generate takes for its new tokens), batch 8.
Per mode: the loss relative to the plain fp32 model's (its forward over whole blocks, no cache),
with the standard error of that difference over the blocks (each block's mean difference taken as
one sample: what tells two modes' losses apart); the largest logit difference from that model's
logits over its largest logit; and whether 64 greedy tokens after a 16-character prompt equal the
plain model's. Prints a Markdown table with the machine and date.

With --llama-quantize (llama.cpp's binary), a row for each of --llama-types (default q4_K_M): the
model written as an f32 GGUF by gpt2attn, quantized to that type by llama.cpp, read back through
gpt2attn's GGUF reader (its weights dequantized to fp32) and decoded as a plain fp32 model:
llama.cpp's 4-bit weights, the bar for q4 (q4_K_M, the mix q4 follows, and q4_0, the type
llama.cpp decodes fastest).
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_common import SHAKESPEARE, machine_line, read_text_file

from gpt2attn import GPT2LMHeadModel
from gpt2attn.quantize import MODES
from gpt2attn.shipped import DEFAULT_MODEL_DIR
from gpt2attn.tokenizer import load_tokenizer

BATCH = 8  # blocks decoded side by side


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
    parser.add_argument("--llama-quantize", help="path of llama.cpp's llama-quantize: add a row for each of --llama-types")
    parser.add_argument("--llama-types", default="q4_K_M",
                        help="comma-separated llama.cpp types llama-quantize makes for their rows (default q4_K_M, "
                             "the bar for q4; q4_0 is llama.cpp's fastest to decode)")
    args = parser.parse_args(argv)
    text = read_text_file(args.data)
    tok = load_tokenizer(DEFAULT_MODEL_DIR)
    ids = torch.tensor(tok.encode(text[int(len(text) * 0.9) :]).ids)
    if ids.numel() < 2 * 128:
        parser.error(f"{args.data}: its last 10% holds {ids.numel()} characters; the losses need two blocks of 128")
    blocks = ids[: ids.numel() // 128 * 128].view(-1, 128)  # (n, 128)
    prompt = blocks[:1, :16]

    plain = GPT2LMHeadModel.from_pretrained(DEFAULT_MODEL_DIR).eval()
    reference = torch.cat([plain(b[:, :-1]).logits for b in blocks.split(BATCH)])  # (n, 127, V)
    losses_ref = block_losses(reference, blocks)
    loss_ref = losses_ref.mean().item()
    tokens_ref = plain.generate(prompt, max_new_tokens=64, eos_token_id=None)
    print(machine_line() + f"; {datetime.date.today().isoformat()}")
    print(f"{blocks.size(0)} blocks of 128 characters")
    print(f"| mode | loss vs fp32 ({loss_ref:.5f}) | largest logit difference / largest logit | 64 greedy tokens = fp32's |")
    print("|---|---|---|---|")
    rows = [(mode, lambda mode=mode: GPT2LMHeadModel.from_pretrained(DEFAULT_MODEL_DIR, quantize=mode))
            for mode in MODES]
    tmp = tempfile.TemporaryDirectory()
    if args.llama_quantize:
        rows += [(f"llama.cpp {kind} (read as fp32)",
                  lambda kind=kind: llama_quantized(plain, args.llama_quantize, Path(tmp.name), kind))
                 for kind in args.llama_types.split(",")]
    for name, load in rows:
        model = load().eval()
        logits = torch.cat([decoded_logits(model, b) for b in blocks.split(BATCH)])
        gaps = block_losses(logits, blocks) - losses_ref  # (n,)
        error = gaps.std().item() / gaps.numel() ** 0.5
        diff = ((logits - reference).abs().max() / reference.abs().max()).item()
        same = torch.equal(model.generate(prompt, max_new_tokens=64, eos_token_id=None), tokens_ref)
        gap = round(100 * gaps.mean().item() / loss_ref, 3) + 0.0  # + 0.0: no "-0.000"
        print(f"| {name} | {gap:+.3f}% ± {100 * error / loss_ref:.3f}% | {diff:.1e} "
              f"| {'yes' if same else 'no'} |")
    tmp.cleanup()
    return 0


def block_losses(logits: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Each block's mean next-character loss (n,) from its logits (n, 127, V)."""
    return F.cross_entropy(logits.transpose(1, 2), blocks[:, 1:], reduction="none").mean(dim=1)


def llama_quantized(plain: GPT2LMHeadModel, llama_quantize: str, folder: Path, kind: str) -> GPT2LMHeadModel:
    """The model's weights as llama.cpp's `kind` (q4_K_M, q4_0, ...), made by llama-quantize from
    gpt2attn's f32 GGUF and read back through gpt2attn's GGUF reader."""
    f32, quantized = folder / "model-f32.gguf", folder / f"model-{kind}.gguf"
    if not f32.exists():
        plain.save_pretrained(folder / "hf")
        load_tokenizer(DEFAULT_MODEL_DIR).save(str(folder / "hf" / "tokenizer.json"))
        subprocess.run([sys.executable, "-m", "gpt2attn", "convert", str(folder / "hf"), str(f32), "--dtype", "f32"],
                       check=True, capture_output=True)
    subprocess.run([llama_quantize, str(f32), str(quantized), kind.upper()], check=True, capture_output=True)
    return GPT2LMHeadModel.from_pretrained(quantized)


if __name__ == "__main__":
    raise SystemExit(main())
