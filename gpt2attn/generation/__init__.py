"""Text generation for GPT2LMHeadModel, as transformers' generate() does it.

Sits below the model: generate(model, ...) drives the model it is given (its `transformer` and
`lm_head`), and model.py imports this package for its generate() / generation_config. It imports
from gpt2attn only what lies below the model: cache.py, outputs.py and errors.py (files.py to
save a config), and, for the decoder's one-call step, the layers (layers.py), quantize.py's layer
classes, the kernels and decode_step.py.

    config.py      GenerationConfig: defaults from the model, overridden by keywords
    processors.py  logits processors, one small function each
    sampling.py    a token drawn from each row's probabilities, as torch.multinomial draws it
    decoder.py     the model stepping on one preallocated, in-place KV cache
    search.py      greedy / sampling, beam search
    assisted.py    assisted decoding: an assistant model's or the prompt's drafts, verified
    generate.py    generate(): inputs checked, settings resolved, a search chosen, outputs
    mixin.py       GenerationMixin: generate() and its companions as methods of a model class
"""

from .config import GenerationConfig, as_generation_config
from .generate import GenerateBeamDecoderOnlyOutput, GenerateDecoderOnlyOutput, compute_transition_scores, generate
from .mixin import GenerationMixin

__all__ = [
    "GenerateBeamDecoderOnlyOutput",
    "GenerateDecoderOnlyOutput",
    "GenerationConfig",
    "GenerationMixin",
    "as_generation_config",
    "compute_transition_scores",
    "generate",
]
