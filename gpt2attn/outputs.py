"""What the models return: dataclasses that are also ordered dicts, as transformers' ModelOutput.

An output reads as an object (`out.logits`), as a dict over the fields that are set
(`out["logits"]`, `keys()`, `items()`, `"loss" in out`) and as a tuple of those same fields
(`out[0]`, `out[:2]`, `to_tuple()`): with labels `out[0]` is the loss, without it the logits.
Fields left at None are not keys, exactly as in transformers.

Every output class is registered as a pytree node (cache.py registers `KVCache`), so torch.compile,
torch.export and `torch.utils._pytree` flatten them into their tensors and build them back.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, fields
from typing import Any

import torch.utils._pytree as pytree
from torch import Tensor

from .cache import KVCache


class ModelOutput(OrderedDict):
    """Base of every output dataclass: the dict holds the fields that are not None, in field order."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        pytree.register_pytree_node(
            cls,
            _flatten_output,
            lambda values, keys: cls(**dict(zip(keys, values))),
            serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        )

    def __post_init__(self) -> None:
        names = [f.name for f in fields(self)]
        first = getattr(self, names[0])
        # type(out)({"logits": ...}), as libraries that rebuild mappings do (accelerate, for one).
        if isinstance(first, dict) and all(getattr(self, n) is None for n in names[1:]):
            unknown = set(first) - set(names)
            if unknown:
                raise TypeError(f"{type(self).__name__} has no field(s) {sorted(unknown)}")
            object.__setattr__(self, names[0], None)
            for name, value in first.items():
                object.__setattr__(self, name, value)
        self._sync()
        object.__setattr__(self, "_synced", True)  # from now on, setting a field updates the dict

    def _sync(self) -> None:
        """Rebuild the dict from the attributes: set fields, in declaration order."""
        super().clear()
        for f in fields(self):
            value = getattr(self, f.name, None)
            if value is not None:
                super().__setitem__(f.name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in self.__dataclass_fields__ and "_synced" in self.__dict__:
            self._sync()

    def __setitem__(self, key: str, value: Any) -> None:
        if key not in self.__dataclass_fields__:
            raise KeyError(f"{type(self).__name__} has no field {key!r}")
        setattr(self, key, value)

    def __getitem__(self, key: str | int | slice) -> Any:
        if isinstance(key, str):
            return super().__getitem__("cache" if key == "past_key_values" else key)
        return self.to_tuple()[key]

    @property
    def past_key_values(self) -> Any:
        """The field's name before transformers 5.24 (now `cache`), kept for code that uses it."""
        return self.cache

    def __contains__(self, key: object) -> bool:
        return super().__contains__("cache" if key == "past_key_values" else key)

    def __delitem__(self, key: str) -> None:
        raise TypeError(f"fields of {type(self).__name__} cannot be deleted; set them to None")

    def to_tuple(self) -> tuple[Any, ...]:
        """The set fields in order: what `return_dict=False` returns."""
        return tuple(self.values())

    # dict methods that would bypass the attributes
    def pop(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{type(self).__name__}.pop is not supported; set the field to None")

    def setdefault(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{type(self).__name__}.setdefault is not supported")

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value


def _flatten_output(out: ModelOutput) -> tuple[list[Any], list[str]]:
    keys = list(out.keys())
    return [out[k] for k in keys], keys


# --- the models' outputs --------------------------------------------------------------------


@dataclass
class BaseModelOutput(ModelOutput):
    """GPT2Model: transformers' BaseModelOutputWithPastAndCrossAttentions."""

    last_hidden_state: Tensor | None = None
    cache: KVCache | None = None
    hidden_states: tuple[Tensor, ...] | None = None  # embeddings, then each block (the last after ln_f)
    attentions: tuple[Tensor, ...] | None = None  # per layer (B, nh, T_q, T_k)
    cross_attentions: tuple[Tensor, ...] | None = None  # per layer (B, nh, T_q, T_encoder)


@dataclass
class CausalLMOutput(ModelOutput):
    """GPT2LMHeadModel: transformers' CausalLMOutputWithCrossAttentions."""

    loss: Tensor | None = None
    logits: Tensor | None = None  # (B, T, vocab)
    cache: KVCache | None = None
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None
    cross_attentions: tuple[Tensor, ...] | None = None


@dataclass
class SequenceClassifierOutput(ModelOutput):
    """GPT2ForSequenceClassification: transformers' SequenceClassifierOutputWithPast."""

    loss: Tensor | None = None
    logits: Tensor | None = None  # (B, num_labels)
    cache: KVCache | None = None
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None


@dataclass
class TokenClassifierOutput(ModelOutput):
    """GPT2ForTokenClassification."""

    loss: Tensor | None = None
    logits: Tensor | None = None  # (B, T, num_labels)
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None


@dataclass
class QuestionAnsweringOutput(ModelOutput):
    """GPT2ForQuestionAnswering: transformers' QuestionAnsweringModelOutput."""

    loss: Tensor | None = None
    start_logits: Tensor | None = None  # (B, T)
    end_logits: Tensor | None = None  # (B, T)
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None


@dataclass
class DoubleHeadsOutput(ModelOutput):
    """GPT2DoubleHeadsModel: transformers' GPT2DoubleHeadsModelOutput."""

    loss: Tensor | None = None
    mc_loss: Tensor | None = None
    logits: Tensor | None = None  # (B, n_choices, T, vocab)
    mc_logits: Tensor | None = None  # (B, n_choices)
    cache: KVCache | None = None
    hidden_states: tuple[Tensor, ...] | None = None
    attentions: tuple[Tensor, ...] | None = None
