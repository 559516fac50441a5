"""One module per `gpt2attn` subcommand; see gpt2attn/cli.py.

The top of gpt2attn (only cli.py imports these): each module defines HELP, add_arguments(parser)
and run(args), and imports the library it drives inside run(), so `gpt2attn --help` stays fast.

    generate.py   continue a prompt, streaming     train.py   training.train on a TOML recipe
    convert.py    any checkpoint -> an HF folder   parity.py  layer by layer against transformers
    attention.py  one layer's attention, PNG/JSON  export.py  ONNX, with its check
"""

from __future__ import annotations

from pathlib import Path


def model_folder(src: str | Path) -> Path:
    """A --model argument as a folder: a local one, or a hub name's cached one (not a weights file)."""
    from ..hub import resolve

    folder = resolve(src)
    if not folder.is_dir():
        raise ValueError(f"--model {src} is a file; give the model's folder (config.json, weights, tokenizer files)")
    return folder
