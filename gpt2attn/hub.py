"""Where a model source lives: a local path as it is, or a hub name found through `huggingface_hub`'s cache.

At the bottom of the package (it imports nothing of gpt2attn), so that the config, the tokenizer
and the loader can all find files without importing one another.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# The weights files of a Hugging Face model folder.
SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
BIN_WEIGHTS = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"


def resolve(src: str | os.PathLike, cache_dir=None, local_files_only: bool = False) -> Path:
    """A local path as it is; otherwise a hub name, looked up through huggingface_hub."""
    path = Path(src).expanduser()
    if path.exists():
        return path
    name = str(src)
    if name.startswith((".", "/", "~")) or name.count("/") > 1 or not re.fullmatch(r"[\w.\-/]+", name):
        raise FileNotFoundError(f"{src}: no such file or folder")
    try:
        return download(name, cache_dir, local_files_only)
    except FileNotFoundError as e:  # 'out/model' may have been meant as a folder: say first that none is here
        raise FileNotFoundError(f"{src}: no such local file or folder (looked in {Path.cwd()}), and {e}") from None


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def download(repo_id: str, cache_dir=None, local_files_only: bool = False) -> Path:
    """The snapshot folder of a hub model (config + one weights format), cached by huggingface_hub."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    offline = local_files_only or hub_offline()
    # 'gpt2' now lives at 'openai-community/gpt2'; a cache may hold either name.
    names = [repo_id] if "/" in repo_id else [repo_id, f"openai-community/{repo_id}"]
    for name in names:
        try:
            folder = Path(
                snapshot_download(name, cache_dir=cache_dir, local_files_only=True, allow_patterns=["*.json"])
            )
            if has_weights(folder):
                return folder
        except LocalEntryNotFoundError:
            pass
    if offline:
        raise FileNotFoundError(
            f"{repo_id!r} is not in the Hugging Face cache and downloads are off (HF_HUB_OFFLINE=1 or "
            f"local_files_only): if it is a hub repo, download it once with network access (`hf download {names[-1]}`)"
        )
    try:
        patterns = ["*.json", "*.txt", "*.safetensors"]  # config, tokenizer, weights
        folder = Path(snapshot_download(names[-1], cache_dir=cache_dir, allow_patterns=patterns))
    except Exception as e:  # network errors, missing repos, gated repos: all say why, in the first line
        said = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise FileNotFoundError(f"could not download {names[-1]!r} from the Hugging Face hub: {said}") from None
    return folder


def has_weights(folder: Path) -> bool:
    return any((folder / name).exists() for name in (SAFE_WEIGHTS, SAFE_INDEX, BIN_WEIGHTS, BIN_INDEX))
