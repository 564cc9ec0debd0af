"""Files written whole or not at all.

Every result row file, report, generated document and sidecar of the kit is written through
:func:`atomic_write`: the data goes to a temporary file in the target's folder, which is then renamed over
the target (``os.replace``, atomic on POSIX within one file system). A reader, or a run killed half-way,
sees the old file or the new one, never a torn one; the temporary file is removed on any error.
"""
from __future__ import annotations

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


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> str:
    """:func:`atomic_write` of ``data`` (bytes)."""
    return atomic_write(path, lambda f: f.write(data), "wb")


def atomic_write_text(path: str | os.PathLike, text: str) -> str:
    """:func:`atomic_write` of ``text`` (UTF-8)."""
    return atomic_write(path, lambda f: f.write(text), "w")
