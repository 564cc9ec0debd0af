"""Load, check and render committed capacity-sweep results (``results/capacity/*.jsonl``), and the
reference data they are compared with (the seed's published points, REPRODUCTION-CARD.md's measurements).

A result file is JSON Lines written by ``kvrepro.sweep``: one object per (mode, num_users) run with at
least the fields of :data:`REQUIRED_FIELDS`. "Max clean capacity" of a mode = the largest ``num_users``
whose run was clean (``clean`` true and ``preemptions == 0``), the seed's metric.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import kvrepro

# field -> accepted Python types (bool is checked apart: it is an int subclass).
REQUIRED_FIELDS: dict[str, tuple[type, ...]] = {
    "mode": (str,), "kv_cache_dtype": (str,), "num_users": (int,), "clean": (bool,), "preemptions": (int,),
    "aggregate_decode_tok_s": (int, float), "ttft_s_mean": (int, float), "ttft_s_max": (int, float),
    "tpot_ms_mean": (int, float), "kv_cache_tokens": (int,), "users_fit_arithmetic": (int,),
    "prompt_tokens": (int,), "decode_tokens": (int,), "gpu": (str,), "gpu_memory_gb": (int, float),
    "gpu_memory_utilization": (int, float), "vllm_version": (str,), "torch_version": (str,),
    "kvrepro_version": (str,), "model": (str,), "load_format": (str,), "date": (str,), "run_id": (str,),
    "measured": (bool,),
}
# Fields kvrepro.sweep may leave null (e.g. a run that never reached its decode window).
NULLABLE_FIELDS = ("aggregate_decode_tok_s", "ttft_s_mean", "ttft_s_max", "tpot_ms_mean")
DEFAULT_RESULTS_DIR = "results/capacity"
BASELINE_ALIASES = {"bf16": ("bf16", "fp16", "auto"), "fp8": ("fp8",)}

SEED_SOURCE = "seed (published; A100 80GB, vLLM 0.20.2, 128K + 1024 per user)"
CARD_SOURCE = "REPRODUCTION-CARD.md (measured; H200 emulating 80 GiB, vLLM 0.20.2, 128K + 256 per user, 2026-11-29)"
# (mode, num_users, aggregate_decode_tok_s, source, is max clean capacity)
_REFERENCE = [
    ("fp16", 2, 66.6, SEED_SOURCE, True),
    ("fp8", 5, 105.0, SEED_SOURCE, True),
    ("compressed (seed)", 6, 140.9, SEED_SOURCE, True),
    ("bf16", 3, 163.6, CARD_SOURCE, True),  # 3 users = all that fit (arithmetic), 0 preemptions
    ("fp8", 6, 174.5, CARD_SOURCE, True),  # 6 = all that fit, 0 preemptions
    ("turboquant_4bit_nc", 3, 35.0, CARD_SOURCE, False),  # 10 fit, only 3 were run
]
# The seed's published points (mode, users at max clean capacity, aggregate decode tok/s there).
SEED_POINTS = tuple((m, u, t) for m, u, t, src, _ in _REFERENCE if src == SEED_SOURCE)


def repo_root() -> Path:
    """The checkout holding kvrepro (editable install), else the current directory."""
    root = Path(kvrepro.__file__).resolve().parents[1]
    return root if (root / "pyproject.toml").exists() else Path.cwd()


def resolve_results_dir(results_dir: str | Path = DEFAULT_RESULTS_DIR) -> Path:
    """``results_dir`` as a path; a relative one is taken from :func:`repo_root`."""
    p = Path(results_dir)
    return p if p.is_absolute() else repo_root() / p


def check_replay_params(measure, results_dir) -> None:
    """Notebook 02's run parameters. ``measure``: True or False (a string such as "no" is refused, not taken as
    true). ``results_dir``: a string path; without ``measure`` it must be an existing folder (a mistyped path would
    otherwise replay nothing and render an empty report).

    Raises:
        ValueError: naming ``measure`` or ``results_dir`` and what is allowed.
    """
    if not isinstance(measure, bool):
        raise ValueError(f"measure must be True or False, got {measure!r}")
    if not isinstance(results_dir, (str, Path)) or not str(results_dir).strip():
        raise ValueError(f"results_dir must be a folder path (e.g. {DEFAULT_RESULTS_DIR!r}), got {results_dir!r}")
    if not measure and not resolve_results_dir(results_dir).is_dir():
        raise ValueError(f"results_dir={str(results_dir)!r}: no such folder ({resolve_results_dir(results_dir)}); "
                         f"the committed results are in {DEFAULT_RESULTS_DIR!r}")


def _check_record(rec, where: str) -> None:
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    missing = [k for k in REQUIRED_FIELDS if k not in rec]
    if missing:
        raise ValueError(f"{where}: missing field(s) {', '.join(missing)}")
    for key, types in REQUIRED_FIELDS.items():
        val = rec[key]
        if val is None and key in NULLABLE_FIELDS:
            continue
        ok = isinstance(val, bool) if types == (bool,) else (isinstance(val, types) and not isinstance(val, bool))
        if not ok:
            names = "/".join(t.__name__ for t in types)
            raise ValueError(f"{where}: field {key!r} must be {names}, got {val!r}")
    if rec["num_users"] < 0 or (rec["num_users"] == 0 and rec.get("measured_by") != "sizing"):
        raise ValueError(f"{where}: num_users must be positive (0 only for a measured_by='sizing' row), "
                         f"got {rec['num_users']}")
    if rec["preemptions"] < 0:
        raise ValueError(f"{where}: preemptions must be >= 0, got {rec['preemptions']}")
    tok_s = rec["aggregate_decode_tok_s"]
    if tok_s is not None and (not math.isfinite(tok_s) or tok_s < 0):
        raise ValueError(f"{where}: aggregate_decode_tok_s must be finite and >= 0, got {rec['aggregate_decode_tok_s']}")
    if rec["measured"] is not True:
        raise ValueError(f"{where}: measured must be true for a replayable result")


def load_jsonl(path: str | Path):
    """Read and validate one result file; return a DataFrame (one row per run, plus ``source_file``).

    Raises:
        FileNotFoundError: no such file.
        ValueError: empty file, a line that is not JSON, a missing field or a field of the wrong type
            (the message gives file, line number and field).
    """
    import pandas as pd

    path = Path(path)
    records = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
        _check_record(rec, where)
        records.append(rec)
    if not records:
        raise ValueError(f"{path}: no result records")
    df = pd.DataFrame(records)
    df["source_file"] = str(path)
    return df


def find_result_files(results_dir: str | Path = DEFAULT_RESULTS_DIR) -> list[Path]:
    """Sorted ``*.jsonl`` files under ``results_dir`` (relative paths are from the repo root); [] if none."""
    d = resolve_results_dir(results_dir)
    return sorted(d.glob("*.jsonl")) if d.is_dir() else []


def load_results(results_dir: str | Path = DEFAULT_RESULTS_DIR):
    """All result files under ``results_dir`` concatenated, or None when there are none.
    Raises ValueError on the first malformed file (see :func:`load_jsonl`)."""
    import pandas as pd

    files = find_result_files(results_dir)
    if not files:
        return None
    return pd.concat([load_jsonl(f) for f in files], ignore_index=True)


def run_keys(df) -> list[str]:
    """Per row, the key of its engine run: ``engine_run_id`` where the row has one, else "<file>|<run_id>|<mode>"
    (rows written before the sweep recorded engine runs: one file, run and mode = one engine run)."""
    import pandas as pd

    eng = df["engine_run_id"] if "engine_run_id" in df.columns else pd.Series([None] * len(df), index=df.index)
    return [str(e) if isinstance(e, str) and e else f"{f}|{r}|{m}"
            for e, f, r, m in zip(eng, df["source_file"], df["run_id"], df["mode"])]


def utc_times(values):
    """Row ``date`` strings (ISO 8601, a day or a time; without offset taken as UTC) as a Series of UTC timestamps."""
    import pandas as pd

    return pd.to_datetime(pd.Series(list(values), dtype=object).astype(str), utc=True, format="mixed")


def time_span(dates) -> str:
    """The UTC span of some rows' ``date`` values: "2026-11-30 09:41-09:46 UTC"; one minute: "2026-11-30 09:41 UTC";
    two days: "2026-11-30 23:58 - 2026-12-01 00:03 UTC"; rows dated by day only: "2026-11-29"."""
    vals = [str(d) for d in dates]
    t = utc_times(vals)
    a, b = t.min(), t.max()
    if all(len(v) == 10 for v in vals):
        return a.strftime("%Y-%m-%d") if a == b else f"{a:%Y-%m-%d} - {b:%Y-%m-%d}"
    if a.strftime("%Y-%m-%d") != b.strftime("%Y-%m-%d"):
        return f"{a:%Y-%m-%d %H:%M} - {b:%Y-%m-%d %H:%M} UTC"
    return f"{a:%Y-%m-%d %H:%M} UTC" if a.strftime("%H:%M") == b.strftime("%H:%M") else f"{a:%Y-%m-%d %H:%M}-{b:%H:%M} UTC"


def replay_labels(df, measured_now=()) -> list[str]:
    """One label per engine run (:func:`run_keys`), in row order: ``"<mode>: replayed from <file>, measured on
    <GPU> <span> (<workload>)"`` (file relative to the repo root when inside it; span = :func:`time_span` of that
    run's own rows; workload = the rows' prompt + decode tokens and memory budget, which may differ from the
    notebook's parameters: replayed rows are shown as measured). Runs in a file of ``measured_now`` (paths written
    by this run's ``measure``) are labelled ``"<mode>: measured now, written to <file>, on ..."``."""
    labels = []
    root = repo_root()
    now = {str(Path(m).resolve()) for m in measured_now}
    d = df.assign(_run=run_keys(df))
    for _, g in d.groupby("_run", sort=False):
        p = Path(str(g["source_file"].iloc[0]))
        fresh = str(p.resolve()) in now
        try:
            p = p.resolve().relative_to(root)
        except ValueError:
            pass
        gpus = "/".join(sorted(set(g["gpu"])))
        work = "/".join(sorted({f"{int(r.prompt_tokens)}+{int(r.decode_tokens)} tokens per user, "
                                f"{float(r.gpu_memory_gb):g} GiB budget" for r in g.itertuples()}))
        labels.append(f"{g['mode'].iloc[0]}: {'measured now, written to' if fresh else 'replayed from'} {p}, "
                      f"measured on {gpus} {time_span(g['date'])} ({work})")
    return labels


