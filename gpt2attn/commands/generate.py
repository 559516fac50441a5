"""PLACEHOLDER: the owner of this command replaces this whole file."""

HELP = "generate (not written yet)"


def add_arguments(parser):
    pass


def run(args):
    raise NotImplementedError("gpt2attn generate is not written yet")
