"""Every notebook executed with its tiny CI parameters (notebooks/params/NN_ci.yaml) through papermill,
failing on any cell error; bad or undeclared parameters fail with a message naming them, also through the
papermill CLI; an untagged parameters cell is refused; reports open with their answer and carry no progress
dumps."""
import ast
import json
import subprocess
import sys
from pathlib import Path

import papermill as pm
import pytest
import torch
import yaml

from kvrepro import provenance

ROOT = Path(__file__).resolve().parents[1]
NB_DIR = ROOT / "notebooks"
NOTEBOOKS = sorted(NB_DIR.glob("[0-9][0-9]_*.ipynb"))
KERNEL = "kvrepro-pytest"


@pytest.fixture(scope="module", autouse=True)
def kernel_of_this_interpreter(notebook_kernel):
    """Every notebook of this module runs on the kernelspec of this interpreter (conftest.notebook_kernel)."""
    assert notebook_kernel == KERNEL


def run(nb: Path, params: dict, out: Path):
    """What `make report` does for one notebook: refuse a bad parameters cell / unknown parameter, then
    papermill (raises PapermillExecutionError on any cell error). Returns the executed notebook (dict)."""
    provenance.check_parameters(nb, params)
    pm.execute_notebook(str(nb), str(out), parameters=params, kernel_name=KERNEL, cwd=str(nb.parent),
                        progress_bar=False, log_output=False)
    return json.loads(out.read_text())


_CI_RUNS: dict = {}


def run_ci(nb: Path, tmp_path_factory) -> dict:
    """``nb`` executed once per test session with its CI parameters (03 takes a minute: its tests share one run)."""
    if nb.name not in _CI_RUNS:
        _CI_RUNS[nb.name] = run(nb, ci_params(nb), tmp_path_factory.mktemp(nb.stem) / nb.name)
    return _CI_RUNS[nb.name]


def outputs(nb: dict):
    for cell in nb["cells"]:
        yield from cell.get("outputs", [])


def text_of(nb: dict) -> str:
    parts = []
    for o in outputs(nb):
        parts.append(o.get("text", "") if isinstance(o.get("text", ""), str) else "".join(o["text"]))
        for mime in ("text/plain", "text/markdown", "text/html"):
            v = o.get("data", {}).get(mime, "")
            parts.append(v if isinstance(v, str) else "".join(v))
    return "\n".join(parts)


def ci_params(nb: Path) -> dict:
    path = NB_DIR / "params" / f"{nb.name[:2]}_ci.yaml"
    assert path.exists(), f"{nb.name} has no CI parameters file {path}"
    return yaml.safe_load(path.read_text())


def stderr_of(nb: dict) -> str:
    return "".join("".join(o.get("text", "")) for o in outputs(nb) if o.get("name") == "stderr")


