"""Tokenizers for gpt2attn, built on the `tokenizers` library.

`load_tokenizer(src)` reads GPT-2's byte-level BPE from `tokenizer.json`, HF's
`vocab.json` + `merges.txt`, or OpenAI's `encoder.json` + `vocab.bpe`.
`char_tokenizer(text)` makes a character-level vocabulary (ids 0..V-1, sorted characters),
as nanoGPT's shakespeare_char does; its `encode` (like `encode(tokenizer, text)` for any
tokenizer) raises a ValueError naming the characters the vocabulary lacks. `token_labels(tokenizer,
ids)` gives each token's text with its whitespace made visible, for tick labels and pages.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from .errors import CheckpointError, read_json_file
from .hub import resolve

EOS_TOKEN = "<|endoftext|>"


def load_tokenizer(src: str | Path, cache_dir: str | Path | None = None) -> Tokenizer | CharTokenizer:
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
    one, with no unknown token) is a ValueError that names them. A character vocabulary as
    `char_tokenizer` makes it is a table lookup (0.07 s for tinyshakespeare, tokenizers takes 1.6 s)."""
    ids = _char_lookup(tokenizer, text)
    if ids is not None:
        return ids
    try:
        return tokenizer.encode(text).ids
    except Exception as e:  # tokenizers raises plain Exception ("Missing [UNK] token ...")
        raise _missing_characters(tokenizer, text, e) from None


CHAR_SPLIT = {"type": "Split", "pattern": {"String": ""}, "behavior": "Isolated", "invert": False}


def _char_lookup(tokenizer: Tokenizer, text: str) -> list[int] | None:
    """text's ids by looking each character up, for a tokenizer that is exactly one token per
    character (WordLevel over single characters, split into characters, nothing added around);
    None for any other tokenizer, or when text has a character the vocabulary lacks (the caller's
    tokenizer then raises)."""
    if not isinstance(getattr(tokenizer, "model", None), models.WordLevel):
        return None
    spec = json.loads(tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    if not is_characters(spec) or spec["normalizer"] or spec["post_processor"] or spec["added_tokens"]:
        return None
    chars = np.array([ord(token) for token in vocab], dtype=np.uint32)
    order = np.argsort(chars)
    chars, ids = chars[order], np.array(list(vocab.values()), dtype=np.int64)[order]
    try:
        points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    except UnicodeEncodeError:  # a lone surrogate: tokenizers' own path reports it
        return None
    where = np.searchsorted(chars, points).clip(max=len(chars) - 1)
    if not np.array_equal(chars[where], points):
        return None
    return ids[where].tolist()


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


def is_characters(spec: dict) -> bool:
    """Whether a tokenizer (its JSON form, tokenizer.to_str()) is a character vocabulary: WordLevel
    over single characters, as char_tokenizer makes it."""
    return (spec["model"]["type"] == "WordLevel" and spec["pre_tokenizer"] == CHAR_SPLIT
            and all(len(token) == 1 for token in spec["model"]["vocab"]))


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE writes each byte as one printable character ('Ġ' is the space byte,
    'Ċ' the newline): printable Latin-1 bytes stand for themselves, the others are 256, 257, ... in
    byte order. Returns character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}


def _missing_characters(tokenizer: Tokenizer, text: str, error: Exception) -> ValueError:
    """The error for text that tokenizer failed on: the characters its vocabulary lacks, by name."""
    vocab = tokenizer.get_vocab()
    pieces = tokenizer.pre_tokenizer.pre_tokenize_str(text) if tokenizer.pre_tokenizer else [(text, None)]
    missing = [piece for piece in dict.fromkeys(piece for piece, _ in pieces) if piece not in vocab]
    if not missing:
        return ValueError(f"cannot encode the text: {error}")
    shown = ", ".join(f"{piece!r} ({', '.join(f'U+{ord(c):04X}' for c in piece)})" for piece in missing[:20])
    more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
    return ValueError(f"the text has characters that the tokenizer's vocabulary ({len(vocab)} tokens) "
                      f"does not hold: {shown}{more}")