def workload_mismatch(df, context_tokens: int, decode_tokens: int, gpu_memory_gb: float) -> str | None:
    """A warning naming the modes whose replayed rows were measured for another workload than the
    notebook's parameters (prompt + decode tokens per user, memory budget), else None: the replayed
    figures are shown as measured and are not rescaled to the requested workload."""
    want = (int(context_tokens), int(decode_tokens), float(gpu_memory_gb))
    other = {}
    for r in df.itertuples():
        w = (int(r.prompt_tokens), int(r.decode_tokens), float(r.gpu_memory_gb))
        if w != want:
            other.setdefault(w, set()).add(str(r.mode))
    if not other:
        return None
    got = "; ".join(f"{', '.join(sorted(m))}: {p}+{d} tokens per user at {g:g} GiB"
                    for (p, d, g), m in sorted(other.items()))
    return (f"Replayed rows measured for another workload than this notebook's {want[0]}+{want[1]} "
            f"tokens per user at {want[2]:g} GiB ({got}): they are shown as measured, not rescaled; the "
            "arithmetic above uses this notebook's parameters. Set measure=True on a GPU with vLLM to "
            "measure this workload.")


# What a ratio's two rows must share to be a like-for-like comparison (those present in the data).
WORKLOAD_KEYS = ("gpu", "gpu_memory_gb", "model", "prompt_tokens", "decode_tokens", "vllm_version", "load_format",
                 "enable_prefix_caching")


