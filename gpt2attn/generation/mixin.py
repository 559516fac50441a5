"""GenerationMixin: what a model that continues text adds to its forward pass, as transformers'
GenerationMixin does: generate(), its defaults (generation_config), the inputs of each decoding
step (prepare_inputs_for_generation) and the scores of the chosen tokens.

The model it is mixed into has a `transformer` (GPT2Model) and an `lm_head`; generate.py drives them.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..cache import cached_length, takes_past_key_values
from .config import GenerationConfig, as_generation_config
from .generate import compute_transition_scores, generate


class GenerationMixin:
    @classmethod
    def can_generate(cls) -> bool:
        return True

    @takes_past_key_values
    def prepare_inputs_for_generation(
        self,
        input_ids: Tensor,
        cache: Any = None,
        attention_mask: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        position_ids: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """forward's arguments for the next decoding step, as transformers' generate builds them:
        with a cache only the ids it does not hold yet; position ids counted from the attention
        mask (so left padding works); inputs_embeds only before anything is cached."""
        past_len = cached_length(cache)
        next_len = kwargs.pop("next_sequence_length", None)
        for key in ("labels", "is_first_iteration"):  # generate's bookkeeping, not forward's arguments
            kwargs.pop(key, None)
        if next_len is not None:
            input_ids = input_ids[:, -next_len:]
        elif past_len:
            input_ids = input_ids[:, past_len:]
        if position_ids is None and attention_mask is not None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
        T = input_ids.size(1)
        inputs: dict[str, Any] = {"input_ids": input_ids}
        if inputs_embeds is not None and past_len == 0:
            inputs = {"inputs_embeds": inputs_embeds}
            T = inputs_embeds.size(1)
        return {
            **inputs,
            "cache": cache,
            "attention_mask": attention_mask,
            "position_ids": position_ids[:, -T:] if position_ids is not None else None,
            "token_type_ids": token_type_ids[:, -T:] if token_type_ids is not None else None,
            "use_cache": use_cache,
            **kwargs,
        }

    @property
    def generation_config(self) -> Any:
        """generate()'s defaults: the folder's generation_config.json, else from the config."""
        if "_generation_config" not in self.__dict__:
            self.__dict__["_generation_config"] = GenerationConfig.from_model_config(self.config)
        return self.__dict__["_generation_config"]

    @generation_config.setter
    def generation_config(self, value: Any) -> None:
        """gpt2attn's GenerationConfig, or transformers' (kept as ours: the fields it sets)."""
        self.__dict__["_generation_config"] = as_generation_config(value)

    def generate(self, input_ids: Tensor | None = None, generation_config: Any = None, stopping_criteria: Any = None,
                 assistant_model: Any = None, **kwargs: Any) -> Any:
        """Continue input_ids as transformers' generate does; see gpt2attn.generation.generate."""
        return generate(self, input_ids, generation_config=generation_config, stopping_criteria=stopping_criteria,
                        assistant_model=assistant_model, **kwargs)

    def compute_transition_scores(self, sequences: Tensor, scores: tuple[Tensor, ...],
                                  beam_indices: Tensor | None = None, normalize_logits: bool = False) -> Tensor:
        """Each generated token's score at the step that chose it; see gpt2attn.generation."""
        return compute_transition_scores(sequences, scores, beam_indices, normalize_logits)


__all__ = ["GenerationMixin"]
