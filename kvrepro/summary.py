"""One source for every published figure: the README's results and fidelity blocks, ``docs/capacity.png`` and the
index ``results/capacity/README.md``, generated from committed result files only.

    python -m kvrepro.summary --write   # rewrite the outputs (each atomically: write, then rename)
    python -m kvrepro.summary --check   # exit 1, with a diff, when README.md or the index differ from the results
    python -m kvrepro.summary           # print the README blocks

Inputs: ``results/capacity/*.jsonl`` (``kvrepro.sweep`` rows, read by :func:`kvrepro.replay.load_jsonl`),
``results/accuracy/vllm_h200/vllm_accuracy.csv`` (``scripts/vllm_accuracy.py``: needle retrieval through vLLM) and,
for the fidelity block (:func:`fidelity_block`, ``kvrepro.accuracy_summary``), the committed large fidelity runs
``results/fidelity/reference_h200_smollm2.csv`` (reference path, float32 on the GPU) and
``results/fidelity/vllm_h200_smollm2.csv`` (through vLLM); a file not committed yet is said to be so in the block; for
the serving block (:func:`serve_block`), ``results/serve/*.json`` (``scripts/serve_bench.py``).

Selection: one *current run* per mode = the newest engine run of that mode for the seed's workload
(:data:`SEED_WORKLOAD`). An engine run is the rows sharing an ``engine_run_id``; rows without one are grouped by
(file, ``run_id``, mode). Newest = latest ``date`` among its rows. Ratios "vs fp8" use the fp8 engine run of the
mode's own run (same file and ``run_id``: both measured in one sweep) where it has one of the same setup, else the
newest fp8 run of the mode's setup, else fp8's current run; the table's header gives fp8's current run, and a row says
when its ratios use another fp8 run. The strongest fp8 backend (:func:`strongest_fp8`, each backend from its newest
run) is named beside where it is stronger than the fp8 a row's ratios use.
"""
from __future__ import annotations

import argparse
import difflib
import math
import os
import sys
from pathlib import Path

from kvrepro.fileio import atomic_write_bytes
from kvrepro.style import STYLE, _style, markers, palette, style_of  # noqa: F401 (re-exported)
from kvrepro.formats import DEFAULT_PRESET, get_format
from kvrepro.replay import (SEED_POINTS, WORKLOAD_KEYS, capped_at, find_result_files, load_jsonl,  # noqa: F401
                            repo_root, run_keys, time_span, utc_times)

# Modes of the README table, in its order: (result-file mode, display name, KV format); the default preset is named.
MODES = tuple((m, f"kvrepro {f} (default)" if f == DEFAULT_PRESET else d, f) for m, d, f in (
    ("bf16", "bf16", "bf16"),
    ("fp8", "fp8", "fp8"),
    ("kvrepro:k8v4", "kvrepro k8v4", "k8v4"),
    ("kvrepro:k5v4", "kvrepro k5v4", "k5v4"),
    ("kvrepro:k4v4", "kvrepro k4v4", "k4v4"),
    ("kvrepro:k4v2", "kvrepro k4v2", "k4v2"),
))
CAPACITY_PRESET = "kvrepro:k4v4"   # the preset with the most users at fp8-class speed: the seed's point sits beside it
MODE_NAMES = tuple(m for m, _, _ in MODES)
DISPLAY = {m: d for m, d, _ in MODES}
# The chart adds the fp8 backend the README's answer compares with at capacity (vLLM's choice, FLASH_ATTN, is "fp8")
CHART_MODES = MODE_NAMES + ("fp8:flashinfer",)
DISPLAY["fp8:flashinfer"] = "fp8 on FlashInfer"
FORMAT_OF = {m: f for m, _, f in MODES}
BASELINE = "fp8"
HEAD_DIM = 128  # Qwen3-4B's head_dim: the bytes column is per token and KV head at this size

# The seed's published points (kvrepro.replay's reference data), keyed by the kvrepro mode they sit beside.
# The seed's compressed format is not kvrepro's: it sits on the capacity preset's row, with a footnote.
_SEED_MODE = {"fp16": "bf16", "fp8": "fp8", "compressed (seed)": CAPACITY_PRESET}
SEED = {_SEED_MODE[m]: (u, t) for m, u, t in SEED_POINTS}

# The seed's workload: 128K prompt + 1024 decode tokens per user on an 80 GiB card.
SEED_WORKLOAD = {"prompt_tokens": 131_072, "decode_tokens": 1_024, "gpu_memory_gb": 80.0}

README = "README.md"
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
SETTINGS_BEGIN, SETTINGS_END = "<!-- settings:begin -->", "<!-- settings:end -->"
FIDELITY_BEGIN, FIDELITY_END = "<!-- fidelity:begin -->", "<!-- fidelity:end -->"
ANSWER_BEGIN, ANSWER_END = "<!-- answer:begin -->", "<!-- answer:end -->"
SERVE_BEGIN, SERVE_END = "<!-- serve:begin -->", "<!-- serve:end -->"
CHART = "docs/capacity.png"
CAPACITY_DIR = "results/capacity"
CAPACITY_INDEX = "results/capacity/README.md"
VLLM_ACCURACY = "results/accuracy/vllm_h200/vllm_accuracy.csv"
VLLM_ACCURACY_REPLICA = "results/accuracy/vllm_h200_replica/vllm_accuracy.csv"   # its pre-registered replication
NEEDLE_MODEL = "SmolLM2-135M-Instruct"

# Per mode: colour and marker, so modes differ in both (print, colour-blind readers).


# ---------------------------------------------------------------- selection

def engine_runs(df):
    """The engine runs in result rows, one row per run.

    Args:
        df: rows of :func:`kvrepro.replay.load_jsonl` (columns mode, run_id, date, source_file; optional
            ``engine_run_id``, ``measured_by``).

    Returns:
        DataFrame: run (the run's key: its ``engine_run_id``, else "<file>|<run_id>|<mode>"), mode, source_file,
        run_id, first, last (UTC timestamps of its earliest and latest row), rows (count), sizing_only (bool:
        every row is a ``measured_by == "sizing"`` row, i.e. no users were run). Sorted by mode, then last.
    """
    import pandas as pd

    d = df.assign(_run=run_keys(df), _t=utc_times(df["date"]).to_numpy())
    out = []
    for key, g in d.groupby("_run", sort=False):
        sizing = "measured_by" in g.columns and bool((g["measured_by"] == "sizing").all())
        out.append(dict(run=key, mode=str(g["mode"].iloc[0]), source_file=str(g["source_file"].iloc[0]),
                        run_id=str(g["run_id"].iloc[0]), first=g["_t"].min(), last=g["_t"].max(), rows=len(g),
                        sizing_only=sizing))
    cols = ["run", "mode", "source_file", "run_id", "first", "last", "rows", "sizing_only"]
    if not out:
        return pd.DataFrame(columns=cols)
    return pd.DataFrame(out, columns=cols).sort_values(["mode", "last", "source_file"], kind="stable") \
        .reset_index(drop=True)


def _matches(df, workload: dict | None):
    import pandas as pd

    ok = pd.Series(True, index=df.index)
    for col, want in (workload or {}).items():
        ok &= df[col].map(lambda v: v == want)
    return ok


def select_current(df, modes=None, workload: dict | None = SEED_WORKLOAD, accept=None) -> dict:
    """One current run per mode: the newest engine run (latest row ``date``; ties: the later file name) among
    the rows whose columns equal ``workload`` (None: every row), leaving out runs of sizing rows only.

    Args:
        df: result rows (:func:`kvrepro.replay.load_jsonl`, concatenated), or None.
        modes: modes to select, in order (None: every mode present, :data:`MODE_NAMES` first, then by name).
        workload: column -> required value (default :data:`SEED_WORKLOAD`).
        accept: None, or a predicate on one run's rows (a DataFrame sorted by num_users): the newest run it accepts.

    Returns:
        dict mode -> DataFrame of that run's rows (sorted by num_users), for the modes that have a run.
    """
    if df is None or not len(df):
        return {}
    d = df[_matches(df, workload)]
    d = d.assign(_run=run_keys(d))
    runs = engine_runs(d) if len(d) else None
    out = {}
    present = set(d["mode"])
    order = [m for m in MODE_NAMES if m in present] + sorted(present - set(MODE_NAMES))
    for mode in (modes if modes is not None else order):
        cand = runs[(runs["mode"] == mode) & ~runs["sizing_only"]] if runs is not None else []
        if not len(cand):
            continue
        for run in cand.sort_values(["last", "source_file", "run"], kind="stable")["run"][::-1]:
            rows = d[d["_run"] == run].drop(columns="_run").sort_values("num_users", kind="stable")
            if accept is None or accept(rows):
                out[mode] = rows.reset_index(drop=True)
                break
    return out


def clean_rows(rows):
    """Rows of one run that count for capacity: clean, no preemption, users > 0, a measured tok/s."""
    ok = rows["clean"].astype(bool) & (rows["preemptions"] == 0) & (rows["num_users"] > 0)
    return rows[ok & rows["aggregate_decode_tok_s"].notna()]


def max_clean(rows) -> tuple[int, float] | None:
    """(users, aggregate decode tok/s) at the largest clean ``num_users`` of one run; None when none is clean or the
    run was capped below what its cache fits (:func:`capped_at`: its largest point is not its capacity)."""
    good = clean_rows(rows)
    if not len(good) or capped_at(rows) is not None:
        return None
    best = good.loc[good["num_users"].idxmax()]
    return int(best["num_users"]), float(best["aggregate_decode_tok_s"])


def best_clean(rows) -> tuple[int, float] | None:
    """(users, tok/s) of the clean point with the highest aggregate decode tok/s of one run (ties: fewer users)."""
    good = clean_rows(rows)
    if not len(good):
        return None
    top = good["aggregate_decode_tok_s"].max()
    users = int(good.loc[good["aggregate_decode_tok_s"] == top, "num_users"].min())
    return users, float(top)