def _source_column(df) -> str | None:
    """The column that tells sources apart: ``source`` (reference data), ``source_file`` (result files)."""
    return next((c for c in ("source", "source_file") if c in df.columns), None)


def decode_kernel(mode: str, settings) -> str:
    """Which decode kernel a result row's mode ran: vLLM's own for non-kvrepro modes; for kvrepro modes the
    ``decode_impl`` its ``kvrepro_settings`` recorded (``"cuda"``, ``"triton"``), or ``"triton (not recorded)"``
    for rows without the field (the sweep recorded it from the CUDA kernel on; before it, the Triton kernel was
    the only one)."""
    if not str(mode).startswith("kvrepro:"):
        return "vLLM"
    impl = settings.get("decode_impl") if isinstance(settings, dict) else None
    if isinstance(impl, dict) and impl:
        return ", ".join(sorted(set(impl.values())))
    if isinstance(impl, str) and impl:
        return impl                                   # recorded but not resolved, e.g. "auto (no layer resolved it yet)"
    return "triton (not recorded)"


def capped_at(rows) -> int | None:
    """The users a run was capped at below what its KV cache fits (the sweep's ``max_users``): its ``full`` row's
    ``num_users`` where that is below the row's ``users_fit_arithmetic``; None for a run that filled its cache (or
    rows without those columns)."""
    if "measured_by" not in rows or "users_fit_arithmetic" not in rows:
        return None
    full = rows[(rows["measured_by"] == "full") & rows["users_fit_arithmetic"].notna()]
    short = full[full["num_users"] < full["users_fit_arithmetic"]]
    return int(short["num_users"].max()) if len(short) else None


