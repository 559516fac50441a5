"""One module per `gpt2attn` subcommand; see gpt2attn/cli.py."""