def when(rows) -> str:
    """The UTC span of one run's rows (:func:`kvrepro.replay.time_span`)."""
    return time_span(rows["date"])


def _rel(path) -> str:
    p = Path(str(path))
    try:
        return p.resolve().relative_to(repo_root()).as_posix()
    except ValueError:
        return p.as_posix()


def _same_setup(a, b) -> list[str]:
    """WORKLOAD_KEYS on which two runs' first rows differ (both present); [] = a like-for-like ratio."""
    out = []
    for c in WORKLOAD_KEYS:
        if c in a.columns and c in b.columns:
            x, y = a[c].iloc[0], b[c].iloc[0]
            if not ((x is None or (isinstance(x, float) and math.isnan(x))) and
                    (y is None or (isinstance(y, float) and math.isnan(y)))) and x != y:
                out.append(c)
    return out


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or not den:
        return None
    return num / den


def summary_rows(df, needle=None, modes=MODE_NAMES, workload: dict | None = SEED_WORKLOAD,
                 backends: list[dict] | None = None) -> list[dict]:
    """The README table as plain values, one dict per mode of ``modes`` (in that order).

    Args:
        df: result rows (None: no measured runs).
        needle: :func:`needle_counts` output (None: no needle column values).
        modes, workload: as :func:`select_current`.
        backends: :func:`fp8_backends` of ``df`` and ``workload`` where the caller has them already (one README
            build computes them once); None: computed here.

    Returns:
        list of dicts: mode, name, bytes_per_token_head (int, head_dim 128), seed_users / seed_tok_s (None off the
        seed's modes), users / tok_s (max clean capacity of the current run; None without a run or a clean point),
        vs_fp8_max / vs_fp8_best (float ratios of tok_s to fp8's tok/s at its max clean capacity / at its best
        clean point; None when either is missing or the setups differ), fp8_max / fp8_best ((users, tok/s) of the
        fp8 run the ratios use: the mode's own run's fp8 where that run has one of the same setup, else the newest
        fp8 run of the mode's setup, else fp8's current run), fp8_table_max / fp8_table_best (the same of fp8's
        current run: the table's header), fp8_same_run (True when the ratios use an fp8 engine run other than the
        header's, which the row then names), source_file, run_id, when (UTC
        span), fp8_source_file / fp8_when (when the fp8 run used is in another file), setup_differs (WORKLOAD_KEYS
        that differ from that fp8 run), strongest_max / strongest_best (the strongest fp8 at its max clean capacity /
        best clean point among the row's ratio fp8 and every other fp8 backend of the row's setup, each from its newest
        run: mode, backend, users, tok_s, source_file, run_id; None when it is the row's own fp8) and
        vs_strongest_max / vs_strongest_best (tok_s over theirs), needle / needle_bf16
        ((correct, prompts) single-needle through vLLM, bf16's from the same run), key_offset (the kvrepro run's
        key offset, :func:`run_key_offset`; None for bf16 / fp8).
    """
    runs = select_current(df, list(dict.fromkeys([*modes, BASELINE])), workload)
    base = runs.get(BASELINE)
    backends = _measured_fp8_backends(df, workload) if backends is None else backends
    fp8_max = max_clean(base) if base is not None else None
    fp8_best = best_clean(base) if base is not None else None
    needle = needle or {}
    out = []
    for mode in modes:
        fmt = FORMAT_OF.get(mode, mode.split(":")[-1])
        try:
            nbytes = get_format(fmt).bytes_per_token_per_head(HEAD_DIM)
        except ValueError:
            nbytes = None
        seed = SEED.get(mode, (None, None))
        r = dict(mode=mode, name=DISPLAY.get(mode, mode), bytes_per_token_head=nbytes, seed_users=seed[0],
                 seed_tok_s=seed[1], users=None, tok_s=None, vs_fp8_max=None, vs_fp8_best=None, fp8_max=fp8_max,
                 fp8_best=fp8_best, fp8_table_max=fp8_max, fp8_table_best=fp8_best, fp8_same_run=False,
                 strongest_max=None, vs_strongest_max=None, strongest_best=None, vs_strongest_best=None,
                 source_file=None, run_id=None, when=None, fp8_source_file=None, fp8_when=None,
                 setup_differs=[], needle=needle.get(fmt),
                 needle_bf16=needle.get("_bf16", {}).get(fmt, needle.get("bf16")), gpu=None, key_offset=None)
        rows = runs.get(mode)
        if rows is not None:
            cap = max_clean(rows)
            r.update(source_file=_rel(rows["source_file"].iloc[0]), run_id=str(rows["run_id"].iloc[0]),
                     when=when(rows), gpu=str(rows["gpu"].iloc[0]) if "gpu" in rows else None,
                     key_offset=run_key_offset(rows))
            if cap is not None:
                r.update(users=cap[0], tok_s=cap[1])
            ref = base if mode == BASELINE else same_run_fp8(df, rows, workload)
            if ref is None or _same_setup(rows, ref):
                match = _fp8_of_setup(df, rows, workload)
                ref = match if match is not None else ref if ref is not None else base
            if ref is not None and base is not None and _run_key(ref) != _run_key(base):
                r.update(fp8_max=max_clean(ref), fp8_best=best_clean(ref), fp8_same_run=True)
            if ref is not None:
                differs = _same_setup(rows, ref)
                r["setup_differs"] = differs
                if rows["source_file"].iloc[0] != ref["source_file"].iloc[0]:
                    r.update(fp8_source_file=_rel(ref["source_file"].iloc[0]), fp8_when=when(ref))
                if not differs and cap is not None:
                    r.update(vs_fp8_max=_ratio(cap[1], r["fp8_max"] and r["fp8_max"][1]),
                             vs_fp8_best=_ratio(cap[1], r["fp8_best"] and r["fp8_best"][1]))
            if cap is not None:
                # the row's ratio fp8 stands for vLLM's choice (ref is None only where no fp8 run exists at all)
                own = [dict(mode=BASELINE, source_file=_rel(ref["source_file"].iloc[0]), rows=ref,
                            max_clean=r["fp8_max"], best_clean=r["fp8_best"])] if ref is not None else []
                others = [b for b in backends if b["mode"] != BASELINE]
                for key, point in _strongest_of([*own, *others], rows).items():
                    if point is not None and point["mode"] != BASELINE:
                        r[f"strongest_{key}"] = {k: point[k] for k in ("mode", "backend", "users", "tok_s",
                                                                       "source_file", "run_id")}
                        r[f"vs_strongest_{key}"] = _ratio(cap[1], point["tok_s"])
        out.append(r)
    return out


def fp8_backends(df, workload: dict | None = SEED_WORKLOAD) -> list[dict]:
    """Every fp8 KV mode (``kvrepro.sweep.FP8_MODES``: vLLM's choice and each named backend) at its current run
    (:func:`select_current`, so each from its own newest run), in that order.

    Returns:
        list of dicts: mode, backend (the resolved one, else the one asked), max_clean / best_clean ((users, tok/s) or
        None; max_clean None for a run capped below what its cache fits), capped_at (the cap, else None), source_file,
        when, rows (the run's DataFrame).
    """
    from kvrepro import sweep

    runs = select_current(df, list(sweep.FP8_MODES), workload)
    out = []
    for m in sweep.FP8_MODES:
        rows = runs.get(m)
        if rows is None:
            continue
        cap = capped_at(rows)
        out.append(dict(mode=m, backend=_backend_of(rows, m, sweep), max_clean=None if cap is not None else max_clean(rows),
                        best_clean=best_clean(rows), capped_at=cap, source_file=_rel(rows["source_file"].iloc[0]),
                        when=when(rows), rows=rows))
    return out


def _measured_fp8_backends(df, workload: dict | None = SEED_WORKLOAD) -> list[dict]:
    """:func:`fp8_backends`, or [] without result rows (``df`` None or empty)."""
    return fp8_backends(df, workload) if df is not None and len(df) else []


def strongest_fp8(df, workload: dict | None = SEED_WORKLOAD) -> dict:
    """The strongest fp8 over :func:`fp8_backends` whose setup equals vLLM's choice fp8's (``_same_setup``), each
    backend from its own newest run: ``at_capacity`` (the most tok/s at a backend's own max clean capacity) and
    ``best_point`` (the most tok/s at any clean point), each a :func:`fp8_backends` entry plus users / tok_s, or None."""
    top = _strongest_vs_choice(_measured_fp8_backends(df, workload))
    return dict(at_capacity=top["max"], best_point=top["best"])


def _strongest_vs_choice(backends: list[dict]) -> dict:
    """:func:`_strongest_of` the :func:`fp8_backends` entries whose setup equals vLLM's choice fp8's (all of them
    where that has no run)."""
    base = next((b for b in backends if b["mode"] == BASELINE), None)
    return _strongest_of(backends, base["rows"] if base is not None else None)


def _strongest_of(cands: list[dict], setup_rows=None) -> dict:
    """``{"max": entry, "best": entry}``: among :func:`fp8_backends`-like entries (mode, rows, max_clean, best_clean)
    whose setup equals ``setup_rows``' (None: all), the one with the most tok/s at its max clean capacity and the one
    with the most at its best clean point, each with users / tok_s / backend / run_id added; None where none has one."""
    from kvrepro import sweep

    ok = [c for c in cands if setup_rows is None or not _same_setup(setup_rows, c["rows"])]
    out = {}
    for key, field in (("max", "max_clean"), ("best", "best_clean")):
        have = [c for c in ok if c.get(field)]
        top = max(have, key=lambda c: c[field][1]) if have else None
        out[key] = None if top is None else dict(
            top, users=top[field][0], tok_s=top[field][1], run_id=str(top["rows"]["run_id"].iloc[0]),
            backend=top.get("backend") or _backend_of(top["rows"], top["mode"], sweep))
    return out


