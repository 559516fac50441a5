"""GPT2Config: Hugging Face's GPT-2 configuration as a plain dataclass.

Field names, defaults and aliases are those of `transformers.GPT2Config`, so an HF `config.json`
round-trips through `from_dict` / `to_dict` unchanged. As in transformers, the constructor takes
any keyword: keys no GPT-2 config has are kept as attributes (with a warning, except the keys
every transformers config may carry, such as `torch_dtype` or `transformers_version`).
"""

from __future__ import annotations

import copy
import inspect
import json
import math
import os
import warnings
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar

import torch

from .errors import CheckpointError, read_json_file
from .files import write_text_atomic
from .hub import resolve  # hub names go through huggingface_hub's cache, as for models
from .shipped import configs_dir

CONFIG_NAME = "config.json"

# HF's `attribute_map`: alias -> field.
ALIASES = {
    "hidden_size": "n_embd",
    "max_position_embeddings": "n_positions",
    "num_attention_heads": "n_head",
    "num_hidden_layers": "n_layer",
}

# The largest value each size may take: gpt2-xl (48 layers, 1600 wide, 25 heads, 50257 tokens, 1024
# positions) with wide headroom. A file declaring more is refused before anything is built or
# allocated (docs/hostile-files.md).
LIMITS = {
    "vocab_size": 2**21,  # 2,097,152 tokens (gpt2: 50257)
    "n_positions": 2**20,  # 1,048,576 positions (gpt2: 1024)
    "n_embd": 2**16,  # 65,536 wide (gpt2-xl: 1600)
    "n_layer": 256,  # (gpt2-xl: 48)
    "n_head": 2**10,  # 1024 heads (gpt2-xl: 25)
    "n_inner": 2**18,  # 262,144 (4 * the widest n_embd; gpt2-xl: 6400)
    "num_labels": 2**16,  # 65,536 labels of a classification head
}
GPT2_XL = {"vocab_size": 50257, "n_positions": 1024, "n_embd": 1600, "n_layer": 48, "n_head": 25, "n_inner": 6400,
           "num_labels": 2}


def check_limit(name: str, value: int) -> None:
    """Raise ValueError naming the field when `value` exceeds LIMITS[name]."""
    if value > LIMITS[name]:
        raise ValueError(f"GPT2Config.{name} is {value}, above gpt2attn's limit of {LIMITS[name]} "
                         f"(gpt2-xl has {GPT2_XL[name]}; see docs/hostile-files.md)")


PRESETS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
SUMMARY_TYPES = ("last", "first", "mean", "cls_index", "attn")
PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")

# Keys any transformers config may hold (PretrainedConfig's, from 4.x and 5.x, generation settings
# that older configs stored, GPT-2's old n_ctx): kept as attributes without a warning.
COMMON_KEYS = frozenset({
    "transformers_version", "_name_or_path", "name_or_path", "_commit_hash", "_attn_implementation",
    "attn_implementation", "torch_dtype", "dtype", "use_bfloat16", "torchscript", "tf_legacy_loss",
    "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder", "cross_attention_hidden_size",
    "tie_encoder_decoder", "pruned_heads", "finetuning_task", "tokenizer_class", "prefix",
    "sep_token_id", "decoder_start_token_id", "task_specific_params", "gradient_checkpointing", "n_ctx",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens",
})


def _alias(name: str) -> property:
    """A property that reads and writes the field `name` under another name."""
    return property(lambda self: getattr(self, name), lambda self, value: setattr(self, name, value))


def _default_labels() -> dict[int, str]:
    return {0: "LABEL_0", 1: "LABEL_1"}