def max_clean_capacity(df):
    """Per mode: the largest clean ``num_users`` and its aggregate decode tok/s.

    Args:
        df: runs with columns mode, num_users, aggregate_decode_tok_s and either ``clean`` + ``preemptions``
            (measured results) or ``max_clean`` (reference data, taken as given).

    Returns:
        DataFrame indexed by nothing, columns mode, max_clean_users (nullable Int64: 0 when no run was
        clean, <NA> when the mode has only ``measured_by == "sizing"`` rows, i.e. was not run with
        users, or reference data without a max-clean point, or the run was capped below what its cache fits:
        then ``capped_at`` holds the cap, :func:`capped_at`), aggregate_decode_tok_s (NaN when none),
        plus the input's ``source`` (reference data) or ``source_file`` (result files) column: one
        row per mode and source, so several files are never merged into one figure; and, where the
        input has them, the workload columns ``WORKLOAD_KEYS`` (first value per mode and source) that
        :func:`ratios` matches before it takes a baseline from another file; and ``decode_kernel``
        (:func:`decode_kernel`) where the input has ``kvrepro_settings``.
    """
    import pandas as pd

    src = _source_column(df)
    keys = ["mode", src] if src else ["mode"]
    if not len(df):
        return pd.DataFrame({**{k: pd.Series(dtype=object) for k in keys},
                             "max_clean_users": pd.Series(dtype="Int64"),
                             "aggregate_decode_tok_s": pd.Series(dtype="float64")})
    if "max_clean" in df.columns:
        ok = df["max_clean"].astype(bool)
    else:
        ok = df["clean"].astype(bool) & (df["preemptions"] == 0) & (df["num_users"] > 0)
    rows = []
    for key, g in df.groupby(keys, sort=False):
        key = key if isinstance(key, tuple) else (key,)
        good = g[ok.loc[g.index] & g["aggregate_decode_tok_s"].notna()]
        row = dict(zip(keys, key))
        row.update({c: g[c].iloc[0] for c in WORKLOAD_KEYS if c in g.columns})
        if "kvrepro_settings" in g.columns:
            known = [x for x in g["kvrepro_settings"] if isinstance(x, dict)]   # sizing rows of older code may lack it
            row["decode_kernel"] = decode_kernel(row["mode"], known[0] if known else None)
        # <NA>: capacity not measured (only sized, or reference data without a max-clean point)
        sizing_only = ("measured_by" in g.columns and (g["measured_by"] == "sizing").all()) or "max_clean" in g.columns
        cap = capped_at(g)
        if cap is not None:   # measured with max_users below what its cache fits: its largest point is no capacity
            row.update(max_clean_users=pd.NA, aggregate_decode_tok_s=float("nan"), capped_at=cap)
        elif len(good):
            best = good.loc[good["num_users"].idxmax()]
            row.update(max_clean_users=int(best["num_users"]), aggregate_decode_tok_s=float(best["aggregate_decode_tok_s"]))
        else:
            row.update(max_clean_users=pd.NA if sizing_only else 0, aggregate_decode_tok_s=float("nan"))
        rows.append(row)
    out = pd.DataFrame(rows)
    if len(out):
        out["max_clean_users"] = out["max_clean_users"].astype("Int64")
        if "capped_at" in out.columns:
            out["capped_at"] = out["capped_at"].astype("Int64")
    return out


