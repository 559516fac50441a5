"""`gpt2attn` command line: one subcommand per module in gpt2attn/commands/.

Each command module defines `HELP`, `add_arguments(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = ("generate", "train", "convert", "parity", "attention", "export")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpt2attn", description="GPT-2 as plain PyTorch modules.")
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
        return args.run(args) or 0
    except (ValueError, FileNotFoundError) as e:
        print(f"gpt2attn {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
