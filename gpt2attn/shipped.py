"""Where the files gpt2attn ships beside its code are: the default model and configs/.

    DEFAULT_MODEL_DIR  gpt2attn/default_model: the char-level Shakespeare model that `gpt2attn
                       generate`, `attention` and `explore` use when no --model is given
    configs_dir()      the presets (gpt2, gpt2-medium, ...) and training recipes (train/*.toml)

Imports nothing of gpt2attn (nor torch), so the command line's parser can name them.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "default_model"


def configs_dir() -> Path:
    """`configs/` ships inside the wheel as gpt2attn/configs; in a checkout it is ../configs."""
    packaged = Path(__file__).parent / "configs"
    return packaged if packaged.is_dir() else Path(__file__).parent.parent / "configs"
