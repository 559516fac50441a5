"""gpt2attn.files: atomic file writes and folder swaps keep the old contents on failure and leave
no temporary behind; leftovers of killed writes are cleaned unless in use."""

import os
from pathlib import Path

import pytest

from gpt2attn import files
from gpt2attn.files import write_atomic, write_bytes_atomic, write_text_atomic


def test_a_failed_write_keeps_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "out.bin"
    write_bytes_atomic(target, b"old")

    def half_then_fail(f):
        f.write(b"new, but only ha")
        raise KeyboardInterrupt("power cut")

    with pytest.raises(KeyboardInterrupt):
        write_atomic(target, half_then_fail)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]


def test_text_goes_in_as_utf8_with_umask_permissions_and_parents_made(tmp_path):
    target = tmp_path / "a" / "b" / "note.txt"
    write_text_atomic(target, "héllo\n")
    assert target.read_bytes() == "héllo\n".encode("utf-8")
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask


def test_replace_folder_swaps_in_the_new_contents_and_keeps_what_it_is_told_to(tmp_path):
    target = tmp_path / "model"
    (target / "sub").mkdir(parents=True)
    (target / "weights").write_text("old")
    (target / "README.md").write_text("mine")
    (target / "sub" / "notes").write_text("kept")
    with files.replace_folder(target, keep=lambda name: name != "weights") as new:
        assert new.parent == tmp_path and new.name.startswith(".model.") and list(new.iterdir()) == []
        (new / "weights").write_text("new")
        (new / "README.md").write_text("the block's own")  # the block's file wins over a kept one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert (target / "weights").read_text() == "new"
    assert (target / "README.md").read_text() == "the block's own"
    assert (target / "sub" / "notes").read_text() == "kept"


def test_kept_entries_are_linked_not_copied_links_stay_links_and_leftovers_are_not_kept(tmp_path):
    target = tmp_path / "model"
    (target / "sub").mkdir(parents=True)
    (target / "README.md").write_text("mine")
    (target / "sub" / "notes").write_text("kept")
    (target / "link").symlink_to("README.md")
    (target / ".README.md.abcd1234.tmp").write_text("half a README")  # a killed write's leftover
    (target / "weights").write_text("old")
    readme_inode = os.stat(target / "README.md").st_ino
    with files.replace_folder(target, keep=lambda name: name != "weights") as new:
        (new / "weights").write_text("new")
    assert sorted(os.listdir(target)) == ["README.md", "link", "sub", "weights"]
    assert os.stat(target / "README.md").st_ino == readme_inode  # the same file, no copy
    assert (target / "link").is_symlink() and os.readlink(target / "link") == "README.md"
    assert (target / "sub" / "notes").read_text() == "kept" and (target / "weights").read_text() == "new"


def test_replace_folder_on_failure_leaves_the_old_folder_and_nothing_else(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "weights").write_text("old")
    with pytest.raises(OSError, match="disk full"):
        with files.replace_folder(target) as new:
            (new / "weights").write_text("new, but only ha")
            raise OSError("disk full")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert (target / "weights").read_text() == "old"


def test_replace_folder_without_rename_exchange(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "_exchange", lambda a, b: False)  # as on a file system without it
    target = tmp_path / "model"
    for text in ("one", "two"):
        with files.replace_folder(target) as new:
            (new / "weights").write_text(text)
    assert (target / "weights").read_text() == "two"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_leftovers_are_removed_unless_in_use_or_the_only_copy(tmp_path):
    fcntl = pytest.importorskip("fcntl", reason="advisory locks are POSIX only")
    target = tmp_path / "model"
    dead = tmp_path / ".model.abcd1234.tmp"  # a killed save's folder
    live = tmp_path / ".model.efgh5678.tmp"  # a save running now (it holds the lock)
    old = tmp_path / ".model.ijkl9012.old"   # the old model, moved aside by the two-rename swap
    other = tmp_path / ".other.abcd1234.tmp"  # another target's
    for folder in (dead, live, old, other):
        folder.mkdir()
    fd = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        files.remove_leftovers(target)  # `model` is missing: the .old folder is its only copy
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (live, old, other))
        target.mkdir()
        files.remove_leftovers(target)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (live, other, target))
    finally:
        os.close(fd)
    write_text_atomic(tmp_path / "note", "x")
    (tmp_path / ".note.abcd1234.tmp").write_text("a killed write")
    write_text_atomic(tmp_path / "note", "y")
    assert not (tmp_path / ".note.abcd1234.tmp").exists()