def _baseline(cap, name: str):
    for alias in BASELINE_ALIASES[name]:
        hit = cap[cap["mode"] == alias]
        if len(hit):
            return hit.iloc[0]
    return None


def ratios(cap):
    """Capacity and throughput ratios vs bf16 (or fp16/auto) and fp8, per source when ``cap`` has one.

    Each row's baseline is the bf16 / fp8 row of its own source. A result file without one (e.g. a
    re-measure of one kvrepro mode after a kernel change) takes it from another file whose baseline
    row has the same ``WORKLOAD_KEYS`` as the row (GPU, budget, model, prompt and decode tokens, vLLM
    version, load format, prefix caching); the latest such file by name wins. The column
    ``baseline_from`` says, per row, where its baselines came from: "same file" (or "same source" for
    reference data), "other run: <file>", and "(workload differs: <keys>)" when a same-source baseline
    ran another workload, so a cross-run or unlike ratio is never shown as a like-for-like one;
    "none" where the row has no ratio (no baseline, or a sizing-only row without users).

    Args:
        cap: output of :func:`max_clean_capacity`.

    Returns:
        ``cap`` plus columns users_vs_bf16, tok_s_vs_bf16, users_vs_fp8, tok_s_vs_fp8 (NaN where the
        baseline is missing or zero) and, with a source column, ``baseline_from``.
    """
    import pandas as pd

    src = _source_column(cap)
    keys = [c for c in WORKLOAD_KEYS if c in cap.columns]
    same = "same source" if src == "source" else "same file"
    parts = [cap] if src is None or not len(cap) else [g for _, g in cap.groupby(src, sort=False)]
    out = []
    for g in parts:
        g = g.copy()
        notes = {i: [] for i in g.index}
        for name in ("bf16", "fp8"):
            own = _baseline(g, name)
            for col in ("users", "tok_s"):
                g[f"{col}_vs_{name}"] = float("nan")
            for i, row in g.iterrows():
                base, origin = own, same
                if base is None and src is not None:
                    base, origin = _borrowed_baseline(cap, row, src, name, keys)
                if base is None:
                    continue
                used = False
                for col, ref in (("users", "max_clean_users"), ("tok_s", "aggregate_decode_tok_s")):
                    num, den = row[ref], base[ref]
                    if not pd.isna(num) and not pd.isna(den) and float(den):
                        g.loc[i, f"{col}_vs_{name}"] = float(num) / float(den)
                        used = True
                if used:                     # a row with no ratio (e.g. sizing only) names no baseline
                    differ = [c for c in keys if not _same_value(row[c], base[c])]
                    notes[i].append(origin + (f" (workload differs: {', '.join(differ)})" if differ else ""))
        if src is not None:
            g["baseline_from"] = ["; ".join(dict.fromkeys(notes[i])) or "none" for i in g.index]
        out.append(g)
    return pd.concat(out, ignore_index=True)


