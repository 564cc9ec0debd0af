"""Files written whole or not at all.

Every result row file, report, generated document and sidecar of the kit is written through
:func:`atomic_write`: the data goes to a temporary file in the target's folder, which is then renamed over
the target (``os.replace``, atomic on POSIX within one file system). A reader, or a run killed half-way,
sees the old file or the new one, never a torn one; the temporary file is removed on any error.

:func:`file_sha256` is the kit's one file hash (bundles, models, notebooks, fatbins, wheels, built modules).
This module imports only the standard library (no torch), so scripts run in other environments can use it.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from typing import Callable, IO


def atomic_write(path: str | os.PathLike, write: Callable[[IO], object], mode: str = "w") -> str:
    """Write ``path`` through ``write(file)`` into a temporary file, then rename it into place.

    Args:
        path: the target; its folder is created if missing.
        write: called once with the open temporary file.
        mode: ``"w"`` (text, UTF-8) or ``"wb"`` (bytes).

    Returns:
        ``path`` as a string. The file gets mode 0644 (``mkstemp`` creates 0600).

    Raises:
        ValueError: ``mode`` is not ``"w"`` or ``"wb"``; whatever ``write`` or the file system raises.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"mode must be 'w' or 'wb', got {mode!r}")
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, **({"encoding": "utf-8"} if mode == "w" else {})) as fh:
            write(fh)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def out_path_error(path: str, flag: str = "--out", give: str = "the result file's path") -> str | None:
    """Why ``path`` cannot take a result file, as a message naming ``flag``: its folder does not exist, or it is a
    folder (the message then asks for ``give``); None if it can. Scripts check their output path with it before any
    GPU work."""
    if not os.path.isdir(os.path.dirname(os.path.abspath(os.path.realpath(path)))):
        return f"{flag} {path!r}: its folder does not exist"
    if os.path.isdir(path):
        return f"{flag} {path!r} is a folder: give {give}"
    return None


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> str:
    """:func:`atomic_write` of ``data`` (bytes)."""
    return atomic_write(path, lambda f: f.write(data), "wb")


def atomic_write_text(path: str | os.PathLike, text: str) -> str:
    """:func:`atomic_write` of ``text`` (UTF-8)."""
    return atomic_write(path, lambda f: f.write(text), "w")


def file_sha256(path: str | os.PathLike, chunk_bytes: int = 1 << 20) -> str:
    """SHA-256 of the bytes of the file at ``path``, read ``chunk_bytes`` bytes at a time.

    Args:
        path: the file to hash.
        chunk_bytes: read size [bytes], at least 1 (default 1 MiB); it bounds the memory used, not the digest.

    Returns:
        The digest as 64 lowercase hex characters (``hashlib.sha256(data).hexdigest()`` of the whole file).

    Raises:
        ValueError: ``chunk_bytes`` is not an int of at least 1 (checked before the file is opened).
        FileNotFoundError: ``path`` does not exist; IsADirectoryError / PermissionError / other OSError as
            ``open`` or ``read`` raise them.
    """
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be an int >= 1, got {chunk_bytes!r}")
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(chunk_bytes), b""):
            h.update(chunk)
    return h.hexdigest()
