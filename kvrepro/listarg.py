"""Comma-separated list arguments of the kit's command lines and settings (modes, formats, users, GPUs, ...).

One parser for all of them, so that a typo such as ``13,,6`` or a trailing comma is an error naming the argument
instead of a silently shorter list.
"""
from __future__ import annotations

import re

_SEP = re.compile(r"\s*,\s*|\s+")


def comma_list(text: str, name: str) -> list[str]:
    """The items of ``text``, separated by commas and / or whitespace (``"a,b"``, ``"a, b"``, ``"a b"``).

    Args:
        text: the argument as given.
        name: the argument's name, for the error (e.g. ``"--users"``).

    Returns:
        the items, in order, stripped (at least one).

    Raises:
        ValueError: ``text`` is not a string, is empty, or has an empty item (``"a,,b"``, ``"a,"``, ``",a"``),
            naming ``name`` and the text.
    """
    if not isinstance(text, str):
        raise ValueError(f"{name} must be a comma-separated list, got {text!r}")
    items = _SEP.split(text.strip())
    if items == [""]:
        raise ValueError(f"{name} is empty: give a comma-separated list")
    if any(not x for x in items):
        raise ValueError(f"{name} has an empty item in {text!r}: remove the extra comma")
    return items
