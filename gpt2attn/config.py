"""GPT2Config: Hugging Face's GPT-2 configuration as a plain dataclass.

Field names and defaults are those of `transformers.GPT2Config`, so an HF `config.json`
round-trips through `from_dict` / `to_dict` unchanged (keys we do not use are kept).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from .files import write_text_atomic

# HF's `attribute_map`: alias -> field.
ALIASES = {
    "hidden_size": "n_embd",
    "max_position_embeddings": "n_positions",
    "num_attention_heads": "n_head",
    "num_hidden_layers": "n_layer",
}

PRESETS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")


def _alias(name: str) -> property:
    """A property that reads and writes the field `name` under another name."""
    return property(lambda self: getattr(self, name), lambda self, value: setattr(self, name, value))


@dataclass
class GPT2Config:
    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None  # MLP width; None means 4 * n_embd
    activation_function: str = "gelu_new"
    resid_pdrop: float = 0.1
    embd_pdrop: float = 0.1
    attn_pdrop: float = 0.1
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    reorder_and_upcast_attn: bool = False
    tie_word_embeddings: bool = True
    use_cache: bool = True
    bos_token_id: int | None = 50256
    eos_token_id: int | list[int] | None = 50256
    pad_token_id: int | None = None
    # Keys of an HF config that no field above holds (summary_*, architectures, torch_dtype, ...),
    # kept so that to_dict() gives back what from_dict() was given.
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError for a configuration no GPT-2 can be built from."""
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPT2Config.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}): "
                f"each head gets n_embd / n_head dimensions"
            )
        if self.n_inner is not None and self.n_inner <= 0:
            raise ValueError(f"GPT2Config.n_inner must be positive or None, got {self.n_inner!r}")

    # HF aliases, readable and writable.
    hidden_size = _alias("n_embd")
    max_position_embeddings = _alias("n_positions")
    num_attention_heads = _alias("n_head")
    num_hidden_layers = _alias("n_layer")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def inner_dim(self) -> int:
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd

    # --- dict / JSON -------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GPT2Config":
        """Build from an HF `config.to_dict()` / `config.json` dict. Unknown keys go to `extra`."""
        model_type = d.get("model_type", "gpt2")
        if model_type != "gpt2":
            raise ValueError(f"config has model_type {model_type!r}; gpt2attn builds only 'gpt2' models")
        names = {f.name for f in fields(cls)} - {"extra"}
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in d.items():
            key = ALIASES.get(key, key)
            if key in names:
                kwargs[key] = value
            elif key not in ("model_type", "extra"):
                extra[key] = value
        extra.update(d.get("extra", {}))
        return cls(**kwargs, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        """An HF-style dict: `transformers.GPT2Config.from_dict` accepts it."""
        d = asdict(self)
        extra = d.pop("extra")
        return {**extra, **d, "model_type": "gpt2"}

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "GPT2Config":
        with open(path, encoding="utf-8") as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(d)

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def to_json_file(self, path: str | os.PathLike) -> None:
        """Write atomically: a temporary file in the same folder, then a rename."""
        write_text_atomic(Path(path), self.to_json_string())

    @classmethod
    def from_preset(cls, name: str) -> "GPT2Config":
        """One of OpenAI's sizes: 'gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl'."""
        name = name.removeprefix("openai-community/")
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
        return cls.from_json_file(_configs_dir() / f"{name}.json")


def _configs_dir() -> Path:
    """`configs/` ships inside the wheel as gpt2attn/configs; in a checkout it is ../configs."""
    packaged = Path(__file__).parent / "configs"
    return packaged if packaged.is_dir() else Path(__file__).parent.parent / "configs"
