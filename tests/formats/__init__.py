"""Reading and writing checkpoints in every format (HF, GGUF, llm.c, nanoGPT, OpenAI TF),
the tokenizer files, safe saves, memory while loading, hostile files."""
