"""kvrepro.provenance: what a report echoes, the parameters-cell guard, and the refusal of undeclared parameters."""
import datetime as dt
import importlib.util
import json
import os
import socket
import sys

import pytest
import torch

from kvrepro import provenance


def test_collect_echoes_params_interpreter_versions_machine():
    params = {"kv_mode": "fp8", "users": [1, 2]}
    info = provenance.collect(params)
    assert info["parameters"] == params and info["parameters"] is not params
    assert info["python"] == sys.executable
    assert info["python_version"] == ".".join(map(str, sys.version_info[:3]))
    assert info["torch_version"] == torch.__version__
    if importlib.util.find_spec("vllm") is None:
        assert info["vllm_version"] == "not installed"
    if importlib.util.find_spec("triton") is not None:
        import triton
        assert info["triton_version"] == triton.__version__
    if torch.cuda.is_available():
        assert info["gpu"] == torch.cuda.get_device_name(0)
        assert info["gpu_total_memory_gib"] > 0
    else:
        assert (info["gpu"], info["gpu_total_memory_gib"]) == ("none", 0.0)
    assert info["cpu_count"] == os.cpu_count()
    assert info["hostname"] == socket.gethostname()
    when = dt.datetime.fromisoformat(info["date_utc"])
    assert when.utcoffset() == dt.timedelta(0)
    assert abs((dt.datetime.now(dt.timezone.utc) - when).total_seconds()) < 60
    json.dumps(info)  # serialisable, so it can sit next to any result


def test_collect_rejects_non_dict():
    with pytest.raises(ValueError, match="params must be a dict"):
        provenance.collect(["kv_mode", "fp8"])


def test_show_prints_outside_ipython(capsys):
    info = provenance.show({"kv_mode": "fp8"})
    out = capsys.readouterr().out
    assert "param: kv_mode" in out and "'fp8'" in out and sys.executable in out
    assert info["parameters"] == {"kv_mode": "fp8"}


def _nb(tmp_path, cells, name="nb.ipynb"):
    """A minimal notebook file; cells = [(source, tags)]."""
    nb = {"nbformat": 4, "nbformat_minor": 5, "metadata": {},
          "cells": [{"cell_type": "code", "metadata": {"tags": tags}, "source": src, "outputs": [],
                     "execution_count": None, "id": f"c{i}"} for i, (src, tags) in enumerate(cells)]}
    path = tmp_path / name
    path.write_text(json.dumps(nb))
    return path


def test_require_parameters_cell(tmp_path):
    untagged = _nb(tmp_path, [('kv_mode = "fp16"', []), ("print(kv_mode)", [])], "untagged.ipynb")
    with pytest.raises(ValueError, match="parameters.*found 0"):
        provenance.require_parameters_cell(untagged)
    two = _nb(tmp_path, [('a = 1', ["parameters"]), ('b = 2', ["parameters"])], "two.ipynb")
    with pytest.raises(ValueError, match="found 2"):
        provenance.require_parameters_cell(two)
    good = _nb(tmp_path, [('kv_mode = "fp16"\nusers = [1, 2]', ["parameters"]), ("x = kv_mode * 2", [])])
    assert provenance.require_parameters_cell(good) == 'kv_mode = "fp16"\nusers = [1, 2]'
    assert provenance.parameters_cell_names(good) == ["kv_mode", "users"]
    provenance.check_parameters(good, {"kv_mode": "fp8"})
    with pytest.raises(ValueError, match="unknown parameter.*kv_mod\\b"):
        provenance.check_parameters(good, {"kv_mod": "fp8"})


def test_parameters_cell_must_hold_literals(tmp_path):
    derived = _nb(tmp_path, [('n = 4\nm = n * 2', ["parameters"])])
    with pytest.raises(ValueError, match="'m' is not a literal"):
        provenance.parameters_cell_names(derived)
    code = _nb(tmp_path, [('import os', ["parameters"])], "code.ipynb")
    with pytest.raises(ValueError, match="only 'name = <literal>'"):
        provenance.parameters_cell_names(code)


def test_cli_check(tmp_path):
    untagged = _nb(tmp_path, [('kv_mode = "fp16"', [])])
    assert provenance._main(["check", str(untagged)]) == 1
    good = _nb(tmp_path, [('kv_mode = "fp16"', ["parameters"])], "good.ipynb")
    params = tmp_path / "p.yaml"
    params.write_text("kv_mode: fp8\n")
    assert provenance._main(["check", str(good), str(params)]) == 0
    params.write_text("kv_mod: fp8\n")
    assert provenance._main(["check", str(good), str(params)]) == 1
    params.write_text("kv_mode: [fp8\n")                       # malformed YAML: a message, not a traceback
    assert provenance._main(["check", str(good), str(params)]) == 1


def test_parameters_refuses_names_set_by_literal_cells_it_does_not_declare():
    """The IPython history (``In``) holds the parameters cell, papermill's injected cell and the calling cell."""
    ns = {"In": ["", 'kv_mode = "fp16"\nusers = 4', '# Parameters\nkv_mode = "fp8"\nusres = 8\n', "check()"],
          "kv_mode": "fp8", "users": 4, "usres": 8}
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) usres: this notebook declares kv_mode, users"):
        provenance.parameters(["kv_mode", "users"], ns)
    ns["In"][2] = '# Parameters\nkv_mode = "fp8"\n'
    del ns["usres"]
    assert provenance.parameters(["kv_mode", "users"], ns) == {"kv_mode": "fp8", "users": 4}
    # papermill writes a NaN as float('nan'): still a parameters cell, its unknown names still refused
    ns["In"][2] = "# Parameters\nusers = float('nan')\ntypo = 1\n"
    ns.update(users=float("nan"), typo=1)
    with pytest.raises(ValueError, match="typo"):
        provenance.parameters(["kv_mode", "users"], ns)


def test_parameters_ignores_computed_names_and_needs_declared_ones():
    ns = {"In": ["", "a = 1", "import os\nb = os.sep", "c = f(a)", "check()"], "a": 1, "b": "/", "c": 2,
          "os": os}
    assert provenance.parameters(["a"], ns) == {"a": 1}        # b, c come from cells that compute: not parameters
    with pytest.raises(ValueError, match="parameter\\(s\\) z not set"):
        provenance.parameters(["a", "z"], ns)


def test_parameters_without_history_checks_literal_globals():
    ns = {"a": 1, "b": [1, 2], "typo": "x", "os": os, "_private": 3, "f": print}
    with pytest.raises(ValueError, match="unknown parameter\\(s\\) typo"):
        provenance.parameters(["a", "b"], ns)
    del ns["typo"]
    assert provenance.parameters(["a", "b"], ns) == {"a": 1, "b": [1, 2]}


def test_headline_is_one_line():
    info = provenance.collect({})
    line = provenance.headline(info)
    assert "\n" not in line and info["date_utc"] in line and f"torch {torch.__version__}" in line