def _backend_of(rows, mode: str, sweep) -> str:
    """The attention backend a run's engine resolved (``attention_backend_resolved``), else the one its mode asks for
    (``kvrepro.sweep.engine_settings``; "vllm-auto" when vLLM chooses)."""
    resolved = rows["attention_backend_resolved"].iloc[0] if "attention_backend_resolved" in rows.columns else None
    if isinstance(resolved, (list, tuple)) and len(resolved):
        return ", ".join(resolved)
    return sweep.engine_settings(mode)["attention_backend"] or "vllm-auto"


def fp8_backends_line(df, workload: dict | None = SEED_WORKLOAD, backends: list[dict] | None = None,
                      link_prefix: str = "") -> str | None:
    """The README line under the results table: each fp8 backend's points (its newest run) and which is the strongest
    at its max clean capacity and at any clean point; None with fewer than two backends measured. ``backends``:
    :func:`fp8_backends` of ``df`` and ``workload`` where the caller has them already (None: computed here).
    ``link_prefix``: put before the repository-relative file links (``"../"`` for a report under ``reports/``)."""
    backends = _measured_fp8_backends(df, workload) if backends is None else backends
    if len(backends) < 2:
        return None
    base = next((b for b in backends if b["mode"] == BASELINE), None)
    top = _strongest_vs_choice(backends)
    parts = []
    for b in backends:
        differs = _same_setup(b["rows"], base["rows"]) if base is not None else []
        cap = (f"capacity not measured (capped at {b['capped_at']} users)" if b["capped_at"] is not None else
               f"{b['max_clean'][0]} users at {b['max_clean'][1]:.1f} tok/s" if b["max_clean"] else "no clean point")
        best = f", best clean point {b['best_clean'][0]} users at {b['best_clean'][1]:.1f}" if b["best_clean"] else ""
        note = f", not compared: setup differs from vLLM's choice fp8's run ({', '.join(differs)})" if differs else ""
        parts.append(f"{b['mode']} ({b['backend']}) {cap}{best} ([{Path(b['source_file']).name}]"
                     f"({link_prefix}{b['source_file']})"
                     f"{note})")
    tail = ""
    for label, t in (("Strongest at its max clean capacity", top["max"]), ("best clean point of any", top["best"])):
        if t:
            tail += (f"{'; ' if tail else ' '}{label}: {t['mode']} ({t['backend']}, {t['users']} users, "
                     f"{t['tok_s']:.1f} tok/s)")
    tail += (". " if tail else " ") + ("The table's ratios use vLLM's choice fp8 of each row's own run where that run "
                                       "measured it, else fp8's newest run.")
    return "fp8 on each vLLM attention backend measured (each from its newest run): " + "; ".join(parts) + "." + tail


def _fp8_of_setup(df, rows, workload: dict | None = SEED_WORKLOAD):
    """The newest engine run of vLLM's choice fp8 (:func:`select_current`) whose setup equals that of ``rows``
    (``_same_setup``), or None."""
    return select_current(df, [BASELINE], workload, accept=lambda cand: not _same_setup(rows, cand)).get(BASELINE)


def _run_key(rows) -> str:
    """The engine-run key of one engine run's rows (:func:`kvrepro.replay.run_keys` of its first row)."""
    return run_keys(rows.iloc[:1])[0]


def same_run_fp8(df, rows, workload: dict | None = SEED_WORKLOAD):
    """The newest fp8 engine run (:func:`select_current`) among the rows of ``df`` in the same file and ``run_id`` as
    ``rows`` (one engine run of a mode), or None when that run measured no fp8."""
    src, run_id = rows["source_file"].iloc[0], rows["run_id"].iloc[0]
    same = df[(df["source_file"] == src) & (df["run_id"] == run_id)]
    return select_current(same, [BASELINE], workload).get(BASELINE)


def _as_committed(path: str) -> str:
    """``path`` (relative to the repository) as committed: with ``.gz`` where only the compressed copy exists."""
    from kvrepro.accuracy import existing

    return os.path.relpath(existing(str(repo_root() / path)), repo_root())


def run_key_offset(rows) -> str | None:
    """The key offset a kvrepro mode's run stored keys with, from its rows' ``kvrepro_settings`` ("off" for runs
    before the setting existed; several joined by ", "); None for a run without kvrepro settings (bf16, fp8)."""
    if "kvrepro_settings" not in rows:
        return None
    seen = {ko for ko in map(_settings_key_offset, rows["kvrepro_settings"]) if ko is not None}
    return ", ".join(sorted(seen)) or None


def _settings_key_offset(settings) -> str | None:
    """One row's key offset from its ``kvrepro_settings`` ("off" before the setting existed; None without settings)."""
    return str(settings.get("key_offset", "off")) if isinstance(settings, dict) else None


def needle_counts(path: str | os.PathLike | None = None, variant: str = "single") -> dict:
    """Needle retrieval through vLLM: format -> (correct, prompts) for ``variant``; {} when no file is there.

    ``path``: one run's file; None = the committed runs, :data:`VLLM_ACCURACY_REPLICA` and :data:`VLLM_ACCURACY`,
    those whose compressed presets ran with the default key offset first, each format from the first run that has it
    (the fidelity table's order, ``kvrepro.accuracy_summary.needle_sources``). Also returns, under ``"_bf16"``,
    format -> bf16's (correct, prompts) in the same run, and under ``"_meta"`` a list, one dict per run used: gpu,
    vllm_version, first / last (UTC measurement times), context_lengths (sorted ints), file (relative path),
    key_offset, formats."""
    import pandas as pd

    from kvrepro import accuracy_summary as acs
    from kvrepro.accuracy import existing, needle_key_offset

    runs = []
    for one in ([path] if path is not None else [VLLM_ACCURACY_REPLICA, VLLM_ACCURACY]):
        p = Path(one)
        p = Path(existing(str(p if p.is_absolute() else repo_root() / p)))
        if not p.is_file():
            continue
        d = pd.read_csv(p, usecols=lambda c: c in {"format", "variant", "correct", "gpu", "vllm_version", "date",
                                                   "context_length", "kvrepro_settings"})
        if "variant" in d.columns:
            d = d[d["variant"] == variant]
        if len(d):
            runs.append((p, d, needle_key_offset(d)))
    out, bf16_of, metas = {}, {}, []
    for p, d, ko in acs.by_default_offset(runs, offset_of=lambda r: r[2]):
        counts = {str(f): (int(g["correct"].sum()), int(len(g))) for f, g in d.groupby("format", sort=True)}
        new = [f for f in counts if f not in out]
        if not new:
            continue
        for f in new:
            out[f] = counts[f]
            bf16_of[f] = counts.get("bf16")
        t = utc_times(d["date"]) if "date" in d.columns else None
        metas.append(dict(gpu=", ".join(sorted(set(map(str, d.get("gpu", []))))),
                          vllm_version=", ".join(sorted(set(map(str, d.get("vllm_version", []))))),
                          first=t.min() if t is not None else None, last=t.max() if t is not None else None,
                          context_lengths=sorted(set(int(x) for x in d.get("context_length", []))),
                          file=_rel(p), key_offset=ko, formats=new))
    if metas:
        out["_bf16"], out["_meta"] = bf16_of, metas
    return out


def load_capacity(results_dir: str | os.PathLike = CAPACITY_DIR):
    """Result rows of every ``*.jsonl`` in ``results_dir`` (relative to the repo root), or None when none."""
    import pandas as pd

    files = find_result_files(results_dir)
    return pd.concat([load_jsonl(f) for f in files], ignore_index=True) if files else None


# ---------------------------------------------------------------- the strongest fp8 (issue 23)

class ModeNotInRun(ValueError):
    """:func:`fp8_ratios`: the compared mode has no rows in the run."""


def fp8_ratios(source, mode: str = CAPACITY_PRESET) -> dict:
    """``mode`` against every fp8 KV mode of ONE sweep run (``kvrepro.sweep.FP8_MODES``: vLLM's choice and each
    named backend), both ways: against fp8 at its max clean capacity (the seed's protocol) and against the best
    clean point of any fp8 mode.

    Args:
        source: a results file (``*.jsonl`` of ``kvrepro.sweep``; its ``<file>.engine_errors`` beside it is read
            too) or a DataFrame of :func:`kvrepro.replay.load_jsonl` rows of one file.
        mode: the mode compared (default the capacity preset, ``kvrepro:k4v4``), at its max clean capacity.

    Returns:
        dict: file, run_id, mode, point ((users, tok/s) of ``mode`` at its max clean capacity, None without a clean
        point); fp8 (one dict per fp8 mode present, in ``FP8_MODES`` order: mode, backend (what the engine resolved,
        ``attention_backend_resolved``, else the one asked), users_max / tok_s_max (max clean capacity; None for a run
        capped below what its cache fits, whose ``capped_at`` gives the cap: :func:`capped_at`), incomplete (what
        ``kvrepro.sweep.mode_status`` finds missing, e.g. abort windows a timeout cut; None when complete), users_best /
        tok_s_best (highest clean tok/s), vs_max / vs_best (``mode``'s tok/s over those; None when a side has no clean
        point or the setups differ), setup_differs (``kvrepro.replay.WORKLOAD_KEYS`` that differ)); missing (fp8 modes
        without rows), engine_errors (``{mode: error}`` of fp8 modes whose engine did not start);
        at_capacity (the fp8 mode with the most tok/s at its own max clean capacity: fp8_mode, users, tok_s, ratio)
        and best_point (the fp8 mode and users with the most clean tok/s anywhere: fp8_mode, users, tok_s, ratio),
        each None when no fp8 mode has a comparable clean point. Aggregate decode tok/s throughout.

    Raises:
        ValueError: the rows come from more than one file or ``run_id`` (a ratio is taken within one run);
            :class:`ModeNotInRun` (a ValueError) when they hold no row of ``mode``.
    """
    from kvrepro import sweep

    errors: dict = {}
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        df = load_jsonl(path)
        errors = {e["mode"]: e["error"] for e in sweep.engine_errors(path) if e.get("mode") in sweep.FP8_MODES}
    else:
        df = source
    files = sorted(set(map(str, df["source_file"]))) if "source_file" in df.columns else []
    run_ids = sorted(set(map(str, df["run_id"])))
    if len(files) > 1 or len(run_ids) != 1:
        raise ValueError(f"fp8_ratios takes the rows of one run (one file, one run_id); got files {files} and "
                         f"run_ids {run_ids}")
    runs = select_current(df, [mode, *sweep.FP8_MODES], workload=None)
    if mode not in runs:
        raise ModeNotInRun(f"mode {mode!r} has no rows in {files[0] if files else 'these rows'}; modes present: "
                           f"{sorted(set(map(str, df['mode'])))}")
    own = runs[mode]
    point = max_clean(own)
    out = dict(file=files[0] if files else None, run_id=run_ids[0], mode=mode, point=point, fp8=[],
               missing=[m for m in sweep.FP8_MODES if m not in runs], engine_errors=errors,
               at_capacity=None, best_point=None)
    for m in sweep.FP8_MODES:
        rows = runs.get(m)
        if rows is None:
            continue
        backend = _backend_of(rows, m, sweep)
        cap, best = max_clean(rows), best_clean(rows)
        differs = _same_setup(own, rows)
        ok = point is not None and not differs
        done, why = sweep.mode_status(rows.to_dict("records"), m)
        out["fp8"].append(dict(
            mode=m, backend=backend, users_max=cap and cap[0], tok_s_max=cap and cap[1], capped_at=capped_at(rows),
            incomplete=None if done else why, users_best=best and best[0], tok_s_best=best and best[1],
            vs_max=_ratio(point[1], cap and cap[1]) if ok else None,
            vs_best=_ratio(point[1], best and best[1]) if ok else None, setup_differs=differs))
    comparable = [r for r in out["fp8"] if not r["setup_differs"]]
    caps = [r for r in comparable if r["tok_s_max"]]
    bests = [r for r in comparable if r["tok_s_best"]]
    if caps and point is not None:
        top = max(caps, key=lambda r: r["tok_s_max"])
        out["at_capacity"] = dict(fp8_mode=top["mode"], backend=top["backend"], users=top["users_max"],
                                  tok_s=top["tok_s_max"], ratio=point[1] / top["tok_s_max"])
    if bests and point is not None:
        top = max(bests, key=lambda r: r["tok_s_best"])
        out["best_point"] = dict(fp8_mode=top["mode"], backend=top["backend"], users=top["users_best"],
                                 tok_s=top["tok_s_best"], ratio=point[1] / top["tok_s_best"])
    return out


