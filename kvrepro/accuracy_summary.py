"""The answer of notebook 03 and of the README's fidelity block: one row per KV mode with what it costs and gives.

Per mode (bf16, fp8 and every compressed preset of ``kvrepro.formats``, read at call time): stored KV bytes per
token and KV head at head_dim 128, the users that fit the seed's workload (notebook 02's arithmetic,
``kvrepro.capacity.users_that_fit``: Qwen3-4B, 131,072 + 1,024 tokens per user, 80 GiB), fidelity against bf16
(``kvrepro.fidelity``: KL over the full vocabulary, top-1 agreement and perplexity change on the reference path;
top-20 KL through vLLM), the needle verdict of the vLLM run (``kvrepro.accuracy.mode_verdicts``: the exact
one-sided 95% bound on the accuracy loss per needle variant, output sanity first), and issue 21's goal: fp8's KL
and perplexity change at >= ``GOAL_USERS`` users.

Every figure names its source (:class:`Source`): measured now, or replayed from a committed file with its engine,
GPU and dates (from the rows' provenance); a file that does not exist yet is "not measured yet", never an error.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import pandas as pd

from kvrepro import accuracy, fidelity
from kvrepro.formats import COMPRESSED_PRESETS, DEFAULT_PRESET, FORMAT_NAMES, get_format

GOAL_USERS = 12          # issue 21: fp8's fidelity at >= 12 users of the seed's workload
GOAL_REFERENCE = "fp8"   # the format users deploy: its KL and perplexity change are the bar
BASELINE = "bf16"
HEAD_DIM = 128           # Qwen3-4B's head_dim (the bytes column; SmolLM2's own is 64)
WORKLOAD = (131_072, 1_024)  # the seed's prompt + decode tokens per user (notebook 02)

REFERENCE_GPU = "results/fidelity/reference_h200_smollm2.csv"   # the reference path in float32 on the H200
REFERENCE_CPU = "results/fidelity/reference_cpu_smollm2.csv"    # the same path on a 2-core CPU (fewer windows)
VLLM_FIDELITY = fidelity.DEFAULT_VLLM_RESULTS                    # through vLLM, top-20 KL only
NEEDLE = accuracy.VLLM_RESULTS                                   # the vLLM needle run (statistical verdict)
NEEDLE_REPLICA = "results/accuracy/vllm_h200_replica/vllm_accuracy.csv"  # its pre-registered replication grid
KEYBIAS = "results/keybias/keybias_rope_mean_cpu.csv"            # kvrepro.keybias.bias_table, the default offset
NOT_MEASURED = "not measured yet"
JUDGE_TOKENS = 100_000   # issue 21: fidelity is judged on >= 100,000 scored tokens; fewer only checks the path


# ---------------------------------------------------------------- sources

@dataclass
class Source:
    """Where a set of figures comes from.

    Attributes:
        kind: "reference" (fidelity, reference path), "vllm" (fidelity through vLLM) or "needle".
        status: "measured now", "replayed" or :data:`NOT_MEASURED`.
        path: the result file (relative to the repository root where it is inside it).
        engine: e.g. "reference path (float32)", "vLLM 0.20.2".
        machine: the GPU, or "CPU (<host>, <n> cores)".
        when: the UTC span of the rows' measurement times (``kvrepro.replay.time_span``).
        size: what was measured, e.g. "50 windows x 2,048 scored tokens (102,400 tokens), pd-books".
        summary: ``fidelity.summarize`` of the rows (fidelity sources), else None.
        rows: the rows of one parameter set (fidelity sources), else None.
        verdicts: ``accuracy.mode_verdicts`` (needle sources), else None.
        tag: its number in a table's legend (set by :func:`summary_rows`).
        formats: the formats it measured.
        key_offset: the compressed presets' key offset of a needle run's rows (fidelity sources read theirs from
            the rows' parameters: :func:`key_offset_of`).
    """

    kind: str
    status: str
    path: str
    engine: str = ""
    machine: str = ""
    when: str = ""
    size: str = ""
    summary: pd.DataFrame | None = None
    rows: pd.DataFrame | None = None
    verdicts: pd.DataFrame | None = None
    tag: int = 0
    formats: tuple = field(default_factory=tuple)
    key_offset: str = ""

    @property
    def ok(self) -> bool:
        return self.status != NOT_MEASURED

    def short(self) -> str:
        """One line: "replayed: reference path (float32), NVIDIA H200, 2026-12-01 10:02-11:40 UTC"."""
        if not self.ok:
            return f"{NOT_MEASURED} ({self.path})"
        return f"{self.status}: {self.engine}, {self.machine}, {self.when}"

    def label(self) -> str:
        """The legend line: status, engine, machine, dates, size and file."""
        if not self.ok:
            return f"{NOT_MEASURED}: no `{self.path}`"
        where = f"`{self.path}`" if self.status == "replayed" else f"written to `{self.path}`" if self.path else ""
        return "; ".join(p for p in (self.short(), self.size, where) if p)


def _rel(path: str) -> str:
    root = accuracy.resolve_path("")
    full = os.path.abspath(accuracy.resolve_path(path))
    return os.path.relpath(full, root) if full.startswith(os.path.join(root, "")) else path


def _prov(rows: pd.DataFrame) -> dict:
    if "provenance" not in rows or not len(rows):
        return {}
    try:
        return json.loads(rows["provenance"].dropna().iloc[0])
    except (ValueError, TypeError, IndexError):
        return {}


def _machine(prov: dict) -> str:
    gpu = str(prov.get("gpu", "") or "")
    if gpu and gpu != "none":
        return gpu
    return f"CPU ({prov.get('hostname', '?')}, {prov.get('cpu_count', '?')} cores)"


def _params_offset(params: str) -> str:
    try:
        return json.loads(params).get("key_offset", "off")
    except (ValueError, TypeError, AttributeError):
        return ""


def _one_run(rows: pd.DataFrame) -> pd.DataFrame:
    """The rows of one parameter set (``params_key``) of a fidelity file: the one measured with the default preset's
    key offset (what a user runs), else the one with the most rows (ties: the newest). A file keeps rows of other
    parameters (``fidelity.run_cpu`` resumes; one file per engine holds each key offset's run); they are never
    mixed."""
    if "params_key" not in rows or rows["params_key"].nunique() <= 1:
        return rows
    want = get_format(DEFAULT_PRESET).default_key_offset
    g = rows.groupby("params_key").agg(n=("format", "size"), t=("measured_utc", "max"), params=("params", "first"))
    g["default"] = g["params"].map(_params_offset) == want
    key = g.sort_values(["default", "n", "t"]).index[-1]
    return rows[rows["params_key"] == key]


def fidelity_source(path: str, rows: pd.DataFrame | None = None, measured_now: bool = False,
                    kind: str | None = None) -> Source:
    """A fidelity result file (``kvrepro.fidelity``: one row per format x window, provenance columns) as a
    :class:`Source` with its :func:`kvrepro.fidelity.summarize`. ``rows``: rows already read (e.g. returned by
    ``fidelity.run_cpu`` just now, with ``measured_now=True``). No file (or no rows): status :data:`NOT_MEASURED`."""
    if rows is None:
        full = accuracy.resolve_path(path) if path else ""
        rows = fidelity.read_rows(full) if full else pd.DataFrame()
    rel = _rel(path) if path else ""
    if kind is None:
        kind = "vllm" if len(rows) and "engine" in rows and str(rows["engine"].iloc[0]) == "vllm" else "reference"
    if not len(rows):
        return Source(kind, NOT_MEASURED, rel)
    rows = _one_run(rows)
    from kvrepro.replay import time_span

    prov = _prov(rows)
    engine_col = str(rows["engine"].iloc[0]) if "engine" in rows else ""
    if kind == "vllm":
        engine = f"vLLM {prov.get('vllm_version', '?')}, top-{int(rows['top_k'].iloc[0])} log-probs"
    else:
        engine = "reference path (float32)" if engine_col not in ("", "reference-cpu") else "reference path"
    s = fidelity.summarize(rows)
    try:
        p = json.loads(rows["params"].iloc[0])
        per = int(p["window_tokens"]) - int(p["score_from"])
        corpus = (f", {p.get('corpus', '?')}, windows of {int(p['window_tokens']):,} tokens, compressed presets' key "
                  f"offset {p.get('key_offset', 'off')}")
    except (KeyError, ValueError, TypeError, IndexError):
        per, corpus = None, ""
    lo, hi = (int(s["windows"].min()), int(s["windows"].max())) if len(s) else (0, 0)
    t_lo, t_hi = (int(s["scored_tokens"].min()), int(s["scored_tokens"].max())) if len(s) else (0, 0)
    win = f"{hi} window{'s' if hi != 1 else ''}" if lo == hi else f"{lo}-{hi} windows (per format, each with bf16)"
    tokens = f"{t_hi:,} tokens" if t_lo == t_hi else f"{t_lo:,}-{t_hi:,} tokens"
    size = (f"{win} x {per:,} scored tokens ({tokens}){corpus}" if per else f"{win}, {tokens} scored")
    when = time_span(rows["measured_utc"]) if "measured_utc" in rows else "?"
    return Source(kind, "measured now" if measured_now else "replayed", rel, engine, _machine(prov), when, size,
                  summary=s, rows=rows, formats=tuple(map(str, s["format"])))


def key_offset_of(src: Source) -> str:
    """The compressed presets' key offset (``kvrepro.formats.offset.MODES``) of a source's rows ("off" for rows
    measured before the offset existed; "" without rows or, for a needle run, without compressed presets)."""
    if src is not None and src.kind == "needle":
        return src.key_offset
    if src is None or src.rows is None or not len(src.rows) or "params" not in src.rows:
        return ""
    try:
        return json.loads(src.rows["params"].iloc[0]).get("key_offset", "off")
    except (ValueError, TypeError, AttributeError):
        return ""


def default_offset_sentence(rows: list[dict], sources: dict) -> str:
    """One sentence: the default preset against fp8 with the engines' default key offset, from the reference
    source measured with it, when the preferred source (the table's) used another offset; "" otherwise."""
    from kvrepro.formats import get_format

    refs = [s for s in sources.get("reference", []) if s.ok]
    want = get_format(DEFAULT_PRESET).default_key_offset
    if not refs or key_offset_of(refs[0]) == want:
        return ""
    src = next((s for s in refs if key_offset_of(s) == want), None)
    first = f"The table's reference figures [{refs[0].tag}] were measured with the key offset {key_offset_of(refs[0])}"
    if src is None:
        return f"{first}; the engines' default, {want}, has no reference measurement yet."
    r = next((r for r in rows if r["format"] == DEFAULT_PRESET), None)
    x = r.get("by_source", {}).get(src.tag) if r else None
    if x is None:
        return f"{first}; [{src.tag}] ({want}, the default) did not measure {DEFAULT_PRESET}."
    return (f"{first}; with the default, {want} [{src.tag}]: {DEFAULT_PRESET} KL {x['kl']:.3g} = "
            f"{x['kl_vs_fp8']:.2f}x fp8's, perplexity {x['ppl_change_pct']:+.2f}% (fp8 "
            f"{x['fp8_ppl_change_pct']:+.2f}%).")


def needle_source(path: str = NEEDLE, measured_now: bool = False) -> Source:
    """The committed vLLM needle run (``scripts/vllm_accuracy.py``; ``accuracy.load_vllm_results``) with its
    :func:`kvrepro.accuracy.mode_verdicts` (sanity rows included where the run wrote them). No file: status
    :data:`NOT_MEASURED`."""
    if path and accuracy.existing(accuracy.resolve_path(path)).endswith(".gz") and not str(path).endswith(".gz"):
        path = f"{path}.gz"       # the committed copy is gzip-compressed
    rel = _rel(path) if path else ""
    if not path or not os.path.isfile(accuracy.resolve_path(path)):
        return Source("needle", NOT_MEASURED, rel)
    from kvrepro.replay import time_span

    res = accuracy.load_vllm_results(path)
    rows = res["rows"]
    verdicts = accuracy.mode_verdicts(rows, res["sanity"])
    per = rows.groupby(["format", "variant"]).size()
    n = {v: int(per.xs(v, level="variant").max()) for v in per.index.get_level_values("variant").unique()}
    order = sorted(n, key=lambda v: (v != "single", v))
    size = ", ".join(f"{n[v]:,} {v}-needle" for v in order) + " prompts per mode"
    vllm = ", ".join(sorted(set(rows["vllm_version"].astype(str))))
    gpu = ", ".join(sorted(set(rows["gpu"].astype(str))))
    ko = res["key_offset"]
    if ko:
        size += f", compressed presets' key offset {ko}"
    return Source("needle", "measured now" if measured_now else "replayed", rel, f"vLLM {vllm}", gpu,
                  time_span(rows["date"]), size, verdicts=verdicts,
                  formats=tuple(accuracy.format_order(rows["format"])), key_offset=ko)


def needle_sources(*paths: str) -> list:
    """The needle runs of the summary, preferred first: ``paths`` (default the committed replication grid and the
    first grid, :data:`NEEDLE_REPLICA` and :data:`NEEDLE`) as :func:`needle_source`, those whose compressed presets
    ran with the default key offset first. Each format's needle figures come from the first run that has it."""
    return by_default_offset([needle_source(p) for p in (paths or (NEEDLE_REPLICA, NEEDLE))])


def needles_for(path: str) -> list:
    """The needle sources of a summary that names ``path`` (notebook 03's ``vllm_results``): both committed runs,
    preferred first (:func:`needle_sources`), when ``path`` is one of them; else that run alone."""
    committed = {os.path.normpath(p) for p in (NEEDLE, NEEDLE_REPLICA)}
    if path and os.path.normpath(str(path)).removesuffix(".gz") in committed:
        return needle_sources()
    return [needle_source(path)]


def _needles(sources: dict) -> list:
    n = sources.get("needle")
    return [] if n is None else list(n) if isinstance(n, (list, tuple)) else [n]


def by_default_offset(items: list, offset_of=None) -> list:
    """``items`` (sources, by default) in the order the summary prefers them: those measured with the default
    preset's key offset (what a user runs) first, otherwise in the given order. ``offset_of``: an item's key offset
    (default :func:`key_offset_of`)."""
    want = get_format(DEFAULT_PRESET).default_key_offset
    offset_of = key_offset_of if offset_of is None else offset_of
    return sorted(items, key=lambda s: offset_of(s) != want)


def default_sources(live: Source | None = None, needle: Source | None = None) -> dict:
    """The sources of the summary: ``{"reference": [H200 reference, committed CPU reference, live], "vllm",
    "needle"}`` (the reference list in the order they are preferred: those measured with the default preset's key
    offset first, then the H200's before the CPU's; ``live`` is this run's measurement, if any;
    ``needle``: a :class:`Source` or a list of them, preferred first; default :func:`needle_sources`, the committed
    vLLM runs)."""
    refs = [fidelity_source(REFERENCE_GPU), fidelity_source(REFERENCE_CPU)]
    if live is not None:
        refs.append(live)
    refs = by_default_offset(refs)
    return {"reference": refs, "vllm": fidelity_source(VLLM_FIDELITY, kind="vllm"),
            "needle": needle if needle is not None else needle_sources()}


# ---------------------------------------------------------------- the table

def modes() -> list[str]:
    """bf16, fp8 and every compressed preset of the registry, by stored bytes per token (most first)."""
    return sorted(FORMAT_NAMES, key=lambda f: (-get_format(f).bytes_per_token_per_head(HEAD_DIM),
                                               FORMAT_NAMES.index(f)))


def users_that_fit(fmt: str) -> int:
    """Users of the seed's workload that fit (``kvrepro.capacity.users_that_fit``, notebook 02's arithmetic)."""
    from kvrepro.capacity import users_that_fit as fit

    return int(fit(fmt, *WORKLOAD)["users_fit"])


def display_name(fmt: str) -> str:
    return f"{fmt} (default)" if fmt == DEFAULT_PRESET else fmt


def _row_of(summary: pd.DataFrame | None, fmt: str):
    if summary is None or not len(summary) or fmt not in set(summary["format"]):
        return None
    return summary.set_index("format").loc[fmt]


def vs_fp8(src: Source, fmt: str) -> dict | None:
    """``fmt`` and fp8 of one fidelity source on the same tokens: ``fidelity.summarize`` and ``fidelity.goal_check``
    of the windows that bf16, fp8 and ``fmt`` all measured (a file may hold more windows of some formats). Returns
    ``{kl, top1_pct, ppl_change_pct, fp8_kl, fp8_ppl_change_pct, kl_vs_fp8, meets_fp8, windows}`` or None when
    the source lacks ``fmt`` or fp8 or has no full-vocabulary KL."""
    if not src.ok or src.rows is None or fmt not in src.formats or GOAL_REFERENCE not in src.formats:
        return None
    want = {BASELINE, GOAL_REFERENCE, fmt}
    sub = src.rows[src.rows["format"].isin(want)]
    per_window = sub.groupby("window")["format"].nunique()
    sub = sub[sub["window"].isin(per_window[per_window == len(want)].index)]
    s = fidelity.summarize(sub)
    if not len(s) or s["kl"].isna().any():
        return None
    row, ref = _row_of(s, fmt), _row_of(s, GOAL_REFERENCE)
    g = fidelity.goal_check(s).set_index("format")
    return dict(kl=float(row["kl"]), top1_pct=float(row["top1_pct"]), ppl_change_pct=float(row["ppl_change_pct"]),
                fp8_kl=float(ref["kl"]), fp8_ppl_change_pct=float(ref["ppl_change_pct"]),
                kl_vs_fp8=float(row["kl"]) / float(ref["kl"]) if float(ref["kl"]) else None,
                meets_fp8=bool(g.loc[fmt, "meets_fp8"]), windows=int(row["windows"]))


def _num(x) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def summary_rows(sources: dict, formats=None, cpu_sanity: pd.DataFrame | None = None) -> list[dict]:
    """The summary as plain values, one dict per mode (:func:`modes` order; ``formats`` restricts it).

    Args:
        sources: :func:`default_sources` (``reference``: list of :class:`Source`, preferred first; ``vllm``;
            ``needle``). Tags 1, 2, ... are set on the sources that are used or missing, in that order.
        cpu_sanity: greedy continuations on the CPU reference path (``accuracy.run_sanity`` rows), shown beside the
            needle run's sanity (``cpu_sanity`` field); the verdict follows the needle run's.

    Returns:
        dicts with: format, name (``(default)`` marked), bytes (per token and KV head at head_dim 128), users,
        needle_tag (the tag of the needle run its needle verdict comes from; None without one), needle_tag_shown
        (that run is not most rows' one, so its bound cell names it: each figure there carries its source),
        kl, kl_vs_fp8 (ratio to fp8 of the same source), top1_pct, ppl_change_pct, ref_tag (the source's tag;
        None when no reference source measured the mode), kl_topk_vllm, vllm_tag, single_bound / multi_bound
        (pp, the needle's one-sided 95% bound, each from the first run that has the variant; None if not run;
        single_tag / multi_tag: that run's tag where it is not the needle_tag run; the bound cell then marks each
        figure with its source), needle (overall verdict word), needle_text, sanity ("pass" / "FAIL" / ""),
        cpu_sanity (the same on the CPU path, "" without rows), meets_fp8 (True / False; None: not measured),
        verdict (MET, NOT MET, FAIL, NOT JUDGED, "baseline", "the bar"), verdict_why,
        by_source ({tag: kl, kl_vs_fp8, ppl_change_pct, fp8_ppl_change_pct} per reference source that measured the
        mode and fp8), sources (text).
    """
    refs, vsrc, nsrcs = list(sources.get("reference", [])), sources.get("vllm"), _needles(sources)
    tag = 0
    for s in [*refs, vsrc, *nsrcs]:
        if s is not None:
            tag += 1
            s.tag = tag
    cpu_sv = None
    if cpu_sanity is not None and len(cpu_sanity) and (cpu_sanity["format"].astype(str) == BASELINE).any():
        cpu_sv = accuracy.sanity_verdicts(cpu_sanity)["sanity_pass"]
    out = []
    fmts = [f for f in modes() if formats is None or f in set(formats)]
    for fmt in fmts:
        r = dict(format=fmt, name=display_name(fmt), bytes=get_format(fmt).bytes_per_token_per_head(HEAD_DIM),
                 users=users_that_fit(fmt), kl=None, kl_vs_fp8=None, top1_pct=None, ppl_change_pct=None,
                 fp8_kl=None, fp8_ppl_change_pct=None, ref_tag=None, kl_topk_vllm=None, vllm_tag=None,
                 single_bound=None, multi_bound=None, needle="", needle_text="", sanity="", meets_fp8=None,
                 cpu_sanity="" if cpu_sv is None or fmt not in cpu_sv.index or fmt == BASELINE
                 else ("pass" if cpu_sv[fmt] else "FAIL"))
        r["by_source"] = {t: x for t, x in ((s.tag, vs_fp8(s, fmt)) for s in refs) if x is not None}
        src = next((s for s in refs if s.tag in r["by_source"]), None)    # the preferred source that measured it
        if src is not None:
            x = r["by_source"][src.tag]
            r.update(kl=x["kl"], top1_pct=x["top1_pct"], ppl_change_pct=x["ppl_change_pct"], fp8_kl=x["fp8_kl"],
                     fp8_ppl_change_pct=x["fp8_ppl_change_pct"], kl_vs_fp8=x["kl_vs_fp8"], ref_tag=src.tag)
            if fmt != BASELINE:
                r["meets_fp8"] = x["meets_fp8"]
        if vsrc is not None and vsrc.ok and (v := _row_of(vsrc.summary, fmt)) is not None:
            r.update(kl_topk_vllm=_num(v["kl_topk"]), vllm_tag=vsrc.tag)
        nsrc = next((n for n in nsrcs if n.ok and n.verdicts is not None
                     and fmt in n.verdicts.index.get_level_values(0)), None)   # the preferred run that has it
        r["needle_tag"] = None
        if nsrc is not None:
            r["needle_tag"] = nsrc.tag
            mv = nsrc.verdicts.loc[fmt]
            r.update(needle=str(mv.loc[accuracy.OVERALL, "verdict"]), needle_text=str(mv.loc[accuracy.OVERALL, "text"]),
                     sanity=str(mv.loc[accuracy.OVERALL, "sanity"]))
            for var in ("single", "multi"):     # each variant's bound from the first run that has it (a run may lack one)
                vs = next((n for n in nsrcs if n.ok and n.verdicts is not None and (fmt, var) in n.verdicts.index), None)
                if vs is not None:
                    v = vs.verdicts.loc[(fmt, var)]
                    r[f"{var}_bound"] = _num(v["bound_pp"])
                    r[f"{var}_judged"] = str(v["retrieval"]) != "NOT JUDGED"
                    if vs is not nsrc:
                        r[f"{var}_tag"] = vs.tag
        r["verdict"], r["verdict_why"] = _verdict(r)
        tags = [f"[{t}]" for t in (r["ref_tag"], r["vllm_tag"], r["needle_tag"] if r["needle"] else None,
                                   r.get("single_tag"), r.get("multi_tag")) if t]
        r["sources"] = " ".join(tags)
        out.append(r)
    # a row whose reference (needle) figures come from another source than most rows' names it in its KL (bound) cell
    _mark_uncommon(out, "ref_tag", out)
    _mark_uncommon(out, "needle_tag", [r for r in out if r["format"] != BASELINE])
    return out


def _mark_uncommon(rows: list[dict], key: str, counted: list[dict]) -> None:
    """Set ``<key>_shown`` on every row whose ``key`` (a source tag) is not the one most ``counted`` rows have (ties:
    the lowest tag)."""
    used = [r[key] for r in counted if r.get(key) is not None]
    common = max(set(used), key=lambda t: (used.count(t), -t)) if used else None
    for r in rows:
        r[f"{key}_shown"] = r.get(key) is not None and r[key] != common


def _verdict(r: dict) -> tuple[str, str]:
    """The overall verdict of one mode against issue 21's goal: >= GOAL_USERS users, KL and perplexity change at
    most fp8's, needle retrieval non-inferior to bf16, output sane."""
    fmt = r["format"]
    if fmt == BASELINE:
        return "baseline", ""
    if fmt == GOAL_REFERENCE:
        return "the bar", ""
    if r["needle"] == "FAIL":
        return "FAIL", "output sanity"
    short, missing = [], []
    if r["users"] < GOAL_USERS:
        short.append(f"{r['users']} users < {GOAL_USERS}")
    if r["meets_fp8"] is None:
        missing.append("fidelity not measured")
    elif not r["meets_fp8"]:
        short += _short_of(r)
    if r["needle"] == "INFERIOR":
        short.append("needle INFERIOR")
    elif r["needle"] != "NON-INFERIOR":
        missing.append("needle not run" if not r["needle"] else "needle NOT JUDGED")
    if short:
        return "NOT MET", "; ".join(short)
    if missing:
        return "NOT JUDGED", "; ".join(missing)
    return "MET", ""


def _apart(a: float, b: float, pattern: str) -> tuple[str, str]:
    """``a`` and ``b`` formatted with ``pattern`` (a format spec with ``{d}`` decimals) at the fewest decimals, from
    2 to 6, that tell them apart (so "+2.28% > +2.28%" is never shown)."""
    for d in range(2, 7):
        x, y = format(a, pattern.format(d=d)), format(b, pattern.format(d=d))
        if x != y:
            return x, y
    return x, y


def _short_of(x: dict) -> list[str]:
    """What keeps a mode from fp8's fidelity: its KL ratio and / or its perplexity change against fp8's."""
    out = []
    if x["kl"] > x["fp8_kl"]:
        out.append(f"KL {_apart(x['kl_vs_fp8'], 1.0, '.{d}f')[0]}x fp8's")
    if x["ppl_change_pct"] > x["fp8_ppl_change_pct"]:
        a, b = _apart(x["ppl_change_pct"], x["fp8_ppl_change_pct"], "+.{d}f")
        out.append(f"perplexity {a}% > fp8's {b}%")
    return out


def _g(x) -> str:
    return "–" if x is None else f"{x:.3g}"


def _kl_cell(r: dict) -> str:
    if r["kl"] is None:
        return NOT_MEASURED
    if r["format"] == BASELINE:
        return "0"
    note = f" [{r['ref_tag']}]" if r.get("ref_tag_shown") else ""
    return (f"{r['kl']:.3g} ({r['kl_vs_fp8']:.2f}x fp8){note}" if r["format"] != GOAL_REFERENCE
            else f"{r['kl']:.3g}{note}")


def _pct(x, signed: bool = True) -> str:
    return "–" if x is None else (f"{x:+.2f}%" if signed else f"{x:.1f}%")


def _ppl_cell(r: dict) -> str:
    return NOT_MEASURED if r["kl"] is None else _pct(r["ppl_change_pct"])


def _bounds(r: dict) -> str:
    if r["format"] == BASELINE:
        return "baseline"
    if r["single_bound"] is None and r["multi_bound"] is None:
        return NOT_MEASURED if not r["needle"] else "–"
    figures = [(v, b, r.get(f"{v}_tag") or r.get("needle_tag"))
               for v, b in (("single", r["single_bound"]), ("multi", r["multi_bound"]))]
    # each figure names its own source once any does: a mark at the cell's end could belong to either figure
    marked = r.get("needle_tag_shown") or len({t for _, b, t in figures if b is not None}) > 1
    return " / ".join("–" if b is None else f"{b:.2f}" + ("" if r.get(f"{v}_judged", True) else " (not judged)")
                      + (f" [{t}]" if marked and t is not None else "") for v, b, t in figures)


def _sanity_cell(r: dict) -> str:
    if r["format"] == BASELINE:
        return "–"
    return (r["sanity"] or NOT_MEASURED) + (f"; CPU {r['cpu_sanity']}" if r.get("cpu_sanity") else "")


def _needle_word(r: dict) -> str:
    if r["format"] == BASELINE:
        return "baseline"
    return r["needle"] or NOT_MEASURED


def _verdict_cell(r: dict) -> str:
    return r["verdict"] + (f": {r['verdict_why']}" if r["verdict_why"] else "")


def display_table(rows: list[dict]) -> pd.DataFrame:
    """Notebook 03's answer table (text cells), one row per mode, the default preset marked."""
    t = pd.DataFrame([{
        "mode": r["name"], "KV B/token/head (hd 128)": r["bytes"], "users (Qwen3-4B, 128K, 80 GiB)": r["users"],
        "KL vs bf16, full vocab (nats/token)": _kl_cell(r),
        "KL top-20, vLLM": NOT_MEASURED if r["kl_topk_vllm"] is None else _g(r["kl_topk_vllm"]),
        "top-1 agreement": _pct(r["top1_pct"], signed=False), "perplexity change": _ppl_cell(r),
        "needle bound single / multi (pp, 95%)": _bounds(r), "needle verdict": _needle_word(r),
        "output sanity": _sanity_cell(r),
        "KL and perplexity within fp8's": "–" if r["meets_fp8"] is None or r["format"] in (BASELINE, GOAL_REFERENCE)
        else ("yes" if r["meets_fp8"] else "no"),
        "verdict": _verdict_cell(r), "sources": r["sources"]} for r in rows])
    return t


def table_notes(cpu_sanity_label: str = "") -> str:
    """What the table's columns mean and what the verdict asks (markdown, one paragraph)."""
    from kvrepro import stats

    cpu = f", with the CPU reference path's ({cpu_sanity_label}) beside it" if cpu_sanity_label else ""
    return (f"KL: KL(bf16 || format) of the next-token distribution, nats per token; vLLM returns only the top-20 "
            f"log-probs (the rest bounded, `kvrepro.fidelity`). Needle bound: exact one-sided 95% upper bound on the "
            f"accuracy loss against bf16 on the same prompts (percentage points; NON-INFERIOR when <= "
            f"{stats.MARGIN_PP:g} pp; NOT JUDGED with fewer than {stats.min_pairs()} pairs). Output sanity: greedy "
            f"continuations of the needle run against bf16's (loops, stutter){cpu}. Verdict: MET = >= {GOAL_USERS} "
            f"users, KL and perplexity change at most fp8's, needle NON-INFERIOR, output sane in the needle run.")


def legend(sources: dict) -> str:
    """The numbered sources under the table, one line each (markdown)."""
    refs, vsrc, nsrcs = list(sources.get("reference", [])), sources.get("vllm"), _needles(sources)
    what = {"reference": "KL (full vocabulary), top-1, perplexity", "vllm": "KL top-20 through vLLM",
            "needle": "needle bounds and verdicts, output sanity"}
    later = nsrcs[1:]

    def what_of(s):
        if any(s is n for n in later):
            return f"{what['needle']} of the formats or needle variants (single, multi) the needle runs above lack"
        return what["needle"] if s.kind == "needle" else what[s.kind]

    lines = [f"[{s.tag}] {what_of(s)}: {s.label()}" for s in [*refs, vsrc, *nsrcs] if s is not None and s.tag]
    return "\n\n".join(lines)


def closest_to_fp8(rows: list[dict]) -> str:
    """The sentence under the table, from the data: which preset at >= GOAL_USERS users is closest to fp8's
    fidelity and whether it meets the goal, what each other preset at >= GOAL_USERS users costs, and the presets
    below GOAL_USERS users.

    Closest: among the presets at >= GOAL_USERS users whose perplexity change is at most fp8's (all of them if
    none is), the lowest KL relative to fp8. All figures of the sentence come from ONE reference source (ratios to
    fp8 are like for like): the preferred (lowest tag) one that measured the default preset, else the one that
    measured the most of those presets (ties: the preferred)."""
    presets = [r for r in rows if r["format"] in COMPRESSED_PRESETS]
    cands = [r for r in presets if r["users"] >= GOAL_USERS]
    tags = sorted({t for r in cands for t in r.get("by_source", {})})
    if not tags:
        return (f"No preset at >= {GOAL_USERS} users has a fidelity measurement with fp8 beside it yet: which one "
                "is closest to fp8 is not known.")
    default = next((r for r in cands if r["format"] == DEFAULT_PRESET), None)
    with_default = [t for t in tags if default is not None and t in default["by_source"]]
    tag = min(with_default) if with_default else max(tags, key=lambda t: (sum(t in r["by_source"] for r in cands), -t))
    fp8 = next((r for r in rows if r["format"] == GOAL_REFERENCE), None)

    def v(r):
        return r.get("by_source", {}).get(tag)

    def cost(r):
        x = v(r)
        if x is None:
            return f"{r['name']} ({r['users']} users): not measured in [{tag}]"
        return (f"{r['name']} ({r['users']} users): KL {x['kl']:.3g} = {x['kl_vs_fp8']:.2f}x fp8's, perplexity "
                f"{x['ppl_change_pct']:+.2f}%")

    measured = [r for r in cands if v(r) is not None]
    ppl_ok = [r for r in measured if v(r)["ppl_change_pct"] <= v(r)["fp8_ppl_change_pct"]]
    best = min(ppl_ok or measured, key=lambda r: (v(r)["kl_vs_fp8"], v(r)["ppl_change_pct"]))
    b = v(best)
    if not b["meets_fp8"]:
        goal = f"it does **not** meet the goal ({'; '.join(_short_of(b))})"
    elif best["verdict"] == "MET":
        goal = "it **meets** the goal (KL and perplexity change at most fp8's, needle non-inferior, output sane)"
    else:
        goal = (f"its KL and perplexity change are within fp8's; the goal is **not met yet** "
                f"({best['verdict']}: {best['verdict_why']})")
    f8 = v(fp8) if fp8 is not None else None
    text = (f"**Closest to fp8's fidelity at >= {GOAL_USERS} users: {cost(best)}**; {goal}. "
            + (f"fp8 ({fp8['users']} users): KL {f8['kl']:.3g}, perplexity {f8['ppl_change_pct']:+.2f}%. "
               if f8 else ""))
    others = [r for r in cands if r is not best]
    if others:
        text += (f"The other presets at >= {GOAL_USERS} users, kept for capacity, cost: "
                 + "; ".join(cost(r) for r in sorted(others, key=lambda r: r["users"])) + ". ")
    below = [r for r in presets if r["users"] < GOAL_USERS]
    if below:
        text += f"Below {GOAL_USERS} users: " + "; ".join(cost(r) for r in below) + ". "
    return text + f"(All figures of this sentence from source [{tag}].)"


# ---------------------------------------------------------------- the chart

def plot_users_vs_kl(panels: list[tuple[str, Source, str]], formats=None):
    """Users that fit (x) against KL vs bf16 (y, log), one panel per ``(title, source, column)`` (column ``kl``
    or ``kl_topk``), one colour and marker per format (``kvrepro.style``), fp8's KL as a dashed line, the
    ``GOAL_USERS`` line, the goal's corner shaded. bf16 (KL 0) is not drawn. Returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    from kvrepro.style import style_of

    panels = [p for p in panels if p[1].ok]
    n = max(1, len(panels))
    fig, axes = plt.subplots(1, n, figsize=((5.6 if n <= 2 else 4.6) * n, 4.4), squeeze=False)
    for ax, (title, src, col) in zip(axes[0], panels):
        s = src.summary.set_index("format")
        fmts = [f for f in modes() if f in s.index and f != BASELINE and (formats is None or f in set(formats))]
        users = {f: users_that_fit(f) for f in fmts}
        for f in fmts:
            c, m = style_of(f, FORMAT_NAMES.index(f))
            y = float(s.loc[f, col])
            ax.scatter([users[f]], [y], color=c, marker=m, s=90, edgecolor="black", linewidth=0.6, zorder=3,
                       label=display_name(f))
            ax.annotate(display_name(f), (users[f], y), textcoords="offset points", xytext=(7, 4), fontsize=9)
        ys = [float(s.loc[f, col]) for f in fmts if float(s.loc[f, col]) > 0]
        if GOAL_REFERENCE in s.index and ys:
            ref = float(s.loc[GOAL_REFERENCE, col])
            ax.axhline(ref, color="#555555", linestyle="--", linewidth=1)
            ax.axvline(GOAL_USERS, color="#555555", linestyle=":", linewidth=1)
            ax.fill_between([GOAL_USERS, max(users.values()) + 2], min(ys) / 3, ref, color="#55a868", alpha=0.12,
                            label=f"goal: >= {GOAL_USERS} users, KL <= fp8")
            ax.text(GOAL_USERS + 0.15, min(ys) / 2.6, f"{GOAL_USERS} users", fontsize=8.5, color="#333333")
            ax.set_ylim(min(ys) / 3, max(ys) * 2.5)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))      # users are whole
        ax.set_xlim(min(users.values(), default=0) - 1, max(users.values(), default=GOAL_USERS) + 2)
        ax.set_xlabel(f"users that fit (Qwen3-4B, {WORKLOAD[0]:,} + {WORKLOAD[1]:,} tokens, 80 GiB)")
        ax.set_ylabel(("KL vs bf16, full vocabulary" if col == "kl" else "KL vs bf16, top-20") + " (nats/token)")
        ax.set_title(title, fontsize=10.5)
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=8.5, loc="upper left", framealpha=0.9)
    if not panels:
        axes[0][0].text(0.5, 0.5, "no fidelity measurement", ha="center", va="center")
        axes[0][0].set_axis_off()
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------- key bias

def keybias_summary(table: pd.DataFrame) -> pd.DataFrame:
    """``kvrepro.keybias.bias_table`` per format x placement x bias norm: the worst error ratio over the shapes the
    format supports, how many of them meet the bar (ratio <= ``keybias.BAR``), and the shapes it refuses."""
    from kvrepro.keybias import BAR

    sup = table[table["supported"].astype(bool)]
    refused = table[~table["supported"].astype(bool)].groupby("format")["shape"].apply(lambda s: ", ".join(s))
    out = []
    for (fmt, pl, bn), g in sup.groupby(["format", "placement", "bias_norm"], sort=False):
        out.append({"format": fmt, "placement": pl, "bias norm": bn, "worst ratio": float(g["ratio"].max()),
                    "median ratio": float(g["ratio"].median()),
                    "shapes meeting": f"{int((g['ratio'] <= BAR).sum())}/{len(g)}",
                    "worst shape": str(g.loc[g["ratio"].idxmax(), "shape"]),
                    "refused shapes": refused.get(fmt, "")})
    return _by_mode(pd.DataFrame(out))


def _by_mode(t: pd.DataFrame) -> pd.DataFrame:
    """``t`` with its rows in :func:`modes` order of its ``format`` column (stable), other formats last."""
    if not len(t):
        return t
    rank = {f: i for i, f in enumerate(modes())}
    return t.sort_values("format", key=lambda c: c.map(lambda f: rank.get(f, len(rank))), kind="stable") \
        .reset_index(drop=True)


def keybias_verdicts(table: pd.DataFrame) -> pd.DataFrame:
    """One row per format: the bar's verdict ("met" / "NOT MET") and by how much (worst ratio / bar)."""
    from kvrepro.keybias import BAR

    rows = []
    for fmt, g in table.groupby("format", sort=False):
        s = g[g["supported"].astype(bool)]
        worst = float(s["ratio"].max()) if len(s) else float("nan")
        n_ref = int((~g["supported"].astype(bool)).sum())
        met = len(s) and bool((s["ratio"] <= BAR).all()) and not n_ref
        why = (f"worst ratio {worst:.2f} <= {BAR:g}" if met else
               f"worst ratio {worst:.2f} = {worst / BAR:.1f}x the {BAR:g}x bar"
               + (f"; {n_ref} shape(s) refused" if n_ref else ""))
        rows.append({"format": fmt, "verdict": "met" if met else "NOT MET", "worst ratio": worst,
                     "times the bar": worst / BAR, "detail": why})
    return _by_mode(pd.DataFrame(rows))


def load_keybias(path: str = KEYBIAS) -> tuple[pd.DataFrame | None, str]:
    """A committed key-bias table and its label, or (None, "not measured yet: ...")."""
    full = accuracy.resolve_path(path) if path else ""
    if not full or not os.path.isfile(full):
        return None, f"{NOT_MEASURED}: no `{path}`"
    t = pd.read_csv(full)
    when = ""
    for c in ("measured_utc", "date", "date_utc"):
        if c in t:
            from kvrepro.replay import time_span

            when = ", " + time_span(t[c].dropna())
            break
    machine = f", {_machine(_prov(t))}" if "provenance" in t else ""
    tokens = f", {int(t['tokens'].dropna().iloc[0]):,} tokens per case" if "tokens" in t and t["tokens"].notna().any() \
        else ""
    ko = ""
    if "key_offset" in t and "format" in t:
        modes = sorted(set(t.loc[t["format"].astype(str).isin(COMPRESSED_PRESETS), "key_offset"].dropna().astype(str)))
        ko = f", compressed presets' key offset {', '.join(modes)}" if modes else ""
    return t, f"replayed from `{_rel(path)}`{machine}{when}{tokens}{ko}"


# ---------------------------------------------------------------- the README block

def readme_table(rows: list[dict]) -> str:
    """The README's fidelity table (markdown): fp8 and every preset."""
    head = ["mode", f"KV bytes per token and KV head (head_dim {HEAD_DIM})",
            "users (Qwen3-4B, 128K + 1K tokens, 80 GiB)", "KL vs bf16, reference path (nats/token)",
            "KL top-20 vs bf16, vLLM", "perplexity change vs bf16", "needle loss bound, single / multi (pp, 95%)",
            "needle verdict", "verdict (the goal below)"]
    lines = ["| " + " | ".join(head) + " |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        if r["format"] == BASELINE:
            continue
        name = f"**{r['name']}**" if r["format"] == DEFAULT_PRESET else r["name"]
        lines.append("| " + " | ".join([
            name, str(r["bytes"]), str(r["users"]), _kl_cell(r),
            NOT_MEASURED if r["kl_topk_vllm"] is None else f"{r['kl_topk_vllm']:.3g}", _ppl_cell(r),
            _bounds(r), _needle_word(r), _verdict_cell(r)]) + " |")
    return "\n".join(lines)


def readme_text(sources: dict) -> str:
    """The README's fidelity section body: table, the closest-to-fp8 sentence, the sources (no markers)."""
    from kvrepro import stats

    rows = summary_rows(sources)
    lg = legend(sources).replace("\n\n", "\n")
    note = default_offset_sentence(rows, sources)
    return "\n".join([
        readme_table(rows), "",
        closest_to_fp8(rows) + (f" {note}" if note else ""), "",
        f"Goal: fp8's KL and perplexity change at >= {GOAL_USERS} users, needle retrieval non-inferior to "
        f"bf16 (exact one-sided 95% bound on the loss <= {stats.MARGIN_PP:g} pp) and sane output. Fidelity: "
        "SmolLM2-135M-Instruct on public-domain prose, each format against bf16 on the same engine "
        "(`kvrepro.fidelity`); users: notebook 02's arithmetic. Sources:", "",
        "\n".join(f"- {ln}" for ln in lg.splitlines())])


# ---------------------------------------------------------------- notebook 03's parameters

# Notebook 03's parameters beyond the needle grid's (``AccuracyParams``), with their defaults.
NOTEBOOK_PARAMETERS = {"fidelity_windows": 2, "fidelity_window_tokens": 1024, "fidelity_score_from": 512,
                       "keybias_results": KEYBIAS, "keybias_tokens": 2048}


def notebook_params(d: dict):
    """Notebook 03's parameters split and checked: ``(AccuracyParams, FidelityParams or None, keybias)``.

    ``d``: the notebook's parameters (a params file or papermill's): ``AccuracyParams``' fields with ``formats``
    "all" (every format of the registry) or a list, plus :data:`NOTEBOOK_PARAMETERS` (missing ones take their
    defaults). The fidelity measurement made now (None for ``fidelity_windows: 0``) covers the same formats;
    ``keybias`` = ``{"results": path, "tokens": int}``. ValueError naming the first bad or unknown parameter."""
    extra = {**NOTEBOOK_PARAMETERS, **{k: v for k, v in d.items() if k in NOTEBOOK_PARAMETERS}}
    grid = {k: v for k, v in d.items() if k not in NOTEBOOK_PARAMETERS}
    if "formats" in grid:
        grid["formats"] = resolve_formats(grid["formats"])
    params = accuracy.AccuracyParams.from_dict(grid)
    fid = live_fidelity_params(params.formats, extra["fidelity_windows"], extra["fidelity_window_tokens"],
                               extra["fidelity_score_from"], params.block_size)
    if not isinstance(extra["keybias_results"], str):
        raise ValueError(f"keybias_results must be a path (or '' for none), got {extra['keybias_results']!r}")
    return params, fid, {"results": extra["keybias_results"], "tokens": check_keybias_tokens(extra["keybias_tokens"])}


def resolve_formats(formats) -> list[str]:
    """Notebook 03's ``formats``: ``"all"`` = every format of ``kvrepro.formats`` at run time (bf16, fp8, each
    compressed preset), else the list as given (checked by ``AccuracyParams``). ValueError for another string."""
    if isinstance(formats, str):
        if formats != "all":
            raise ValueError(f"formats must be 'all' or a list of {', '.join(FORMAT_NAMES)}, got {formats!r}")
        return list(FORMAT_NAMES)
    return list(formats)


def live_fidelity_params(formats, windows, window_tokens, score_from, block_size: int = 16):
    """The fidelity measurement notebook 03 makes now on the CPU (``kvrepro.fidelity.run_cpu``), or None for
    ``windows == 0``. ValueError naming the parameter (``fidelity_windows`` etc.) when one is bad."""
    if not isinstance(windows, int) or isinstance(windows, bool) or windows < 0:
        raise ValueError(f"fidelity_windows must be a non-negative integer (0: no live measurement), got {windows!r}")
    if windows == 0:
        return None
    p = fidelity.FidelityParams(formats=tuple(formats), window_tokens=window_tokens, score_from=score_from,
                                num_windows=windows, block_size=block_size)
    try:
        p.validate()
    except ValueError as e:
        msg = str(e).replace("window_tokens", "fidelity_window_tokens").replace("score_from", "fidelity_score_from")
        raise ValueError(msg) from None
    return p


def check_keybias_tokens(tokens) -> int:
    """``keybias_tokens`` of notebook 03: an integer in [16, 8192]; ValueError otherwise."""
    if not isinstance(tokens, int) or isinstance(tokens, bool) or not 16 <= tokens <= 8192:
        raise ValueError(f"keybias_tokens must be an integer in [16, 8192], got {tokens!r}")
    return tokens
