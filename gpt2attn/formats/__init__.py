"""The formats GPT-2 weights live in, one module each, behind one small interface:

    NAME      short name ('hf', 'llmc', ...)
    SUFFIXES  destination suffixes that pick this format for writing ('' is a folder)
    detect(path) -> bool
              cheap: the suffix, the first bytes, a folder's file names
    read(path) -> (GPT2Config, state dict with HF GPT2LMHeadModel keys, tokenizer or None)
    write(path, state_dict, config, *, dtype=None, tokenizer=None)
              writable formats only; crash-safe (files.py), nothing written on failure
    weights_file(path) -> Path
              optional: the file to name in errors about the tensors (default: path)

    state_dict.py  what they share: key conventions, a config from shapes, weights-only torch.load
    hf.py          Hugging Face folders and .safetensors / .bin files (also save_pretrained)
    llmc.py        llm.c's gpt2_124M.bin model files (fp32, bf16)
    gguf.py        llama.cpp's GGUF (read F32 ... Q6_K, write f32/f16/bf16/q8_0/q4; tokenizer embedded)
    nanogpt.py     nanoGPT's ckpt.pt (read)
    openai_tf.py   OpenAI's TensorFlow release (read; the bundle reader is tf_checkpoint.py)

FORMATS is the registry: a new format is a new module added there. gpt2attn/loader.py turns what
read() returns into a model; hub names are found by gpt2attn/hub.py before any format is asked.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from . import gguf, hf, llmc, nanogpt, openai_tf

# detect() is asked in this order: llm.c's .bin (its magic) before hf, which takes any other .bin.
FORMATS = (gguf, llmc, nanogpt, openai_tf, hf)


def detect_format(path: str | os.PathLike):
    """The format module that reads `path` (a file or folder); an error naming it if none does."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or folder")
    for fmt in FORMATS:
        if fmt.detect(path):
            return fmt
    if path.is_dir():
        raise FileNotFoundError(f"{path}: no model found (expected config.json and HF weights, or OpenAI's "
                                f"hparams.json and {openai_tf.TF_INDEX})")
    owner = next((fmt for fmt in FORMATS if path.suffix and path.suffix in fmt.SUFFIXES), None)
    if owner is not None:
        with open(path, "rb") as f:
            start = f.read(8)
        raise CheckpointError(path, f"not a {owner.NAME} file, despite its suffix: it starts with {start!r} "
                                    f"(damaged or truncated?)")
    readable = sorted({*hf.FILE_SUFFIXES, *(s for fmt in FORMATS for s in fmt.SUFFIXES if s)})
    suffix = f"suffix {path.suffix!r}" if path.suffix else "no suffix"
    raise CheckpointError(path, f"not a model file gpt2attn reads ({suffix}; it reads "
                                f"{', '.join(readable)} files and model folders)")


def format_for_suffix(path: str | os.PathLike):
    """The format that writes `path`, picked by its suffix: .bin is llm.c, .gguf is GGUF, and a name
    with no suffix, or one that is not all letters ('model.v2'), is an HF folder. A suffix of a
    read-only format, or any other suffix of letters ('.onnx', '.safetensors': a file's name), is an
    error that says what writes such a file, if anything."""
    path = Path(path)
    owners = [fmt for fmt in FORMATS if path.suffix and path.suffix in fmt.SUFFIXES]
    if owners and hasattr(owners[0], "write"):
        return owners[0]
    if not owners and not path.suffix[1:].isalpha():
        return hf
    writable = ", ".join(s for fmt in FORMATS if hasattr(fmt, "write") for s in fmt.SUFFIXES if s)
    if owners:
        why = f"gpt2attn reads {owners[0].NAME} files ({path.suffix}) but does not write them"
    elif path.suffix == ".onnx":
        why = f"ONNX files are written by `gpt2attn export MODEL {path}`, not here"
    elif path.suffix in hf.FILE_SUFFIXES:
        why = (f"a Hugging Face model is written as a folder (config.json, {hf.SAFE_WEIGHTS}, tokenizer files), "
               f"not one {path.suffix} file: name the folder, e.g. {path.with_suffix('')}")
    else:
        why = f"the name looks like a {path.suffix} file, a format gpt2attn does not write"
    raise ValueError(f"{path}: {why}; write {writable} or a folder (Hugging Face)")


def weights_file(fmt, path: Path) -> Path:
    return fmt.weights_file(path) if hasattr(fmt, "weights_file") else path


def save(model, path: str | os.PathLike, dtype: Any = None, tokenizer: Any = None) -> None:
    """Write `model` (a GPT2LMHeadModel) to `path` in the format its suffix picks (format_for_suffix);
    dtype is a name the format knows ('fp32', 'bf16', ...) or None for the model's own."""
    path = Path(path)
    format_for_suffix(path).write(path, model.state_dict(), model.config, dtype=dtype, tokenizer=tokenizer)
