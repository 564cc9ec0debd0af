"""The exit path every ``python -m kvrepro.<module>`` command shares: :func:`run`.

A reader that closes the pipe early (``python -m kvrepro.summary ... | head -3``) makes the next write to stdout
raise BrokenPipeError; the command then ends quietly with status 1, as the Python docs advise (``signal`` module,
"Note on SIGPIPE"), instead of a traceback.
"""
from __future__ import annotations

import os
import sys
from typing import Callable

# The exit status of a command whose stdout was closed early (Python's own on EPIPE).
BROKEN_PIPE_STATUS = 1


def run(main: Callable[[], int | None]) -> int:
    """``main()``'s exit status, or :data:`BROKEN_PIPE_STATUS` when its stdout was closed while it wrote.

    Use as ``raise SystemExit(cli.run(main))`` in a module's ``__main__`` block. stdout is flushed inside, so a
    closed pipe is met here, not by the interpreter's flush at exit; after one, stdout points at os.devnull so
    that flush writes nowhere."""
    try:
        status = main()
        sys.stdout.flush()
        return status
    except BrokenPipeError:
        _stdout_to_devnull()
        return BROKEN_PIPE_STATUS


def _stdout_to_devnull() -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (AttributeError, OSError, ValueError):     # stdout replaced by an object without a file descriptor
        sys.stdout = open(os.devnull, "w")
    finally:
        os.close(devnull)
