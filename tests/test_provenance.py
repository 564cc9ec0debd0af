"""kvrepro.provenance: what a report echoes, and the parameters-cell guard (field-faults row 12)."""
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
