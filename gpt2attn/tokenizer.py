"""Tokenizers for gpt2attn, built on the `tokenizers` library.

`load_tokenizer(src)` reads GPT-2's byte-level BPE from `tokenizer.json`, HF's
`vocab.json` + `merges.txt`, or OpenAI's `encoder.json` + `vocab.bpe`.
`char_tokenizer(text)` makes a character-level vocabulary (ids 0..V-1, sorted characters),
as nanoGPT's shakespeare_char does.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

EOS_TOKEN = "<|endoftext|>"


def load_tokenizer(src: str | Path, cache_dir: str | Path | None = None) -> Tokenizer:
    """The tokenizer stored in folder src (or a tokenizer.json file, or a hub model's folder)."""
    from .checkpoint import resolve

    path = resolve(src, cache_dir)
    if path.is_file():
        return Tokenizer.from_file(str(path))
    if not path.is_dir():
        raise FileNotFoundError(f"no tokenizer folder at {path}")
    if (path / "tokenizer.json").is_file():
        return Tokenizer.from_file(str(path / "tokenizer.json"))
    for vocab_name, merges_name in (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")):
        if (path / vocab_name).is_file() and (path / merges_name).is_file():
            return _byte_level_bpe(path / vocab_name, path / merges_name)
    raise FileNotFoundError(
        f"no tokenizer in {path}: expected tokenizer.json, vocab.json + merges.txt, or encoder.json + vocab.bpe"
    )


def _byte_level_bpe(vocab_file: Path, merges_file: Path) -> Tokenizer:
    bpe = models.BPE.from_file(str(vocab_file), str(merges_file))
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
