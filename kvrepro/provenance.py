"""Provenance of a notebook run or a measured figure: parameters, interpreter, library versions, machine, date.

Every reported figure in kvrepro carries provenance (GPU, memory budget, versions, parameters, date, measured vs
replayed). :func:`collect` gathers it as a plain dict (JSON-serialisable), :func:`headline` says it in one line and
:func:`show` renders it as a table in a notebook report. Parameters are guarded twice: :func:`require_parameters_cell`
refuses a notebook without exactly one literal-only ``parameters`` cell (papermill would inject values that the
untagged defaults then silently override), and :func:`parameters`, called by each notebook's first cell, refuses any
parameter the notebook does not declare, however it was run (papermill's CLI or API, nbconvert, interactively).
"""
from __future__ import annotations

import datetime as _dt
import hashlib
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
        ``hostname``, ``platform``, ``date_utc`` (ISO 8601, seconds), ``kvrepro_src_sha256`` (:func:`src_sha256`:
        the code that ran, also off a git checkout).

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
    info["kvrepro_src_sha256"] = src_sha256()
    return info


def src_sha256() -> str:
    """SHA-256 (64 hex digits) over the kvrepro package's .py files (sorted relative paths + contents): identifies
    the code that ran even where the machine's git HEAD does not match its working tree (or there is no git)."""
    root = os.path.dirname(os.path.abspath(__file__))
    h = hashlib.sha256()
    for d, _, files in sorted(os.walk(root)):
        for f in sorted(files):
            if f.endswith(".py"):
                p = os.path.join(d, f)
                h.update(os.path.relpath(p, root).encode() + b"\0")
                with open(p, "rb") as fh:
                    h.update(fh.read())
    return h.hexdigest()


def to_frame(info: dict[str, Any]):
    """Two-column pandas DataFrame (``item``, ``value``) of a :func:`collect` dict; parameters one row each."""
    import pandas as pd

    rows = [(f"param: {k}", repr(v)) for k, v in info.get("parameters", {}).items()]
    rows += [(k, str(v)) for k, v in info.items() if k != "parameters"]
    return pd.DataFrame(rows, columns=["item", "value"])


def headline(info: dict[str, Any]) -> str:
    """One line of a :func:`collect` dict: date, host, GPU (or CPU cores), and the kvrepro / torch / vLLM versions."""
    gpu = info.get("gpu", "none")
    where = f"{gpu} ({info.get('gpu_total_memory_gib', 0):g} GiB)" if gpu != "none" else f"no GPU, {info.get('cpu_count')} CPU cores"
    return (f"Run {info.get('date_utc')} on {info.get('hostname')} ({where}); kvrepro {info.get('kvrepro_version')}, "
            f"torch {info.get('torch_version')}, vLLM {info.get('vllm_version')}, Python {info.get('python_version')}")


def show(params: dict | None = None, info: dict[str, Any] | None = None) -> dict[str, Any]:
    """Display the provenance table (parameters, versions, machine, date) in a notebook; return the dict.

    ``info``: an earlier :func:`collect` result to show (default: collect now with ``params``).
    In IPython it emits one output holding an HTML table (what the nbconvert report shows), a plain-text
    table, and the dict itself as ``application/json`` (what tests read back from an executed notebook).
    Outside IPython it prints the plain-text table. Raises ValueError like :func:`collect`.
    """
    info = collect(params) if info is None else info
    frame = to_frame(info)
    text = frame.to_string(index=False)
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        get_ipython = None
    if get_ipython is None or get_ipython() is None:
        print(text)
        return info
    html = "<p><b>Provenance of this run</b></p>" + frame.to_html(index=False, escape=True)
    display({"text/html": html, "text/plain": text, "application/json": json.loads(json.dumps(info, default=str))},
            raw=True)
    return info


_LITERAL_TYPES = (str, int, float, bool, type(None), list, tuple, dict)


def _is_parameter_value(node) -> bool:
    """A literal, or ``float('nan')`` / ``float('inf')`` / ``float('-inf')`` (how papermill writes those floats)."""
    import ast

    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "float"
            and len(node.args) == 1 and not node.keywords and isinstance(node.args[0], ast.Constant)
            and str(node.args[0].value).lower() in ("nan", "inf", "-inf", "+inf")):
        return True
    try:
        ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


def _literal_cell_names(src: str) -> list[str] | None:
    """Names a cell assigns when every statement is ``name = <literal>`` (papermill's injected cell, the
    parameters cell, one typed interactively), else None."""
    import ast

    try:
        body = ast.parse(src).body
    except SyntaxError:
        return None
    names = []
    for node in body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
                and _is_parameter_value(node.value)):
            return None
        names.append(node.targets[0].id)
    return names or None


