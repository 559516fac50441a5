"""gpt2attn: Hugging Face's GPT-2 as plain PyTorch modules, built for looking inside attention.

The names below are imported when first used (PEP 562's module `__getattr__`):
`from gpt2attn import GPT2LMHeadModel` and `gpt2attn.GPT2Config` work as usual, while
`import gpt2attn` alone, and so the `gpt2attn` command's parser (`gpt2attn --help`), import
neither torch nor the model. What importing gpt2attn does at once: install the import hooks that
teach PEFT, transformers' Trainer and pipelines our models when (if ever) they are imported
(gpt2attn/interop/hooks.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import lazy
from .interop import hooks

hooks.install()

__version__ = "0.1.0"

# public name -> the module of gpt2attn that defines it
_HOMES = {
    "GPT2Config": "config",
    "CheckpointError": "errors",
    "Conv1D": "layers",
    "Attention": "layers",
    "MLP": "layers",
    "Block": "layers",
    "GPT2PreTrainedModel": "pretrained",
    "GPT2Model": "model",
    "GPT2LMHeadModel": "model",
    "GPT2ForSequenceClassification": "heads",
    "GPT2ForTokenClassification": "heads",
    "GPT2ForQuestionAnswering": "heads",
    "GPT2DoubleHeadsModel": "heads",
    "BaseModelOutput": "model",
    "CausalLMOutput": "model",
    "KVCache": "cache",
    "causal_mask": "attention",
    "scaled_dot_product_attention": "attention",
}
__all__ = [  # written out, for the API docs, which read it from the source
    "GPT2Config", "CheckpointError", "Conv1D", "Attention", "MLP", "Block", "GPT2PreTrainedModel", "GPT2Model",
    "GPT2LMHeadModel", "GPT2ForSequenceClassification", "GPT2ForTokenClassification", "GPT2ForQuestionAnswering",
    "GPT2DoubleHeadsModel", "BaseModelOutput", "CausalLMOutput", "KVCache", "causal_mask",
    "scaled_dot_product_attention",
]


__getattr__, __dir__ = lazy.exports(__name__, _HOMES)

if TYPE_CHECKING:  # the same names, for type checkers and the API docs (mkdocstrings), which read the source
    from .attention import causal_mask, scaled_dot_product_attention
    from .cache import KVCache
    from .config import GPT2Config
    from .errors import CheckpointError
    from .heads import (
        GPT2DoubleHeadsModel,
        GPT2ForQuestionAnswering,
        GPT2ForSequenceClassification,
        GPT2ForTokenClassification,
    )
    from .layers import MLP, Attention, Block, Conv1D
    from .model import BaseModelOutput, CausalLMOutput, GPT2LMHeadModel, GPT2Model
    from .pretrained import GPT2PreTrainedModel
