"""One module per `gpt2attn` subcommand; see gpt2attn/cli.py.

The top of gpt2attn (only cli.py imports these): each module defines HELP, add_arguments(parser)
and run(args). cli.py imports every one to build the parser, so their top-level imports and
add_arguments reach only modules that import no torch (shipped.py, files.py, training/config.py,
this package); each imports the library it drives inside run(). `gpt2attn --help` thus stays fast
(gpt2attn/__init__.py imports its names on first use; tests/project/test_import_graph.py holds this).

    generate.py   continue a prompt, streaming     train.py   training.train on a TOML recipe
    convert.py    any checkpoint -> an HF folder   parity.py  layer by layer against transformers
    attention.py  one layer's attention, PNG/JSON  export.py  ONNX, with its check
"""

from __future__ import annotations

from pathlib import Path


def model_folder(src: str | Path) -> Path:
    """A --model argument: a folder (local, or a hub name's cached one), or a GGUF file, which
    carries its tokenizer. Other weights files are refused: their tokenizer is not beside them."""
    from ..formats import gguf
    from ..hub import resolve

    path = resolve(src)
    if not path.is_dir() and not gguf.detect(path):
        raise ValueError(f"--model {src} is a file; give the model's folder (config.json, weights, tokenizer "
                         f"files) or a .gguf file")
    return path


def load_tokenizer_of(src: Path):
    """The tokenizer of a model_folder(): a GGUF file's embedded one, or the folder's files."""
    from ..formats import gguf
    from ..tokenizer import load_tokenizer

    if gguf.detect(src):
        tokenizer = gguf.tokenizer_of(src)
        if tokenizer is None:
            raise ValueError(f"{src}: the GGUF file holds no tokenizer (tokenizer.ggml.tokens)")
        return tokenizer
    return load_tokenizer(src)