def fp8_ratios_markdown(r: dict, other_errors: dict | None = None, other_runs: dict | None = None) -> str:
    """:func:`fp8_ratios` as a markdown table (one line per fp8 mode measured), a list of the fp8 modes the run
    lacks with the reason, and two headline sentences.

    ``other_errors``: ``{mode: (results file name, error)}`` of fp8 modes this run lacks whose engine did not start in
    another run (:func:`fp8_engine_errors`); their line says so and names that run. ``other_runs``: ``{mode:
    (results file name, fp8 entry of that run's fp8_ratios, the compared mode's point there, that mode)}`` of fp8
    modes this run lacks that another run measured beside the same mode or beside vLLM's choice fp8
    (:func:`fp8_measured_elsewhere`); their line gives that run's figures and ratios (not this run's: the headline
    sentences stay this run's)."""
    def num(v, fmt="{:.1f}"):
        return "" if v is None else fmt.format(v)

    p = r["point"]
    name = DISPLAY.get(r["mode"], r["mode"])
    lines = [f"{name} at its max clean capacity: " + (f"{p[0]} users, {p[1]:.1f} tok/s" if p else "no clean point")
             + f" (run {r['run_id']}, `{Path(str(r['file'])).name if r['file'] else '-'}`).", "",
             "| fp8 mode | backend | users at max clean capacity | tok/s there | best clean point (users) | tok/s "
             f"there | {name} vs max clean | {name} vs best clean |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for f in r["fp8"]:
        users_max = (f"capacity not measured (capped at {f['capped_at']} users)" if f.get("capped_at") is not None
                     else num(f["users_max"], "{}"))
        users_best = num(f["users_best"], "{}")
        if f.get("incomplete") and users_best:
            users_best += f" (best of the windows measured; {f['incomplete']})"
        lines.append(f"| {f['mode']} | {f['backend']} | {users_max} | {num(f['tok_s_max'])} | "
                     f"{users_best} | {num(f['tok_s_best'])} | {_x(f['vs_max'])} | {_x(f['vs_best'])} |")
    ran = {f["backend"]: f["mode"] for f in r["fp8"]}
    if r["missing"]:
        lines += ["", "Not in this run:", ""]
    for m in r["missing"]:
        why = r["engine_errors"].get(m)
        same = ran.get(sweep_backend(m))
        elsewhere = (other_errors or {}).get(m)
        measured = (other_runs or {}).get(m)
        text = ("engine did not start: " + why[:160] if why else
                f"not run on its own (the {same} row ran this backend)" if same else
                _measured_elsewhere_text(name, *measured) if measured else
                f"not run here; its engine did not start in `{elsewhere[0]}`: {elsewhere[1][:160]}" if elsewhere
                else "not run")
        lines.append(f"- {m} ({sweep_backend(m)}): {text}")
    lines.append("")
    a, b = r["at_capacity"], r["best_point"]
    if a or b:
        lines += [f"{name}'s decode rate against fp8:", ""]
    if a:
        lines.append(f"- Against the strongest fp8 of this run at its max clean capacity ({a['fp8_mode']}, {a['users']} users, "
                     f"{a['tok_s']:.1f} tok/s): **{a['ratio']:.2f}x**.")
    if b:
        lines.append(f"- Against the best clean point of any fp8 backend of this run ({b['fp8_mode']}, {b['users']} users, "
                     f"{b['tok_s']:.1f} tok/s): **{b['ratio']:.2f}x**.")
    return "\n".join(lines) + "\n"


def _measured_elsewhere_text(name: str, file: str, f: dict, point, beside: str | None = None) -> str:
    """The line of an fp8 mode measured in another run beside the same kvrepro mode (``beside`` None or that mode):
    its points and ratios there; beside vLLM's choice fp8 only (``beside`` "fp8"): its points and fp8's there, with
    the backend's tok/s over fp8's at each one's max clean capacity and best clean point."""
    if f.get("users_max") is not None:
        where = f"max clean capacity {f['users_max']} users, {f['tok_s_max']:.1f} tok/s; "
    elif f.get("capped_at") is not None:
        where = f"capacity not measured (capped at {f['capped_at']} users); "
    else:
        where = ""
    best = (f"best clean point {f['users_best']} users, {f['tok_s_best']:.1f} tok/s"
            + (f" (best of the windows measured; {f['incomplete']})" if f.get("incomplete") else "")
            if f.get("users_best") is not None else "no clean point")
    if beside == BASELINE:
        ref_best = f.get("fp8_best")
        pairs = (("at max clean capacity", f.get("tok_s_max"), point and point[1]),
                 ("at best clean points", f.get("tok_s_best"), ref_best and ref_best[1]))
        inv = ", ".join(f"{label} {_x(_ratio(a, b))}" for label, a, b in pairs if a and b)
        there = (f"vLLM's choice fp8 there: max clean capacity {point[0]} users, {point[1]:.1f} tok/s" if point
                 else "vLLM's choice fp8 there: no clean point")
        if ref_best:
            there += f", best clean point {ref_best[0]} users, {ref_best[1]:.1f} tok/s"
        return (f"not run beside {name}; measured in `{file}` beside vLLM's choice fp8: {where}{best} ({there}"
                f"{'; this backend / fp8 ' + inv if inv else ''})")
    there = f"{name} there {point[1]:.1f} tok/s at {point[0]} users" if point else f"{name} there: no clean point"
    ratios = ", ".join(f"{label} {_x(f[k])}" for k, label in (("vs_max", "vs max clean"), ("vs_best", "vs best clean"))
                       if f.get(k) is not None)
    return f"not run here; measured in `{file}` beside {name}: {where}{best} ({there}{'; ' + ratios if ratios else ''})"


def fp8_measured_elsewhere(current: str | os.PathLike, mode: str = CAPACITY_PRESET,
                           results_dir: str | os.PathLike | None = None) -> dict:
    """``{fp8 mode: (results file name, fp8 entry, point, beside)}``: for each fp8 mode that another run of
    ``results_dir`` (default: ``current``'s folder) measured beside ``mode``, from the newest such run (by its newest
    row's ``date``): that run's :func:`fp8_ratios` entry for the fp8 mode, ``mode``'s max clean point there and
    ``beside`` = ``mode``. An fp8 backend no such run measured but a run without ``mode`` measured beside vLLM's
    choice fp8 (``"fp8"``) comes from the newest such run, compared with that fp8 (``beside`` = ``"fp8"``; point =
    fp8's max clean point there; the entry's ``fp8_best`` = fp8's best clean point there). ``current`` itself is left
    out."""
    current = Path(current)
    found: dict = {}
    near: dict = {}
    runs = []
    for f in find_result_files(results_dir or current.parent):
        if Path(f).resolve() != current.resolve():
            whole = load_jsonl(f)
            runs += [g for _, g in whole.groupby(whole["run_id"].astype(str), sort=False)]   # fp8_ratios: one run
    for df in runs:
        f = str(df["source_file"].iloc[0])
        key = (str(df["date"].max()), Path(f).name)
        try:
            r, into, beside = fp8_ratios(df, mode), found, mode
        except ModeNotInRun:
            if BASELINE not in set(map(str, df["mode"])):
                continue
            r, into, beside = fp8_ratios(df, BASELINE), near, BASELINE
        base = next((e for e in r["fp8"] if e["mode"] == BASELINE), None)
        for e in r["fp8"]:
            if beside == BASELINE:
                if e["mode"] == BASELINE:
                    continue
                e = dict(e, fp8_best=(base["users_best"], base["tok_s_best"]) if base and base["tok_s_best"] else None)
            if e["mode"] not in into or key > into[e["mode"]][0]:
                into[e["mode"]] = (key, (Path(f).name, e, r["point"], beside))
    near = {m: v for m, v in near.items() if m not in found}
    return {m: v for m, (_, v) in {**near, **found}.items()}


def strongest_fp8_markdown(rows: list[dict]) -> str:
    """Notebook 02's comparison with the strongest fp8: :func:`fp8_ratios_markdown` of the capacity preset's current
    run file (the fp8 backends that run measured beside it; the missing ones listed), then the ratio against the
    strongest fp8 of any run (:func:`strongest_fp8`) where that is stronger than this run's, or a sentence when the
    capacity preset has no current run. ``rows``: :func:`summary_rows`."""
    cap = next((r for r in rows if r["mode"] == CAPACITY_PRESET), None)
    if cap is None or not cap["source_file"]:
        return f"No current run of {DISPLAY.get(CAPACITY_PRESET, CAPACITY_PRESET)}: nothing to compare with fp8."
    path = repo_root() / cap["source_file"]
    r = fp8_ratios(str(path))
    text = fp8_ratios_markdown(r, fp8_engine_errors(path.parent), fp8_measured_elsewhere(path))
    for key, what, here in (("max", "at its max clean capacity", r["at_capacity"]),
                            ("best", "at its best clean point", r["best_point"])):
        p, x = cap.get(f"strongest_{key}"), cap.get(f"vs_strongest_{key}")
        if p and x is not None and (here is None or p["tok_s"] > here["tok_s"]):
            text += (f"- Against the strongest fp8 of any run {what} ({p['mode']}, {p['users']} users, "
                     f"{p['tok_s']:.1f} tok/s, `{Path(p['source_file']).name}`: another run): **{x:.2f}x**.\n")
    return text


def fp8_engine_errors(results_dir: str | os.PathLike = CAPACITY_DIR) -> dict:
    """``{fp8 mode: (results file name, error)}``: for each fp8 mode of ``kvrepro.sweep.FP8_MODES`` whose engine did
    not start in some run of ``results_dir`` (its ``<file>.engine_errors``), the newest such record (by the record's
    ``date``, else the file name)."""
    from kvrepro import sweep

    found = {}
    for f in find_result_files(results_dir):
        for e in sweep.engine_errors(f):
            m = e.get("mode")
            if m in sweep.FP8_MODES:
                key = (str(e.get("date") or ""), Path(f).name)
                if m not in found or key > found[m][0]:
                    found[m] = (key, (Path(f).name, str(e.get("error", ""))))
    return {m: v for m, (_, v) in found.items()}


def sweep_backend(mode: str) -> str:
    """The attention backend a sweep mode asks vLLM for (``vllm-auto`` where vLLM chooses)."""
    from kvrepro import sweep

    return sweep.engine_settings(mode)["attention_backend"] or "vllm-auto"


# ---------------------------------------------------------------- rendering

def _x(v: float | None) -> str:
    return "" if v is None else f"{v:.2f}x"


def _frac(c) -> str:
    return "" if c is None else f"{c[0]}/{c[1]}"


def _link(path: str | None, readme_dir: str = "") -> str:
    if not path:
        return ""
    name = Path(path).name
    return f"[{name}]({os.path.relpath(path, readme_dir or '.')})" if readme_dir else f"[{name}]({path})"


def _measured_cell(r: dict, compact: bool = False) -> str:
    if r["source_file"] is None:
        return "no run for this workload"
    file = Path(r["source_file"]).name if compact else _link(r["source_file"])
    text = f"{r['when']}, {file}" + (f", key offset {r['key_offset']}" if r.get("key_offset") else "")
    if r["fp8_source_file"] and r["mode"] != BASELINE:
        text += (f"; fp8 from another run: {Path(r['fp8_source_file']).name}, {r['fp8_when']}")
    if r.get("fp8_same_run") and r["fp8_max"] and r["fp8_best"]:
        (mu, mt), (bu, bt) = r["fp8_max"], r["fp8_best"]
        text += f"; vs its run's fp8: {mu} users {mt:.1f} tok/s, best {bu} users {bt:.1f}"
    if r["setup_differs"]:
        text += f"; no ratio: setup differs from fp8's run ({', '.join(r['setup_differs'])})"
    return text


def _needle_cell(r: dict) -> str:
    if r["needle"] is None:
        return ""
    if r["mode"] == "bf16" or r["needle_bf16"] is None:
        return _frac(r["needle"])
    return f"{_frac(r['needle'])} (bf16 {_frac(r['needle_bf16'])})"


def markdown_table(rows: list[dict], compact: bool = False) -> str:
    """The summary rows as a markdown table. ``compact``: short headers and file names (notebook 02's top,
    which must fit 1400 px); else the README's headers and file links."""
    fp8_max = rows[0]["fp8_table_max"] if rows else None
    fp8_best = rows[0]["fp8_table_best"] if rows else None
    at = (lambda p: f" ({p[0]} users, {p[1]:.1f} tok/s)" if p else "")
    if compact:
        head = ["mode", "KV B/token/head", "users, seed A100", "users, H200 @80 GiB", "tok/s at those users",
                f"vs fp8 max clean{at(fp8_max)}", f"vs fp8 best{at(fp8_best)}", "needle vLLM (single)", "measured"]
    else:
        # short headers: long ones wrap the table at GitHub's README width (the line under it defines the terms)
        head = ["mode", f"KV bytes per token and KV head (head_dim {HEAD_DIM})", "users, seed (A100)",
                "users, kvrepro (H200, 80 GiB)", "decode tok/s at those users",
                f"vs fp8 at capacity{at(fp8_max)}", f"vs fp8's best point{at(fp8_best)}",
                "needle via vLLM (single, correct / prompts)", "measured (date, file)"]
    lines = ["| " + " | ".join(head) + " |", "| --- | " + " | ".join(["---:"] * 6) + " | --- | --- |"]
    for r in rows:
        seed = ""
        if r["seed_users"] is not None:
            first = r["mode"] == "bf16"
            seed = f"{r['seed_users']} ({r['seed_tok_s']:.1f}{' tok/s' if first else ''})"
            if r["mode"] == "kvrepro:k4v4":
                seed += " \\*"
        name = f"**{r['name']}**" if r["mode"] == f"kvrepro:{DEFAULT_PRESET}" else r["name"]
        cells = [name, "" if r["bytes_per_token_head"] is None else str(r["bytes_per_token_head"]), seed,
                 "" if r["users"] is None else str(r["users"]),
                 "" if r["tok_s"] is None else f"{r['tok_s']:.1f}",
                 _x(r["vs_fp8_max"]), _x(r["vs_fp8_best"]), _needle_cell(r), _measured_cell(r, compact)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _setup_words(df) -> dict:
    """Model, load format, vLLM version, GPU(s) of the seed-workload rows, as display strings."""
    d = df[_matches(df, SEED_WORKLOAD)] if df is not None else None
    if d is None or not len(d):
        return dict(model="?", load="", vllm="?", gpu="?")
    load = sorted(set(map(str, d["load_format"])))
    return dict(model=", ".join(sorted(set(map(str, d["model"])))),
                load=" (dummy weights: capacity and speed only)" if load == ["dummy"] else f" (load format {', '.join(load)})",
                vllm=", ".join(sorted(set(map(str, d["vllm_version"])))),
                gpu=", ".join(sorted(set(map(str, d["gpu"])))))


def uncorrected_point(df, mode: str = CAPACITY_PRESET) -> dict | None:
    """The newest seed-workload run of ``mode`` whose keys were stored without the rope-mean correction (key offset
    ``slow-pairs``, ``first-prefill`` or ``off``: the decode kernel without it), at its max clean capacity: dict mode,
    key_offset, users, tok_s, file (repository-relative), when; None when there is no such run or no clean point."""
    if df is None or not len(df) or "kvrepro_settings" not in df:
        return None
    offs = df["kvrepro_settings"].map(_settings_key_offset)
    sub = df[(df["mode"] == mode) & offs.notna() & (offs != "rope-mean")]
    rows = select_current(sub, [mode]).get(mode)
    cap = max_clean(rows) if rows is not None else None
    if cap is None:
        return None
    return dict(mode=mode, key_offset=run_key_offset(rows), users=cap[0], tok_s=cap[1],
                file=_rel(rows["source_file"].iloc[0]), when=when(rows))


def notes_lines(df, needle: dict, chart: bool = True, backends: list[dict] | None = None,
                link_prefix: str = "") -> list[str]:
    """The lines under the table: the seed footnote, the workload, the GPU / ratios rule, the fp8 backends
    (:func:`fp8_backends_line`, with ``backends`` as there), the needle source, and (``chart``) the chart image.
    ``link_prefix``: put before the repository-relative links (``"../"`` for a report under ``reports/``)."""
    s = _setup_words(df)
    w = SEED_WORKLOAD
    lines = [
        f"\\* The seed's compressed KV format is not kvrepro's: its point sits on the {DISPLAY[CAPACITY_PRESET]} row "
        "(kvrepro's capacity preset) for comparison only.",
        f"Workload: {s['model']}{s['load']} on vLLM {s['vllm']}, each user {w['prompt_tokens']:,} prompt + "
        f"{w['decode_tokens']:,} decode tokens; users = max clean capacity (most concurrent users with no "
        "preemption); tok/s = aggregate decode tok/s; fp8 \"at capacity\" = at its max clean capacity, \"best "
        "point\" = its best clean point (the highest tok/s of any clean user count); needle: single-needle prompts "
        "through vLLM; one current run per mode (the newest in `results/capacity/`).",
        f"GPU: the seed ran on one A100 80GB; kvrepro on one {s['gpu']} emulating an {w['gpu_memory_gb']:g} GiB card "
        "(vLLM's memory budget scaled to it), "
        "so user counts are for the same memory budget (the seed's own non-KV memory is not published) and tok/s "
        "are not comparable across GPUs: compare kvrepro with fp8 of the same run.",
    ]
    backends_line = fp8_backends_line(df, backends=backends, link_prefix=link_prefix)
    if backends_line:
        lines.append(backends_line)
    u = uncorrected_point(df)
    if u is not None:
        lines.append(f"{DISPLAY.get(u['mode'], u['mode'])} without the rope-mean correction (keys stored with key "
                     f"offset {u['key_offset']}, the speed of `KVREPRO_KEY_OFFSET=slow-pairs`): {u['users']} users, "
                     f"{u['tok_s']:.1f} tok/s ({u['when']}, [{Path(u['file']).name}]({link_prefix}{u['file']})).")
    metas = (needle.get("_meta") or []) if needle else []
    for i, meta in enumerate([metas] if isinstance(metas, dict) else metas):
        lens = meta["context_lengths"]
        span = f"{lens[0]:,}-{lens[-1]:,} tokens" if lens else "?"
        which = "" if len(metas) < 2 else f" ({', '.join(meta.get('formats', []))})" if i else " (first choice)"
        ko = f", compressed presets' key offset {meta['key_offset']}" if meta.get("key_offset") else ""
        lines.append(f"Needle{which}: {NEEDLE_MODEL} through vLLM {meta['vllm_version']} on {meta['gpu']} "
                     f"({meta['first']:%Y-%m-%d}), single needle at {span}{ko}, `{meta['file']}`.")
    if chart:
        lines.append(f"![Aggregate decode tok/s vs concurrent users, one current run per mode, with the seed's "
                     f"A100 points]({link_prefix}{CHART})")
    return lines


def readme_block(df=None, needle=None, rows: list[dict] | None = None, backends: list[dict] | None = None) -> str:
    """The README's results block, markers included (inputs default to the committed result files).

    ``rows`` (:func:`summary_rows` of ``df`` and ``needle``) and ``backends`` (:func:`fp8_backends` of ``df``) may be
    passed where the caller has them already (:func:`main` builds them once for this block and the answer block);
    None: computed here, the fp8 backends once for the table and the line under it.
    """
    if df is None:
        df = load_capacity()
    if needle is None:
        needle = needle_counts()
    if backends is None:
        backends = _measured_fp8_backends(df)
    if rows is None:
        rows = summary_rows(df, needle, backends=backends)
    body = [BEGIN, "<!-- generated by `python -m kvrepro.summary --write` from results/capacity/*.jsonl and "
                   f"{_as_committed(VLLM_ACCURACY_REPLICA)}, {_as_committed(VLLM_ACCURACY)}: edit those, not this "
                   "block -->",
            markdown_table(rows)]
    for line in notes_lines(df, needle, backends=backends):
        body += ["", line]
    body.append(END)
    return "\n".join(body)


def fidelity_sources(root: str | os.PathLike | None = None) -> dict:
    """The committed sources of the README's fidelity block (``kvrepro.accuracy_summary``): the reference path on
    the GPU (the large run; the CPU runs are notebook 03's), vLLM's top-20 KL and the vLLM needle run, read from
    ``root`` (default the repository)."""
    from kvrepro import accuracy_summary as acs

    root = Path(root) if root is not None else repo_root()
    refs = [p for p in (acs.REFERENCE_GPU, acs.REFERENCE_CPU) if (root / p).exists()] or [acs.REFERENCE_GPU]
    return {"reference": acs.by_default_offset([acs.fidelity_source(str(root / p), kind="reference") for p in refs]),
            "vllm": acs.fidelity_source(str(root / acs.VLLM_FIDELITY), kind="vllm"),
            "needle": acs.needle_sources(*(str(root / p) for p in (acs.NEEDLE_REPLICA, acs.NEEDLE)))}


def fidelity_block(sources: dict | None = None) -> str:
    """The README's fidelity block, markers included: per preset and fp8 the bytes, users, KL (reference path),
    KL top-20 (vLLM), perplexity change, needle bound and verdict, the closest preset to fp8 at >= 12 users, the
    sources (default :func:`fidelity_sources`)."""
    from kvrepro import accuracy_summary as acs

    sources = fidelity_sources() if sources is None else sources
    files = ", ".join(_as_committed(p) for p in (acs.REFERENCE_GPU, acs.REFERENCE_CPU, acs.VLLM_FIDELITY,
                                                 acs.NEEDLE_REPLICA, acs.NEEDLE))
    return "\n".join([
        FIDELITY_BEGIN,
        f"<!-- generated by `python -m kvrepro.summary --write` from {files}: edit those, not this block -->",
        f"### Fidelity: each preset against fp8 at >= {acs.GOAL_USERS} users", "",
        acs.readme_text(sources), FIDELITY_END])


def verdict(rows: list[dict], default: str | None = None) -> str:
    """One line: the default preset's users and tok/s against fp8 here and the seed's points (``default``: a mode,
    None = kvrepro's default preset). Where that preset has no measured run, the line says so, then gives the capacity
    preset's (:data:`CAPACITY_PRESET`)."""
    default = default or f"kvrepro:{DEFAULT_PRESET}"
    by = {r["mode"]: r for r in rows}
    k, f = by.get(default), by.get(BASELINE)
    if not k or k["users"] is None:
        lead = f"No measured run of {DISPLAY.get(default, default)} for the seed's workload in the committed results"
        cap = by.get(CAPACITY_PRESET)
        if default != CAPACITY_PRESET and cap and cap["users"] is not None:
            return f"{lead}. The capacity preset: {verdict(rows, CAPACITY_PRESET)}"
        return lead + "."
    parts = [f"**{k['name']}** serves **{k['users']} users** at {SEED_WORKLOAD['gpu_memory_gb']:g} GiB "
             f"({k['tok_s']:.1f} tok/s)"]
    if f and f["users"] is not None:
        parts.append(f"fp8 serves {f['users']} here")
    if k["seed_users"] is not None and SEED.get(BASELINE):
        parts.append(f"the seed's compressed KV {k['seed_users']} and fp8 {SEED[BASELINE][0]} on its A100")
    line = "; ".join(parts)
    if k["vs_fp8_max"] is not None:
        line += (f". Aggregate decode: **{k['vs_fp8_max']:.2f}x fp8** at fp8's max clean capacity, "
                 f"{k['vs_fp8_best']:.2f}x fp8's best clean point")
        if k["fp8_source_file"]:
            line += f" (fp8 from another run: {Path(k['fp8_source_file']).name})"
        line += _stronger(k)
    return line + "."


def _stronger(r: dict) -> str:
    """", 2.27x the strongest fp8 at its max clean capacity (BACKEND: users, tok/s, `file`)" for each of a summary
    row's :func:`strongest_fp8` points that is stronger than the fp8 its own ratios use; "" where none is."""
    out = []
    for key, own, what in (("max", r["fp8_max"], "at its max clean capacity"),
                           ("best", r["fp8_best"], "at its best clean point")):
        p, x = r.get(f"strongest_{key}"), r.get(f"vs_strongest_{key}")
        if p and x is not None and (own is None or p["tok_s"] > own[1]):
            other = (p["source_file"], p.get("run_id")) != (r["source_file"], r["run_id"])
            out.append(f"{x:.2f}x the strongest fp8 {what} ({p['backend']}: {p['users']} users, "
                       f"{p['tok_s']:.1f} tok/s, {'another run: ' if other else ''}`{Path(p['source_file']).name}`)")
    return ", " + ", ".join(out) if out else ""


def _speed(r: dict) -> str:
    """A summary row's decode rate against fp8, the fairest comparison first: against the best clean point of any fp8
    backend, then the strongest fp8 at its max clean capacity, then (where that is another backend) vLLM's default
    fp8 at its max clean capacity, the seed's protocol; each with the fp8 point it divides by."""
    ko = f", key offset {r['key_offset']}" if r.get("key_offset") else ""
    rate = f"its aggregate decode rate ({r['tok_s']:.1f} tok/s{ko})"
    if r["vs_fp8_max"] is None:
        return f"{rate} is not comparable with fp8's run"

    def point(p: dict) -> str:
        other = (p["source_file"], p.get("run_id")) != (r["source_file"], r["run_id"])
        return (f"{p['backend']}: {p['users']} users, {p['tok_s']:.1f} tok/s"
                f"{', another run: `' + Path(p['source_file']).name + '`' if other else ''}")

    own_max, own_best = r["fp8_max"], r["fp8_best"]
    sb, sm = r.get("strongest_best"), r.get("strongest_max")
    if sb and r.get("vs_strongest_best") is not None and (own_best is None or sb["tok_s"] > own_best[1]):
        best = f"{r['vs_strongest_best']:.2f}x the best clean point of any fp8 backend ({point(sb)})"
    else:
        best = (f"{r['vs_fp8_best']:.2f}x the best clean point of any fp8 backend (vLLM's default: {own_best[0]} "
                f"users, {own_best[1]:.1f} tok/s)")
    seed_protocol = f"{r['vs_fp8_max']:.2f}x fp8 on vLLM's default backend at its max clean capacity " \
                    f"({own_max[0]} users, {own_max[1]:.1f} tok/s: the seed's protocol)"
    if sm and r.get("vs_strongest_max") is not None and sm["tok_s"] > own_max[1]:
        return (f"{rate} is {best} and {r['vs_strongest_max']:.2f}x the strongest fp8 at its max clean capacity "
                f"({point(sm)}); {seed_protocol}")
    return f"{rate} is {best}; {seed_protocol}"


def answer(rows: list[dict], fid_rows: list[dict]) -> str:
    """The README's opening answer (markdown, two sentences), from the capacity rows (:func:`summary_rows`) and the
    fidelity rows (``kvrepro.accuracy_summary.summary_rows``): first the default preset (what a user gets): its
    users against fp8's, its fidelity against fp8 and its decode rate against fp8's; then the capacity preset's
    users, decode-rate ratios and fidelity cost. Says "not measured" where a figure has no committed row."""
    from kvrepro import stats

    by = {r["mode"]: r for r in rows}
    fid = {r["format"]: r for r in fid_rows}
    cap, f8 = by.get(CAPACITY_PRESET), by.get(BASELINE)
    cap_fmt = FORMAT_OF.get(CAPACITY_PRESET, CAPACITY_PRESET.split(":")[-1])
    gib = f"{SEED_WORKLOAD['gpu_memory_gb']:g} GiB"
    fp8_users = f8["users"] if f8 and f8["users"] is not None else None

    def cost(fmt: str) -> str:
        r = fid.get(fmt)
        if r is None or r["kl"] is None:
            return "fidelity not measured"
        ppl = (f"perplexity {r['ppl_change_pct']:+.2f}% (fp8 {r['fp8_ppl_change_pct']:+.2f}%)"
               if r["fp8_ppl_change_pct"] is not None else f"perplexity {r['ppl_change_pct']:+.2f}%")
        needle = (f"needle retrieval {r['needle']} (loss bound {r['single_bound']:.2f} pp, bar "
                  f"{stats.MARGIN_PP:g} pp)" if r["needle"] in ("NON-INFERIOR", "INFERIOR")
                  and r["single_bound"] is not None else f"needle {r['needle'] or 'not run'}")
        return f"KL {r['kl_vs_fp8']:.2f}x fp8's, {ppl}, {needle}"

    d, dcap = fid.get(DEFAULT_PRESET), by.get(f"kvrepro:{DEFAULT_PRESET}")
    where = f" where fp8 serves {fp8_users}" if fp8_users is not None else ""
    met = d is not None and d.get("verdict") == "MET"
    if dcap and dcap["users"] is not None:
        first = (f"**On one {_gpu_words(dcap)} at an emulated {gib}, kvrepro's default preset {DEFAULT_PRESET} serves "
                 f"{dcap['users']} users of 128K tokens{where}, "
                 + ("at fp8's fidelity or better**" if met else "at a fidelity cost**")
                 + f": {cost(DEFAULT_PRESET)}; {_speed(dcap)}.")
    else:
        users = f"{d['users']} users by the capacity arithmetic (no 128K run yet)" if d else "users not known"
        first = f"kvrepro's default preset {DEFAULT_PRESET}: {cost(DEFAULT_PRESET)}; {users}."
    if cap and cap["users"] is not None:
        second = (f"For throughput, the capacity preset {cap_fmt} serves {cap['users']} users; {_speed(cap)}; "
                  f"it costs {cost(cap_fmt)}.")
    else:
        second = f"The capacity preset {cap_fmt} has no measured run for the seed's workload yet."
    return f"{first} {second} Details, sources and dates: the tables below."


def _gpu_words(r: dict) -> str:
    """The GPU of a capacity row's run, as its result file records it (e.g. "NVIDIA H200"); "GPU" if unknown."""
    return r.get("gpu") or "GPU"


def answer_block(rows: list[dict] | None = None, fid_rows: list[dict] | None = None) -> str:
    """:func:`answer` between its markers (inputs default to the committed result files)."""
    from kvrepro import accuracy_summary as acs

    rows = summary_rows(load_capacity(), needle_counts()) if rows is None else rows
    fid_rows = acs.summary_rows(fidelity_sources()) if fid_rows is None else fid_rows
    return "\n".join([ANSWER_BEGIN, "<!-- generated by `python -m kvrepro.summary --write` from the results and "
                      "fidelity blocks' files: edit those, not this block -->", answer(rows, fid_rows), ANSWER_END])


# ---------------------------------------------------------------- notebook tables

from kvrepro.style import MISSING, cell_text  # noqa: E402,F401 (one formatter for every table; re-exported)


def styled(df, digits: int = 3, index: bool = False, max_chars: int | None = None):
    """``df`` for ``display``: cells as :func:`cell_text` (integers as integers, one missing marker, ⏎ for
    newlines), text left-aligned, and the index hidden unless ``index`` (a meaningful index, e.g. a format
    column or a MultiIndex, is kept with ``index=True``). ``max_chars`` cuts long text cells."""
    def fmt(v):
        t = cell_text(v, digits)
        return t if max_chars is None or len(t) <= max_chars else t[:max_chars - 1] + "…"

    st = df.style.format(fmt)
    if not index:
        st = st.hide(axis="index")
    from pandas.api.types import is_bool_dtype, is_numeric_dtype

    def is_text(c, t):  # text columns go left; a transposed table's object columns of numbers stay right
        if is_numeric_dtype(t) or is_bool_dtype(t):
            return False
        col = df[c]
        vals = col.stack() if hasattr(col, "columns") else col
        return any(isinstance(v, str) for v in vals)

    text_cols = list(dict.fromkeys(c for c, t in df.dtypes.items() if is_text(c, t)))
    if text_cols:
        st = st.set_properties(subset=text_cols, **{"text-align": "left"})
    return st


# ---------------------------------------------------------------- chart

def caption(runs: dict, width: int = 150) -> str:
    """Provenance under the chart: GPU, budget, vLLM version, workload, and per run its file and dates."""
    import textwrap

    if not runs:
        return "No measured runs."
    rows = next(iter(runs.values()))
    first = rows.iloc[0]
    by_file: dict[str, list[str]] = {}
    for mode, r in runs.items():
        by_file.setdefault(Path(str(r["source_file"].iloc[0])).name, []).append(f"{DISPLAY.get(mode, mode)} {when(r)}")
    files = "; ".join(f"{f}: {', '.join(m)}" for f, m in by_file.items())
    text = (f"Measured on {first['gpu']} emulating an {float(first['gpu_memory_gb']):g} GiB card, vLLM "
            f"{first['vllm_version']}, {first['model']}, {int(first['prompt_tokens']):,} + "
            f"{int(first['decode_tokens']):,} tokens per user; one current run per mode, from results/capacity/ "
            f"({files}). Stars: max clean capacity. Grey hollow markers: the seed's published A100 80GB points "
            "(named in the legend), reference data "
            "(users for the same memory budget; tok/s compare only as ratios to fp8 of one run).")
    return "\n".join(textwrap.wrap(text, width))


def plot_capacity(runs: dict, seed: bool = True, title: str = "Aggregate decode tok/s vs concurrent users"):
    """The seed-style chart: aggregate decode tok/s vs concurrent users, one line per current run (distinct colour
    and marker per mode; clean points only), each run's max clean capacity as a star and in its legend entry,
    the seed's A100 points as labelled grey hollow markers, integer user ticks, and :func:`caption` under the axes.

    Args:
        runs: :func:`select_current` output (mode -> rows of one run).
        seed: draw the seed's published points.

    Returns:
        the matplotlib Figure.
    """
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(11, 6.2))
    top_users = 1
    for i, (mode, rows) in enumerate(runs.items()):
        colour, marker = _style(mode, i)
        good = clean_rows(rows).sort_values("num_users")
        cap = max_clean(rows)
        label = DISPLAY.get(mode, mode) + (f": {cap[0]} users, {cap[1]:.1f} tok/s" if cap else ": no clean point")
        ax.plot(good["num_users"], good["aggregate_decode_tok_s"], color=colour, marker=marker, markersize=6,
                linewidth=1.8, label=label)
        if cap:
            ax.scatter([cap[0]], [cap[1]], marker="*", s=300, color=colour, edgecolor="black", linewidth=0.8,
                       zorder=5)
            top_users = max(top_users, cap[0])
        if len(good):
            top_users = max(top_users, int(good["num_users"].max()))
    if seed:
        # Distinct grey hollow markers per seed point, named in the legend (not as labels beside the points, which
        # sat on measured stars at the same user count and read as theirs).
        seed_markers = {"fp16": "o", "fp8": "s", "compressed (seed)": "D"}
        pts = list(SEED_POINTS)
        for m, u, t in pts:
            ax.scatter([u], [t], marker=seed_markers.get(m, "h"), s=80, facecolor="white", edgecolor="dimgrey",
                       linewidth=1.6, zorder=6,
                       label=f"seed A100 (published), {m.replace(' (seed)', '')}: {u} users, {t:.1f} tok/s")
        top_users = max(top_users, max(u for _, u, _ in pts))
    ax.scatter([], [], marker="*", s=160, color="white", edgecolor="black", label="max clean capacity")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xticks(range(1, top_users + 2))
    ax.set_xlim(0.5, top_users + 1.5)
    ax.set_ylim(bottom=0)
    ax.margins(y=0.08)
    ax.grid(True, alpha=0.3)
    ax.set_xlabel("concurrent users (each 128K context + 1024 decode tokens)"
                  if runs and int(next(iter(runs.values()))["prompt_tokens"].iloc[0]) == 131_072 else "concurrent users",
                  fontsize=11)
    ax.set_ylabel("aggregate decode tok/s", fontsize=11)
    ax.set_title(title, fontsize=13)
    # outside the axes: any corner inside sits on some mode's curve or star as the runs change
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9.5, frameon=True, framealpha=0.95)
    fig.text(0.01, 0.01, caption(runs), fontsize=8.5, ha="left", va="bottom", color="#333333")
    n_lines = caption(runs).count("\n") + 1
    fig.tight_layout(rect=(0, 0.015 + 0.024 * n_lines, 1, 1))
    return fig


