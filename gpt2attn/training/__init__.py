"""Training: `train(load_config("recipe.toml", ["--max_iters=100"]))` or `gpt2attn train`."""

from .config import TrainConfig, load_config
from .data import TokenData, prepare_data
from .loop import latest_checkpoint, lr_at, read_metrics, train

__all__ = ["TrainConfig", "TokenData", "latest_checkpoint", "load_config", "lr_at", "prepare_data", "read_metrics", "train"]
