"""Training: `train(load_config("recipe.toml", ["--max_iters=100"]))` or `gpt2attn train`.

Sits above the model and checkpoint files; nothing below imports it.

    config.py       TrainConfig: the recipe's settings, from TOML and `--key=value` overrides
    data.py         text -> token files on disk -> random (x, y) blocks
    distributed.py  one process, DDP or FSDP2 under torchrun
    loop.py         the loop: schedule, evaluation, checkpoints that appear whole, resuming

The names below are imported when first used (gpt2attn/lazy.py): `gpt2attn train --help` reads
config.py (no torch) without importing the loop.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import lazy

# public name -> the module of this package that defines it
_HOMES = {
    "TrainConfig": "config", "find_recipe": "config", "load_config": "config", "packaged_recipes": "config",
    "TokenData": "data", "prepare_data": "data",
    "latest_checkpoint": "loop", "lr_at": "loop", "read_metrics": "loop", "train": "loop",
}
__all__ = [  # written out, for the API docs, which read it from the source
    "TrainConfig", "TokenData", "find_recipe", "latest_checkpoint", "load_config", "lr_at", "packaged_recipes",
    "prepare_data", "read_metrics", "train",
]
__getattr__, __dir__ = lazy.exports(__name__, _HOMES)

if TYPE_CHECKING:  # the same names, for type checkers and the API docs (mkdocstrings), which read the source
    from .config import TrainConfig, find_recipe, load_config, packaged_recipes
    from .data import TokenData, prepare_data
    from .loop import latest_checkpoint, lr_at, read_metrics, train
