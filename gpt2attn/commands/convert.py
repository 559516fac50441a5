"""`gpt2attn convert SRC DST`: any checkpoint gpt2attn loads -> a Hugging Face model folder."""

from __future__ import annotations

import shutil
from pathlib import Path

HELP = "convert any checkpoint gpt2attn loads (HF, hub, nanoGPT, OpenAI TF) to an HF folder"

# Tokenizer files copied along; OpenAI's names (TF release) get HF's.
TOKENIZER_FILES = {
    "vocab.json": "vocab.json",
    "merges.txt": "merges.txt",
    "tokenizer.json": "tokenizer.json",
    "tokenizer_config.json": "tokenizer_config.json",
    "special_tokens_map.json": "special_tokens_map.json",
    "generation_config.json": "generation_config.json",
    "encoder.json": "vocab.json",
    "vocab.bpe": "merges.txt",
}


def add_arguments(parser) -> None:
    parser.add_argument(
        "src", help="HF folder, hub name, .safetensors/.bin file, nanoGPT ckpt.pt, or OpenAI TF checkpoint folder"
    )
    parser.add_argument("dst", help="output folder (created; config.json is written last)")
    parser.add_argument("--dtype", choices=["float32", "fp32", "float16", "fp16", "bfloat16", "bf16"],
                        help="store the weights in this dtype (default: as in SRC)")
    parser.add_argument("--max-shard-size", help="split into shards of at most this size, e.g. 500MB")
    parser.add_argument("--bin", action="store_true", help="write pytorch_model.bin instead of safetensors")


def run(args) -> int:
    from tqdm import tqdm

    from ..checkpoint import resolve
    from ..files import write_atomic
    from ..model import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(args.src, dtype=args.dtype)
    dst = Path(args.dst)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {dst}") as bar:
        model.save_pretrained(
            dst, safe_serialization=not args.bin, max_shard_size=args.max_shard_size, progress=bar.update
        )
    src = resolve(args.src) if not Path(args.src).is_file() else Path(args.src).parent
    copied = []
    for name, new_name in TOKENIZER_FILES.items():
        if (src / name).is_file() and not (dst / new_name).exists():
            with open(src / name, "rb") as source:
                write_atomic(dst / new_name, lambda f: shutil.copyfileobj(source, f))
            copied.append(new_name)
    n_params = model.num_parameters()
    print(f"{args.src} -> {dst}: {n_params:,} parameters, {model.dtype}, {total / 1e6:.1f} MB of weights"
          + (f"; copied {', '.join(copied)}" if copied else ""))
    return 0
