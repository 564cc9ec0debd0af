"""kvrepro.fileio: a file is written whole or not at all."""
import os

import pytest

from kvrepro.fileio import atomic_write, atomic_write_bytes, atomic_write_text


def test_writes_text_and_bytes_with_readable_mode(tmp_path):
    p = tmp_path / "sub" / "a.txt"                      # the folder is created
    assert atomic_write_text(p, "héllo\n") == str(p)
    assert p.read_text(encoding="utf-8") == "héllo\n"
    atomic_write_bytes(p, b"\x00\x01")
    assert p.read_bytes() == b"\x00\x01"
    assert os.stat(p).st_mode & 0o777 == 0o644
    assert os.listdir(p.parent) == ["a.txt"]            # no temporary file left


def test_a_failing_writer_leaves_the_old_file_and_no_temporary(tmp_path):
    p = tmp_path / "r.jsonl"
    p.write_text("old\n")

    def broken(f):
        f.write("half a row")
        raise RuntimeError("killed mid-write")

    with pytest.raises(RuntimeError, match="killed mid-write"):
        atomic_write(p, broken)
    assert p.read_text() == "old\n" and os.listdir(tmp_path) == ["r.jsonl"]


def test_refuses_an_unknown_mode(tmp_path):
    with pytest.raises(ValueError, match="mode must be 'w' or 'wb', got 'a'"):
        atomic_write(tmp_path / "x", lambda f: None, "a")
    assert not os.listdir(tmp_path)