def test_replace_folder_through_a_link_and_from_inside(tmp_path, monkeypatch):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    with files.replace_folder(tmp_path / "link") as new:
        (new / "weights").write_text("new")
    assert (tmp_path / "link").is_symlink() and (real / "weights").read_text() == "new"
    monkeypatch.chdir(real)
    with files.replace_folder(".") as new:
        (new / "weights").write_text("newer")
    assert Path("weights").read_text() == "newer"  # the working directory is the new folder
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="is not a folder"):
        with files.replace_folder(tmp_path / "file"):
            pass


# --- durability: what a swap makes visible is on disk before it --------------------------------


def record_disk_events(monkeypatch) -> list[tuple[str, object]]:
    """Patch os.fsync, os.replace, os.rename and files._exchange to log, in order,
    ("fsync", (device, inode)) and (kind, destination path) for each rename / exchange."""
    events: list[tuple[str, object]] = []
    real_fsync, real_replace, real_rename, real_exchange = os.fsync, os.replace, os.rename, files._exchange

    def fsync(fd):
        st = os.fstat(fd)
        events.append(("fsync", (st.st_dev, st.st_ino)))
        real_fsync(fd)

    def replace(src, dst, **kwargs):
        events.append(("replace", os.path.abspath(dst)))
        real_replace(src, dst, **kwargs)

    def rename(src, dst, **kwargs):
        events.append(("rename", os.path.abspath(dst)))
        real_rename(src, dst, **kwargs)

    def exchange(a, b):
        events.append(("exchange", os.path.abspath(b)))
        return real_exchange(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(files, "_exchange", exchange)
    return events


def inode(path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def synced_before_and_after(events, target: Path) -> tuple[set, set]:
    """The inodes fsynced before the event that put something at `target`, and those after it."""
    swaps = [i for i, (kind, arg) in enumerate(events) if kind != "fsync" and arg == str(target)]
    assert swaps, f"nothing was renamed or exchanged to {target}: {events}"
    synced = lambda part: {arg for kind, arg in part if kind == "fsync"}  # noqa: E731
    return synced(events[: swaps[0]]), synced(events[swaps[0] + 1 :])


def test_write_atomic_fsyncs_the_temporary_file_before_renaming_it(tmp_path, monkeypatch):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    events = record_disk_events(monkeypatch)
    write_bytes_atomic(target, b"new")
    before, _ = synced_before_and_after(events, target)
    assert inode(target) in before


@pytest.mark.parametrize("how", ["replace_folder", "replace_folder, new path", "save_pretrained",
                                 "exchange unsupported"])
def test_every_file_and_folder_is_fsynced_before_the_swap_and_the_parent_after(tmp_path, monkeypatch, how):
    from gpt2attn import GPT2LMHeadModel
    from tests.helpers import tiny_config

    target = tmp_path / "model"
    if how != "replace_folder, new path":
        (target / "sub").mkdir(parents=True)
        (target / "README.md").write_text("kept")
        (target / "sub" / "notes").write_text("kept too")
    if how == "exchange unsupported":
        monkeypatch.setattr(files, "_exchange", lambda a, b: False)
    events = record_disk_events(monkeypatch)
    if how == "save_pretrained":
        GPT2LMHeadModel(tiny_config()).save_pretrained(target)
    else:
        with files.replace_folder(target, keep=lambda name: True) as new:
            (new / "deep" / "er").mkdir(parents=True)
            (new / "deep" / "er" / "weights").write_bytes(b"new")
    before, after = synced_before_and_after(events, target)
    on_disk = [Path(root) / name for root, dirs, names in os.walk(target) for name in [*dirs, *names]] + [target]
    assert len(on_disk) >= 3
    assert {path: inode(path) in before for path in on_disk} == {path: True for path in on_disk}
    assert inode(tmp_path) in after  # the parent's entry for the swapped name
