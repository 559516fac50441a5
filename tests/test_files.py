"""gpt2attn.files: atomic writes keep the old file on failure and leave no temporary behind."""

import os

import pytest

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
