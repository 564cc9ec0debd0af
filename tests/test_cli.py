"""The package's commands end quietly when their reader closes the pipe early (``... | head -3``)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]



def _closed_reader(args: list[str]) -> subprocess.CompletedProcess:
    """Run ``python -m <args>`` with stdout into a pipe whose only reader is closed before the command writes."""
    r, w = os.pipe()
    p = subprocess.Popen([sys.executable, "-m", *args], stdout=w, stderr=subprocess.PIPE, cwd=ROOT)
    os.close(w)
    os.close(r)          # the reader is gone: the command's first write to stdout meets EPIPE
    _, err = p.communicate(timeout=300)
    return subprocess.CompletedProcess(p.args, p.returncode, None, err.decode())


@pytest.mark.parametrize("args", [["kvrepro.settings"], ["kvrepro.summary"]], ids=lambda a: a[0])
def test_a_command_whose_reader_closed_the_pipe_ends_quietly_with_status_1(args):
    out = _closed_reader(args)
    assert out.stderr == ""             # no BrokenPipeError traceback, nor "Exception ignored ... BrokenPipeError"
    assert out.returncode == 1


def test_a_command_read_to_the_end_still_exits_0():
    out = subprocess.run([sys.executable, "-m", "kvrepro.settings"], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert out.returncode == 0 and out.stderr == ""
    assert out.stdout.startswith("| variable | values | default |")


def test_run_returns_main_status_and_1_on_a_closed_stdout():
    code = ("import sys\nfrom kvrepro import cli\n"
            "def broken():\n    raise BrokenPipeError(32, 'Broken pipe')\n"
            "print(cli.run(lambda: 3), cli.run(broken), file=sys.stderr)\n"
            "print('after: written to os.devnull')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0
    assert out.stderr == "3 1\n" and out.stdout == ""    # stdout points at os.devnull once the pipe broke


def test_every_command_of_the_package_exits_through_cli_run():
    """Each ``if __name__ == "__main__":`` block of kvrepro ends with ``raise SystemExit(cli.run(...))``; pyproject
    declares no console scripts (a new one would need the same wrapper)."""
    mains = {}
    for p in sorted((ROOT / "kvrepro").rglob("*.py")):
        text = p.read_text(encoding="utf-8")
        if 'if __name__ == "__main__":' in text:
            mains[p.relative_to(ROOT).as_posix()] = text[text.index('if __name__ == "__main__":'):]
    assert {"kvrepro/summary.py", "kvrepro/settings.py", "kvrepro/reach.py", "kvrepro/nbsweep.py"} <= set(mains)
    wrong = [f for f, tail in mains.items()
             if not re.search(r"raise SystemExit\(cli\.run\([\w.]+\)\)", tail)]
    assert wrong == []
    assert "[project.scripts]" not in (ROOT / "pyproject.toml").read_text(encoding="utf-8")
