"""Crash-safe writes: every file and every model folder gpt2attn writes appears whole or not at all.

A file: `write_atomic(path, write)` writes into a temporary file beside `path`, fsyncs it and
renames it over `path`. rename(2) replaces a name in one step: readers see the old file or the
new one, never a part.

A model folder (config.json, weights or shards and their index, tokenizer files) is several
files that must change together, so renaming them one by one is not enough: a kill in between
leaves new shards beside an old index, or a new config.json beside old weights.
`replace_folder(path)` instead hands out a new folder to write the whole model into and swaps
it in at the end. Why `path` holds the complete old model or the complete new one at every
instant, wherever the process is killed (SIGKILL, power cut):

1. Leftovers of earlier killed writes to `path` (siblings named `.NAME.XXXXXXXX.tmp`) are
   removed, except those a live process holds a lock on (a save running in parallel).
2. A new folder `.NAME.XXXXXXXX.tmp` is made beside `path` and locked. The caller writes every
   new file into it; the old folder's files the caller keeps (a README, tokenizer files) are
   hard-linked in; then every file and folder in it is fsynced. `path` has not been touched: a
   kill until here leaves the old folder as it was, plus a leftover that no load reads (loads
   read `path`, never its siblings) and that the next write to `path` removes.
3. One renameat2(RENAME_EXCHANGE) call swaps the two names. The kernel does it in one step:
   before it, `path` is the old folder; after it, the new one; there is no instant between.
   The parent folder is fsynced so that the swap survives a power cut. (When `path` does not
   exist yet, a plain rename puts the new folder there, just as atomically.)
4. The old folder, now under the temporary name, is deleted. A kill while deleting leaves part
   of it under that name, not under `path`; step 1 of the next write removes it.

Where the file system cannot exchange names (not Linux; some network file systems), step 3 is
two renames: `path` to `.NAME.XXXXXXXX.old`, then the new folder to `path`. A kill between them
leaves no `path` and the whole old model under the `.old` name; that name is never cleaned
while `path` is missing. A mount point cannot be renamed at all: save into a folder inside it.
Writing `path` needs write access to its parent folder, where the new folder is made.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; leftovers are then removed without asking
    fcntl = None


def write_atomic(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> None:
    """write(f) into a temporary file beside `path` (created with the usual umask permissions,
    not mkstemp's 0600), flush it to disk, then rename it to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            _lock(fd, blocking=True)  # held until the rename, so no cleanup removes it meanwhile
            os.chmod(tmp, 0o666 & ~_umask())
            write(f)
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    write_atomic(path, lambda f: f.write(text.encode("utf-8")))


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> None:
    write_atomic(path, lambda f: f.write(data))


@contextmanager
def replace_folder(path: str | os.PathLike, keep: Callable[[str], bool] = lambda name: False) -> Iterator[Path]:
    """Yield an empty folder to write the new contents of folder `path` into; when the block
    ends without an exception, swap it in for `path` as one step (see the module docstring).
    Entries of the old folder for which keep(name) is true, and that the block did not write,
    are carried over. On an exception `path` is left as it was and the new folder removed."""
    path = Path(os.path.abspath(path))
    if path.is_symlink():
        path = Path(os.path.realpath(path))  # replace what the link points at, keep the link
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{path} exists and is not a folder")
    if os.path.ismount(path):
        raise OSError(errno.EBUSY, f"{path} is a mount point, which cannot be replaced by a rename; "
                                   "save into a folder inside it")
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(path)
    try:
        new = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    except PermissionError:
        raise PermissionError(errno.EACCES, f"cannot write {path}: the new contents go into a folder beside it, "
                              f"and {path.parent} is not writable") from None
    lock = os.open(new, os.O_RDONLY)
    try:
        _lock(lock, blocking=True)
        os.chmod(new, path.stat().st_mode & 0o7777 if path.is_dir() else 0o777 & ~_umask())
        yield new
        if path.is_dir():
            for entry in path.iterdir():
                if keep(entry.name) and not LEFTOVER.fullmatch(entry.name) and not os.path.lexists(new / entry.name):
                    _link_tree(entry, new / entry.name)
        _fsync_tree(new)
        in_it = path.exists() and Path.cwd() == path
        _swap(new, path)
        _fsync(path.parent)
        if in_it:  # our working directory was the old folder, about to be deleted
            os.chdir(path)
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    finally:
        os.close(lock)
    shutil.rmtree(new, ignore_errors=True)  # the old folder, now under the temporary name


def remove_tree(path: str | os.PathLike) -> None:
    """Delete a file or folder: renamed to a leftover name first, so that a kill while deleting
    never leaves part of it under its own name."""
    path = Path(path)
    if not os.path.lexists(path):
        return
    trash = Path(tempfile.mktemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    os.rename(path, trash)
    if trash.is_dir() and not trash.is_symlink():
        shutil.rmtree(trash, ignore_errors=True)
    else:
        trash.unlink(missing_ok=True)


def link_or_copy(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """A hard link to file src at dst (no bytes copied), or a copy where links are not allowed."""
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)


# Temporary names: tempfile's `.NAME.` + 8 random characters + `.tmp` (or `.old`, see _swap).
LEFTOVER = re.compile(r"\.(.+)\.[a-z0-9_]{8}\.(tmp|old)")


def remove_leftovers(path: str | os.PathLike) -> None:
    """Remove the temporary files and folders that killed writes to `path` left beside it,
    unless a live process holds their lock. An `.old` folder is the only copy of a model while
    `path` is missing (see the module docstring), so it is kept until then."""
    path = Path(path)
    if not path.parent.is_dir():
        return
    for entry in path.parent.iterdir():
        m = LEFTOVER.fullmatch(entry.name)
        if m is None or m.group(1) != path.name or (m.group(2) == "old" and not path.exists()):
            continue
        try:
            fd = os.open(entry, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue  # gone already, or a link
        try:
            if not _lock(fd, blocking=False):
                continue  # a write in progress
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        finally:
            os.close(fd)


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _lock(fd: int, blocking: bool) -> bool:
    """An exclusive advisory lock on fd (held until it is closed); False if another holds it."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    return True


def _link_tree(src: Path, dst: Path) -> None:
    if src.is_dir() and not src.is_symlink():
        shutil.copytree(src, dst, symlinks=True, copy_function=link_or_copy)
    else:
        link_or_copy(src, dst)


def _fsync(path: Path) -> None:
    """Flush a file's data or a folder's entries to disk (folders cannot be opened on Windows)."""
    if path.is_dir() and os.name == "nt":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    for root, dirs, files in os.walk(folder):
        for name in files:
            if not os.path.islink(os.path.join(root, name)):
                _fsync(Path(root, name))
        _fsync(Path(root))


def _swap(new: Path, path: Path) -> None:
    """Put folder `new` at `path`; afterwards `new` names the old folder (if there was one)."""
    if not path.exists():
        os.rename(new, path)
        return
    if _exchange(new, path):
        return
    old = Path(tempfile.mktemp(dir=path.parent, prefix=f".{path.name}.", suffix=".old"))
    os.rename(path, old)
    try:
        os.rename(new, path)
    except BaseException:
        os.rename(old, path)
        raise
    os.rename(old, new)


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names a and b in one step (Linux renameat2 with RENAME_EXCHANGE); False where
    the system or file system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)  # glibc >= 2.28
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))
