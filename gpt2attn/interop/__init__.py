"""Bridges to other libraries, each importing its client lazily: `import gpt2attn` imports none of them.

transformers.py sits below the model (model.py imports it for to_/from_transformers, and it is
handed our classes rather than importing them); peft.py, trainer.py and export.py sit above it.

hooks.py         imports peft.py / trainer.py / pipeline.py once their client is imported (on `import gpt2attn`)
transformers.py  zero-copy conversion to and from transformers' GPT-2 classes
peft.py          LoRA on our Conv1D through PEFT
trainer.py       transformers.Trainer checkpoints of our models
pipeline.py      transformers.pipeline on our models, through the zero-copy bridge
export.py        torch.export / ONNX of the prefill and the decode step
"""