def test_notebooks_exist():
    assert [p.name[:2] for p in NOTEBOOKS][:2] == ["01", "02"]


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_shipped_notebook_structure(nb):
    provenance.parameters_cell_names(nb)  # exactly one literal-only `parameters` cell
    for kind in ("default", "ci"):
        params = yaml.safe_load((NB_DIR / "params" / f"{nb.name[:2]}_{kind}.yaml").read_text())
        provenance.check_parameters(nb, params)
    cells = json.loads(nb.read_text())["cells"]
    assert not any(c.get("outputs") for c in cells), f"{nb.name}: outputs must be stripped in git"


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_first_cell_after_parameters_refuses_undeclared_names(nb):
    """The first code cell after the parameters cell calls provenance.parameters with exactly the declared names."""
    cells = [c for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code"]
    i = next(i for i, c in enumerate(cells) if "parameters" in c.get("metadata", {}).get("tags", []))
    src = "".join(cells[i + 1]["source"])
    calls = [n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr == "parameters" and getattr(n.func.value, "id", "") == "provenance"]
    assert len(calls) == 1, f"{nb.name}: the cell after the parameters cell must call provenance.parameters once"
    assert ast.literal_eval(calls[0].args[0]) == provenance.parameters_cell_names(nb)
    assert ast.unparse(calls[0].args[1]) == "globals()"


@pytest.mark.parametrize("nb", [pytest.param(p, marks=pytest.mark.slow) if p.name.startswith("03_") else p
                                for p in NOTEBOOKS], ids=lambda p: p.stem)
def test_notebook_runs_with_ci_params_and_echoes_them(nb, tmp_path_factory):
    params = ci_params(nb)
    done = run_ci(nb, tmp_path_factory)
    assert not stderr_of(done), f"{nb.name}: stderr in the report (progress bars, warnings): {stderr_of(done)[:500]}"
    infos = [o["data"]["application/json"] for o in outputs(done)
             if "application/json" in o.get("data", {}) and "python" in o["data"]["application/json"]]
    assert infos, f"{nb.name}: no provenance (kvrepro.provenance.show) output"
    info = infos[0]
    for key, value in params.items():
        assert info["parameters"][key] == value, key
    assert info["python"] == sys.executable
    assert info["torch_version"] == torch.__version__
    assert "vllm_version" in info and "gpu" in info


@pytest.mark.slow
def test_03_opens_with_the_answer(tmp_path_factory):
    """03's first output is the summary table: one row per mode of the registry (the default preset marked), the
    sentence on the closest preset to fp8, the sources (the live fidelity run labelled measured now, missing files
    "not measured yet"); the key-bias verdicts and the provenance come after it."""
    from kvrepro import accuracy_summary as acs
    from kvrepro.formats import DEFAULT_PRESET, FORMAT_NAMES

    done = run_ci(NB_DIR / "03_accuracy.ipynb", tmp_path_factory)
    cells = [c for c in done["cells"] if c.get("outputs")]
    first = text_of({"cells": cells[:1]})
    assert "**Per KV mode**" in first and "KL vs bf16, full vocab" in first and "needle bound" in first
    for f in FORMAT_NAMES:
        assert f">{acs.display_name(f)}<" in first, f
    assert f"{DEFAULT_PRESET} (default)" in first
    assert "Closest to fp8's fidelity at >= 12 users" in first or "is not known" in first
    assert "measured now: reference path, CPU" in first
    for path in (acs.REFERENCE_GPU, acs.VLLM_FIDELITY):
        if not (ROOT / path).exists():
            assert f"not measured yet: no <code>{path}</code>" in first or f"not measured yet: no `{path}`" in first
    texts = [text_of({"cells": [c]}) for c in cells]
    kb = next(i for i, t in enumerate(texts) if "**Key-bias table**" in t)
    prov = next(i for i, t in enumerate(texts) if "kvrepro_src_sha256" in t)
    assert 0 < kb < prov
    assert "NOT MET" in texts[kb] or ">met<" in texts[kb]


def test_02_replays_committed_results(tmp_path):
    from test_replay import sweep_rows, write

    results = tmp_path / "results"
    results.mkdir()
    write(results / "h200.jsonl", sweep_rows())
    nb = NB_DIR / "02_capacity.ipynb"
    done = run(nb, ci_params(nb) | {"results_dir": str(results)}, tmp_path / "out.ipynb")
    text = text_of(done)
    assert f"bf16: replayed from {results / 'h200.jsonl'}, measured on NVIDIA H200 2026-11-29" in text
    assert "No committed measured results" not in text
    # the answer first: the verdict and the summary table come before the chart and the details
    assert text.index("**Verdict**") < text.index("| mode | KV B/token/head") < text.index("bf16: replayed from")
    assert text.index("bf16: replayed from") < text.index("Arithmetic")
    assert "| bf16 | 512 | 2 (66.6 tok/s) | 3 | 150.0 |" in text           # the synthetic file's bf16 capacity


def test_02_opens_with_the_readme_rows(tmp_path):
    """With the committed results, 02's summary table has the README's rows (same selection, same figures)."""
    from kvrepro import summary

    nb = NB_DIR / "02_capacity.ipynb"
    text = text_of(run(nb, ci_params(nb), tmp_path / "out.ipynb"))
    rows = summary.summary_rows(summary.load_capacity(), summary.needle_counts())
    assert summary.markdown_table(rows, compact=True) in text
    assert summary.verdict(rows) in text


@pytest.mark.parametrize("stem,bad,needle", [
    ("02_capacity", {"formats": ["bf16", "bf17"]}, "formats: unknown KV format 'bf17'"),
    ("02_capacity", {"context_tokens": -1024}, "context_tokens must be a positive integer, got -1024"),
    ("02_capacity", {"max_users": 0}, "max_users must be a positive integer, got 0"),
    ("02_capacity", {"gpu_memory_gb": -40.0}, "gpu_memory_gb must be a positive finite number, got -40.0"),
    ("02_capacity", {"gpu_memory_gb": "80"}, "gpu_memory_gb must be a positive finite number, got '80'"),
    ("01_setup", {"num_tokens": -3}, "num_tokens must be a positive integer, got -3"),
    ("03_accuracy", {"formats": "every"}, "formats must be 'all' or a list of bf16, fp8"),
    ("03_accuracy", {"fidelity_windows": -1}, "fidelity_windows must be a non-negative integer"),
])
def test_bad_parameter_fails_naming_it(stem, bad, needle, tmp_path):
    nb = NB_DIR / f"{stem}.ipynb"
    with pytest.raises(pm.PapermillExecutionError) as err:
        run(nb, ci_params(nb) | bad, tmp_path / "out.ipynb")
    assert err.value.ename == "ValueError" and needle in err.value.evalue


def test_02_measure_without_gpu_fails_not_replays(tmp_path):
    import importlib.util
    if torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None:
        pytest.skip("GPU and vLLM present: measure=True would really measure")
    nb = NB_DIR / "02_capacity.ipynb"
    with pytest.raises(pm.PapermillExecutionError) as err:
        run(nb, ci_params(nb) | {"measure": True}, tmp_path / "out.ipynb")
    assert err.value.ename == "RuntimeError" and "measure=True needs" in err.value.evalue


def _tiny_nb(path: Path, tagged: bool) -> Path:
    cells = [{"cell_type": "code", "metadata": {"tags": ["parameters"] if tagged else []}, "outputs": [],
              "execution_count": None, "id": "p", "source": 'kv_mode = "fp16"'},
             {"cell_type": "code", "metadata": {}, "outputs": [], "execution_count": None, "id": "u",
              "source": "print('kv_mode used:', kv_mode)"}]
    path.write_text(json.dumps({"nbformat": 4, "nbformat_minor": 5, "cells": cells,
                                "metadata": {"kernelspec": {"name": KERNEL, "display_name": KERNEL,
                                                            "language": "python"}}}))
    return path


def test_untagged_parameters_cell_is_refused(tmp_path):
    untagged = _tiny_nb(tmp_path / "untagged.ipynb", tagged=False)
    # The fault: papermill alone injects at the top and the untagged default silently wins.
    pm.execute_notebook(str(untagged), str(tmp_path / "raw.ipynb"), parameters={"kv_mode": "fp8"},
                        kernel_name=KERNEL, progress_bar=False)
    assert "kv_mode used: fp16" in text_of(json.loads((tmp_path / "raw.ipynb").read_text()))
    # kvrepro's runner (make report, these tests) refuses the notebook instead.
    with pytest.raises(ValueError, match="tagged 'parameters', found 0"):
        run(untagged, {"kv_mode": "fp8"}, tmp_path / "out.ipynb")
    # With the tag, the injected value is the one used.
    tagged = _tiny_nb(tmp_path / "tagged.ipynb", tagged=True)
    assert "kv_mode used: fp8" in text_of(run(tagged, {"kv_mode": "fp8"}, tmp_path / "ok.ipynb"))


@pytest.mark.parametrize("nb", NOTEBOOKS, ids=lambda p: p.stem)
def test_papermill_api_with_an_undeclared_parameter_fails_naming_it(nb, tmp_path):
    """papermill itself injects any name; the notebook's first cell refuses it (no provenance.check first)."""
    with pytest.raises(pm.PapermillExecutionError) as err:
        pm.execute_notebook(str(nb), str(tmp_path / "out.ipynb"), parameters=ci_params(nb) | {"typo_name": 1},
                            kernel_name=KERNEL, cwd=str(nb.parent), progress_bar=False, log_output=False)
    assert err.value.ename == "ValueError"
    assert "unknown parameter(s) typo_name: this notebook declares" in err.value.evalue
    assert ", ".join(provenance.parameters_cell_names(nb)) in err.value.evalue


def test_papermill_cli_with_an_undeclared_parameter_fails_naming_it(tmp_path):
    nb = NB_DIR / "01_setup.ipynb"
    r = subprocess.run([sys.executable, "-m", "papermill", str(nb), str(tmp_path / "out.ipynb"), "-p", "typo_name", "1",
                        "-k", KERNEL, "--cwd", str(NB_DIR), "--no-progress-bar"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode != 0
    assert "unknown parameter(s) typo_name: this notebook declares model, formats" in r.stdout + r.stderr