@dataclass(init=False)
class GPT2Config:
    model_type: ClassVar[str] = "gpt2"
    sub_configs: ClassVar[dict[str, type]] = {}  # GPT-2 nests no other config
    base_config_key: ClassVar[str] = ""
    # What transformers' PreTrainedConfig answers for every model, read by its generation code,
    # pipelines, TRL and PEFT; a config may set them (they are then saved with it).
    is_encoder_decoder = False
    chunk_size_feed_forward = 0
    dtype = None  # the weights' dtype as a checkpoint records it ("float32" in config.json)
    base_model_tp_plan: ClassVar[dict | None] = None  # no tensor-parallel plan
    base_model_pp_plan: ClassVar[dict | None] = None
    base_model_ep_plan: ClassVar[dict | None] = None

    # the architecture
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
    add_cross_attention: bool = False
    tie_word_embeddings: bool = True
    # tokens
    bos_token_id: int | None = 50256
    eos_token_id: int | list[int] | None = 50256
    pad_token_id: int | None = None
    # task heads: num_labels is len(id2label), as in transformers
    id2label: dict[int, str] = field(default_factory=_default_labels)
    label2id: dict[str, int] = field(default_factory=lambda: {v: k for k, v in _default_labels().items()})
    problem_type: str | None = None  # one of PROBLEM_TYPES, or None to choose from the labels
    classifier_dropout: float | None = None  # None: resid_pdrop
    summary_type: str = "cls_index"  # GPT2DoubleHeadsModel's multiple-choice head
    summary_use_proj: bool = True
    summary_activation: str | None = None
    summary_proj_to_labels: bool = True
    summary_first_dropout: float = 0.1
    # forward's defaults
    use_cache: bool = True
    output_attentions: bool = False
    output_hidden_states: bool = False
    return_dict: bool = True
    architectures: list[str] | None = None  # model classes, as save_pretrained writes them

    def __init__(self, **kwargs: Any) -> None:
        for f in fields(self):
            setattr(self, f.name, f.default_factory() if f.default is MISSING else f.default)
        self._attn_implementation = None  # None: chosen when a model is built (GPT2PreTrainedModel)
        model_type = kwargs.pop("model_type", "gpt2")
        if model_type != "gpt2":
            raise ValueError(f"config has model_type {model_type!r}; gpt2attn builds only 'gpt2' models")
        num_labels = kwargs.pop("num_labels", None)
        for key in ("attn_implementation", "_attn_implementation"):
            value = kwargs.pop(key, None)
            if value is not None:
                self._attn_implementation = value
        unknown = []
        for key, value in kwargs.items():
            key = ALIASES.get(key, key)
            if key not in _FIELDS and key not in COMMON_KEYS:
                unknown.append(key)
            self._set(key, value)
        if unknown:
            warnings.warn(f"GPT2Config got keys no GPT-2 config has, kept as attributes: {', '.join(unknown)}", stacklevel=2)
        if "id2label" in kwargs:
            self.id2label = _int_keys(self.id2label)
            if "label2id" not in kwargs and isinstance(self.id2label, dict):
                self.label2id = {label: i for i, label in self.id2label.items()}
            if num_labels is not None and num_labels != len(self.id2label):
                raise ValueError(f"GPT2Config: num_labels={num_labels!r} disagrees with id2label, which has {len(self.id2label)} labels")
        elif num_labels is not None:
            self.num_labels = num_labels
        self.validate()

    def _set(self, key: str, value: Any) -> None:
        """Set a field, an alias or an extra key; refuse names of methods and computed properties."""
        attr = getattr(type(self), key, None)
        if not isinstance(key, str) or (key.startswith("__") and key.endswith("__")):
            raise ValueError(f"GPT2Config: {key!r} cannot be set: not a config key")
        if key in ("dtype", "torch_dtype"):  # kept as a torch dtype under `dtype`, as transformers 5 keeps it
            key, value = "dtype", as_torch_dtype(value)
        elif key not in _FIELDS and (callable(attr) or (isinstance(attr, property) and attr.fset is None)):
            raise ValueError(f"GPT2Config: {key!r} cannot be set: it is computed or a method")
        setattr(self, key, value)

    def validate(self) -> None:
        """Raise ValueError naming the field for a value no GPT-2 config may hold."""
        check_config(self)

    _name_or_path = ""  # where from_pretrained read the model from (not saved, as in transformers)

    @property
    def name_or_path(self) -> str:
        """The folder, file or hub name from_pretrained read this config's model from ("" otherwise)."""
        return self._name_or_path

    @name_or_path.setter
    def name_or_path(self, value: str) -> None:
        self._name_or_path = str(value)

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """transformers 4's name for `dtype`."""
        return self.dtype

    @torch_dtype.setter
    def torch_dtype(self, value: Any) -> None:
        self.dtype = as_torch_dtype(value)

    # HF aliases, readable and writable.
    hidden_size = _alias("n_embd")
    max_position_embeddings = _alias("n_positions")
    num_attention_heads = _alias("n_head")
    num_hidden_layers = _alias("n_layer")

    @property
    def num_labels(self) -> int:
        return len(self.id2label)

    @num_labels.setter
    def num_labels(self, n: int) -> None:
        if not is_int(n) or n < 1:
            raise ValueError(f"GPT2Config.num_labels must be a positive integer, got {n!r}")
        check_limit("num_labels", n)
        if n != len(self.id2label):
            self.id2label = {i: f"LABEL_{i}" for i in range(n)}
            self.label2id = {label: i for i, label in self.id2label.items()}

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def inner_dim(self) -> int:
        return self.n_inner if self.n_inner is not None else 4 * self.n_embd

    def get_text_config(self, decoder: bool | None = None, encoder: bool | None = None) -> "GPT2Config":
        """The config of the text part: GPT-2 is all text, so this config itself, as in transformers
        (whose Trainer reads it to align the tokenizer's special tokens with the model)."""
        return self

    @property
    def extra(self) -> dict[str, Any]:
        """The keys that are not GPT-2 fields (dtype, transformers_version, ...)."""
        return {k: v for k, v in vars(self).items() if k not in _FIELDS and k not in NOT_SAVED}

    # --- dict / JSON -------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: dict[str, Any], **kwargs: Any) -> "GPT2Config":
        """Build from an HF `config.to_dict()` / `config.json` dict; kwargs override its keys."""
        if not isinstance(d, dict):
            raise ValueError(f"a config must be a JSON object (a dict of fields), got {type(d).__name__}")
        return cls(**{**d, **kwargs})

    def to_dict(self) -> dict[str, Any]:
        """An HF-style dict: `transformers.GPT2Config.from_dict` accepts it. The attention backend
        is a choice of the running model and is not saved, as in transformers."""
        d = {k: copy.deepcopy(v) for k, v in vars(self).items() if k not in NOT_SAVED}
        if isinstance(d.get("dtype"), torch.dtype):
            d["dtype"] = str(d["dtype"]).removeprefix("torch.")
        return {**d, "model_type": self.model_type}

    def to_diff_dict(self) -> dict[str, Any]:
        """to_dict() without the keys that hold a default GPT2Config's value (model_type stays)."""
        default = GPT2Config().to_dict()
        return {k: v for k, v in self.to_dict().items() if k == "model_type" or k not in default or default[k] != v}

    def update(self, config_dict: dict[str, Any]) -> None:
        """Set each key of config_dict (fields, aliases or extra keys), then check the result."""
        for key, value in config_dict.items():
            self._set(ALIASES.get(key, key), value)
        self.validate()

    def __iter__(self):
        """The names of the config's attributes, as iterating a transformers config gives them."""
        return iter(list(vars(self)))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GPT2Config) and vars(self) == vars(other)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "GPT2Config":
        d = read_json_file(path)
        try:
            return cls.from_dict(d)
        except (ValueError, TypeError) as e:
            raise CheckpointError(path, str(e)) from None

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def to_json_file(self, path: str | os.PathLike) -> None:
        """Write atomically: a temporary file in the same folder, then a rename."""
        write_text_atomic(Path(path), self.to_json_string())

    @classmethod
    def from_pretrained(cls, src: str | os.PathLike, cache_dir: Any = None, local_files_only: bool = False,
                        subfolder: str = "", return_unused_kwargs: bool = False, **kwargs: Any) -> "GPT2Config":
        """The config.json of a model folder (or its `subfolder`), a config file or a hub name;
        kwargs override its keys. return_unused_kwargs: also return {} (every keyword is a key
        here), as transformers returns the keywords it did not use."""
        path = resolve(src, cache_dir=cache_dir, local_files_only=local_files_only)
        if path.is_dir():
            path = path / subfolder / CONFIG_NAME
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file (a model folder holds {CONFIG_NAME})")
        config = cls.from_json_file(path)
        if kwargs:
            config = cls.from_dict(config.to_dict(), **kwargs)
        return (config, {}) if return_unused_kwargs else config

    def save_pretrained(self, save_directory: str | os.PathLike) -> None:
        """Write save_directory/config.json (atomically), as transformers' config.save_pretrained."""
        folder = Path(save_directory)
        if folder.exists() and not folder.is_dir():
            raise ValueError(f"{folder} is a file; save_pretrained writes a folder")
        self.to_json_file(folder / CONFIG_NAME)

    @classmethod
    def from_preset(cls, name: str) -> "GPT2Config":
        """One of OpenAI's sizes: 'gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl'."""
        name = name.removeprefix("openai-community/")
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
        return cls.from_json_file(configs_dir() / f"{name}.json")


