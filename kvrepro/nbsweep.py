"""Papermill parameter sweeps: one notebook run over a grid of parameters, the results gathered on one index page.

    python -m kvrepro.nbsweep NAME|PATH [--jobs N] [--out reports/sweeps] [--kernel kvrepro] [--force] [--dry-run]
    make sweep SWEEP=NAME [JOBS=2]

A sweep is a YAML file ``notebooks/sweeps/<NAME>.yaml``::

    notebook: 02_capacity            # notebooks/02_capacity.ipynb
    base: 02_default.yaml            # notebooks/params/02_default.yaml: every parameter not set below
    description: ...                 # optional, shown on the index page
    parameters: {formats: [bf16]}    # optional: fixed values over the base for every point
    axes:                            # the product of these lists (in this order) ...
      gpu_memory_gb: [24, 80]
      context_tokens: [32768, 131072]
    points:                          # ... or an explicit list of parameter sets (exactly one of axes / points)
      - {gpu_memory_gb: 24}
    chart: {x: gpu_memory_gb, y: users_fit, hue: format, col: context_tokens}   # optional, on the index page

Everything is checked before any point runs (:func:`load`): an unknown notebook or base file, a key or parameter
name the notebook does not declare (its ``parameters`` cell, :func:`kvrepro.provenance.parameters_cell_names`), an
empty axis, a bad chart field: ``ValueError`` naming the field and the allowed values. A value the notebook
refuses fails that point only, with the notebook's own message.

Each point (:func:`expand`; id = the varied values + 8 hex digits of the SHA-256 of its full parameter set) runs
through papermill's API into ``<out>/<NAME>/<point>.ipynb`` (executed, code kept) and ``<point>.html`` (code
hidden, as ``make report``), both written under temporary names and renamed into place, then the sidecar
``<point>.json`` (parameters, status, error, headline figures, kvrepro version and source SHA-256, notebook SHA-256),
written atomically and last. Points run in parallel up to ``--jobs`` (one process each); a failing point does not
stop the others. A re-run skips a point whose sidecar says ok for the same parameters, kvrepro version and sources
and notebook, with its report present (resumable). Then ``index.html`` (one row per point: varied parameters,
status, headline figures, link; failed points with their error; the chart) and ``index.csv``. Exit status 1 when
any point failed, 2 on a bad sweep file.

Headline figures are read from the executed notebook's outputs, never from HTML: the notebook's last cell calls
:func:`record_headline`, which displays them as ``application/json`` under the key ``kvrepro_headline`` (with a
Markdown rendering for the report). Shape: ``{"figures": {name: scalar}, "by": [label columns], "rows": [{...}]}``,
e.g. notebook 02 records the KV memory and, per format, the users that fit (``kvrepro.capacity.headline``).
"""
from __future__ import annotations

import argparse
import base64
import datetime as _dt
import hashlib
import html
import io
import itertools
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import kvrepro
from kvrepro.fileio import atomic_write_bytes, file_sha256
from kvrepro import provenance

ROOT = Path(kvrepro.__file__).resolve().parents[1]
NB_DIR = ROOT / "notebooks"
PARAMS_DIR = NB_DIR / "params"
SWEEP_DIR = NB_DIR / "sweeps"
DEFAULT_OUT = ROOT / "reports" / "sweeps"
DEFAULT_KERNEL = "kvrepro"
HEADLINE_KEY = "kvrepro_headline"

SWEEP_KEYS = ("notebook", "base", "description", "parameters", "axes", "points", "chart")
CHART_KEYS = ("x", "y", "hue", "style", "col", "title", "xlabel", "ylabel")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class Point:
    """One run of a sweep: ``id`` (file stem), ``varied`` (the values that differ from the sweep's fixed
    parameters, in axis order) and ``parameters`` (the full set passed to papermill)."""
    id: str
    varied: dict
    parameters: dict


@dataclass(frozen=True)
class Sweep:
    """A validated sweep file (:func:`load`)."""
    name: str
    path: Path
    notebook: Path
    base: Path
    fixed: dict                      # base parameters + the sweep's ``parameters``
    axes: dict | None = None         # name -> non-empty list (product), or None
    points: list | None = None       # explicit list of dicts, or None
    description: str = ""
    chart: dict | None = None
    declared: tuple = field(default=())


# ---------------------------------------------------------------- loading and validation

def available_sweeps(sweep_dir: Path | None = None) -> list[str]:
    """Names of the sweep files under ``notebooks/sweeps/``."""
    d = Path(sweep_dir or SWEEP_DIR)
    return sorted(p.stem for p in d.glob("*.yaml")) if d.is_dir() else []


