"""transformers.Trainer checkpoints of gpt2attn models: full HF folders, written by our save_pretrained.

    # once transformers.trainer is imported (gpt2attn.interop.hooks imports this module), as for transformers' GPT-2:
    transformers.Trainer(model=model, args=args, train_dataset=ds).train()

The Trainer hands a transformers PreTrainedModel to its save_pretrained and writes any other module as
a bare safetensors state dict: no config.json, and for GPT-2 not even that, since safetensors refuses
the lm_head / wte pair that shares one tensor. Importing this module sends gpt2attn models to their
own save_pretrained instead (config.json, generation_config.json, the tied weight once, the folder
swapped in whole), so checkpoints and `save_model()` open with `from_pretrained` in both libraries and
`resume_from_checkpoint` reads them. Every other model is saved exactly as before.
"""

from __future__ import annotations

import os

import torch
from transformers import Trainer
from transformers.trainer import TRAINING_ARGS_NAME

from ..pretrained import GPT2PreTrainedModel


def _save_ours_whole(default):
    def _save(trainer: Trainer, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        model = trainer.accelerator.unwrap_model(trainer.model, keep_torch_compile=False)
        if not isinstance(model, GPT2PreTrainedModel):
            return default(trainer, output_dir, state_dict)
        if not trainer.args.should_save:  # the other ranks; save_model already gathered state_dict
            return
        output_dir = output_dir if output_dir is not None else trainer.args.output_dir
        model.save_pretrained(output_dir, state_dict=state_dict)
        # then what the Trainer writes beside any model: the tokenizer and the training arguments
        tokenizer = trainer.processing_class
        if tokenizer is None:
            tokenizer = getattr(trainer.data_collator, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
        torch.save(trainer.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    _save.gpt2attn_default = default  # marks the wrapper, so a second import does not wrap it twice
    return _save


if not hasattr(Trainer._save, "gpt2attn_default"):
    Trainer._save = _save_ours_whole(Trainer._save)