def _same_value(a, b) -> bool:
    import pandas as pd

    return (pd.isna(a) and pd.isna(b)) or (not pd.isna(a) and not pd.isna(b) and a == b)


def _borrowed_baseline(cap, row, src: str, name: str, keys):
    """``(row, "other run: <file>")`` of baseline ``name`` from another source of ``cap`` whose
    baseline has the same ``keys`` values as ``row``, the latest source by name; else ``(None, None)``."""
    if not keys:
        return None, None
    import pandas as pd

    others = cap[cap[src] != row[src]]
    for c in keys:
        others = others[pd.Series([_same_value(v, row[c]) for v in others[c]], index=others.index, dtype=bool)]
    for source in sorted(others[src].unique(), reverse=True):
        base = _baseline(others[others[src] == source], name)
        if base is not None:
            return base, f"other run: {Path(str(source)).name}"
    return None, None


def reference_points():
    """The seed's published points and the card's measurements as one DataFrame: mode, num_users,
    aggregate_decode_tok_s, max_clean (bool), source. Reference data, not measured by this run."""
    import pandas as pd

    return pd.DataFrame(_REFERENCE, columns=["mode", "num_users", "aggregate_decode_tok_s", "source", "max_clean"])


# seed/card mode name -> kvrepro format row it is compared with in :func:`side_by_side`
_SAME_AS = {"fp16": "bf16", "auto": "bf16", "bf16": "bf16", "fp8": "fp8"}