def available_notebooks() -> list[str]:
    return sorted(p.stem for p in NB_DIR.glob("*.ipynb"))


def _resolve_sweep_path(name_or_path: str | os.PathLike) -> Path:
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if not p.is_file():
            raise ValueError(f"sweep file {p} not found")
        return p
    cand = SWEEP_DIR / f"{p.name}.yaml"
    if not cand.is_file():
        raise ValueError(f"unknown sweep {str(name_or_path)!r}; available: {', '.join(available_sweeps()) or 'none'} "
                         f"(files under {SWEEP_DIR}), or give a path to a .yaml file")
    return cand


def _json_ok(where: str, value) -> None:
    try:
        json.dumps(value, allow_nan=True)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: value {value!r} is not a plain YAML value (string, number, bool, null, list, "
                         f"mapping): {e}") from None


def _check_names(where: str, names, declared: list[str], notebook: str) -> None:
    unknown = [n for n in names if n not in declared]
    if unknown:
        raise ValueError(f"{where}: {', '.join(repr(n) for n in unknown)} "
                         f"{'is not a parameter' if len(unknown) == 1 else 'are not parameters'} of {notebook}; "
                         f"declared: {', '.join(declared)}")


def load(name_or_path: str | os.PathLike) -> Sweep:
    """Read and validate a sweep (a name under ``notebooks/sweeps/`` or a path to a YAML file).

    Raises:
        ValueError: anything wrong with the file, naming the field and the allowed values (see the module doc).
    """
    import yaml

    path = _resolve_sweep_path(name_or_path)
    name = path.stem
    if not _NAME_RE.match(name):
        raise ValueError(f"{path}: a sweep's file name becomes its output folder: use letters, digits, '-', '_', '.'")
    try:
        spec = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML ({e.__class__.__name__}: {str(e).splitlines()[0]})") from None
    if not isinstance(spec, dict):
        raise ValueError(f"{path}: expected a mapping with keys {', '.join(SWEEP_KEYS)}")
    bad = [k for k in spec if k not in SWEEP_KEYS]
    if bad:
        raise ValueError(f"{path}: unknown key(s) {', '.join(map(repr, bad))}; allowed: {', '.join(SWEEP_KEYS)}")

    # notebook
    nb_name = spec.get("notebook")
    if not isinstance(nb_name, str) or not nb_name:
        raise ValueError(f"{path}: notebook: give a notebook name; available: {', '.join(available_notebooks())}")
    stem = nb_name[:-len(".ipynb")] if nb_name.endswith(".ipynb") else nb_name
    notebook = NB_DIR / f"{stem}.ipynb"
    if "/" in stem or not notebook.is_file():
        raise ValueError(f"{path}: notebook: unknown notebook {nb_name!r}; available: "
                         f"{', '.join(available_notebooks())} (under {NB_DIR})")
    declared = provenance.parameters_cell_names(notebook)

    # base parameters
    base_name = spec.get("base")
    base_files = sorted(p.name for p in PARAMS_DIR.glob("*.yaml"))
    if not isinstance(base_name, str) or not base_name:
        raise ValueError(f"{path}: base: give a parameter file under {PARAMS_DIR}; available: {', '.join(base_files)}")
    base = PARAMS_DIR / (base_name if base_name.endswith((".yaml", ".yml")) else f"{base_name}.yaml")
    if "/" in base_name or not base.is_file():
        raise ValueError(f"{path}: base: unknown parameter file {base_name!r}; available: {', '.join(base_files)} "
                         f"(under {PARAMS_DIR})")
    base_params = yaml.safe_load(base.read_text(encoding="utf-8")) or {}
    if not isinstance(base_params, dict):
        raise ValueError(f"{base}: expected a mapping of parameter names to values")
    _check_names(f"{path}: base {base.name}", base_params, declared, notebook.name)

    fixed_over = spec.get("parameters") or {}
    if not isinstance(fixed_over, dict):
        raise ValueError(f"{path}: parameters: expected a mapping of parameter names to values, got {fixed_over!r}")
    _check_names(f"{path}: parameters", fixed_over, declared, notebook.name)
    fixed = {**base_params, **fixed_over}
    for k, v in fixed.items():
        _json_ok(f"{path}: parameter {k}", v)

    # axes xor points
    axes, points = spec.get("axes"), spec.get("points")
    if (axes is None) == (points is None):
        raise ValueError(f"{path}: give exactly one of 'axes' (a product of lists) or 'points' (a list of "
                         "parameter sets)")
    if axes is not None:
        if not isinstance(axes, dict) or not axes:
            raise ValueError(f"{path}: axes: expected a non-empty mapping of parameter name -> list of values")
        _check_names(f"{path}: axes", axes, declared, notebook.name)
        both = [k for k in axes if k in fixed_over]
        if both:
            raise ValueError(f"{path}: {', '.join(both)} given both in 'parameters' and in 'axes'; keep one")
        for k, vals in axes.items():
            if vals is None or vals == []:
                raise ValueError(f"{path}: axes.{k}: empty axis; give at least one value")
            if not isinstance(vals, list):
                raise ValueError(f"{path}: axes.{k}: expected a list of values, got {vals!r} "
                                 f"(write [{vals!r}] for a single value, or move it to 'parameters')")
            for v in vals:
                _json_ok(f"{path}: axes.{k}", v)
    else:
        if not isinstance(points, list) or not points:
            raise ValueError(f"{path}: points: expected a non-empty list of parameter sets (mappings)")
        for i, pt in enumerate(points):
            if not isinstance(pt, dict) or not pt:
                raise ValueError(f"{path}: points[{i}]: expected a non-empty mapping of parameter name -> value, "
                                 f"got {pt!r}")
            _check_names(f"{path}: points[{i}]", pt, declared, notebook.name)
            for k, v in pt.items():
                _json_ok(f"{path}: points[{i}].{k}", v)

    chart = spec.get("chart")
    if chart is not None:
        if not isinstance(chart, dict):
            raise ValueError(f"{path}: chart: expected a mapping with keys {', '.join(CHART_KEYS)}")
        bad = [k for k in chart if k not in CHART_KEYS]
        if bad:
            raise ValueError(f"{path}: chart: unknown key(s) {', '.join(map(repr, bad))}; allowed: "
                             f"{', '.join(CHART_KEYS)}")
        for k in ("x", "y"):
            if not isinstance(chart.get(k), str) or not chart.get(k):
                raise ValueError(f"{path}: chart.{k}: required (x: a parameter, y: a headline figure)")
        if chart["x"] not in declared:
            raise ValueError(f"{path}: chart.x: {chart['x']!r} is not a parameter of {notebook.name}; "
                             f"declared: {', '.join(declared)}")

    description = spec.get("description") or ""
    if not isinstance(description, str):
        raise ValueError(f"{path}: description: expected a string")
    sweep = Sweep(name=name, path=path, notebook=notebook, base=base, fixed=fixed, axes=axes, points=points,
                  description=description.strip(), chart=chart, declared=tuple(declared))
    expand(sweep)  # duplicate points are refused here, before anything runs
    return sweep