_FIELDS = frozenset(f.name for f in fields(GPT2Config))
NOT_SAVED = frozenset({"_attn_implementation", "_name_or_path"})
_DEFAULTS = {f.name: (f.default_factory() if f.default is MISSING else f.default) for f in fields(GPT2Config)}
GPT2Config.attribute_map = dict(ALIASES)  # transformers' name for the alias table


def _signature() -> inspect.Signature:
    """GPT2Config(...)'s keywords as transformers' dataclass config declares them: every field by
    name (tools read the constructor's signature to learn a config's fields), then **kwargs."""
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    params += [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
               for name, default in _DEFAULTS.items()]
    params.append(inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD))
    return inspect.Signature(params)


GPT2Config.__init__.__signature__ = _signature()

# What a config must carry to build a GPT-2: gpt2attn's GPT2Config, transformers' (AutoConfig's,
# another model's .config) or any object with these attributes.
ARCHITECTURE = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head")


def config_value(config: Any, name: str) -> Any:
    """A GPT-2 field of any config: its value, or GPT2Config's default where the config has none
    (transformers' GPT2Config has no classifier_dropout, for one)."""
    return getattr(config, name, _DEFAULTS[name])


def inner_dim(config: Any) -> int:
    """The MLP's width: n_inner, or 4 * n_embd when that is None."""
    n_inner = getattr(config, "n_inner", None)
    return n_inner if n_inner is not None else 4 * config.n_embd