class CharTokenizer:
    """A character-level `tokenizers.Tokenizer` (a WordLevel vocabulary without an unknown token)
    whose `encode` / `encode_batch` raise a ValueError naming the characters it lacks, where
    tokenizers says "Missing [UNK] token". tokenizers' class cannot be subclassed, so this holds
    one as `.tokenizer` and passes every other attribute, read or set, through to it."""

    def __init__(self, tokenizer: Tokenizer):
        object.__setattr__(self, "tokenizer", tokenizer)

    def encode(self, sequence, *args, **kwargs):
        try:
            return self.tokenizer.encode(sequence, *args, **kwargs)
        except Exception as e:
            raise _missing_characters(self.tokenizer, str(sequence), e) from None

    def encode_batch(self, inputs, *args, **kwargs):
        try:
            return self.tokenizer.encode_batch(inputs, *args, **kwargs)
        except Exception as e:
            raise _missing_characters(self.tokenizer, "".join(map(str, inputs)), e) from None

    def save(self, path: str, pretty: bool = True) -> None:
        # Spelled out: __getattr__ never sees a name every object has, and nnsight gives every
        # object a `save` once it is imported.
        self.tokenizer.save(path, pretty)

    def __getattr__(self, name: str):
        if name == "tokenizer":  # not set yet (copy, unpickling): no endless lookup
            raise AttributeError(name)
        return getattr(self.tokenizer, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self.tokenizer, name, value)

    def __repr__(self) -> str:
        return f"CharTokenizer({self.tokenizer.get_vocab_size()} characters)"


def _with_character_errors(tokenizer: Tokenizer) -> Tokenizer | CharTokenizer:
    """tokenizer, wrapped in CharTokenizer when it is a vocabulary without an unknown token."""
    model = tokenizer.model
    if isinstance(model, models.WordLevel) and tokenizer.token_to_id(model.unk_token) is None:
        return CharTokenizer(tokenizer)
    return tokenizer


PROBE = "Hello, world! <|endoftext|> 1234 café 中文 🙂\n"  # encoded once at load: a tokenizer that loads works


def checked(tokenizer: Tokenizer, file: str | Path) -> Tokenizer:
    """tokenizer, after encoding and decoding PROBE with it: tokenizers can build a tokenizer that
    panics (pyo3's PanicException, a BaseException) on its first encode, e.g. one whose
    post-processor names a token the vocabulary lacks. Plain exceptions are the text's fault
    (a character a vocabulary lacks) and are left to encode()."""
    try:
        tokenizer.decode(tokenizer.encode(PROBE).ids)
    except Exception:
        pass
    except BaseException as e:
        if type(e).__name__ != "PanicException":
            raise  # KeyboardInterrupt, SystemExit
        raise CheckpointError(file, f"the tokenizer it holds fails on its first text (a panic in tokenizers: {e})") from None
    return tokenizer


def _tokenizer_json(path: Path) -> Tokenizer | CharTokenizer:
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises plain Exception for every problem
        raise CheckpointError(path, f"not a readable tokenizer.json ({e})") from None
    return _with_character_errors(checked(tokenizer, path))


def _byte_level_bpe(vocab_file: Path, merges_file: Path) -> Tokenizer:
    vocab = read_json_file(vocab_file, "not a readable vocabulary: not JSON")
    if not isinstance(vocab, dict) or not all(isinstance(i, int) and not isinstance(i, bool) for i in vocab.values()):
        raise CheckpointError(vocab_file, "not a readable vocabulary: expected a JSON object of token -> id")
    try:
        bpe = models.BPE.from_file(str(vocab_file), str(merges_file))
    except Exception as e:  # the vocabulary was read above, so the merges are at fault
        raise CheckpointError(merges_file, f"not readable merges for {vocab_file.name} ({e})") from None
    return checked(_byte_level(bpe, [EOS_TOKEN]), merges_file)


def byte_level_bpe(vocab: dict[str, int], merges: list[tuple[str, str]], special: list[str] = (EOS_TOKEN,),
                   file: str | Path = "tokenizer") -> Tokenizer:
    """GPT-2's byte-level BPE from its vocabulary (token -> id) and merges, as a GGUF file embeds them."""
    try:
        bpe = models.BPE(vocab, merges)
    except Exception as e:  # tokenizers raises plain Exception
        raise CheckpointError(file, f"not a readable BPE vocabulary and merges ({e})") from None
    return checked(_byte_level(bpe, special), file)


def _byte_level(bpe: models.BPE, special: list[str]) -> Tokenizer:
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([t for t in special if bpe.token_to_id(t) is not None])
    return tok


def char_tokenizer(text: str) -> CharTokenizer:
    """One id per distinct character of text, in sorted order; encode/decode round-trip exactly."""
    if not text:
        raise ValueError("char_tokenizer needs a non-empty text to take its characters from")
    return characters({ch: i for i, ch in enumerate(sorted(set(text)))})


def characters(vocab: dict[str, int]) -> CharTokenizer:
    """The character-level tokenizer of vocab (single character -> id), as char_tokenizer makes it."""
    # WordLevel over single characters: the Split pre-tokenizer isolates every character.
    tok = Tokenizer(models.WordLevel(vocab, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return CharTokenizer(tok)
