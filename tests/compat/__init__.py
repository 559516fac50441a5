"""Compatibility with transformers' GPT-2: its public surface, its own test file, code written for it."""
