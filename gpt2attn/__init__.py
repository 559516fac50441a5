"""gpt2attn: Hugging Face's GPT-2 as plain PyTorch modules, built for looking inside attention."""

from .attention import causal_mask, scaled_dot_product_attention
from .cache import KVCache
from .config import GPT2Config
from .errors import CheckpointError
from .layers import MLP, Attention, Block, Conv1D
from .heads import (
    GPT2DoubleHeadsModel,
    GPT2ForQuestionAnswering,
    GPT2ForSequenceClassification,
    GPT2ForTokenClassification,
)
from .model import BaseModelOutput, CausalLMOutput, GPT2LMHeadModel, GPT2Model
from .pretrained import GPT2PreTrainedModel
from .interop import hooks

hooks.install()  # PEFT, transformers' Trainer and pipelines learn our models when (if ever) they are imported

__version__ = "0.1.0"

__all__ = [
    "GPT2Config",
    "CheckpointError",
    "Conv1D",
    "Attention",
    "MLP",
    "Block",
    "GPT2PreTrainedModel",
    "GPT2Model",
    "GPT2LMHeadModel",
    "GPT2ForSequenceClassification",
    "GPT2ForTokenClassification",
    "GPT2ForQuestionAnswering",
    "GPT2DoubleHeadsModel",
    "BaseModelOutput",
    "CausalLMOutput",
    "KVCache",
    "causal_mask",
    "scaled_dot_product_attention",
]
