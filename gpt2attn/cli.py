"""`gpt2attn` command line: one subcommand per module in gpt2attn/commands/.

Each command module defines `HELP`, `add_arguments(parser)` and `run(args) -> int`. A bad
input or an operating-system error (a folder where a file was meant, a missing or unwritable
path) ends as one `gpt2attn CMD: error: ...` line and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import warnings
from pathlib import Path

COMMANDS = ("generate", "train", "convert", "parity", "attention", "explore", "export")
SIGPIPE_STATUS = 128 + 13  # what a Unix tool killed by SIGPIPE returns (`yes | head`)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="gpt2attn", description="GPT-2 as plain PyTorch modules.")
    parser.add_argument("--version", action="version", version=f"gpt2attn {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        module = importlib.import_module(f"gpt2attn.commands.{name}")
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(run=module.run, takes_overrides=getattr(module, "TAKES_OVERRIDES", False))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not args.takes_overrides:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.overrides = extra
    try:
        with warnings_as_lines(args.command):
            return args.run(args) or 0
    except BrokenPipeError:
        # `gpt2attn generate ... | head`: the reader has gone. Point stdout at /dev/null so the
        # interpreter's final flush does not fail again, and stop quietly.
        with contextlib.suppress(AttributeError, ValueError, OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return SIGPIPE_STATUS
    except (ValueError, OSError) as e:
        if os.environ.get("RANK", "0") == "0":  # under torchrun every process fails alike: say it once
            print(f"gpt2attn {args.command}: error: {describe(e)}", file=sys.stderr)
        return 2


def describe(error: BaseException) -> str:
    """The message of an error; an OS error as 'PATH: what went wrong'."""
    if isinstance(error, OSError) and error.strerror and error.filename is not None:
        # os.replace(tmp, target) names both; the target is the one the user gave.
        path = os.fsdecode(error.filename2 if error.filename2 is not None else error.filename)
        if isinstance(error, IsADirectoryError):
            return f"{path} is a folder, not a file"
        if isinstance(error, (FileExistsError, NotADirectoryError)):  # a file where a folder was needed
            blocking = next((p for p in (Path(path), *Path(path).parents) if p.is_file()), None)
            if blocking is not None:
                return f"{blocking} is a file, not a folder"
        return f"{path}: {error.strerror}"
    return str(error)


@contextlib.contextmanager
def warnings_as_lines(command: str):
    """Warnings print as one `gpt2attn CMD: warning: ...` line instead of Python's file:line form."""
    original = warnings.formatwarning
    warnings.formatwarning = lambda message, *rest, **kwargs: f"gpt2attn {command}: warning: {message}\n"
    try:
        yield
    finally:
        warnings.formatwarning = original


if __name__ == "__main__":
    sys.exit(main())
