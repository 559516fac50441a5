"""TrainConfig: every setting of `gpt2attn train`, read from TOML and `--key=value` overrides."""

from __future__ import annotations

import tomllib
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from ..shipped import configs_dir


@dataclass
class TrainConfig:
    # data
    data: str = ""  # a text file, or a folder whose *.txt files are joined
    tokenizer: str = "char"  # "char", or a folder / tokenizer.json (GPT-2 BPE); "" = init_from's
    val_fraction: float = 0.1  # the last part of the text is the validation split
    out_dir: str = "out"
    # model: init_from is "scratch" or any from_pretrained source (folder, hub name, ckpt)
    init_from: str = "scratch"
    resume: bool = False  # continue from out_dir's latest checkpoint
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    block_size: int = 64
    dropout: float = 0.0
    # optimisation; gradient_accumulation_steps counts micro-batches of all processes together
    batch_size: int = 12
    gradient_accumulation_steps: int = 1
    max_iters: int = 2000
    learning_rate: float = 1e-3
    min_lr: float = 1e-4
    warmup_iters: int = 100
    lr_decay_iters: int = 2000
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0  # 0 turns clipping off
    # evaluation, logging, checkpoints
    eval_interval: int = 250  # also the checkpoint interval
    eval_iters: int = 20
    log_interval: int = 10
    # system
    device: str = "auto"  # auto, cpu, cuda, cuda:1, mps
    dtype: str = "float32"  # float32, bfloat16, float16 (autocast), or auto: bfloat16 where the device has it
    compile: bool = False
    gradient_checkpointing: bool = False
    fsdp: bool = False  # under torchrun: shard with FSDP instead of DDP
    seed: int = 1337
    progress: bool = True  # tqdm bar
    plot: bool = True  # loss.png at the end

    def validate(self) -> None:
        for name in ("learning_rate", "n_layer", "n_head", "n_embd", "block_size", "batch_size", "gradient_accumulation_steps",
                     "eval_interval", "eval_iters", "log_interval"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_iters <= 0 or self.warmup_iters < 0:
            raise ValueError(f"max_iters must be positive and warmup_iters >= 0, got {self.max_iters}, {self.warmup_iters}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.dtype not in ("float32", "bfloat16", "float16", "auto"):
            raise ValueError(f"dtype must be float32, bfloat16, float16 or auto, got {self.dtype!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if self.min_lr > self.learning_rate:
            raise ValueError(f"min_lr ({self.min_lr}) is above learning_rate ({self.learning_rate})")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def packaged_recipes() -> list[str]:
    """Names of the training recipes that ship with gpt2attn (configs/train/*.toml)."""
    return sorted(p.stem for p in (configs_dir() / "train").glob("*.toml"))


def find_recipe(name_or_path: str | Path) -> Path:
    """A recipe file: an existing path as given, else a packaged recipe of that name
    (`shakespeare_char_cpu` or `shakespeare_char_cpu.toml`), from any folder and from a wheel."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    packaged = configs_dir() / "train" / (path.stem + ".toml")
    if path.name == str(name_or_path) and path.suffix in ("", ".toml") and packaged.is_file():
        return packaged
    raise FileNotFoundError(
        f"no config file at {name_or_path}, and no packaged recipe of that name "
        f"(packaged: {', '.join(packaged_recipes())})"
    )


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> TrainConfig:
    """Defaults, then the recipe's keys, then `--key=value` overrides (`--flag` means true).

    `path` is a TOML file or the name of a packaged recipe (see `packaged_recipes()`).
    """
    names = {f.name: f for f in fields(TrainConfig)}
    values: dict[str, Any] = {}
    if path is not None:
        path = find_recipe(path)
        try:
            table = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: not valid TOML ({e})") from None
        for key, value in table.items():
            if key not in names:
                raise ValueError(f"{path}: unknown key {key!r}; known keys: {', '.join(names)}")
            values[key] = _coerce(key, value, names[key].type)
    for arg in overrides:
        if not arg.startswith("--"):
            raise ValueError(f"unexpected argument {arg!r}: overrides look like --key=value")
        key, sep, text = arg[2:].partition("=")
        if key not in names:
            raise ValueError(f"unknown setting --{key}; known settings: {', '.join(names)}")
        values[key] = _coerce(key, text if sep else "true", names[key].type)
    config = TrainConfig(**values)
    config.validate()
    return config


def _coerce(key: str, value: Any, annotation: str) -> Any:
    """A TOML value or command-line string as the field's type (bool, int, float or str)."""
    kind = annotation if isinstance(annotation, str) else annotation.__name__
    if kind == "bool":
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "1", "yes"):
            return True
        if str(value).lower() in ("false", "0", "no"):
            return False
    elif kind == "int":
        if not isinstance(value, bool):
            try:
                number = float(value)
                if number == int(number):
                    return int(number)
            except (TypeError, ValueError):
                pass
    elif kind == "float":
        if not isinstance(value, bool):
            try:
                return float(value)
            except (TypeError, ValueError):
                pass
    else:
        return str(value)
    raise ValueError(f"{key} must be {kind}, got {value!r}")
