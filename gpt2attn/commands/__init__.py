"""One module per `gpt2attn` subcommand; see gpt2attn/cli.py."""

from __future__ import annotations

from pathlib import Path


def model_folder(src: str | Path) -> Path:
    """A --model argument as a folder: a local one, or a hub name's cached one (not a weights file)."""
    from ..hub import resolve

    folder = resolve(src)
    if not folder.is_dir():
        raise ValueError(f"--model {src} is a file; give the model's folder (config.json, weights, tokenizer files)")
    return folder
