"""OpenAI's TensorFlow release of GPT-2: a folder with hparams.json and model.ckpt.* (a TF tensor
bundle, read without TensorFlow by tf_checkpoint.py beside it). Read only.
"""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from ..config import CONFIG_NAME, GPT2Config
from .tf_checkpoint import load_tf_checkpoint

NAME = "openai_tf"
SUFFIXES = ()  # a folder
TF_INDEX = "model.ckpt.index"


def detect(path: Path) -> bool:
    """A folder with model.ckpt.index and no config.json (an HF folder may keep TF files beside)."""
    return path.is_dir() and (path / TF_INDEX).exists() and not (path / CONFIG_NAME).exists()


def read(path: Path) -> tuple[GPT2Config, dict[str, Tensor], None]:
    config, state = load_tf_checkpoint(path)
    return config, state, None


def weights_file(path: Path) -> Path:
    return path / TF_INDEX
