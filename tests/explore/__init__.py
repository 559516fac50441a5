"""The attention explorer (gpt2attn explore) and gpt2attn.inspect."""
