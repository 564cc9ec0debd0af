"""benchmarks/decode_splits.py's command line refuses bad input by name before any GPU work."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("args, msg", [
    (["--rope", "--skews", "48"], "--trace and --skews take the kernel without it"),
    (["--rope", "--trace", "README.md"], "--trace and --skews take the kernel without it"),
    (["--variant", "nofile"], "--variant takes NAME=PATH.fatbin"),
    (["--variant", "x=/nonexistent.fatbin"], "no such fatbin: /nonexistent.fatbin"),
    (["--skews", "300"], "--skews must be in 0..255"),
    (["--preset", "k3v3"], "invalid choice: 'k3v3'"),
    (["--variant", "committed=README.md"], "--variant names must be distinct and not 'committed'"),
    (["--variant", "a=README.md", "a=README.md"], "--variant names must be distinct"),
    (["--out", "benchmarks"], "--out 'benchmarks' is a folder"),
    (["--out", "/nonexistent/x.json"], "its folder does not exist"),
])
def test_command_line_refuses_bad_input(args, msg):
    r = subprocess.run([sys.executable, "benchmarks/decode_splits.py", *args], cwd=ROOT, capture_output=True,
                       text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert r.returncode == 2 and msg in r.stderr, r.stderr