# ---------------------------------------------------------------- results/capacity/README.md

def capacity_index(df, results_dir: str | os.PathLike = CAPACITY_DIR) -> str:
    """``results/capacity/README.md``: one line per result file (modes, GPU, budget, workload, measured span,
    kvrepro source / commit where recorded, logs beside it, which modes' current run it holds). No figures:
    they live in the rows."""
    d = Path(results_dir)
    d = d if d.is_absolute() else repo_root() / d
    current = select_current(df, None) if df is not None else {}
    cur_files: dict[str, list[str]] = {}
    for mode, rows in current.items():
        cur_files.setdefault(str(rows["source_file"].iloc[0]), []).append(mode)
    lines = [
        "# Measured capacity sweeps",
        "",
        "Generated by `python -m kvrepro.summary --write` from the files in this folder (do not edit by hand).",
        "Each `*.jsonl` holds one JSON object per (mode, users) measurement, written by `kvrepro.sweep` (protocol:",
        "its module docstring; required fields: `kvrepro.replay.REQUIRED_FIELDS`). Every figure lives in those rows:",
        "notebook 02 replays them, and the README's results table and `docs/capacity.png` are generated from the",
        "current run of each mode (the newest engine run for the seed's workload: 131,072 + 1,024 tokens per user,",
        "80 GiB).",
        "",
        "| file | modes | GPU | budget | tokens per user | measured (UTC) | kvrepro source | logs | current run of |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    if df is not None:
        for src, g in df.groupby("source_file", sort=True):
            name = Path(str(src)).name
            modes = ", ".join(dict.fromkeys(map(str, g["mode"])))
            per_mode: dict[str, list[str]] = {}
            for m, p_, n_ in zip(g["mode"], g["prompt_tokens"], g["decode_tokens"]):
                w = f"{int(p_):,} + {int(n_):,}"
                if m not in per_mode.setdefault(w, []):
                    per_mode[w].append(str(m))
            ws = sorted(per_mode, key=lambda w: -len(per_mode[w]))
            work = ws[0] + "".join(f" ({', '.join(per_mode[w])}: {w})" for w in ws[1:])
            budget = ", ".join(sorted({f"{float(x):g} GiB" for x in g["gpu_memory_gb"]}))
            commits = sorted({str(v) for c in ("kvrepro_commit", "git_commit", "code_commit") if c in g.columns
                              for v in g[c].dropna()})
            srcs = sorted({str(v)[:8] for v in g.get("kvrepro_src_sha256", []) if isinstance(v, str) and v})
            code = ", ".join([f"commit {c}" for c in commits] + [f"sha256 {s}" for s in srcs]) or "not recorded"
            stem = name[:-len(".jsonl")]
            logs = ", ".join(f"`{p.name}`" for p in sorted(d.glob(stem + ".*")) if p.suffix != ".jsonl") or "-"
            cur = ", ".join(cur_files.get(str(src), [])) or "-"
            lines.append(f"| `{name}` | {modes} | {', '.join(sorted(set(map(str, g['gpu']))))} | {budget} | {work} | "
                         f"{when(g)} | {code} | {logs} | {cur} |")
    lines += ["", "`kvrepro source`: the first 8 hex digits of `kvrepro_src_sha256` (the SHA-256 of the kvrepro "
                  "sources that ran; `kvrepro.provenance`)."]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- CLI

def replace_block(text: str, block: str, where: str = README, begin: str = BEGIN, end: str = END) -> str:
    """``text`` with the part from ``begin`` to ``end`` (markers included) replaced by ``block``.

    Raises:
        ValueError: the markers are missing, repeated, or out of order (the message names ``where`` and them).
    """
    a, b = text.count(begin), text.count(end)
    if a != 1 or b != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"{where}: expected one '{begin}' line followed by one '{end}' line (found {a} and {b}); "
                         "add them where the block goes")
    i, j = text.index(begin), text.index(end) + len(end)
    return text[:i] + block + text[j:]


