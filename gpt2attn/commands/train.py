"""`gpt2attn train --config FILE [--key=value ...]`: train or fine-tune a GPT-2."""

from __future__ import annotations

import os

HELP = "train or fine-tune a GPT-2 (TOML recipe; any key overridable as --key=value)"
TAKES_OVERRIDES = True


def add_arguments(parser) -> None:
    parser.add_argument("--config", help="a packaged recipe by name (shakespeare_char_cpu, shakespeare_char_default) "
                        "or the path of a TOML file")
    parser.epilog = (
        "Every key of the recipe can be overridden: --data=PATH --out_dir=DIR --max_iters=500 "
        "--init_from=gpt2 --dtype=bfloat16 --compile --resume. Under torchrun it runs DDP (--fsdp for FSDP)."
    )


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