def check_config(config: Any) -> None:
    """Raise ValueError naming the field for a value no GPT-2 config may hold; TypeError for an
    object that is no GPT-2 config at all."""
    missing = [name for name in ARCHITECTURE if not hasattr(config, name)]
    if missing:
        raise TypeError(f"{type(config).__name__} is not a GPT-2 config: it has no {', '.join(missing)} "
                        f"(pass gpt2attn's or transformers' GPT2Config)")

    def value(name: str) -> Any:
        return config_value(config, name)

    def require(ok: bool, name: str, what: str) -> None:
        if not ok:
            raise ValueError(f"GPT2Config.{name} must be {what}, got {value(name)!r}")

    for name in ARCHITECTURE:
        require(is_int(value(name)) and value(name) > 0, name, "a positive integer")
        check_limit(name, value(name))
    n_inner = value("n_inner")
    require(n_inner is None or (is_int(n_inner) and n_inner > 0), "n_inner", "a positive integer or None")
    if n_inner is not None:
        check_limit("n_inner", n_inner)
    if value("n_embd") % value("n_head") != 0:
        raise ValueError(
            f"n_embd ({value('n_embd')}) must be divisible by n_head ({value('n_head')}): "
            f"each head gets n_embd / n_head dimensions"
        )
    for name in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_first_dropout", "classifier_dropout"):
        ok = (value(name) is None and name == "classifier_dropout") or (_is_real(value(name)) and 0 <= value(name) <= 1)
        require(ok, name, "a probability in [0, 1]" + (" or None" if name == "classifier_dropout" else ""))
    for name in ("layer_norm_epsilon", "initializer_range"):
        require(_is_real(value(name)) and math.isfinite(value(name)) and value(name) > 0, name, "a positive number")
    for name in ("scale_attn_weights", "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn",
                 "add_cross_attention", "tie_word_embeddings", "summary_use_proj", "summary_proj_to_labels",
                 "use_cache", "output_attentions", "output_hidden_states", "return_dict"):
        require(isinstance(value(name), bool), name, "true or false")
    require(isinstance(value("activation_function"), str), "activation_function", "a string")
    for name in ("bos_token_id", "pad_token_id"):
        require(value(name) is None or _is_token(value(name)), name, "a token id (an integer >= 0) or None")
    eos = value("eos_token_id")
    ok = eos is None or _is_token(eos) or (isinstance(eos, list) and len(eos) > 0 and all(map(_is_token, eos)))
    require(ok, "eos_token_id", "a token id (an integer >= 0), a non-empty list of them, or None")
    require(value("summary_type") in SUMMARY_TYPES, "summary_type", f"one of {', '.join(SUMMARY_TYPES)}")
    require(value("summary_activation") is None or isinstance(value("summary_activation"), str), "summary_activation",
            "a string or None")
    require(value("problem_type") is None or value("problem_type") in PROBLEM_TYPES, "problem_type",
            f"None or one of {', '.join(PROBLEM_TYPES)}")
    labels = value("id2label")
    ok = isinstance(labels, dict) and len(labels) > 0 and all(is_int(k) and isinstance(v, str) for k, v in labels.items())
    require(ok, "id2label", "a non-empty dict of {integer id: label name}")
    check_limit("num_labels", len(labels))
    # label2id's ids are not read by any model; transformers keeps whatever a file holds ("0" or 0)
    require(isinstance(value("label2id"), dict) and all(isinstance(k, str) for k in value("label2id")), "label2id",
            "a dict of {label name: id}")
    arch = value("architectures")
    require(arch is None or (isinstance(arch, list) and all(isinstance(a, str) for a in arch)), "architectures",
            "a list of class names or None")


def as_torch_dtype(value: Any) -> torch.dtype | None:
    """A config's dtype ("float16", "torch.float16" or torch.float16) as a torch dtype, read as
    transformers reads it (torch's own name); None and "auto" are kept as they are."""
    if value is None or isinstance(value, torch.dtype) or value == "auto":
        return value
    dtype = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"GPT2Config.dtype must name a torch dtype (float32, float16, bfloat16, ...), got {value!r}")
    return dtype


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_token(value: Any) -> bool:
    return is_int(value) and value >= 0


def _int_keys(labels: Any) -> Any:
    """id2label with JSON's string keys made integers, as transformers converts them."""
    if not isinstance(labels, dict):
        return labels  # validate() names the problem
    try:
        return {int(k): v for k, v in labels.items()}
    except (TypeError, ValueError):
        raise ValueError(f"GPT2Config.id2label keys must be integer ids, got {list(labels)!r}") from None