# ---------------------------------------------------------------- points

def _slug(v) -> str:
    if isinstance(v, (list, tuple)):
        return "+".join(_slug(x) for x in v) or "none"
    if isinstance(v, bool) or v is None:
        return str(v).lower()
    if isinstance(v, float):
        return f"{v:g}"
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", str(v)).strip("_") or "x"


def params_sha256(parameters: dict) -> str:
    """SHA-256 of a parameter set (canonical JSON: sorted keys, no spaces)."""
    blob = json.dumps(parameters, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def point_id(varied: dict, parameters: dict, max_len: int = 48) -> str:
    """``<varied values joined by '_'>-<first 8 hex digits of params_sha256(parameters)>``, e.g.
    ``24_32768-1a2b3c4d``: readable from the values, unique from the whole parameter set."""
    short = "_".join(_slug(v) for v in varied.values())[:max_len].strip("_") or "base"
    if not short[0].isalnum():      # e.g. a negative value: no file name starting with '-'
        short = "p" + short
    return f"{short}-{params_sha256(parameters)[:8]}"


def expand(sweep: Sweep) -> list[Point]:
    """The sweep's points in order: the product of the axes (first axis slowest) or the explicit list.

    Raises:
        ValueError: two points with the same full parameter set.
    """
    if sweep.axes is not None:
        names = list(sweep.axes)
        combos = [dict(zip(names, vals)) for vals in itertools.product(*(sweep.axes[n] for n in names))]
    else:
        combos = [dict(p) for p in sweep.points]
    points, seen = [], {}
    for i, varied in enumerate(combos):
        params = {**sweep.fixed, **varied}
        pid = point_id(varied, params)
        if pid in seen:
            raise ValueError(f"{sweep.path}: points {seen[pid]} and {i} have the same parameters {varied}")
        seen[pid] = i
        points.append(Point(pid, varied, params))
    return points


# ---------------------------------------------------------------- headline figures

def _json_safe(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {str(k): _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    if hasattr(v, "item") and not isinstance(v, (str, bytes)):   # numpy scalars
        return _json_safe(v.item())
    return v


def check_headline(headline: dict) -> dict:
    """Validate (and make JSON-safe: NaN -> null) a headline dict ``{"figures": {..}, "by": [..], "rows": [..]}``.

    Raises:
        ValueError: not that shape (names the part).
    """
    if not isinstance(headline, dict) or set(headline) - {"figures", "by", "rows"}:
        raise ValueError("headline: expected a dict with keys among figures, by, rows")
    figures = headline.get("figures") or {}
    by = list(headline.get("by") or [])
    rows = list(headline.get("rows") or [])
    if not isinstance(figures, dict):
        raise ValueError("headline.figures: expected a dict name -> scalar")
    if rows and not by:
        raise ValueError("headline.by: name the label column(s) of the rows")
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or any(b not in r for b in by):
            raise ValueError(f"headline.rows[{i}]: expected a dict holding the label column(s) {by}")
    return _json_safe({"figures": figures, "by": by, "rows": rows})


def headline_markdown(headline: dict) -> str:
    """The headline figures as Markdown (what the report shows of the recorded output)."""
    h = check_headline(headline)
    parts = ["**Headline figures** (recorded for parameter sweeps, `kvrepro.nbsweep`)"
             + (": " + ", ".join(f"{k} {_fmt(v)}" for k, v in h["figures"].items()) if h["figures"] else "")]
    if h["rows"]:
        cols = list(dict.fromkeys(k for r in h["rows"] for k in r))
        parts.append("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
                     + "\n".join("| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in h["rows"]))
    return "\n\n".join(parts)


def record_headline(headline: dict) -> None:
    """Record a notebook's headline figures for sweeps: one output holding them as ``application/json`` under
    ``kvrepro_headline`` (what :func:`read_headline` finds in the executed notebook) and as Markdown (what the
    report shows). Called by the last cell of notebooks 02 and 03. Raises ValueError as :func:`check_headline`."""
    h = check_headline(headline)
    md = headline_markdown(h)
    try:
        from IPython import get_ipython
        from IPython.display import display
    except ImportError:
        get_ipython = None
    if get_ipython is None or get_ipython() is None:
        print(md)
    else:
        display({"application/json": {HEADLINE_KEY: h}, "text/markdown": md, "text/plain": md}, raw=True)


def read_headline(nb) -> dict | None:
    """The last headline recorded in an executed notebook (dict or nbformat node), or None."""
    found = None
    for cell in nb.get("cells", []):
        for out in cell.get("outputs", []) or []:
            data = (out.get("data") or {}).get("application/json")
            if isinstance(data, str):
                try:
                    data = json.loads(data)
                except ValueError:
                    continue
            if isinstance(data, dict) and HEADLINE_KEY in data:
                found = json.loads(json.dumps(data[HEADLINE_KEY]))
    return found


def headline_columns(headline: dict | None) -> dict:
    """``{(group, label): value}`` of a headline, metric by metric: each figure as ``(name, "")``, and each row's
    metric as ``(metric, "<label values>")``, e.g. ``("users_fit", "bf16")``."""
    if not headline:
        return {}
    out = {(str(k), ""): v for k, v in (headline.get("figures") or {}).items()}
    by = headline.get("by") or []
    rows = headline.get("rows") or []
    for m in dict.fromkeys(k for r in rows for k in r if k not in by):
        for r in rows:
            if m in r:
                out[(m, " ".join(str(r[b]) for b in by))] = r[m]
    return out


def flat_headline(headline: dict | None) -> dict:
    """``{column: value}`` of a headline: each figure, and each row's metric as ``"<metric> <labels>"``
    (e.g. ``users_fit bf16``), metric by metric."""
    return {f"{g} {lab}" if lab else g: v for (g, lab), v in headline_columns(headline).items()}


def _headline_order(records: list[dict]) -> list[tuple]:
    cols = list(dict.fromkeys(c for r in records for c in headline_columns(r.get("headline"))))
    first = {g: i for i, g in reversed(list(enumerate(c[0] for c in cols)))}
    return sorted(cols, key=lambda c: first[c[0]])


# ---------------------------------------------------------------- running

def _write_json(path: Path, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, allow_nan=True) + "\n").encode())


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


def run_point(notebook: str, cwd: str, point: Point, out_dir: str, kernel: str = DEFAULT_KERNEL,
              sweep: str = "") -> dict:
    """Run one point with papermill and write its executed notebook, HTML (code hidden) and JSON sidecar.

    The notebook and HTML are written under temporary names and renamed into place; the previous sidecar is
    removed first and the new one written last (atomically), so a sidecar always describes the files beside it.
    A failing notebook (``PapermillExecutionError``) gives status "failed" with ``"<ename>: <evalue>"``, the
    notebook's own message, and still its executed notebook and HTML (showing where it failed). Never raises for a
    failure of the notebook; returns the sidecar dict.
    """
    import nbformat
    import papermill as pm
    from nbconvert import HTMLExporter

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    final_nb, final_html, sidecar = out / f"{point.id}.ipynb", out / f"{point.id}.html", out / f"{point.id}.json"
    tag = f".{point.id}.{os.getpid()}.tmp"
    tmp_nb, tmp_html = out / f"{tag}.ipynb", out / f"{tag}.html"
    rec = {"sweep": sweep, "point": point.id, "status": "failed", "error": None,
           "varied": point.varied, "parameters": point.parameters,
           "notebook": os.path.relpath(notebook, ROOT) if str(notebook).startswith(str(ROOT)) else str(notebook),
           "notebook_sha256": file_sha256(Path(notebook)),
           "kvrepro_version": kvrepro.__version__, "kvrepro_src_sha256": provenance.src_sha256(),
           "headline": None, "html": None, "ipynb": None, "started_utc": _now(), "wall_s": None}
    t0 = time.monotonic()
    try:
        try:
            pm.execute_notebook(str(notebook), str(tmp_nb), parameters=dict(point.parameters), kernel_name=kernel,
                                cwd=str(cwd), progress_bar=False, log_output=False)
        except pm.PapermillExecutionError as e:
            rec["error"] = f"{e.ename}: {e.evalue}"
        except Exception as e:  # noqa: BLE001 - no kernel, unreadable notebook, ...: this point failed, say why
            rec["error"] = f"{type(e).__name__}: {e}"
        if sidecar.exists():
            sidecar.unlink()
        if tmp_nb.is_file():
            nb = nbformat.read(str(tmp_nb), as_version=4)
            if rec["error"] is None:
                rec["headline"] = read_headline(nb)
            try:
                body, _ = HTMLExporter(exclude_input=True, exclude_input_prompt=True,
                                       exclude_output_prompt=True).from_notebook_node(nb)
                tmp_html.write_text(body, encoding="utf-8")
            except Exception as e:  # noqa: BLE001
                rec["error"] = rec["error"] or f"HTML export failed: {type(e).__name__}: {e}"
            os.replace(tmp_nb, final_nb)
            rec["ipynb"] = final_nb.name
            if tmp_html.is_file():
                os.replace(tmp_html, final_html)
                rec["html"] = final_html.name
            elif final_html.exists():
                final_html.unlink()
        else:  # nothing executed: leave no report of an earlier run beside this failure
            for p in (final_nb, final_html):
                if p.exists():
                    p.unlink()
        if rec["error"] is None:
            rec["status"] = "ok"
    finally:
        for p in (tmp_nb, tmp_html):
            if p.exists():
                p.unlink()
    rec["wall_s"] = round(time.monotonic() - t0, 2)
    _write_json(sidecar, rec)
    return rec


def _read_json(path: Path) -> dict | None:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def up_to_date(out_dir: Path, point: Point, notebook_sha: str, src_sha: str) -> dict | None:
    """The point's sidecar when it can be reused: status ok, the same parameters, kvrepro version, kvrepro sources
    and notebook, and its HTML and executed notebook present; else None."""
    rec = _read_json(Path(out_dir) / f"{point.id}.json")
    if not rec or rec.get("status") != "ok":
        return None
    same = (rec.get("parameters") == json.loads(json.dumps(point.parameters))
            and rec.get("kvrepro_version") == kvrepro.__version__
            and rec.get("kvrepro_src_sha256") == src_sha
            and rec.get("notebook_sha256") == notebook_sha)
    files = all(rec.get(k) and (Path(out_dir) / rec[k]).is_file() for k in ("html", "ipynb"))
    return rec if same and files else None


def _failed_record(sweep: Sweep, point: Point, error: str) -> dict:
    return {"sweep": sweep.name, "point": point.id, "status": "failed", "error": error, "varied": point.varied,
            "parameters": point.parameters, "headline": None, "html": None, "ipynb": None}


def run(sweep: Sweep, out_root: str | os.PathLike = DEFAULT_OUT, jobs: int = 1, kernel: str = DEFAULT_KERNEL,
        force: bool = False, log: Callable[[str], None] | None = print) -> list[dict]:
    """Run every point not up to date (all with ``force``), up to ``jobs`` at once, then write the index.

    Returns one sidecar dict per point, in the sweep's order, each with ``"skipped": True`` when reused.
    """
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be a positive integer, got {jobs!r}")
    log = log or (lambda s: None)
    points = expand(sweep)
    out = Path(out_root) / sweep.name
    out.mkdir(parents=True, exist_ok=True)
    nb_sha, src_sha = file_sha256(sweep.notebook), provenance.src_sha256()
    records: dict[str, dict] = {}
    todo = []
    for p in points:
        rec = None if force else up_to_date(out, p, nb_sha, src_sha)
        if rec is not None:
            records[p.id] = {**rec, "skipped": True}
        else:
            todo.append(p)
    log(f"sweep {sweep.name}: {len(points)} point(s) of {sweep.notebook.name}; {len(points) - len(todo)} up to date, "
        f"{len(todo)} to run with {min(jobs, max(len(todo), 1))} job(s) -> {out}")
    for p in points:
        if p.id in records:
            log(f"  skip {p.id} (report up to date)")

    done = 0

    def finish(p: Point, rec: dict) -> None:
        nonlocal done
        done += 1
        records[p.id] = rec
        msg = "ok" if rec["status"] == "ok" else f"FAILED: {rec['error']}"
        log(f"  [{done}/{len(todo)}] {p.id} {msg} ({rec.get('wall_s') or 0:.1f} s)")

    args = (str(sweep.notebook), str(NB_DIR), str(out), kernel, sweep.name)
    if jobs == 1 or len(todo) <= 1:
        for p in todo:
            finish(p, run_point(args[0], args[1], p, args[2], args[3], args[4]))
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        from kvrepro import nbsweep as _this   # by module name, so spawned workers find it under `python -m` too

        with ProcessPoolExecutor(max_workers=min(jobs, len(todo)),
                                 mp_context=multiprocessing.get_context("spawn")) as ex:
            futures = {ex.submit(_this.run_point, args[0], args[1], p, args[2], args[3], args[4]): p for p in todo}
            for fut in as_completed(futures):
                p = futures[fut]
                try:
                    rec = fut.result()
                except Exception as e:  # noqa: BLE001 - a worker that died: that point failed, the others go on
                    rec = _failed_record(sweep, p, f"{type(e).__name__}: {e}")
                    _write_json(out / f"{p.id}.json", rec)
                finish(p, rec)
    ordered = [records[p.id] for p in points]
    write_index(sweep, points, ordered, out)
    failed = sum(r["status"] != "ok" for r in ordered)
    log(f"sweep {sweep.name}: {len(ordered) - failed} ok, {failed} failed; index: {out / 'index.html'}")
    return ordered


# ---------------------------------------------------------------- index page

def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return "" if not math.isfinite(v) else (f"{v:,.0f}" if v.is_integer() and abs(v) >= 1e4 else f"{v:.4g}")
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    return str(v)


def _chart_png(sweep: Sweep, points: list[Point], records: list[dict]) -> bytes | None:
    """The sweep's chart (``chart:`` of the sweep file) from the ok points' headline rows, as PNG bytes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd
    import seaborn as sns

    c = sweep.chart
    rows = []
    for p, rec in zip(points, records):
        h = rec.get("headline") if rec.get("status") == "ok" else None
        if not h:
            continue
        params = {k: (_fmt(v) if isinstance(v, (list, tuple)) else v) for k, v in p.parameters.items()}
        for r in h.get("rows") or [{}]:
            rows.append({**params, **(h.get("figures") or {}), **r})
    if not rows:
        return None
    df = pd.DataFrame(rows)
    missing = [c[k] for k in ("x", "y", "hue", "style", "col") if c.get(k) and c[k] not in df.columns]
    if missing:
        raise ValueError(f"chart: no column {', '.join(map(repr, missing))} among the parameters and headline "
                         f"figures ({', '.join(df.columns)})")
    kw = {k: c[k] for k in ("hue", "style", "col") if c.get(k)}
    if "col" in kw:
        kw["facet_kws"] = {"sharey": False}
    with sns.axes_style("whitegrid"):
        g = sns.relplot(data=df, x=c["x"], y=c["y"], kind="line", markers=True, dashes=False, height=4.2,
                        aspect=1.4, linewidth=2, markersize=8, **kw)
    xs = sorted(df[c["x"]].dropna().unique())
    for ax in g.axes.flat:
        if len(xs) <= 12:
            ax.set_xticks(xs)
            ax.set_xticklabels([_fmt(x) for x in xs])
        ax.set_ylim(bottom=0)
        if pd.api.types.is_integer_dtype(df[c["y"]]):
            ax.yaxis.get_major_locator().set_params(integer=True)
    g.set_axis_labels(c.get("xlabel") or c["x"], c.get("ylabel") or c["y"])
    if c.get("title"):
        g.figure.suptitle(c["title"], y=1.03)
    buf = io.BytesIO()
    g.figure.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(g.figure)
    return buf.getvalue()


def index_frame(points: list[Point], records: list[dict]):
    """One row per point (flat columns: point, status, the varied parameters, headline figures, wall_s, error,
    html) as a pandas DataFrame; what ``index.csv`` holds."""
    import pandas as pd

    varied = list(dict.fromkeys(k for p in points for k in p.varied))
    heads = [flat_headline(r.get("headline")) for r in records]
    metric_cols = [f"{g} {lab}" if lab else g for g, lab in _headline_order(records)]
    cols = ["point", "status", *varied, *metric_cols, "wall_s", "error", "html"]
    rows = []
    for p, rec, h in zip(points, records, heads):
        row = {"point": p.id, "status": rec.get("status")}
        row.update({k: _fmt(v) if isinstance(v, (list, tuple)) else v for k, v in p.varied.items()})
        row.update(h)
        row.update({"wall_s": rec.get("wall_s"), "error": rec.get("error"), "html": rec.get("html")})
        rows.append(row)
    df = pd.DataFrame(rows, columns=cols)
    for c in df.columns:   # integer figures stay integers where a failed point leaves a gap
        vals = [v for v in df[c] if v is not None and not (isinstance(v, float) and math.isnan(v))]
        if vals and all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
            df[c] = df[c].astype("Int64")
    return df


_CSS = """body{font-family:system-ui,sans-serif;margin:1.5em 2em;color:#222}
table{border-collapse:collapse;font-size:13px}th,td{border:1px solid #ccc;padding:3px 7px;text-align:right}
th{background:#f0f0f0}th[colspan]{text-align:center}td.l,th.l{text-align:left}td.pt{white-space:nowrap}
tr.failed td{background:#fde8e8}td.err{color:#a00;text-align:left;max-width:38em}
code{background:#f4f4f4;padding:0 3px}.fixed td{text-align:left}img{max-width:100%}"""


def index_html(sweep: Sweep, points: list[Point], records: list[dict], chart_png: bytes | None = None,
               chart_error: str | None = None) -> str:
    """The index page: what the sweep is, its fixed parameters, the chart, one row per point."""
    e = html.escape
    varied = list(dict.fromkeys(k for p in points for k in p.varied))
    heads = [headline_columns(r.get("headline")) for r in records]
    metric_cols = _headline_order(records)
    n_ok = sum(r.get("status") == "ok" for r in records)
    n_skip = sum(bool(r.get("skipped")) for r in records)
    fixed = {k: v for k, v in sweep.fixed.items() if k not in varied}
    out = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>Sweep {e(sweep.name)}</title>"
           f"<style>{_CSS}</style></head><body>",
           f"<h1>Sweep <code>{e(sweep.name)}</code></h1>"]
    if sweep.description:
        out.append(f"<p>{e(sweep.description)}</p>")
    rel = lambda p: e(os.path.relpath(p, ROOT) if str(p).startswith(str(ROOT)) else str(p))  # noqa: E731
    out.append(f"<p>Notebook <code>{rel(sweep.notebook)}</code>, base parameters <code>{rel(sweep.base)}</code>, "
               f"sweep file <code>{rel(sweep.path)}</code>. <b>{len(records)} points: {n_ok} ok, "
               f"{len(records) - n_ok} failed</b> ({n_skip} reused from an earlier run with the same parameters and "
               f"code). Index written {e(_now())}, kvrepro {e(kvrepro.__version__)} "
               f"(sources <code>{e(provenance.src_sha256()[:8])}</code>).</p>")
    if chart_png:
        out.append("<img alt='sweep chart' src='data:image/png;base64,"
                   + base64.b64encode(chart_png).decode() + "'>")
    elif chart_error:
        out.append(f"<p class='err'>Chart not drawn: {e(chart_error)}</p>")
    top, sub = [], []          # two header rows: a metric over its labels (e.g. users_fit over the formats)
    for g, group in itertools.groupby(metric_cols, key=lambda c: c[0]):
        labels = [lab for _, lab in group]
        if labels == [""]:
            top.append(f"<th rowspan='2'>{e(g)}</th>")
        else:
            top.append(f"<th colspan='{len(labels)}'>{e(g)}</th>")
            sub += [f"<th>{e(lab)}</th>" for lab in labels]
    out.append("<h2>Points</h2><table><thead><tr><th class='l' rowspan='2'>point</th><th rowspan='2'>status</th>"
               + "".join(f"<th rowspan='2'>{e(k)}</th>" for k in varied) + "".join(top)
               + "<th rowspan='2'>wall s</th><th class='l' rowspan='2'>error</th></tr>"
               + f"<tr>{''.join(sub)}</tr></thead><tbody>")
    for p, rec, h in zip(points, records, heads):
        link = (f"<a href='{e(rec['html'])}'>{e(p.id)}</a>" if rec.get("html") else e(p.id))
        if rec.get("ipynb"):
            link += f" (<a href='{e(rec['ipynb'])}'>ipynb</a>)"
        status = rec.get("status", "?") + (" (reused)" if rec.get("skipped") else "")
        out.append(f"<tr class='{'ok' if rec.get('status') == 'ok' else 'failed'}'><td class='l pt'>{link}</td>"
                   f"<td class='l'>{e(status)}</td>"
                   + "".join(f"<td>{e(_fmt(p.varied.get(k)))}</td>" for k in varied)
                   + "".join(f"<td>{e(_fmt(h.get(k)))}</td>" for k in metric_cols)
                   + f"<td>{e(_fmt(rec.get('wall_s')))}</td><td class='err'>{e(rec.get('error') or '')}</td></tr>")
    out.append("</tbody></table>")
    out.append("<h2>Fixed parameters</h2><table class='fixed'>"
               + "".join(f"<tr><td>{e(k)}</td><td><code>{e(json.dumps(v))}</code></td></tr>" for k, v in fixed.items())
               + "</table><p>Each point's parameters, status, headline figures and versions are in "
               "<code>&lt;point&gt;.json</code> beside its report; all rows in <a href='index.csv'>index.csv</a>."
               "</p></body></html>")
    return "\n".join(out)


def write_index(sweep: Sweep, points: list[Point], records: list[dict], out_dir: str | os.PathLike) -> Path:
    """Write ``index.html`` and ``index.csv`` (atomically) into ``out_dir``; returns the HTML path."""
    out = Path(out_dir)
    png, err = None, None
    if sweep.chart:
        try:
            png = _chart_png(sweep, points, records)
            if png is None:
                err = "no point succeeded with headline figures"
        except Exception as ex:  # noqa: BLE001 - the table is still worth writing
            err = f"{type(ex).__name__}: {ex}"
    atomic_write_bytes(out / "index.csv", index_frame(points, records).to_csv(index=False).encode())
    atomic_write_bytes(out / "index.html", index_html(sweep, points, records, png, err).encode())
    return out / "index.html"


# ---------------------------------------------------------------- CLI

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvrepro.nbsweep",
                                 description="Run a notebook over a grid of parameters (a sweep file under "
                                             "notebooks/sweeps/) with papermill and write an index page.")
    ap.add_argument("sweep", nargs="?", help=f"sweep name ({', '.join(available_sweeps())}) or path to a .yaml")
    ap.add_argument("--jobs", "-j", type=int, default=1, help="points run at once (default 1)")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="output root; the sweep writes <out>/<name>/ "
                                                            "(default reports/sweeps)")
    ap.add_argument("--kernel", default=DEFAULT_KERNEL, help="Jupyter kernel name (default kvrepro)")
    ap.add_argument("--force", action="store_true", help="re-run every point, even those up to date")
    ap.add_argument("--dry-run", action="store_true", help="list the points and exit")
    args = ap.parse_args(argv)
    if not args.sweep:
        print(f"error: name a sweep: {', '.join(available_sweeps())} (notebooks/sweeps/), or a path to a .yaml file",
              file=sys.stderr)
        return 2
    if args.jobs < 1:
        print(f"error: --jobs must be >= 1, got {args.jobs}", file=sys.stderr)
        return 2
    try:
        sweep = load(args.sweep)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dry_run:
        for p in expand(sweep):
            print(p.id, json.dumps(p.varied))
        return 0
    records = run(sweep, args.out, jobs=args.jobs, kernel=args.kernel, force=args.force)
    return 1 if any(r["status"] != "ok" for r in records) else 0


if __name__ == "__main__":
    from kvrepro import cli, nbsweep as _module   # run the package's module, not __main__ (spawned workers import it)

    raise SystemExit(cli.run(_module.main))
