"""Bridges to other libraries, each importing its client lazily: `import gpt2attn` imports none of them.

transformers.py sits below the model (model.py imports it for to_/from_transformers, and it is
handed our classes rather than importing them); peft.py, trainer.py and export.py sit above it.

transformers.py  zero-copy conversion to and from transformers' GPT-2 classes
peft.py          LoRA on our Conv1D through PEFT (registered on `import gpt2attn.interop.peft`)
trainer.py       transformers.Trainer checkpoints of our models (on `import gpt2attn.interop.trainer`)
export.py        torch.export / ONNX of the prefill and the decode step
"""
