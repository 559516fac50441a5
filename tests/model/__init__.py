"""The model against transformers' GPT-2: numbers, API, outputs, task heads, cross-attention, bad inputs."""