def current_block(text: str, where: str = README, begin: str = BEGIN, end: str = END) -> str:
    """The block of ``text`` between the markers, markers included. Raises ValueError as :func:`replace_block`."""
    replace_block(text, "", where, begin, end)
    return text[text.index(begin):text.index(end) + len(end)]


def serve_block(root: str | os.PathLike | None = None) -> str:
    """The README's serving block, markers included: :func:`kvrepro.servebench.readme_text` of the committed
    ``results/serve/*.json`` under ``root`` (default the repository)."""
    from kvrepro import servebench

    return "\n".join([SERVE_BEGIN, "<!-- generated by `python -m kvrepro.summary --write` from results/serve/*.json: "
                      "edit those, not this block -->", servebench.readme_text(root or repo_root()), SERVE_END])


def settings_block() -> str:
    """The README's settings table, generated from the declarations in :mod:`kvrepro.settings`, with its markers."""
    from kvrepro import settings

    return f"{SETTINGS_BEGIN}\n{settings.markdown_table()}\n{SETTINGS_END}"


def chart_png(runs: dict) -> bytes:
    """:func:`plot_capacity` of ``runs`` as PNG bytes (no timestamp or version metadata)."""
    import io

    import matplotlib
    import matplotlib.pyplot as plt

    with matplotlib.rc_context({"backend": "Agg"}):
        fig = plot_capacity(runs)
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
        plt.close(fig)
    return buf.getvalue()


