"""Training: `train(load_config("recipe.toml", ["--max_iters=100"]))` or `gpt2attn train`.

Sits above the model and checkpoint files; nothing below imports it.

    config.py       TrainConfig: the recipe's settings, from TOML and `--key=value` overrides
    data.py         text -> token files on disk -> random (x, y) blocks
    distributed.py  one process, DDP or FSDP2 under torchrun
    loop.py         the loop: schedule, evaluation, checkpoints that appear whole, resuming
"""

from .config import TrainConfig, find_recipe, load_config, packaged_recipes
from .data import TokenData, prepare_data
from .loop import latest_checkpoint, lr_at, read_metrics, train

__all__ = [
    "TrainConfig", "TokenData", "find_recipe", "latest_checkpoint", "load_config", "lr_at", "packaged_recipes", "prepare_data",
    "read_metrics", "train",
]
