"""PLACEHOLDER: the owner of this command replaces this whole file."""

HELP = "train (not written yet)"


def add_arguments(parser):
    pass


def run(args):
    raise NotImplementedError("gpt2attn train is not written yet")
TAKES_OVERRIDES = True
