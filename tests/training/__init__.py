"""Training: the model in a user's loop, `gpt2attn train`'s config, data and loop."""
