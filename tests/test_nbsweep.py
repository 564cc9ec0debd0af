"""kvrepro.nbsweep: sweep files are validated before any point runs; points and their ids; a re-run reuses the
points whose report is up to date; a failing point is listed with the notebook's own message while the others run;
the CI sweep end to end through the command `make sweep` runs, into a temporary folder."""
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvrepro import capacity, nbsweep

ROOT = Path(__file__).resolve().parents[1]
KERNEL = "kvrepro-pytest"


@pytest.fixture(scope="module", autouse=True)
def kernel_of_this_interpreter(notebook_kernel):
    """Every notebook of this module runs on the kernelspec of this interpreter (conftest.notebook_kernel)."""
    assert notebook_kernel == KERNEL


def write_sweep(path: Path, spec: dict) -> Path:
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def sha8(params: dict) -> str:
    return hashlib.sha256(json.dumps(params, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:8]


def no_temp_files(d: Path) -> bool:
    return not [p.name for p in d.iterdir() if p.name.startswith(".") or p.name.endswith(".tmp")]


# ---------------------------------------------------------------- shipped sweeps, points, ids

@pytest.mark.parametrize("name,n", [("capacity-by-gpu", 14), ("accuracy-small", 2), ("ci-tiny", 2)])
def test_shipped_sweeps_load(name, n):
    sweep = nbsweep.load(name)
    assert len(nbsweep.expand(sweep)) == n


def test_capacity_by_gpu_covers_the_cards_and_all_formats():
    sweep = nbsweep.load("capacity-by-gpu")
    assert sweep.axes == {"gpu_memory_gb": [24, 40, 48, 80, 94, 141, 192], "context_tokens": [32768, 131072]}
    from kvrepro.formats import DEFAULT_PRESET, FORMAT_NAMES

    formats = sweep.fixed["formats"]
    assert sorted(formats) == sorted(FORMAT_NAMES) and len(formats) == len(FORMAT_NAMES) and DEFAULT_PRESET in formats
    assert sweep.chart["x"] == "gpu_memory_gb" and sweep.chart["y"] == "users_fit"


def test_product_points_and_ids(tmp_path):
    path = write_sweep(tmp_path / "grid.yaml", {
        "notebook": "02_capacity", "base": "02_ci.yaml", "parameters": {"max_users": 2},
        "axes": {"gpu_memory_gb": [24, 40.5], "context_tokens": [32768, 131072]}})
    base = {**yaml.safe_load((ROOT / "notebooks/params/02_ci.yaml").read_text()), "max_users": 2}
    expected = []
    for mem, mem_s in ((24, "24"), (40.5, "40.5")):          # first axis slowest
        for ctx in (32768, 131072):
            params = {**base, "gpu_memory_gb": mem, "context_tokens": ctx}
            expected.append((f"{mem_s}_{ctx}-{sha8(params)}", {"gpu_memory_gb": mem, "context_tokens": ctx}, params))
    got = [(p.id, p.varied, p.parameters) for p in nbsweep.expand(nbsweep.load(path))]
    assert got == expected
    assert got[0][0] == f"24_32768-{sha8(expected[0][2])}"


def test_explicit_points_and_ids(tmp_path):
    path = write_sweep(tmp_path / "pts.yaml", {"notebook": "03_accuracy.ipynb", "base": "03_ci", "points": [
        {"context_lengths": [512, 1024]}, {"formats": ["bf16", "k4v4"], "engine": "cpu"}, {"seed": -1}]})
    base = yaml.safe_load((ROOT / "notebooks/params/03_ci.yaml").read_text())
    pts = nbsweep.expand(nbsweep.load(path))
    assert [p.varied for p in pts] == [{"context_lengths": [512, 1024]}, {"formats": ["bf16", "k4v4"], "engine": "cpu"},
                                       {"seed": -1}]
    assert [p.parameters for p in pts] == [{**base, **p.varied} for p in pts]
    assert [p.id for p in pts] == [f"512+1024-{sha8(pts[0].parameters)}", f"bf16+k4v4_cpu-{sha8(pts[1].parameters)}",
                                   f"p-1-{sha8(pts[2].parameters)}"]


# ---------------------------------------------------------------- bad sweep files: refused before anything runs

BASE = {"notebook": "02_capacity", "base": "02_ci.yaml"}


@pytest.mark.parametrize("spec,needle", [
    ({"notebook": "02_capacityy", "base": "02_ci.yaml", "axes": {"gpu_memory_gb": [24]}},
     "notebook: unknown notebook '02_capacityy'; available: 01_setup, 02_capacity, 03_accuracy"),
    ({**BASE, "axes": {"gpu_memroy_gb": [24, 80]}},
     "axes: 'gpu_memroy_gb' is not a parameter of 02_capacity.ipynb; declared: model, formats, context_tokens"),
    ({**BASE, "axes": {"gpu_memory_gb": []}}, "axes.gpu_memory_gb: empty axis; give at least one value"),
    ({**BASE, "axes": {"gpu_memory_gb": None}}, "axes.gpu_memory_gb: empty axis"),
    ({**BASE, "axes": {"gpu_memory_gb": 24}}, "axes.gpu_memory_gb: expected a list of values, got 24"),
    ({**BASE, "axis": {"gpu_memory_gb": [24]}}, "unknown key(s) 'axis'; allowed: notebook, base, description, "
                                                "parameters, axes, points, chart"),
    ({**BASE}, "give exactly one of 'axes'"),
    ({**BASE, "axes": {"gpu_memory_gb": [24]}, "points": [{"gpu_memory_gb": 24}]}, "give exactly one of 'axes'"),
    ({**BASE, "points": [{"typo": 1}]}, "points[0]: 'typo' is not a parameter of 02_capacity.ipynb"),
    ({**BASE, "points": []}, "points: expected a non-empty list"),
    ({**BASE, "parameters": {"typo": 1}, "axes": {"gpu_memory_gb": [24]}}, "parameters: 'typo' is not a parameter"),
    ({"notebook": "02_capacity", "base": "02_nope.yaml", "axes": {"gpu_memory_gb": [24]}},
     "base: unknown parameter file '02_nope.yaml'; available: 01_ci.yaml"),
    ({**BASE, "axes": {"gpu_memory_gb": [24, 24]}}, "have the same parameters"),
    ({**BASE, "axes": {"gpu_memory_gb": [24]}, "chart": {"x": "memory", "y": "users_fit"}},
     "chart.x: 'memory' is not a parameter"),
    ({**BASE, "axes": {"gpu_memory_gb": [24]}, "chart": {"x": "gpu_memory_gb", "y": "users_fit", "colour": "x"}},
     "chart: unknown key(s) 'colour'; allowed: x, y, hue, style, col"),
])
def test_bad_sweep_is_refused_before_any_point_runs(spec, needle, tmp_path, monkeypatch, capsys):
    def never(*a, **k):
        raise AssertionError("a point ran although the sweep file is bad")

    monkeypatch.setattr(nbsweep, "run_point", never)
    path = write_sweep(tmp_path / "bad.yaml", spec)
    with pytest.raises(ValueError) as err:
        nbsweep.load(path)
    assert needle in str(err.value)
    rc = nbsweep.main([str(path), "--out", str(tmp_path / "out"), "--jobs", "2"])
    assert rc == 2 and needle in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_unknown_sweep_name_lists_the_sweeps(capsys):
    assert nbsweep.main(["capacity-by-gpuu"]) == 2
    err = capsys.readouterr().err
    assert "unknown sweep 'capacity-by-gpuu'; available: accuracy-small, capacity-by-gpu, ci-tiny" in err


# ---------------------------------------------------------------- headline figures

def test_headline_json_safe_and_flat():
    h = nbsweep.check_headline({"figures": {"kv": float("nan")}, "by": ["format"],
                                "rows": [{"format": "bf16", "users_fit": 3}, {"format": "k4v4", "users_fit": 13}]})
    assert h["figures"] == {"kv": None}
    assert nbsweep.flat_headline(h) == {"kv": None, "users_fit bf16": 3, "users_fit k4v4": 13}
    with pytest.raises(ValueError, match="label column"):
        nbsweep.check_headline({"by": ["format"], "rows": [{"users_fit": 3}]})
    nb = {"cells": [{"cell_type": "code", "outputs": [
        {"output_type": "display_data", "data": {"application/json": {"python": "x"}}},
        {"output_type": "display_data", "data": {"application/json": {nbsweep.HEADLINE_KEY: h}}}]}]}
    assert nbsweep.read_headline(nb) == h


def test_notebook_headlines():
    import pandas as pd

    from kvrepro import accuracy

    table = capacity.capacity_table(["bf16", "k4v4"], 32768, 256, gpu_memory_gb=40)
    h = capacity.headline(table)
    assert h == {"figures": {"kv_cache_gib": round(float(table["kv_cache_gib"][0]), 3)}, "by": ["format"],
                 "rows": [{"format": "bf16", "users_fit": int(table["users_fit"][0])},
                          {"format": "k4v4", "users_fit": int(table["users_fit"][1])}]}
    df = pd.DataFrame([dict(format=f, variant=v, context_length=512, depth=0.5, correct=c)
                       for f, v, c in [("k4v4", "multi", 0), ("bf16", "multi", 0), ("k4v4", "single", 1),
                                       ("bf16", "single", 1)]])
    h = accuracy.headline(df, measured=False)
    assert h["figures"] == {"runs": 4, "cpu_rows": "replayed"}
    assert h["rows"] == [{"format": "bf16", "variant": "single", "accuracy": 1.0},   # the baseline: no verdict
                         {"format": "bf16", "variant": "multi", "accuracy": 0.0},
                         {"format": "k4v4", "variant": "single", "accuracy": 1.0, "target": "MET"},
                         {"format": "k4v4", "variant": "multi", "accuracy": 0.0, "target": "NOT JUDGED"}]
    assert nbsweep.check_headline(h) == h


# ---------------------------------------------------------------- running: resume, failures

TINY_CELLS = [
    ("x = 1\ny = 0", ["parameters"]),
    ("if x < 0:\n    raise ValueError(f'x must be >= 0, got {x}')", []),
    ("from kvrepro import nbsweep\nnbsweep.record_headline({'figures': {'double': 2 * x}, 'by': ['k'], "
     "'rows': [{'k': 'a', 'sum': x + y}]})", []),
]


@pytest.fixture
def tiny_project(tmp_path, monkeypatch):
    """notebooks/tiny.ipynb (parameters x, y; refuses x < 0; records headline figures) and params/tiny.yaml in a
    temporary notebooks folder that nbsweep uses instead of the repository's."""
    nb_dir = tmp_path / "notebooks"
    (nb_dir / "params").mkdir(parents=True)
    cells = [{"cell_type": "code", "id": f"t{i}", "metadata": {"tags": tags}, "source": src, "outputs": [],
              "execution_count": None} for i, (src, tags) in enumerate(TINY_CELLS)]
    (nb_dir / "tiny.ipynb").write_text(json.dumps({"cells": cells, "metadata": {"kernelspec": {
        "name": KERNEL, "display_name": KERNEL, "language": "python"}}, "nbformat": 4, "nbformat_minor": 5}))
    (nb_dir / "params" / "tiny.yaml").write_text("x: 1\ny: 0\n")
    monkeypatch.setattr(nbsweep, "NB_DIR", nb_dir)
    monkeypatch.setattr(nbsweep, "PARAMS_DIR", nb_dir / "params")
    return tmp_path


def test_resume_skips_up_to_date_points_and_reruns_changed_ones(tiny_project, monkeypatch):
    calls = []
    real = nbsweep.run_point

    def spy(notebook, cwd, point, *a, **k):
        calls.append(point.varied["x"])
        return real(notebook, cwd, point, *a, **k)

    monkeypatch.setattr(nbsweep, "run_point", spy)
    out = tiny_project / "out"
    path = write_sweep(tiny_project / "t.yaml", {"notebook": "tiny", "base": "tiny", "axes": {"x": [1, 2]}})
    recs = nbsweep.run(nbsweep.load(path), out, kernel=KERNEL, log=None)
    assert sorted(calls) == [1, 2] and [r["status"] for r in recs] == ["ok", "ok"]
    assert [r["headline"]["figures"]["double"] for r in recs] == [2, 4]
    pid1, pid2 = (r["point"] for r in recs)

    calls.clear()    # the same sweep again: nothing runs, the index still lists both
    recs = nbsweep.run(nbsweep.load(path), out, kernel=KERNEL, log=None)
    assert calls == [] and all(r["skipped"] for r in recs)
    assert pid1 in (out / "t" / "index.html").read_text()

    # another kvrepro source recorded for point 1 (the code changed since): that point runs again, point 2 does not
    side = out / "t" / f"{pid1}.json"
    side.write_text(json.dumps({**json.loads(side.read_text()), "kvrepro_src_sha256": "0" * 64}))
    recs = nbsweep.run(nbsweep.load(path), out, kernel=KERNEL, log=None)
    assert calls == [1] and not recs[0].get("skipped") and recs[1]["skipped"]

    # changed parameters: a new point (new id) runs, the unchanged one is reused
    calls.clear()
    path = write_sweep(path, {"notebook": "tiny", "base": "tiny", "axes": {"x": [1, 3]}})
    recs = nbsweep.run(nbsweep.load(path), out, kernel=KERNEL, log=None)
    assert calls == [3] and recs[0]["skipped"] and recs[0]["point"] == pid1
    assert no_temp_files(out / "t")


def test_failing_point_is_listed_with_the_notebooks_message(tmp_path):
    """02 refuses gpu_memory_gb -5: that point fails with 02's own message, the 40 GiB point succeeds, exit 1."""
    path = write_sweep(tmp_path / "mixed.yaml", {"notebook": "02_capacity", "base": "02_ci.yaml",
                                                 "axes": {"gpu_memory_gb": [-5, 40]}})
    out = tmp_path / "out"
    assert nbsweep.main([str(path), "--out", str(out), "--jobs", "2", "--kernel", KERNEL]) == 1
    d = out / "mixed"
    bad, good = (json.loads((d / f"{p.id}.json").read_text()) for p in nbsweep.expand(nbsweep.load(path)))
    assert bad["status"] == "failed"
    assert bad["error"] == "ValueError: gpu_memory_gb must be a positive finite number, got -5"
    assert good["status"] == "ok" and good["error"] is None
    ci = yaml.safe_load((ROOT / "notebooks/params/02_ci.yaml").read_text())
    table = capacity.capacity_table(ci["formats"], ci["context_tokens"], ci["decode_tokens"], gpu_memory_gb=40,
                                    gpu_memory_utilization=ci["gpu_memory_utilization"],
                                    overhead_gb=ci["overhead_gb"], block_size=ci["block_size"])
    users = {r["format"]: r["users_fit"] for r in good["headline"]["rows"]}
    assert users == dict(zip(table["format"], table["users_fit"]))
    index = (d / "index.html").read_text()
    assert "gpu_memory_gb must be a positive finite number, got -5" in index and "1 ok, 1 failed" in index
    assert (d / bad["html"]).is_file() and (d / good["html"]).is_file()
    assert no_temp_files(d)


# ---------------------------------------------------------------- the CI sweep, end to end

def test_ci_tiny_sweep_end_to_end(tmp_path):
    cmd = [sys.executable, "-m", "kvrepro.nbsweep", "ci-tiny", "--jobs", "2", "--out", str(tmp_path),
           "--kernel", KERNEL]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    d = tmp_path / "ci-tiny"
    points = nbsweep.expand(nbsweep.load("ci-tiny"))
    index = (d / "index.html").read_text()
    assert "2 points: 2 ok, 0 failed" in index and "data:image/png;base64," in index
    links = re.findall(r"href='([^']+\.html)'", index)
    assert links == [f"{p.id}.html" for p in points]
    formats = yaml.safe_load((ROOT / "notebooks/params/02_ci.yaml").read_text())["formats"]
    for p in points:
        rec = json.loads((d / f"{p.id}.json").read_text())
        assert rec["status"] == "ok" and rec["parameters"] == p.parameters
        assert [row["format"] for row in rec["headline"]["rows"]] == formats
        report = (d / f"{p.id}.html").read_text()
        assert "Headline figures" in report and "Verdict" in report and "Traceback" not in report
        executed = json.loads((d / f"{p.id}.ipynb").read_text())
        assert nbsweep.read_headline(executed) == rec["headline"]
        assert f"users_fit {formats[0]}" in (d / "index.csv").read_text()
    assert no_temp_files(d)
    # the same command again: every point is up to date, nothing runs
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0 and "2 up to date, 0 to run" in r.stdout
