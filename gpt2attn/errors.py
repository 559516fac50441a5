"""CheckpointError, the one exception for a file gpt2attn cannot read, and read_json, JSON read safely.

Every reader (formats/, the tokenizer, config.json, generation_config.json) raises CheckpointError
for a file it refuses: the message starts with the file and names the field or byte offset at
fault. It is a ValueError, so code that catches ValueError keeps working. Files that are missing
stay FileNotFoundError. docs/hostile-files.md lists the checks and their limits.

At the bottom of the package: it imports nothing of gpt2attn.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

MAX_JSON_DEPTH = 64  # config.json is 3 levels deep, a safetensors header 3, tokenizer.json 5
MAX_JSON_DIGITS = 30  # longer integers are no size, id or count a GPT-2 can have (2^64 has 20 digits)


class CheckpointError(ValueError):
    """A model, tokenizer or config file gpt2attn refuses: `file` is the file, and the message
    reads "FILE: what is wrong, naming the field or offset"."""

    def __init__(self, file: str | os.PathLike, message: str):
        self.file = str(file)
        super().__init__(f"{file}: {message}")


class ShapeMismatchError(CheckpointError, RuntimeError):
    """A checkpoint with tensors of other shapes than the model's: a CheckpointError, and also the
    RuntimeError transformers raises for it, so code written for transformers catches it."""


def shorten(items: list, count: int = 10, width: int = 120, sep: str = ", ") -> str:
    """items joined for a message: at most `count` of them, each cut to `width` characters."""
    shown = [item if len(item) <= width else item[: width - 3] + "..." for item in map(str, items[:count])]
    return sep.join(shown) + (f"{sep}and {len(items) - count} more" if len(items) > count else "")


class _LongInteger(Exception):
    pass


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_JSON_DIGITS:
        raise _LongInteger(f"an integer of {len(text.lstrip('-'))} digits (at most {MAX_JSON_DIGITS} are read)")
    return int(text)


STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)


def json_depth(data: bytes) -> int:
    """How deeply arrays and objects nest in JSON text (brackets inside strings do not count),
    found without parsing: a parser would recurse once per level."""
    import numpy as np

    brackets = np.frombuffer(STRINGS.sub(b"", data), dtype=np.uint8)
    steps = np.isin(brackets, (ord("["), ord("{"))).astype(np.int64) - np.isin(brackets, (ord("]"), ord("}")))
    return int(np.cumsum(steps).max(initial=0))


def read_json(data: bytes | str, file: str | os.PathLike, what: str = "not valid JSON") -> Any:
    """The JSON value of `data` (the contents of `file`), or a CheckpointError naming the file:
    `what (the parser's message)` for text that is not JSON, and a clear refusal for nesting
    deeper than MAX_JSON_DEPTH or integers longer than MAX_JSON_DIGITS digits."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    depth = json_depth(data)
    if depth > MAX_JSON_DEPTH:
        raise CheckpointError(file, f"{what}: arrays and objects nested {depth} deep (at most {MAX_JSON_DEPTH} are read)")
    try:
        return json.loads(data, parse_int=_parse_int)
    except _LongInteger as e:
        raise CheckpointError(file, f"{what}: {e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(file, f"{what} ({e})") from None


def read_json_file(path: str | os.PathLike, what: str = "not valid JSON") -> Any:
    with open(path, "rb") as f:
        return read_json(f.read(), path, what)
