"""generate() and its pieces: search, logits processors, lengths, bad requests."""
