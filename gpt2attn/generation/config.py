"""GenerationConfig: the defaults `generate()` starts from, as transformers keeps them.

A model's `generation_config` comes from `generation_config.json` beside its weights when
there is one, else from its config (bos/eos/pad token ids). Keywords passed to `generate()`
override it for one call; `resolve()` does that once and checks every value.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, read_json_file

GENERATION_CONFIG_NAME = "generation_config.json"


@dataclass
class GenerationConfig:
    # length
    max_length: int | None = None  # prompt + new tokens; unset: 20 new tokens
    max_new_tokens: int | None = None  # wins over max_length when set
    min_length: int = 0
    min_new_tokens: int | None = None
    stop_strings: str | list[str] | None = None
    # strategy
    do_sample: bool = False
    num_beams: int = 1
    num_return_sequences: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never"
    # logits processors
    temperature: float = 1.0
    top_k: int | None = 50
    top_p: float = 1.0
    min_p: float | None = None
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    bad_words_ids: list[list[int]] | None = None
    forced_eos_token_id: int | list[int] | None = None  # forced as the last token a row can have
    encoder_no_repeat_ngram_size: int = 0  # encoder-decoder models only: must stay 0 for GPT-2
    # special tokens
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    # assisted decoding
    prompt_lookup_num_tokens: int | None = None
    max_matching_ngram_size: int | None = None  # prompt lookup: longest n-gram matched (2 when unset)
    num_assistant_tokens: int = 20
    # outputs
    return_dict_in_generate: bool = False
    output_scores: bool = False
    output_logits: bool = False
    output_attentions: bool = False  # each step's attention weights, per layer
    output_hidden_states: bool = False  # each step's hidden states, embeddings and every layer's output
    remove_invalid_values: bool = False  # nan and ±inf logits made finite before a token is chosen
    use_cache: bool = True
    # how the cache is laid out: gpt2attn always preallocates the whole request's cache in place
    # (transformers' "static"), so any value gives the same tokens; "static" also lets generate
    # compile the model's forward for the one-token steps, as transformers does (see compile_config)
    cache_implementation: str | None = None
    # not saved by transformers, accepted for convenience: seeds the sampling generator
    seed: int | None = field(default=None, metadata={"saved": False})
    # transformers' CompileConfig (torch.compile's options): with cache_implementation="static", on an
    # accelerator (on any device with its _compile_all_devices), generate runs the one-token steps
    # through the compiled forward (generate.compiled_call)
    compile_config: Any = field(default=None, metadata={"saved": False})

    @classmethod
    def from_model_config(cls, config) -> "GenerationConfig":
        """The special tokens of a model config, plus any generation keys it carries (old configs did)."""
        d = config.to_dict()
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names and v is not None})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GenerationConfig":
        if not isinstance(d, dict):
            raise ValueError(f"a generation config must be a JSON object, got {type(d).__name__}")
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})  # transformers' other keys are ignored

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> "GenerationConfig":
        path = Path(folder) / GENERATION_CONFIG_NAME
        try:
            d = read_json_file(path, "cannot read the generation config")
        except OSError as e:
            raise CheckpointError(path, f"cannot read the generation config ({e})") from e
        try:
            config = cls.from_dict(d)
            config.check(vocab_size=2**63)  # the model's vocabulary is checked against at generate()
        except (ValueError, TypeError) as e:
            raise CheckpointError(path, str(e)) from None
        return config

    def to_dict(self) -> dict[str, Any]:
        """The values that differ from the defaults (what transformers writes too)."""
        default = GenerationConfig()
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.metadata.get("saved", True) and getattr(self, f.name) != getattr(default, f.name)
        }

    def save_pretrained(self, folder: str | Path) -> None:
        from ..files import write_text_atomic

        write_text_atomic(Path(folder) / GENERATION_CONFIG_NAME, json.dumps(self.to_dict(), indent=2) + "\n")

    def update(self, **kwargs: Any) -> "GenerationConfig":
        """A copy with kwargs applied; an unknown keyword is an error naming it."""
        names = {f.name for f in fields(self)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"generate() got unknown keyword(s) {unknown}; generation settings are {sorted(names)}")
        return replace(self, **kwargs)

    @property
    def eos_ids(self) -> list[int]:
        """eos_token_id as a list ([] when unset); a negative id, which never occurs, left out."""
        eos = self.eos_token_id
        return [t for t in ([] if eos is None else [eos] if isinstance(eos, int) else eos) if t >= 0]

    def check(self, vocab_size: int, keywords: Iterable[str] = ()) -> None:
        """Raise ValueError naming the first setting out of range.

        bos / eos / pad ids named in `keywords` (the caller's own) must lie in the vocabulary. The
        model's own may lie beyond it, as in transformers: a small model built from GPT-2's default
        config keeps bos = eos = 50256, an id that never occurs, so that eos never stops a row.
        """
        _int_at_least("num_beams", self.num_beams, 1)
        _int_at_least("num_return_sequences", self.num_return_sequences, 1)
        _int_at_least("min_length", self.min_length, 0)
        _int_at_least("no_repeat_ngram_size", self.no_repeat_ngram_size, 0)
        if self.encoder_no_repeat_ngram_size != 0:
            raise ValueError(f"encoder_no_repeat_ngram_size={self.encoder_no_repeat_ngram_size!r}: GPT-2 has no encoder "
                             f"whose n-grams could be banned; leave it 0")
        forced = self.forced_eos_token_id
        if forced is not None and not all(_int(t) and 0 <= t < vocab_size
                                           for t in ([forced] if not isinstance(forced, (list, tuple)) else forced or [-1])):
            raise ValueError(f"forced_eos_token_id must be a token id in [0, {vocab_size}) or a list of them, got {forced!r}")
        _int_at_least("num_assistant_tokens", self.num_assistant_tokens, 1)
        compile_options(self.compile_config)
        if self.max_new_tokens is not None:
            _int_at_least("max_new_tokens", self.max_new_tokens, 1)
        if self.max_length is not None:
            _int_at_least("max_length", self.max_length, 1)
        if self.min_new_tokens is not None:
            _int_at_least("min_new_tokens", self.min_new_tokens, 0)
        if self.top_k is not None:
            _int_at_least("top_k", self.top_k, 0)
        if self.prompt_lookup_num_tokens is not None:
            _int_at_least("prompt_lookup_num_tokens", self.prompt_lookup_num_tokens, 1)
        if self.max_matching_ngram_size is not None:
            _int_at_least("max_matching_ngram_size", self.max_matching_ngram_size, 1)
        for name in ("temperature", "repetition_penalty"):
            value = getattr(self, name)
            if not _real(value) or not value > 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        for name in ("top_p", "typical_p"):
            value = getattr(self, name)
            if not _real(value) or not 0 < value <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {value!r}")
        if self.min_p is not None and (not _real(self.min_p) or not 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _real(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        if self.num_return_sequences > 1 and self.num_beams == 1 and not self.do_sample:
            raise ValueError(
                f"num_return_sequences={self.num_return_sequences} needs num_beams >= it or do_sample=True: "
                "greedy decoding gives one sequence per prompt"
            )
        if self.num_beams > 1 and self.num_return_sequences > self.num_beams:
            raise ValueError(
                f"num_return_sequences ({self.num_return_sequences}) must be <= num_beams ({self.num_beams})"
            )
        def id_range(name: str) -> tuple[float, str]:
            return (vocab_size, f"in [0, {vocab_size})") if name in keywords else (math.inf, ">= 0")

        # A negative eos or pad id is transformers' way to say "none": no token ever equals it, so
        # generation runs to its length (and a -1 pad fills rows that never finish, i.e. none).
        end, where = id_range("bos_token_id")
        if self.bos_token_id is not None and (not _int(self.bos_token_id) or not 0 <= self.bos_token_id < end):
            raise ValueError(f"bos_token_id must be a token id {where}, got {self.bos_token_id!r}")
        end, where = id_range("pad_token_id")
        if self.pad_token_id is not None and (not _int(self.pad_token_id) or not self.pad_token_id < end):
            raise ValueError(f"pad_token_id must be a token id {where} (or negative: none), got {self.pad_token_id!r}")
        eos = self.eos_token_id
        eos_list = [eos] if not isinstance(eos, (list, tuple)) and eos is not None else list(eos or [])
        end, where = id_range("eos_token_id")
        if any(not _int(t) or not t < end for t in eos_list) or isinstance(eos, (list, tuple)) and not eos:
            raise ValueError(f"eos_token_id must be a token id {where} (or negative: never stop) or a non-empty "
                             f"list of them, got {eos!r}")
        if any(t < 0 for t in eos_list):
            warnings.warn(f"eos_token_id={eos!r}: a negative id never occurs, so generation stops only at its length")
        if self.bad_words_ids is not None:
            bad = self.bad_words_ids
            if not isinstance(bad, (list, tuple)) or not bad or any(
                not isinstance(seq, (list, tuple)) or not seq or any(not _int(t) or not 0 <= t < vocab_size for t in seq)
                for seq in bad
            ):
                raise ValueError(
                    f"bad_words_ids must be a non-empty list of non-empty lists of token ids in [0, {vocab_size}), got {bad!r}"
                )
        if self.stop_strings is not None:
            stops = [self.stop_strings] if isinstance(self.stop_strings, str) else self.stop_strings
            if not isinstance(stops, (list, tuple)) or not stops or any(not isinstance(s, str) or not s for s in stops):
                raise ValueError(f"stop_strings must be a non-empty string or a list of them, got {self.stop_strings!r}")


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _int_at_least(name: str, value: Any, low: int) -> None:
    if not _int(value) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def compile_options(compile_config: Any) -> dict[str, Any]:
    """torch.compile's keywords from transformers' CompileConfig (its to_dict(), which leaves out
    the private _compile_all_devices), a dict of them, or None: CompileConfig's defaults."""
    if compile_config is None:
        return {"fullgraph": False, "dynamic": None, "backend": "inductor", "mode": "reduce-overhead", "options": None}
    if isinstance(compile_config, dict):
        return dict(compile_config)
    if not callable(getattr(compile_config, "to_dict", None)):
        raise ValueError(f"compile_config must be transformers' CompileConfig or a dict of torch.compile's "
                         f"keywords, got {type(compile_config).__name__}")
    return compile_config.to_dict()


# transformers' GenerationConfig fields that choose how generate runs (compilation, the cache's layout,
# bookkeeping), not which tokens come out: a transformers config carrying them is taken without them.
HOW_NOT_WHAT = {"transformers_version", "_from_model_config", "disable_compile", "compile_config",
                "cache_config", "low_memory"}


def as_generation_config(value: Any, base: GenerationConfig | None = None) -> GenerationConfig:
    """Ours as it is; transformers' GenerationConfig (anything with its to_diff_dict) as ours: the
    fields it sets applied to `base` (else to the defaults), as transformers fills the fields a
    passed config leaves unset from the model's. A field ours does not implement is an error."""
    if isinstance(value, GenerationConfig):
        return value
    to_diff_dict = getattr(value, "to_diff_dict", None)
    if not callable(to_diff_dict):
        raise TypeError(f"generation_config must be a GenerationConfig (gpt2attn's or transformers'), "
                        f"got {type(value).__name__}")
    given = {k: v for k, v in to_diff_dict().items() if k not in HOW_NOT_WHAT}
    names = {f.name for f in fields(GenerationConfig)}
    unknown = sorted(set(given) - names)
    if unknown:
        raise ValueError(f"generation_config sets {unknown}, which gpt2attn's generate does not implement")
    return replace(base if base is not None else GenerationConfig(), **given)


def load_generation_config(model, folder: str | Path) -> None:
    """Give model the folder's generation_config.json, when there is one."""
    if (Path(folder) / GENERATION_CONFIG_NAME).is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)


def save_generation_config(model, folder: str | Path) -> None:
    """Write model's generation config beside its weights (models without one write nothing)."""
    config = getattr(model, "generation_config", None)
    if config is not None:
        config.save_pretrained(folder)


__all__ = ["GenerationConfig", "as_generation_config", "GENERATION_CONFIG_NAME", "load_generation_config", "save_generation_config"]
