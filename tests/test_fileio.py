"""kvrepro.fileio: a file is written whole or not at all; file_sha256 hashes a file in chunks."""
import hashlib
import os

import pytest

from kvrepro.fileio import atomic_write, atomic_write_bytes, atomic_write_text, file_sha256


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


def test_file_sha256_matches_hashlib_over_several_chunks_and_an_empty_file(tmp_path):
    data = os.urandom((1 << 20) + 17)                   # one default chunk (1 MiB) and a partial one
    big, empty = tmp_path / "big.bin", tmp_path / "empty.bin"
    big.write_bytes(data)
    empty.write_bytes(b"")
    want = hashlib.sha256(data).hexdigest()
    assert file_sha256(big) == want
    assert file_sha256(str(big), chunk_bytes=4096) == want      # many chunks, a str path
    assert file_sha256(big, chunk_bytes=len(data)) == want      # exactly one chunk
    assert file_sha256(empty) == hashlib.sha256(b"").hexdigest()
    assert file_sha256(empty, chunk_bytes=1024) == hashlib.sha256(b"").hexdigest()


def test_file_sha256_refuses_a_missing_file_and_a_bad_chunk(tmp_path):
    with pytest.raises(FileNotFoundError):
        file_sha256(tmp_path / "missing.bin")
    (tmp_path / "a").write_bytes(b"x")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="chunk_bytes must be an int >= 1"):
            file_sha256(tmp_path / "a", chunk_bytes=bad)


def test_out_path_error_names_the_flag_and_the_fault(tmp_path):
    from kvrepro.fileio import out_path_error

    assert out_path_error(str(tmp_path / "r.json")) is None                      # a new file in an existing folder
    assert out_path_error(str(tmp_path / "no" / "r.json")) == f"--out {str(tmp_path / 'no' / 'r.json')!r}: its folder does not exist"
    assert out_path_error(str(tmp_path), "--csv", "a CSV file path") == f"--csv {str(tmp_path)!r} is a folder: give a CSV file path"
