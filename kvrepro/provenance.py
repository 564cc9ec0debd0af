"""Provenance of a notebook run or a measured figure: parameters, interpreter, library versions, machine, date.

Every reported figure in kvrepro carries provenance (STYLE: GPU, memory budget, versions, parameters, date,
measured vs replayed).  :func:`collect` gathers it as a plain dict (JSON-serialisable), :func:`show` renders it
at the top of a notebook report, and :func:`require_parameters_cell` guards against field-faults row 12
(papermill injecting parameters into a notebook whose defaults cell is not tagged ``parameters``).
"""
from __future__ import annotations

import datetime as _dt
import importlib
import json
import os
import platform
import socket
import sys
from pathlib import Path
from typing import Any

NOT_INSTALLED = "not installed"

_PACKAGES = ("torch", "triton", "transformers", "vllm", "kvrepro")


def _version(name: str) -> str:
    """Version string of an installed package, or ``"not installed"``.

    Uses the package metadata first (cheap: does not import vllm), then ``module.__version__``.
    """
    try:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version(name)
        except PackageNotFoundError:
            pass
        mod = importlib.import_module(name)
        return str(getattr(mod, "__version__", "unknown"))
    except Exception:  # noqa: BLE001 - any import failure means "not usable here"
        return NOT_INSTALLED


def _gpu() -> dict[str, Any]:
    """Name and total memory (GiB) of CUDA device 0, or ``{"gpu": "none", ...}`` without a usable CUDA GPU."""
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return {
                "gpu": props.name,
                "gpu_total_memory_gib": round(props.total_memory / 2**30, 2),
                "gpu_count": torch.cuda.device_count(),
            }
    except Exception:  # noqa: BLE001
        pass
    return {"gpu": "none", "gpu_total_memory_gib": 0.0, "gpu_count": 0}


def collect(params: dict | None = None) -> dict[str, Any]:
    """Gather the provenance of this run.

    Args:
        params: the notebook/job parameters actually used (echoed verbatim; must be a dict or None).

    Returns:
        dict with keys ``parameters`` (dict), ``python`` (executable path), ``python_version``,
        ``<pkg>_version`` for torch, triton, transformers, vllm, kvrepro (``"not installed"`` if absent),
        ``gpu`` (name or ``"none"``), ``gpu_total_memory_gib`` (float, GiB), ``gpu_count``, ``cpu_count``,
        ``hostname``, ``platform``, ``date_utc`` (ISO 8601, seconds).

    Raises:
        ValueError: if ``params`` is not a dict (or None).
    """
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise ValueError(f"params must be a dict of the parameters used, got {type(params).__name__}")
    info: dict[str, Any] = {
        "parameters": dict(params),
        "python": sys.executable,
        "python_version": platform.python_version(),
    }
    for name in _PACKAGES:
        info[f"{name}_version"] = _version(name)
    info.update(_gpu())
    info["cpu_count"] = os.cpu_count()
    info["hostname"] = socket.gethostname()
    info["platform"] = platform.platform()
    info["date_utc"] = _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()
    return info


def to_frame(info: dict[str, Any]):
    """Two-column pandas DataFrame (``item``, ``value``) of a :func:`collect` dict; parameters one row each."""
    import pandas as pd

    rows = [(f"param: {k}", repr(v)) for k, v in info.get("parameters", {}).items()]
    rows += [(k, str(v)) for k, v in info.items() if k != "parameters"]
    return pd.DataFrame(rows, columns=["item", "value"])


def show(params: dict | None = None) -> dict[str, Any]:
    """Display the provenance table (parameters, versions, machine, date) in a notebook; return the dict.

    Renders with IPython's ``display`` when available (HTML table in the nbconvert report), else prints
    a plain-text table.  Raises ValueError like :func:`collect`.
    """
    info = collect(params)
    frame = to_frame(info)
    try:
        from IPython.display import display

        display(frame.style.hide(axis="index").set_caption("Provenance of this run"))
    except Exception:  # noqa: BLE001 - outside IPython, or pandas without jinja2
        print(frame.to_string(index=False))
    return info


def require_parameters_cell(nb_path: str | os.PathLike) -> None:
    """Fail unless the notebook has exactly one code cell tagged ``parameters`` (field-faults row 12).

    Without that tag papermill appends injected values *after* nothing in particular and an untagged
    ``kv_mode = "fp16"`` cell silently overrides ``-p kv_mode fp8``; this check refuses such a notebook.

    Raises:
        FileNotFoundError: if ``nb_path`` does not exist.
        ValueError: if no code cell, or more than one, carries the ``parameters`` tag.
    """
    path = Path(nb_path)
    nb = json.loads(path.read_text(encoding="utf-8"))
    tagged = [
        i
        for i, cell in enumerate(nb.get("cells", []))
        if cell.get("cell_type") == "code" and "parameters" in cell.get("metadata", {}).get("tags", [])
    ]
    if len(tagged) != 1:
        raise ValueError(
            f"{path}: expected exactly one code cell tagged 'parameters', found {len(tagged)}; "
            "papermill would inject parameters without overriding the notebook's defaults "
            "(field-faults row 12). Tag the defaults cell with 'parameters'."
        )
