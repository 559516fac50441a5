"""`gpt2attn convert SRC DST`: any checkpoint gpt2attn loads -> a Hugging Face model folder."""

from __future__ import annotations

import re
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
# Files of a model already in DST (HF weights and config, tokenizer, OpenAI TF release): --overwrite
# replaces them all, so that no old tokenizer or TF checkpoint stays beside the new weights.
OLD_MODEL_FILES = re.compile(r"hparams\.json|checkpoint|model\.ckpt\..+|ckpt\.pt")


def add_arguments(parser) -> None:
    parser.add_argument(
        "src", help="HF folder, hub name, .safetensors/.bin file, nanoGPT ckpt.pt, or OpenAI TF checkpoint folder"
    )
    parser.add_argument("dst", help="output folder (written beside and swapped in whole: never half a model)")
    parser.add_argument("--dtype", choices=["float32", "fp32", "float16", "fp16", "bfloat16", "bf16"],
                        help="store the weights in this dtype (default: as in SRC)")
    parser.add_argument("--max-shard-size", help="split into shards of at most this size, e.g. 500MB")
    parser.add_argument("--bin", action="store_true", help="write pytorch_model.bin instead of safetensors")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the model DST already holds (its weights, config and tokenizer files)")


def is_model_file(name: str) -> bool:
    from ..formats.hf import MODEL_FILE

    return bool(MODEL_FILE.fullmatch(name) or name in TOKENIZER_FILES or OLD_MODEL_FILES.fullmatch(name))


def run(args) -> int:
    from tqdm import tqdm

    from ..formats.hf import write_model
    from ..files import link_or_copy, replace_folder
    from ..hub import resolve
    from ..model import GPT2LMHeadModel

    dst = Path(args.dst)
    if dst.exists() and not dst.is_dir():
        raise ValueError(f"destination {dst} is a file, not a folder")
    held = sorted(p.name for p in dst.iterdir() if is_model_file(p.name)) if dst.is_dir() else []
    if held and not args.overwrite:
        raise ValueError(f"{dst} already holds a model ({', '.join(held)}); pass --overwrite to replace it")
    model = GPT2LMHeadModel.from_pretrained(args.src, dtype=args.dtype)
    src = resolve(args.src) if not Path(args.src).is_file() else Path(args.src).parent
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    copied = []
    with replace_folder(dst, keep=lambda name: not is_model_file(name)) as folder:
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {dst}") as bar:
            write_model(model, folder, safe_serialization=not args.bin, max_shard_size=args.max_shard_size,
                        progress=bar.update)
        for name, new_name in TOKENIZER_FILES.items():
            if (src / name).is_file() and not (folder / new_name).exists():
                link_or_copy(src / name, folder / new_name)
                copied.append(new_name)
    n_params = model.num_parameters()
    print(f"{args.src} -> {dst}: {n_params:,} parameters, {model.dtype}, {total / 1e6:.1f} MB of weights"
          + (f"; copied {', '.join(copied)}" if copied else ""))
    return 0