def side_by_side(table, context_tokens: int, decode_tokens: int, block_size: int = 16):
    """One row per KV mode: this kit's arithmetic, the seed's published point and the card's measurement.

    Args:
        table: ``kvrepro.capacity.capacity_table`` output (format, users_fit).
        context_tokens, decode_tokens, block_size: the workload, to convert the card's measured KV-token
            counts into users that fit: ``(kv_tokens / block_size - 1) // ceil(tokens / block_size)``.

    Returns:
        DataFrame: mode, users_arithmetic (kvrepro formats), seed_users, seed_tok_s (A100 80GB),
        card_kv_tokens, card_users_fit (at this workload, from the measured KV tokens), card_users_run,
        card_tok_s (H200 emulating 80 GiB, 128K + 256). NaN where a source has no such mode.
    """
    import pandas as pd

    from kvrepro.capacity import CARD_KV_TOKENS, blocks_per_request

    per_user = blocks_per_request(context_tokens + decode_tokens, block_size)
    rows = {f: {"mode": f, "users_arithmetic": int(u)} for f, u in zip(table["format"], table["users_fit"])}

    def row(mode):
        return rows.setdefault(_SAME_AS.get(mode, mode), {"mode": _SAME_AS.get(mode, mode)})

    for mode, users, tok_s, source, _ in _REFERENCE:
        r = row(mode)
        if source == SEED_SOURCE:
            r.update(seed_users=users, seed_tok_s=tok_s)
        else:
            r.update(card_users_run=users, card_tok_s=tok_s)
    for dtype, tokens in CARD_KV_TOKENS.items():
        row(dtype).update(card_kv_tokens=tokens, card_users_fit=(tokens // block_size - 1) // per_user)
    cols = ["mode", "users_arithmetic", "seed_users", "seed_tok_s", "card_kv_tokens", "card_users_fit",
            "card_users_run", "card_tok_s"]
    df = pd.DataFrame(list(rows.values())).reindex(columns=cols)
    ints = ["users_arithmetic", "seed_users", "card_kv_tokens", "card_users_fit", "card_users_run"]
    return df.astype({c: "Int64" for c in ints})


def require_gpu_and_vllm() -> dict:
    """Check that a re-measurement can run here (``measure=True``): a CUDA GPU and vLLM installed.

    Returns:
        the :func:`kvrepro.provenance.collect` dict (for the caller's labels).

    Raises:
        RuntimeError: no CUDA GPU or no vLLM; the message says which, and that nothing is replayed instead.
    """
    from kvrepro.provenance import collect
    from kvrepro.sweep import measurement_blockers

    info = collect({})
    missing = measurement_blockers(info)
    if missing:
        raise RuntimeError(
            "measure=True needs " + " and ".join(missing) + ". Nothing was replayed in its place: "
            "run with measure=False to render the committed results instead."
        )
    return info


# The line under 02's "All rows" table (what kvrepro.sweep.window_stats puts in tpot_ms_mean).
TPOT_NOTE = (
    "`tpot_ms_mean` (`kvrepro.sweep.window_stats`): per request, the row's window duration divided by the tokens that "
    "request received in the window (ms), averaged over the requests; the window is the same one as the row's "
    "`aggregate_decode_tok_s` (*full*: from the last request's first token until every request has `decode_tokens` "
    "tokens; *abort-window*: `window_steps` steps). In a *full* row the requests prefilled first made many of their "
    "tokens while the others prefilled, so they receive few in the window and raise the mean: it is not "
    "`1000 x num_users / aggregate_decode_tok_s`; compare it only across *full* rows.")


def plot_kv_demand(demand, kv_budget_gib: float, ax=None, title: str = "KV cache needed vs concurrent users"):
    """Line per format of ``kvrepro.capacity.kv_demand`` output, with the KV budget as a horizontal line;
    the users that fit are the points under it. Returns the Axes."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 4.5))
    from kvrepro.style import markers, palette  # the one palette + marker per format / mode

    names = list(dict.fromkeys(map(str, demand["format"])))
    sns.lineplot(data=demand, x="users", y="kv_gib_needed", hue="format", hue_order=names, style="format",
                 style_order=names, palette=palette(names), markers=markers(names), dashes=False, ax=ax)
    ax.axhline(kv_budget_gib, color="black", ls="--", label=f"KV budget {kv_budget_gib:.1f} GiB")
    ax.set_xlabel("concurrent users")
    ax.set_ylabel("KV cache needed (GiB, whole blocks)")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return ax


def kv_sizes(df):
    """Per mode (and source file): the KV-cache tokens vLLM reported and the users that fit by its block
    arithmetic, as recorded by the sweep; columns mode, kv_cache_tokens, users_fit_arithmetic, gpu,
    gpu_memory_gb, source_file."""
    cols = ["mode", "kv_cache_tokens", "users_fit_arithmetic", "gpu", "gpu_memory_gb", "source_file"]
    return df[cols].drop_duplicates(subset=["mode", "source_file"]).reset_index(drop=True)


def measure(*, modes, max_users: int, context_tokens: int, decode_tokens: int, gpu_memory_gb: float,
            block_size: int, results_dir: str | Path = DEFAULT_RESULTS_DIR) -> Path:
    """Re-measure the capacity sweep with ``kvrepro.sweep.run_sweep`` (vLLM on this GPU, budget
    ``0.9 x gpu_memory_gb`` GiB) into ``<results_dir>/<date>-<gpu>.jsonl``; return that path.

    Checks the machine first (:func:`require_gpu_and_vllm`); the protocol belongs to ``kvrepro.sweep``.

    Raises:
        RuntimeError: no GPU or no vLLM here, ``kvrepro.sweep`` missing, or a mode's measurement failed.
        ValueError: unknown modes (from ``kvrepro.sweep.check_modes``).
    """
    info = require_gpu_and_vllm()
    try:
        from kvrepro import sweep
    except ImportError as e:
        raise RuntimeError(f"measure=True needs kvrepro.sweep, which failed to import: {e}") from e
    gpu = "".join(c if c.isalnum() else "-" for c in info["gpu"]).strip("-").lower()
    run_id = f"{info['date_utc'][:10]}-{gpu}"
    out_dir = resolve_results_dir(results_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{run_id}.jsonl"
    sweep.run_sweep(list(modes), path, run_id,
                    params={"gpu_memory_gb": gpu_memory_gb, "prompt_tokens": context_tokens,
                            "decode_tokens": decode_tokens, "max_users": max_users, "block_size": block_size})
    return path
