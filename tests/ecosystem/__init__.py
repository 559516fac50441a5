"""Other libraries on our model: the transformers bridge, PEFT, the Trainer, TRL, lm-eval,
TransformerLens, accelerate and co., export, the import hooks."""