def parameters(declared, namespace: dict) -> dict[str, Any]:
    """The notebook's parameters, refusing any the notebook does not declare (a typo such as
    ``papermill -p gpu_memroy_gb 40`` would otherwise be injected and silently ignored).

    Called by each notebook's first cell after its ``parameters`` cell as
    ``params = provenance.parameters([<the parameters cell's names>], globals())``. A parameter is a name set by a
    cell of literal assignments only: the ``parameters`` cell, the cell papermill injects (``-p``, ``-y``, ``-f``,
    ``parameters=``), or such a cell typed in an interactive session. In IPython the cells executed so far (its
    ``In`` history) are read for them; without that history, every public name of ``namespace`` holding a plain
    literal value (str, number, bool, None, list, tuple, dict) counts.

    Args:
        declared: the parameter names the notebook declares (the names of its ``parameters`` cell).
        namespace: the notebook's globals().

    Returns:
        dict name -> value for the declared names, in their order.

    Raises:
        ValueError: an undeclared parameter (names it and the allowed ones), or a declared name missing from
            ``namespace`` (the parameters cell was not run).
    """
    declared = list(declared)
    history = namespace.get("In")
    if isinstance(history, list) and history:
        seen = []
        for src in history[:-1]:                       # the last entry is the calling cell itself
            for name in _literal_cell_names(src) or ():
                if name in namespace and name not in seen:
                    seen.append(name)
    else:
        seen = [k for k, v in namespace.items() if not k.startswith("_") and isinstance(v, _LITERAL_TYPES)]
    unknown = [n for n in seen if n not in declared]
    if unknown:
        raise ValueError(f"unknown parameter(s) {', '.join(unknown)}: this notebook declares "
                         f"{', '.join(declared)}")
    missing = [n for n in declared if n not in namespace]
    if missing:
        raise ValueError(f"parameter(s) {', '.join(missing)} not set: run the parameters cell first")
    return {n: namespace[n] for n in declared}


def parameters_cell_names(nb_path: str | os.PathLike) -> list[str]:
    """Names assigned in the notebook's ``parameters``-tagged cell (checked by :func:`require_parameters_cell`).

    Raises:
        ValueError: as :func:`require_parameters_cell`, or an assignment that is not ``name = <literal>``
            (derived values belong in a later cell: papermill injects its cell after the tagged one).
    """
    import ast

    src = require_parameters_cell(nb_path)
    names = []
    for node in ast.parse(src).body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            raise ValueError(f"{nb_path}: the parameters cell must hold only 'name = <literal>' lines, got "
                             f"{ast.unparse(node)!r}")
        try:
            ast.literal_eval(node.value)
        except ValueError:
            raise ValueError(f"{nb_path}: parameter {node.targets[0].id!r} is not a literal: "
                             f"{ast.unparse(node.value)!r}") from None
        names.append(node.targets[0].id)
    return names


def check_parameters(nb_path: str | os.PathLike, params: dict) -> None:
    """Refuse parameters the notebook does not declare (a typo would otherwise be silently ignored).

    Raises:
        ValueError: names of ``params`` missing from the parameters cell (lists the declared ones).
    """
    declared = parameters_cell_names(nb_path)
    unknown = sorted(set(params) - set(declared))
    if unknown:
        raise ValueError(f"{nb_path}: unknown parameter(s) {', '.join(unknown)}; declared: {', '.join(declared)}")


def require_parameters_cell(nb_path: str | os.PathLike) -> None:
    """Fail unless the notebook has exactly one code cell tagged ``parameters``.

    Without that tag papermill injects its values at the top and an untagged ``kv_mode = "fp16"`` cell
    silently overrides ``-p kv_mode fp8``; this check refuses such a notebook.

    Returns:
        the source of the tagged cell.

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
            "papermill would inject parameters without overriding the notebook's defaults. "
            "Tag the defaults cell with 'parameters'."
        )
    src = nb["cells"][tagged[0]]["source"]
    return "".join(src) if isinstance(src, list) else src


def _main(argv: list[str] | None = None) -> int:
    """``python -m kvrepro.provenance check NOTEBOOK [PARAMS.yaml]``: exit 1 with the reason when the
    notebook has no single literal-only ``parameters`` cell or the YAML names an undeclared parameter."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kvrepro.provenance")
    sub = ap.add_subparsers(dest="cmd", required=True)
    chk = sub.add_parser("check", help="check a notebook's parameters cell (and a params YAML against it)")
    chk.add_argument("notebook")
    chk.add_argument("params", nargs="?")
    args = ap.parse_args(argv)
    try:
        names = parameters_cell_names(args.notebook)
        if args.params:
            import yaml

            try:
                params = yaml.safe_load(Path(args.params).read_text(encoding="utf-8")) or {}
            except yaml.YAMLError as e:
                raise ValueError(f"{args.params}: not valid YAML ({e.__class__.__name__}: "
                                 f"{str(e).splitlines()[0]})") from None
            if not isinstance(params, dict):
                raise ValueError(f"{args.params}: expected a mapping of parameter names to values")
            check_parameters(args.notebook, params)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{args.notebook}: parameters cell ok ({', '.join(names)})")
    return 0


if __name__ == "__main__":
    from kvrepro import cli

    raise SystemExit(cli.run(_main))


def params_as_dict(params) -> dict:
    """A parameter dataclass (``AccuracyParams``, ``VllmGrid``, ``FidelityParams``) as a JSON-ready dict: tuples
    become lists."""
    import dataclasses

    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(params).items()}


def params_from_dict(cls, d: dict, what: str = "parameter"):
    """Build the parameter dataclass ``cls`` from ``d`` (lists become tuples) and run its ``validate()``.

    Raises:
        ValueError: keys ``cls`` does not declare (``"unknown <what>(s) [...]; allowed: [...]"``), or what
            ``validate`` refuses.
    """
    import dataclasses

    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"unknown {what}(s) {unknown}; allowed: {sorted(names)}")
    p = cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
    p.validate()
    return p
