"""transformers.pipeline on gpt2attn models: the pipeline runs on the zero-copy bridge.

    transformers.pipeline("text-generation", model=model, tokenizer=tok)   # model: gpt2attn's

A pipeline drives transformers' own generate and GenerationConfig, which our models do not have (they
have gpt2attn's). Importing this module makes every Pipeline given a gpt2attn model take its
transformers twin instead, `model.to_transformers()`: the same parameters seen through
transformers' class, so the tokens are exactly those of `pipeline(..., model=model.to_transformers())`
and `pipe.model` is that twin. Every other model is passed on as before.
"""

from __future__ import annotations

from transformers.pipelines.base import Pipeline

from ..pretrained import GPT2PreTrainedModel


def _on_the_bridge(default):
    def __init__(self, model, *args, **kwargs):
        if isinstance(model, GPT2PreTrainedModel):
            model = model.to_transformers()
        default(self, model, *args, **kwargs)

    __init__.gpt2attn_default = default  # marks the wrapper, so a second import does not wrap it twice
    return __init__


if not hasattr(Pipeline.__init__, "gpt2attn_default"):
    Pipeline.__init__ = _on_the_bridge(Pipeline.__init__)