def _diff(old: str, new: str, name: str) -> str:
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"{name} (committed)",
                                        f"{name} (from the results)"))


def main(argv: list[str] | None = None) -> int:
    """``python -m kvrepro.summary [--write | --check]``; returns the exit status (see the module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m kvrepro.summary", description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--write", action="store_true", help=f"rewrite {README}'s blocks, {CHART} and {CAPACITY_INDEX}")
    g.add_argument("--check", action="store_true", help=f"exit 1 when {README}'s blocks or {CAPACITY_INDEX} differ")
    g.add_argument("--fp8-ratios", metavar="FILE", help="print the ratios of --ratio-mode against every fp8 backend "
                   "of one sweep run's results file (fp8_ratios), as markdown and JSON")
    ap.add_argument("--ratio-mode", default=CAPACITY_PRESET, help=f"mode compared by --fp8-ratios ({CAPACITY_PRESET})")
    args = ap.parse_args(argv)
    if args.ratio_mode != CAPACITY_PRESET and not args.fp8_ratios:
        ap.error("--ratio-mode goes with --fp8-ratios FILE")
    if args.fp8_ratios:
        import json

        from kvrepro import sweep

        if args.ratio_mode not in sweep.ALL_MODES:
            ap.error(f"--ratio-mode {args.ratio_mode!r}: not a sweep mode (kvrepro presets are kvrepro:<preset>); "
                     f"allowed: {', '.join(sweep.ALL_MODES)}")
        what = "expected a capacity-sweep results file, results/capacity/<run>.jsonl"
        try:
            r = fp8_ratios(args.fp8_ratios, args.ratio_mode)
        except ModeNotInRun as e:
            print(f"error: --ratio-mode {args.ratio_mode}: {e}", file=sys.stderr)
            return 1
        except (OSError, UnicodeDecodeError, ValueError) as e:
            why = (e.strerror if isinstance(e, OSError) and e.strerror else
                   "not a text file (binary or compressed)" if isinstance(e, UnicodeDecodeError) else e)
            print(f"error: --fp8-ratios {args.fp8_ratios}: {why} ({what})", file=sys.stderr)
            return 1
        if not r["fp8"] and not r["engine_errors"]:
            print(f"error: --fp8-ratios {args.fp8_ratios}: no fp8 mode was measured in this run (allowed fp8 modes: "
                  f"{', '.join(r['missing'])}); ratios are taken within one run", file=sys.stderr)
            return 1
        print(fp8_ratios_markdown(r, fp8_engine_errors(Path(args.fp8_ratios).parent),
                                  fp8_measured_elsewhere(args.fp8_ratios, r["mode"])))
        print(json.dumps(r, indent=1, default=str))
        return 0
    root = repo_root()
    df = load_capacity()
    needle = needle_counts()
    backends = _measured_fp8_backends(df)   # once per build: the table's rows and the line under it
    rows = summary_rows(df, needle, backends=backends)      # the results block's table and the answer block
    block = readme_block(df, needle, rows=rows, backends=backends)
    from kvrepro import accuracy_summary as acs

    sources = fidelity_sources(root)      # read once: the fidelity block and the answer both come from them
    fblock = fidelity_block(sources)
    index = capacity_index(df)
    readme = root / README
    if not (args.write or args.check):
        print(block + "\n\n" + fblock)
        return 0
    try:
        text = readme.read_text(encoding="utf-8")
        new_text = replace_block(text, block, README)
        new_text = replace_block(new_text, fblock, README, FIDELITY_BEGIN, FIDELITY_END)
        new_text = replace_block(new_text, settings_block(), README, SETTINGS_BEGIN, SETTINGS_END)
        sblock = serve_block(root)
        new_text = replace_block(new_text, sblock, README, SERVE_BEGIN, SERVE_END)
        ablock = answer_block(rows, acs.summary_rows(sources))
        new_text = replace_block(new_text, ablock, README, ANSWER_BEGIN, ANSWER_END)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    index_path = root / CAPACITY_INDEX
    if args.write:
        atomic_write_bytes(root / CHART, chart_png(select_current(df, CHART_MODES)))
        atomic_write_bytes(index_path, index.encode())
        if new_text != text:
            atomic_write_bytes(readme, new_text.encode())
        print(f"wrote {README} (answer, results, fidelity, settings and serving blocks), {CHART}, {CAPACITY_INDEX}")
        return 0
    problems = []
    if new_text != text:
        problems.append(_diff(current_block(text), block, README))
        problems.append(_diff(current_block(text, README, FIDELITY_BEGIN, FIDELITY_END), fblock, README))
        problems.append(_diff(current_block(text, README, SETTINGS_BEGIN, SETTINGS_END), settings_block(), README))
        problems.append(_diff(current_block(text, README, ANSWER_BEGIN, ANSWER_END), ablock, README))
        problems.append(_diff(current_block(text, README, SERVE_BEGIN, SERVE_END), sblock, README))
    old_index = index_path.read_text(encoding="utf-8") if index_path.is_file() else ""
    if old_index != index:
        problems.append(_diff(old_index, index, CAPACITY_INDEX))
    if not (root / CHART).is_file():
        problems.append(f"{CHART} is missing\n")
    if problems:
        sys.stdout.write("".join(problems))
        print("error: out of date with the results; run `python -m kvrepro.summary --write`", file=sys.stderr)
        return 1
    print(f"{README} results, fidelity, settings and serving blocks and {CAPACITY_INDEX} match the results and "
              "kvrepro.settings")
    return 0


if __name__ == "__main__":
    from kvrepro import cli

    raise SystemExit(cli.run(main))
