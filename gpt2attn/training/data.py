"""Text -> uint16 token ids on disk (once) -> random contiguous (x, y) blocks.

`prepare_data` tokenizes a text file (or a folder of .txt files) with the GPT-2 BPE or a char
vocabulary and writes train.bin / val.bin (raw uint16), tokenizer.json and meta.json into a
folder; a later run with the same source and tokenizer reuses them. `TokenData` memory-maps
the two splits and cuts batches from them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from torch import Tensor

from ..files import write_bytes_atomic, write_text_atomic
from ..tokenizer import char_tokenizer, encode, load_tokenizer


def read_text(src: str | Path) -> str:
    """The text of a file, or of a folder's *.txt files (sorted by name) joined."""
    path = Path(src)
    if path.is_dir():
        files = sorted(path.rglob("*.txt"))
        if not files:
            raise FileNotFoundError(f"no .txt files in the data folder {path}")
        return "".join(_read_utf8(f) for f in files)
    if not path.is_file():
        raise FileNotFoundError(f"no data file or folder at {path} (set --data=PATH)")
    return _read_utf8(path)


def _read_utf8(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text: byte {e.object[e.start]:#04x} at offset {e.start}") from None


def prepare_data(src: str | Path, folder: str | Path, tokenizer: str = "char", val_fraction: float = 0.1,
                 keep_vocabulary: str | Path | None = None) -> Path:
    """Tokenize src into folder (train.bin, val.bin, tokenizer.json, meta.json); returns folder.

    tokenizer is "char" (a vocabulary of src's characters) or a folder / tokenizer.json file.
    keep_vocabulary, a tokenizer.json (a resumed run's), refuses before anything is written
    when src tokenizes to another vocabulary.
    """
    folder = Path(folder)
    text = read_text(src)
    digest = hashlib.sha256(f"{tokenizer}\0{val_fraction}\0".encode() + text.encode()).hexdigest()
    meta_path = folder / "meta.json"
    prepared = meta_path.is_file() and json.loads(meta_path.read_text())["digest"] == digest
    if prepared and keep_vocabulary is None:
        return folder

    if prepared:
        tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    else:
        tok = char_tokenizer(text) if tokenizer == "char" else load_tokenizer(tokenizer)
    if keep_vocabulary is not None:
        _check_same_vocabulary(tok, Path(keep_vocabulary), src)
    if prepared:
        return folder
    vocab_size = tok.get_vocab_size()
    if vocab_size > 65536:
        raise ValueError(f"the tokenizer has {vocab_size} tokens; uint16 token files hold at most 65536")
    ids = np.array(encode(tok, text), dtype=np.uint16)
    n_val = int(len(ids) * val_fraction)
    if n_val < 2 or len(ids) - n_val < 2:
        raise ValueError(f"{src} gives only {len(ids)} tokens: too few for a train/val split")

    folder.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(folder / "train.bin", ids[: len(ids) - n_val].tobytes())
    write_bytes_atomic(folder / "val.bin", ids[len(ids) - n_val :].tobytes())
    write_text_atomic(folder / "tokenizer.json", tok.to_str())
    meta = {"digest": digest, "source": str(src), "tokenizer": tokenizer, "vocab_size": vocab_size,
            "train_tokens": len(ids) - n_val, "val_tokens": n_val}
    write_text_atomic(meta_path, json.dumps(meta, indent=2) + "\n")  # last: marks the folder complete
    return folder


def _check_same_vocabulary(tok: Tokenizer, kept: Path, src: str | Path) -> None:
    old, new = Tokenizer.from_file(str(kept)).get_vocab(), tok.get_vocab()
    if old == new:
        return
    changed = sorted(set(old.items()) ^ set(new.items()), key=lambda item: item[1])
    shown = ", ".join(repr(token) for token, _ in changed[:8]) + (", ..." if len(changed) > 8 else "")
    raise ValueError(
        f"--resume: {src} tokenizes to another vocabulary ({len(new)} tokens) than the checkpoint was trained "
        f"on ({len(old)} tokens, {kept}); tokens that differ: {shown}. Resume with the run's own data and "
        f"tokenizer, or start a new out_dir"
    )


class TokenData:
    """The two splits of a prepared folder, memory-mapped, cut into (x, y) blocks."""

    def __init__(self, folder: str | Path, block_size: int):
        folder = Path(folder)
        self.meta = json.loads((folder / "meta.json").read_text())
        self.vocab_size = self.meta["vocab_size"]
        self.block_size = block_size
        self.splits = {name: np.memmap(folder / f"{name}.bin", dtype=np.uint16, mode="r") for name in ("train", "val")}
        for name, ids in self.splits.items():
            if len(ids) <= block_size + 1:
                raise ValueError(f"the {name} split has {len(ids)} tokens, fewer than block_size + 2 = {block_size + 2}")

    def offsets(self, split: str, n: int, generator: torch.Generator) -> Tensor:
        """n random block starts in split."""
        return torch.randint(len(self.splits[split]) - self.block_size - 1, (n,), generator=generator)

    def batch(self, split: str, offsets: Tensor) -> tuple[Tensor, Tensor]:
        """Inputs x and next-token targets y, both (len(offsets), block_size) int64."""
        rows = offsets.numpy()[:, None] + np.arange(self.block_size + 1)  # (B, T+1)
        blocks = torch.from_numpy(self.splits[split][rows].astype(np.int64))
        return blocks[:, :-1], blocks[:, 1:]
