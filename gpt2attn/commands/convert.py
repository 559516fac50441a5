"""`gpt2attn convert SRC DST`: any checkpoint gpt2attn loads -> a Hugging Face model folder, or a file
of another format picked by DST's suffix (gpt2attn.formats.format_for_suffix: .bin is llm.c, .gguf GGUF)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

HELP = "convert any checkpoint gpt2attn loads (HF, hub, llm.c, GGUF, nanoGPT, OpenAI TF) to an HF folder, an llm.c .bin or a .gguf"

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
        "src", help="HF folder, hub name, .safetensors/.bin file (an llm.c .bin is told by its magic number), "
        "nanoGPT ckpt.pt, GGUF file, or OpenAI TF checkpoint folder"
    )
    parser.add_argument("dst", help="output: its suffix picks the format: .bin is an llm.c model file, .gguf a GGUF file "
                        "(llama.cpp; the tokenizer embedded when it is GPT-2's BPE or a character vocabulary of ASCII "
                        "characters, else a note says why not), any other name "
                        "an HF folder (each written beside and swapped in whole: never half a model)")
    parser.add_argument("--dtype", help="store the weights in this dtype (default: as in SRC): HF folder float32/fp32, "
                        "float16/fp16, bfloat16/bf16; llm.c fp32, bf16; GGUF f32, f16 (default), bf16, q8_0, q4 "
                        "(quantize()'s mode q4: Q4_K, Q8_0 where it keeps 8 bits)")
    parser.add_argument("--max-shard-size", help="split into shards of at most this size, e.g. 500MB")
    parser.add_argument("--bin", action="store_true", help="write pytorch_model.bin instead of safetensors")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the model DST already holds (its weights, config and tokenizer files, or the file)")


def is_model_file(name: str) -> bool:
    from ..formats.hf import MODEL_FILE

    return bool(MODEL_FILE.fullmatch(name) or name in TOKENIZER_FILES or OLD_MODEL_FILES.fullmatch(name))


def run(args) -> int:
    from ..formats import format_for_suffix, hf

    fmt = format_for_suffix(args.dst)
    if fmt is not hf:
        return write_file(args, fmt)
    return write_folder(args)


def write_file(args, fmt) -> int:
    """DST is one file of a non-HF format (llm.c's .bin): the model as loaded, cast by the format."""
    from ..hub import resolve
    from ..model import GPT2LMHeadModel
    from . import load_tokenizer_of
    from ..formats import gguf

    dst = Path(args.dst)
    if args.bin or args.max_shard_size:
        raise ValueError(f"--bin and --max-shard-size are for HF folders; {dst} is written as a {fmt.NAME} file")
    if dst.is_dir():
        raise ValueError(f"destination {dst} is a folder; a {fmt.NAME} model is one file")
    if dst.exists() and not args.overwrite:
        raise ValueError(f"{dst} already exists; pass --overwrite to replace it")
    model = GPT2LMHeadModel.from_pretrained(args.src)
    src = resolve(args.src)
    try:  # the source's tokenizer (a folder's files, a GGUF's own), for formats that embed one
        tokenizer = load_tokenizer_of(src) if src.is_dir() or gguf.detect(src) else None
    except (FileNotFoundError, ValueError):
        tokenizer = None
    reason = gguf.why_not_embedded(tokenizer) if fmt is gguf and tokenizer is not None else None
    if reason is not None:
        print(f"note: {dst} is written without the tokenizer: {reason}", file=sys.stderr)
        tokenizer = None
    fmt.write(dst, model.state_dict(), model.config, dtype=args.dtype, tokenizer=tokenizer)
    print(f"{args.src} -> {dst}: {model.num_parameters():,} parameters, {fmt.NAME} file of "
          f"{dst.stat().st_size / 1e6:.1f} MB")
    return 0


def write_folder(args) -> int:
    from tqdm import tqdm

    from ..files import link_or_copy, replace_folder
    from ..formats import gguf
    from ..formats.hf import write_model
    from ..hub import resolve
    from ..model import GPT2LMHeadModel

    dst = Path(args.dst)
    if dst.exists() and not dst.is_dir():
        raise ValueError(f"destination {dst} is a file, not a folder")
    held = sorted(p.name for p in dst.iterdir() if is_model_file(p.name)) if dst.is_dir() else []
    if held and not args.overwrite:
        raise ValueError(f"{dst} already holds a model ({', '.join(held)}); pass --overwrite to replace it")
    model = GPT2LMHeadModel.from_pretrained(args.src, dtype=args.dtype)
    source = resolve(args.src)
    embedded = gguf.tokenizer_of(source) if gguf.detect(source) else None  # a GGUF carries its tokenizer
    src = source if source.is_dir() else source.parent
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    copied = []
    with replace_folder(dst, keep=lambda name: not is_model_file(name)) as folder:
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {dst}") as bar:
            write_model(model, folder, safe_serialization=not args.bin, max_shard_size=args.max_shard_size,
                        progress=bar.update)
        if embedded is not None:
            embedded.save(str(folder / "tokenizer.json"))
            copied.append("tokenizer.json (from the GGUF)")
        else:
            for name, new_name in TOKENIZER_FILES.items():
                if (src / name).is_file() and not (folder / new_name).exists():
                    link_or_copy(src / name, folder / new_name)
                    copied.append(new_name)
    n_params = model.num_parameters()
    print(f"{args.src} -> {dst}: {n_params:,} parameters, {model.dtype}, {total / 1e6:.1f} MB of weights"
          + (f"; copied {', '.join(copied)}" if copied else ""))
    return 0
