"""Bridges to other libraries, each importing its client lazily: `import gpt2attn` imports none of them.

Everything here sits above the model: it imports the model, never the other way round (the
zero-copy bridge to transformers that the model's to_/from_transformers use is gpt2attn/bridge.py,
below the model; tests/project/test_import_graph.py keeps it so).

hooks.py         imports peft.py / trainer.py / pipeline.py once their client is imported (on `import gpt2attn`)
peft.py          LoRA on our Conv1D through PEFT
trainer.py       transformers.Trainer checkpoints of our models (TRL's trainers are Trainers)
pipeline.py      transformers.pipeline on our models, through the zero-copy bridge
export.py        torch.export / ONNX of the prefill and the decode step
"""
