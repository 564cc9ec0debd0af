"""benchmarks/triton_spills.py: the offline sm_90 compile of the Triton decode kernel reads Triton's own ptxas log
(no GPU needed), and its command line refuses bad launches."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import triton_spills as ts

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("text", ["64", "64,2,1", "48,2", "64,3", "64,,2", "a,b"])
def test_parse_launch_refuses_bad_launches(text):
    with pytest.raises(ValueError, match="--launch"):
        ts.parse_launch(text)


def test_parse_launch():
    assert ts.parse_launch("64,2") == (64, 2) and ts.parse_launch("256, 4") == (256, 4)


@pytest.mark.slow
def test_compile_reads_ptxas_figures_and_the_rope_path_is_compiled_in(tmp_path):
    """k4v2 for sm_90 (a subprocess: the tests run Triton in its interpreter, the script compiles for the GPU):
    ptxas's figures of the entry function for each launch, and the rope-mean correction (NPAIRS 8) adds its float64
    angle reduction, absent without it; the result file holds the rows printed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    out = tmp_path / "spills.json"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "triton_spills.py"), "--presets", "k4v2",
                          "--launch", "64,2", "--out", str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["block_n"], r["num_warps"], r["npairs"]) for r in rows] == [(256, 4, 0), (256, 4, 8), (64, 2, 0),
                                                                           (64, 2, 8)]
    for r in rows:
        assert r["arch"] == "sm_90a" and 1 <= r["registers"] <= 255 and r["preset"] == "k4v2"
        assert min(r["stack_bytes"], r["spill_store_bytes"], r["spill_load_bytes"]) >= 0
        assert (r["ptx_f64_instructions"] > 0) == (r["npairs"] > 0)
        assert f"NPAIRS={r['npairs']} block_n={r['block_n']}" in res.stdout
