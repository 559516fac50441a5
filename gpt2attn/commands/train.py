"""`gpt2attn train --config FILE [--key=value ...]`: train or fine-tune a GPT-2."""

from __future__ import annotations

import argparse
import os
from dataclasses import fields

HELP = "train or fine-tune a GPT-2 (TOML recipe; any key overridable as --key=value)"
TAKES_OVERRIDES = True


def add_arguments(parser) -> None:
    from ..training.config import packaged_recipes

    parser.add_argument("--config", help=f"a packaged recipe by name ({', '.join(packaged_recipes())}) "
                        "or the path of a TOML file")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter  # the table of settings as it is
    parser.epilog = (
        "settings: every key of a recipe, overridden as --key=value (a bare --flag means true);\n"
        "the recipe's value, else the default below (their meanings: docs/training.md):\n"
        + settings_table()
        + "\nUnder torchrun it runs DDP (--fsdp for FSDP)."
    )


def settings_table() -> str:
    """One line per TrainConfig field: --name=TYPE and its default."""
    from ..training.config import TrainConfig

    rows = [(f"--{f.name}={f.type.upper()}", repr(f.default)) for f in fields(TrainConfig)]
    width = max(len(flag) for flag, _ in rows)
    return "".join(f"  {flag:{width}}  default {default}\n" for flag, default in rows)


def run(args) -> int:
    from ..training import load_config, train

    config = load_config(args.config, args.overrides)
    result = train(config)
    if os.environ.get("RANK", "0") == "0":  # under torchrun, only the main process reports
        print(f"step {result['step']}: train loss {_loss(result['train_loss'])}, val loss {_loss(result['val_loss'])}, "
              f"{result['seconds']:.1f} s; model in {result['model_dir']}")
    return 0


def _loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"
