"""Tokenizers for gpt2attn, built on the `tokenizers` library.

`load_tokenizer(src)` reads GPT-2's byte-level BPE from `tokenizer.json`, HF's
`vocab.json` + `merges.txt`, or OpenAI's `encoder.json` + `vocab.bpe`.
`char_tokenizer(text)` makes a character-level vocabulary (ids 0..V-1, sorted characters),
as nanoGPT's shakespeare_char does. `encode(tokenizer, text)` gives the ids, or a ValueError
naming the characters a vocabulary lacks. `token_labels(tokenizer, ids)` gives each token's text
with its whitespace made visible, for tick labels and pages.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from .hub import resolve

EOS_TOKEN = "<|endoftext|>"


def load_tokenizer(src: str | Path, cache_dir: str | Path | None = None) -> Tokenizer:
    """The tokenizer stored in folder src (or a tokenizer.json file, or a hub model's folder)."""
    path = resolve(src, cache_dir)
    if path.is_file():
        return _tokenizer_json(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no tokenizer folder at {path}")
    if (path / "tokenizer.json").is_file():
        return _tokenizer_json(path / "tokenizer.json")
    for vocab_name, merges_name in (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")):
        if (path / vocab_name).is_file() and (path / merges_name).is_file():
            return _byte_level_bpe(path / vocab_name, path / merges_name)
    raise FileNotFoundError(
        f"no tokenizer in {path}: expected tokenizer.json, vocab.json + merges.txt, or encoder.json + vocab.bpe"
    )


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    """The token ids of text. A vocabulary without some of text's characters (a character-level
    one, with no unknown token) is a ValueError that names them."""
    try:
        return tokenizer.encode(text).ids
    except Exception as e:  # tokenizers raises plain Exception ("Missing [UNK] token ...")
        vocab = tokenizer.get_vocab()
        pieces = tokenizer.pre_tokenizer.pre_tokenize_str(text) if tokenizer.pre_tokenizer else [(text, None)]
        missing = [piece for piece in dict.fromkeys(piece for piece, _ in pieces) if piece not in vocab]
        if not missing:
            raise ValueError(f"cannot encode the text: {e}") from None
        shown = ", ".join(f"{piece!r} ({', '.join(f'U+{ord(c):04X}' for c in piece)})" for piece in missing[:20])
        more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
        raise ValueError(f"the text has characters that the tokenizer's vocabulary ({len(vocab)} tokens) "
                         f"does not hold: {shown}{more}") from None


def token_labels(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    """Each token's own text, whitespace made visible (see `visible`). A byte-level BPE token that
    holds part of a character (an emoji split in two) shows its bytes as \\xNN."""
    if not isinstance(tokenizer.decoder, decoders.ByteLevel):
        return [visible(tokenizer.decode([i])) for i in ids]
    byte_of = _byte_level_alphabet()
    labels = []
    for i in ids:
        piece = tokenizer.id_to_token(i) or ""
        if all(c in byte_of for c in piece):
            piece = bytes(byte_of[c] for c in piece).decode("utf-8", errors="backslashreplace")
        labels.append(visible(piece))
    return labels


def visible(piece: str) -> str:
    """A token's text with its whitespace shown: ' ' -> '␣', newline -> '↵', tab -> '⇥'; '' -> '∅'."""
    return piece.replace(" ", "␣").replace("\n", "↵").replace("\r", "␍").replace("\t", "⇥") or "∅"


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE writes each byte as one printable character ('Ġ' is the space byte,
    'Ċ' the newline): printable Latin-1 bytes stand for themselves, the others are 256, 257, ... in
    byte order. Returns character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}


def _tokenizer_json(path: Path) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises plain Exception for every problem
        raise ValueError(f"{path}: not a readable tokenizer.json ({e})") from None


def _byte_level_bpe(vocab_file: Path, merges_file: Path) -> Tokenizer:
    try:
        vocab = json.loads(vocab_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{vocab_file}: not a readable vocabulary: not JSON ({e})") from None
    if not isinstance(vocab, dict) or not all(isinstance(i, int) and not isinstance(i, bool) for i in vocab.values()):
        raise ValueError(f"{vocab_file}: not a readable vocabulary: expected a JSON object of token -> id")
    try:
        bpe = models.BPE.from_file(str(vocab_file), str(merges_file))
    except Exception as e:  # the vocabulary was read above, so the merges are at fault
        raise ValueError(f"{merges_file}: not readable merges for {vocab_file.name} ({e})") from None
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if bpe.token_to_id(EOS_TOKEN) is not None:
        tok.add_special_tokens([EOS_TOKEN])
    return tok


def char_tokenizer(text: str) -> Tokenizer:
    """One id per distinct character of text, in sorted order; encode/decode round-trip exactly."""
    if not text:
        raise ValueError("char_tokenizer needs a non-empty text to take its characters from")
    vocab = {ch: i for i, ch in enumerate(sorted(set(text)))}
    # WordLevel over single characters: the Split pre-tokenizer isolates every character.
    tok = Tokenizer(models.WordLevel(vocab, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return tok
