"""The README's "Supported GPUs and models" block, generated from data: which decode kernel each GPU family runs, how
many CTAs of each CUDA kernel an SM holds, and whether the code that family runs was measured or only built; which
kernel each bundled model's attention gets and what its KV costs per token.

    python -m kvrepro.reach            print the block
    python -m kvrepro.reach --write    rewrite README.md between <!-- reach:begin --> and <!-- reach:end -->
    python -m kvrepro.reach --check    exit 1 if README.md's block differs
    python -m kvrepro.reach --carveout print the split-count timings under other GPUs' shared-memory budgets

Sources: the GPU families of ``kvrepro/ops/cuda/gpus.json`` (per-SM limits, with their NVIDIA sources), the committed
fatbin's manifest (the code it holds: ``kvrepro.ops.cuda_decode.fatbin_code_for``; ptxas's spills per target), the
residency model (``kvrepro.ops.occupancy``), the bundled configs (``kvrepro.configs.facts``), the engine-start rule
(``kvrepro.vllm_backend.config.serving_plan``), and the committed measurements: a family counts as measured only
where a result row names one of its GPUs, ran the CUDA kernel, and ran byte for byte the code the committed fatbin
holds for it, kernel by kernel (a row's fatbin is the committed one, or one listed with its entries and per-kernel
code hashes in ``kvrepro/ops/cuda/measured_fatbins.json``; ``kvrepro.ops.cuda_build.cubin_functions``).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from kvrepro.configs import model_names
from kvrepro.configs.facts import model_facts
from kvrepro.ops import cuda_decode, occupancy
from kvrepro.settings import DEFAULT_PRESET
from kvrepro.style import formatted
from kvrepro.vllm_backend.config import serving_plan

README = "README.md"
BEGIN, END = "<!-- reach:begin -->", "<!-- reach:end -->"
MEASURED_FATBINS = Path(cuda_decode.HERE) / "measured_fatbins.json"
SHAPE = {"head_dim": 128, "num_q_heads": 32, "num_kv_heads": 8}   # the measured geometry (Qwen3-4B; Llama-3.1-8B's)


def repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


def family_of(gpu: str):
    """The ``occupancy.SMLimits`` row one of whose product names ``gpu`` (the driver's name, e.g. "NVIDIA H200",
    "NVIDIA A100-SXM4-80GB") contains as a whole word (a suffix after a dash allowed); None if no family lists it."""
    for fam in occupancy.families():
        if any(re.search(rf"(?<![\w-]){re.escape(name)}(?!\w)", gpu) for name in fam.gpus):   # "A100-SXM4-80GB"
            return fam
    return None


def _cuda_presets(settings: dict) -> set[str]:
    """Presets a row's ``kvrepro_settings.decode_impl`` ran on the CUDA kernel (its keys start with the preset)."""
    return {k.split()[0] for k, v in (settings.get("decode_impl") or {}).items() if v == "cuda"}


def cuda_measurements(root: Path | None = None) -> list[dict]:
    """Committed measurements that ran kvrepro's CUDA decode kernel: ``[{"file", "gpu", "fatbin_sha256", "date",
    "presets"}]`` (``presets``: those whose CUDA kernel ran), one per file, GPU and fatbin: capacity rows
    (``results/capacity/*.jsonl``) and per-model rows (``results/reach/models_*.jsonl``) whose
    ``kvrepro_settings.decode_impl`` resolved to ``cuda``, benchmark files with CUDA rows
    (``benchmarks/results/*.json``: ``impl`` cuda, preset from the row's ``kernel`` name, or ``kernel`` "committed"
    with the provenance's preset) and
    the carveout timings (:data:`CARVEOUT_RESULTS`, its parameters' presets)."""
    root = root or repo_root()
    out: dict[tuple, dict] = {}

    def add(path, gpu, sha, date, presets):
        key = (str(path.relative_to(root)), gpu or "", sha or "")
        hit = out.setdefault(key, {"file": key[0], "gpu": key[1], "fatbin_sha256": key[2], "date": "",
                                   "presets": set()})
        hit["date"] = max(hit["date"], str(date or "")[:10])
        hit["presets"] |= set(presets)

    row_files = [*sorted((root / "results" / "capacity").glob("*.jsonl")),
                 *sorted((root / MODELS_RESULTS).glob("models_*.jsonl"))]
    for path in row_files:
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            st = row.get("kvrepro_settings") or {}
            if _cuda_presets(st):
                add(path, row.get("gpu"), st.get("cuda_fatbin_sha256"), row.get("date"), _cuda_presets(st))
    for path in sorted((root / "benchmarks" / "results").glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        rows, prov = data.get("rows") or [], data.get("provenance") or {}
        presets = {str(r.get("kernel")).removeprefix("kvrepro_") for r in rows if r.get("impl") == "cuda"}
        if any(r.get("kernel") == "committed" for r in rows):
            presets.add(prov.get("preset") or (prov.get("parameters") or {}).get("preset") or "k4v4")  # script default
        if presets:
            add(path, prov.get("gpu"), prov.get("cuda_fatbin_sha256"), prov.get("date_utc"), presets)
    carveout = root / CARVEOUT_RESULTS
    if carveout.is_file():
        data = json.loads(carveout.read_text(encoding="utf-8"))
        prov = data.get("provenance") or {}
        ran = {r["preset"] for r in data.get("rows") or [] if r.get("ms_graph") is not None}
        if ran:
            add(carveout, prov.get("gpu"), prov.get("cuda_fatbin_sha256"), prov.get("date_utc"), ran)
    return [dict(m, presets=sorted(m["presets"])) for m in out.values()]


def _kernels_of(sha: str, manifest: dict, measured: dict) -> dict | None:
    """``{code: {kernel: SHA-256 of its code}}`` of the SASS entries of the fatbin of SHA-256 ``sha``: the committed
    one's from its manifest, an earlier one's from measured_fatbins.json; None if unknown. An entry listed without
    per-kernel hashes counts where its whole entry equals the committed fatbin's (then every kernel in it is the
    committed one's)."""
    if sha == manifest.get("fatbin_sha256"):
        entries = manifest["entries"]
    else:
        known = measured.get("fatbins", {}).get(sha)
        if known is None:
            return None
        entries = known["entries"]
    current = {e["code"]: e for e in manifest["entries"]}
    out = {}
    for e in entries:
        if "kernels" in e:
            out[e["code"]] = dict(e["kernels"])
        elif e["code"] in current and current[e["code"]]["sha256"] == e["sha256"]:
            out[e["code"]] = dict(current[e["code"]].get("kernels") or {})
    return out


def cuda_status(code: str, runs: list[dict], manifest: dict, measured: dict) -> tuple[str, list[dict]] | None:
    """What the measurements ``runs`` (:func:`cuda_measurements` of one GPU family) say of SASS target ``code`` of the
    committed fatbin (``manifest``; earlier fatbins from ``measured``, the content of measured_fatbins.json), per
    kernel: the plain decode kernels (``cuda_decode.KERNELS``: what the matrix row describes) count as measured where a
    run of that kernel's preset ran a fatbin whose ``code`` entry held the same code for it (per-kernel SHA-256,
    ``cuda_build.cubin_functions``); the other kernels of the entry (the rope-mean ones, for the default key
    offset) are said to be built and not run unless a run ran their code. Returns ``(text, runs that count)`` or None if ``runs`` is
    empty."""
    if not runs:
        return None
    current = next(e for e in manifest["entries"] if e["code"] == code).get("kernels") or {}
    preset_of = {k: cuda_decode.PRESETS[b] for b, k in cuda_decode.KERNELS.items()}
    ran: dict[str, list[dict]] = {}          # kernel -> runs that ran this very code
    for m in runs:
        held = (_kernels_of(m["fatbin_sha256"], manifest, measured) or {}).get(code) or {}
        for k, h in current.items():
            if h == held.get(k) and (k not in preset_of or preset_of[k] in m["presets"]):
                ran.setdefault(k, []).append(m)
    plain = list(cuda_decode.KERNELS.values())
    done = [k for k in plain if k in ran]
    if not done:
        return f"measured with an earlier build; this build's {code} not measured", []
    same = [m for m in runs if any(m in ran[k] for k in done)]
    files = ", ".join(dict.fromkeys(f"[{Path(m['file']).name}]({m['file']})" for m in same))   # a file per fatbin: once
    gpus = ", ".join(sorted({m["gpu"].replace("NVIDIA ", "") for m in same}))
    short = " / ".join(preset_of[k] for k in done)
    date = max(m["date"] for m in same)
    text = f"**measured** on {gpus}, {short} ({code} code identical to the runs'; {date}: {files})"
    missing = [preset_of[k] for k in plain if k not in ran]
    if missing:
        text += f"; {' / '.join(missing)} not measured"
    extra = [k for k in current if k not in plain and k not in ran]
    if extra:
        rope = set(cuda_decode.ROPE_KERNELS.values())
        text += ("; rope-mean kernels built, not run" if set(extra) == rope else
                 f"; {', '.join(k.removeprefix('kvrepro_decode_') for k in extra)} built, not run")
    return text, same


def gpu_rows(root: Path | None = None) -> list[dict]:
    """One row per GPU family of gpus.json: ``family``, ``capability``, ``code`` (what of the fatbin it runs),
    ``decode`` (the kernel at the measured geometry under the default rule), ``ctas`` (resident CTAs of k4v4 / k8v4 /
    k4v2 by the model), ``status`` (:func:`cuda_status`: measured per kernel, with files, or built only, with
    ptxas's spills, and whether its shared-memory budget was emulated on the H200 by the carveout:
    :data:`CARVEOUT_RESULTS`)."""
    manifest = cuda_decode.read_manifest()
    measured = json.loads(MEASURED_FATBINS.read_text(encoding="utf-8")) if MEASURED_FATBINS.is_file() else {}
    runs = cuda_measurements(root)
    carveout = (root or repo_root()) / CARVEOUT_RESULTS
    emulated = {r["budget_kb"] for r in json.loads(carveout.read_text(encoding="utf-8"))["rows"]
                if r.get("ms_graph") is not None} if carveout.is_file() else set()
    rows = []
    for fam in occupancy.families():
        cap = fam.capability
        code = cuda_decode.fatbin_code_for(cap)
        plan = serving_plan(capability=cap, **SHAPE)
        ctas = " / ".join(str(cuda_decode.modelled_ctas(b, cap)) for b in cuda_decode.KERNELS)
        said = cuda_status(code, [m for m in runs if family_of(m["gpu"]) == fam], manifest, measured)
        if said is not None:
            status = said[0]
        else:
            res = manifest.get("resources", {}).get(code, {})
            spilled = ", ".join(f"{k.removeprefix('kvrepro_decode_')} {r['spill_stores']} / {r['spill_loads']} B"
                                for k, r in sorted(res.items()) if r["spill_stores"] or r["spill_loads"])
            status = "built, not run" + (f" (ptxas spill stores / loads: {spilled})" if spilled else "")
            if fam.smem_per_sm // 1024 in emulated:
                status += (f"; its {fam.smem_per_sm // 1024} KB shared-memory budget emulated on the H200 by the "
                           f"carveout (the H200's sm_90 code, not run on this GPU): split timings below")
        rows.append({"family": fam.family, "capability": f"{cap[0]}.{cap[1]}",
                     "code": ("SASS " if code.startswith("sm_") else "PTX ") + code, "decode": plan.decode,
                     "ctas": ctas, "smem_kb": fam.smem_per_sm // 1024, "status": status})
    return rows


def _kernel_name(plan) -> str:
    return {"cuda": "CUDA", "triton": "Triton"}.get(plan.decode) or "refused: " + "; ".join(plan.refusals)


def model_rows(root: Path | None = None) -> list[dict]:
    """One row per bundled model: its attention geometry, KV bytes per token (bf16 / fp8 / k4v4), the decode kernel
    on an H100 / H200 (compute capability 9.0) under the default rule for the default preset and for k4v4
    (``decode``: "Triton / CUDA"), and the committed capacity runs of it."""
    root = root or repo_root()
    ran = set()
    for path in (root / "results" / "capacity").glob("*.jsonl"):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                ran.add(str(json.loads(line).get("model", "")).split("/")[-1].lower())
    points = {r.get("model") for path in (root / MODELS_RESULTS).glob("models_*.jsonl")
              for r in map(json.loads, filter(str.strip, path.read_text(encoding="utf-8").splitlines()))
              if r.get("status") == "measured"}
    rows = []
    for name in model_names():
        f = model_facts(name)
        decode = {}
        for preset in (DEFAULT_PRESET, "k4v4"):
            plan = serving_plan(head_dim=f.head_dim, num_q_heads=f.num_q_heads, num_kv_heads=f.num_kv_heads,
                                capability=(9, 0), sliding_window=f.sliding_window, mla=f.mla, preset=preset)
            decode[preset] = _kernel_name(plan)
        kv = f.kv_bytes_per_token
        rows.append({"model": name, "head_dim": f.head_dim, "heads": f"{f.num_q_heads} / {f.num_kv_heads} ({f.group})",
                     "layers": f.num_layers, "key_bias": "yes" if f.has_key_bias else "no",
                     "max_positions": f.max_positions, "kv": f"{kv['bf16']:,} / {kv['fp8']:,} / {kv['k4v4']:,}",
                     "decode": " / ".join(decode[p] for p in (DEFAULT_PRESET, "k4v4")),
                     "measured": ", ".join(x for x in ("capacity sweep" if name in ran else "",
                                                       "capacity point" if name in points else "") if x)
                     + " (dummy weights)" if name in ran | points else "not run"})
    return rows


CONTEXT = 131072              # the seed's prompt (tokens)
WORKLOAD_DECODE = 1024        # the seed's decode tokens per user: users fit at prompt + this many
REACH_MODES = ("fp8", "kvrepro:k4v4")
MODELS_RESULTS = "results/reach"   # models_<gpu>.jsonl of scripts/reach_models.py
MODEL_ROW_DONE = ("measured", "weights exceed budget", "fits 0 users")


def workload(name: str) -> dict:
    """``{"max_model_len", "prompt_tokens", "decode_tokens"}`` of a bundled model's capacity point: ``max_model_len =
    min(131072 + 1024, max_position_embeddings)``, a prompt of ``max_model_len - 1024`` tokens, 1,024 decode tokens.
    Raises ValueError for an unknown model."""
    mml = min(CONTEXT + WORKLOAD_DECODE, model_facts(name).max_positions)
    return {"max_model_len": mml, "prompt_tokens": mml - WORKLOAD_DECODE, "decode_tokens": WORKLOAD_DECODE}


def kv_format(mode: str) -> str | None:
    """The ``kvrepro.capacity`` format of a capacity-sweep mode ("fp8" -> "fp8", "kvrepro:k4v4" -> "k4v4"); None for
    vLLM's turboquant modes, which the arithmetic does not model. Raises ValueError for an unknown mode."""
    from kvrepro import sweep

    sweep.check_modes([mode])
    if mode.startswith("kvrepro:"):
        return mode.split(":", 1)[1]
    return {"bf16": "bf16", "fp8": "fp8"}.get(mode)


def arithmetic_users(name: str, mode: str, gpu_memory_gib: float) -> int | None:
    """Users of bundled model ``name`` that fit its :func:`workload` on one GPU of ``gpu_memory_gib`` GiB, by
    ``kvrepro.capacity.users_that_fit`` (vLLM's block arithmetic, the calibrated overhead); 0 where the weights leave
    no KV memory; None for a mode the arithmetic does not model. Raises ValueError for a bad name, mode or memory."""
    from kvrepro import capacity

    fmt = kv_format(mode)
    if fmt is None:
        return None
    w = workload(name)
    try:
        return capacity.users_that_fit(fmt, w["prompt_tokens"], w["decode_tokens"], gpu_memory_gb=gpu_memory_gib,
                                       cfg=capacity.load_model_config(name))["users_fit"]
    except ValueError as e:
        if "no memory left for the KV cache" in str(e):
            return 0
        raise


def model_runs(root: Path | None = None, gpu_memory_gib: float = 80.0) -> dict:
    """The rows of ``results/reach/models_*.jsonl`` (``scripts/reach_models.py``) at ``gpu_memory_gib`` whose status
    is final (measured, weights exceed budget, fits 0 users): ``{(model, mode): row}``, the latest date where several
    files or GPUs have one."""
    root = root or repo_root()
    out: dict = {}
    for path in sorted((root / MODELS_RESULTS).glob("models_*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            r = json.loads(line)
            if r.get("status") not in MODEL_ROW_DONE or r.get("gpu_memory_gib") != gpu_memory_gib:
                continue
            r = dict(r, _file=str(path.relative_to(root)))
            key = (r.get("model"), r.get("mode"))
            if key not in out or str(r.get("date", "")) > str(out[key].get("date", "")):
                out[key] = r
    return out


def measured_memories(root: Path | None = None) -> list[float]:
    """The GPU memories (GiB) at which ``results/reach/models_*.jsonl`` holds final rows, ascending."""
    root = root or repo_root()
    out = set()
    for path in (root / MODELS_RESULTS).glob("models_*.jsonl"):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip() and (r := json.loads(line)).get("status") in MODEL_ROW_DONE:
                out.add(float(r.get("gpu_memory_gib")))
    return sorted(out)


def _ratio(a, b):
    return round(a / b, 2) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def _swept_models(root: Path | None = None) -> set[str]:
    """Bundled model names with rows in ``results/capacity/*.jsonl`` (the capacity sweep)."""
    root = root or repo_root()
    names = set(model_names())
    out = set()
    for path in (root / "results" / "capacity").glob("*.jsonl"):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                n = str(json.loads(line).get("model", "")).split("/")[-1].lower()
                if n in names:
                    out.add(n)
    return out


def sweep_points(root: Path | None = None, gpu_memory_gib: float = 80.0) -> dict:
    """The capacity sweep's points for the per-model table: per bundled model in ``results/capacity/*.jsonl`` and
    mode of :data:`REACH_MODES`, the current run at the seed's workload and ``gpu_memory_gib``
    (``kvrepro.summary.select_current``) at its max clean capacity (``kvrepro.summary.max_clean``); fp8 is the fp8
    of k4v4's own run where that run measured one (``kvrepro.summary.same_run_fp8``).

    Returns:
        ``{(model, mode): row}`` shaped like a ``models_*.jsonl`` row (status "measured", users_fit,
        aggregate_decode_tok_s, decode_tokens, preemptions 0, kvrepro_settings, gpu, date, _file), for the pairs
        whose run has a clean point.
    """
    from kvrepro import summary

    root = root or repo_root()
    df = summary.load_capacity(root / summary.CAPACITY_DIR)
    if df is None:
        return {}
    out = {}
    workload = dict(summary.SEED_WORKLOAD, gpu_memory_gb=float(gpu_memory_gib))
    short = df["model"].map(lambda m: str(m).split("/")[-1].lower())
    for name in set(short) & set(model_names()):
        runs = summary.select_current(df[short == name], modes=list(REACH_MODES), workload=workload)
        own = summary.same_run_fp8(df[short == name], runs[REACH_MODES[1]], workload) \
            if REACH_MODES[1] in runs else None
        if own is not None:                    # k4v4's ratio against the fp8 of its own run, as the results table
            runs[REACH_MODES[0]] = own
        for mode, rows in runs.items():
            point = summary.max_clean(rows)
            if point is None:
                continue
            r = rows[rows["num_users"] == point[0]].iloc[-1].to_dict()
            path = Path(str(r["source_file"]))
            out[(name, mode)] = {"model": name, "mode": mode, "status": "measured", "users_fit": point[0],
                                 "aggregate_decode_tok_s": point[1], "decode_tokens": int(r["decode_tokens"]),
                                 "preemptions": 0, "kvrepro_settings": r.get("kvrepro_settings"),
                                 "gpu": r.get("gpu"), "date": str(r.get("date", "")),
                                 "_file": str(path.relative_to(root)) if path.is_absolute() else str(path),
                                 "_sweep": True}
    return out


def _capacity_lines(root: Path | None = None, gpu_memory_gib: float = 80.0) -> list[str]:
    """The README's per-model capacity table (:func:`model_capacity_table`) with the sentence that says how it was
    measured."""
    t = model_capacity_table(root, gpu_memory_gib)
    runs = model_runs(root, gpu_memory_gib)
    files = sorted({r["_file"] for r in runs.values()})
    decode = sorted({r.get("decode_tokens") for r in runs.values()})
    n = int(t["source"].str.contains("measured,").sum())
    others = ("" if n == len(t) else "; the others: users by the capacity arithmetic (`kvrepro.capacity`), not "
              "measured, no tok/s")

    out = [f"**Capacity per model** at {gpu_memory_gib:g} GiB (vLLM 0.20.2, dummy weights), fp8 vs kvrepro k4v4: users "
           f"that fit {CONTEXT:,} + {WORKLOAD_DECODE:,} tokens each (or, where the model's window is shorter, the "
           f"window in all) and their aggregate decode tok/s at full context. {n} of {len(t)} models measured "
           f"({', '.join(f'[{Path(f).name}]({f})' for f in files) or 'no file yet'}), timing "
           f"{' / '.join(f'{d:,}' for d in decode) or 'no'} decode tokens per user where the seed's protocol decodes "
           f"{WORKLOAD_DECODE:,} (a model of the capacity sweep: its max clean capacity, from the results table)"
           f"{others}. Where vLLM's KV cache held another number of users than the capacity arithmetic "
           f"(`kvrepro.capacity`, its non-KV memory calibrated on Qwen3-4B) expected, the source cell gives the "
           f"arithmetic's fp8 / k4v4. The k4v4 key offset is the one its run stored keys with: rope-mean (the default now) adds a "
           f"correction to every decode step ([decode_rope_mean.json](benchmarks/results/decode_rope_mean.json) times "
           f"it), so k4v4 tok/s of rows with different offsets are not like for like. Notebook 02 shows the same "
           f"table (`kvrepro.reach.model_capacity_table`).", "",
           "| model | tokens per user | users fp8 / k4v4 | users k4v4 / fp8 | decode tok/s fp8 / k4v4 | "
           "tok/s k4v4 / fp8 | k4v4 key offset | source |", "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in t.to_dict("records"):
        measured = "measured," in r["source"]
        c = model_capacity_cells(r)
        src = f"measured, {r['decode_tokens']:,} decode tokens" if measured else "arithmetic, not measured"
        if "capacity sweep's max clean" in r["source"]:
            src = f"capacity sweep's max clean capacity, {r['decode_tokens']:,} decode tokens: results table above"
        elif "capacity sweep" in r["source"]:
            src += "; capacity sweep: results table above"
        if c["users by arithmetic, fp8 / k4v4"]:
            src += "; arithmetic: " + c["users by arithmetic, fp8 / k4v4"]
        out.append(f"| `{r['model']}` | {c['tokens per user']} | {c['users, fp8 / k4v4']} | {c['users, k4v4 / fp8']} | "
                   f"{c['decode tok/s, fp8 / k4v4']} | {c['tok/s, k4v4 / fp8']} | {c['k4v4 key offset']} | {src} |")
    return out


def model_capacity_cells(r: dict) -> dict:
    """One row of :func:`model_capacity_table` as the text cells both renderings share (the README's reach block,
    notebook 02's :func:`model_capacity_view`): each fp8 / k4v4 pair in one cell, blank where missing; tok/s only
    where the model was measured; ``users by arithmetic``: ``kvrepro.capacity``'s fp8 / k4v4 where it disagrees
    with what vLLM's KV cache held for either (blank where both agree)."""
    measured = "measured," in r["source"]
    arith = {c: formatted(r[f"users_{c}_arithmetic"], "{:,}") for c in ("fp8", "k4v4")}
    return {"tokens per user": f"{r['tokens_per_user']:,}",
            "users, fp8 / k4v4": f"{formatted(r['users_fp8'], '{:,}')} / {formatted(r['users_k4v4'], '{:,}')}",
            "users, k4v4 / fp8": formatted(r["users_ratio"], "{:.2f}"),
            "decode tok/s, fp8 / k4v4": (f"{formatted(r['tok_s_fp8'], '{:,.0f}')} / "
                                         f"{formatted(r['tok_s_k4v4'], '{:,.0f}')}") if measured else "",
            "tok/s, k4v4 / fp8": formatted(r["tok_s_ratio"], "{:.2f}"),
            "k4v4 key offset": formatted(r["key_offset"]),
            "users by arithmetic, fp8 / k4v4": " / ".join(arith[c] or formatted(r[f"users_{c}"], "{:,}") for c in arith)
            if any(arith.values()) else ""}


def model_capacity_view(t):
    """Notebook 02's rendering of :func:`model_capacity_table` ``t``, narrow enough for a 1400 px window: the
    :func:`model_capacity_cells` of each row between the model, the decode tokens the measured tok/s was timed over,
    and the full ``source`` (GPU, date and file per mode). Every figure of ``t`` is in it (as text)."""
    import numbers

    import pandas as pd

    rows = []
    for r in t.to_dict("records"):
        c = model_capacity_cells(r)
        rows.append({"model": r["model"], "tokens per user": c.pop("tokens per user"),
                     "decode tokens timed": formatted(r["decode_tokens"], "{:,}" if isinstance(r["decode_tokens"],
                                                                                         numbers.Integral) else "{}"),
                     **c,
                     "source": r["source"]})
    return pd.DataFrame(rows, columns=["model", "tokens per user", "decode tokens timed", "users, fp8 / k4v4",
                                       "users, k4v4 / fp8", "decode tok/s, fp8 / k4v4", "tok/s, k4v4 / fp8",
                                       "k4v4 key offset", "users by arithmetic, fp8 / k4v4", "source"])


def model_capacity_styled(t):
    """:func:`model_capacity_view` for ``display``: no index, figures right-aligned, the model on one line, the
    source wrapped in a column of at most 420 px."""
    v = model_capacity_view(t)
    text = ["model", "k4v4 key offset", "source"]
    return (v.style.hide(axis="index")
            .set_properties(subset=[c for c in v.columns if c not in text], **{"text-align": "right"})
            .set_properties(subset=text, **{"text-align": "left"})
            .set_properties(subset=["model"], **{"white-space": "nowrap"})
            .set_properties(subset=["source"], **{"white-space": "normal", "min-width": "240px", "max-width": "420px"}))


def model_capacity_caption(t, gpu_memory_gib: float) -> str:
    """The line above notebook 02's per-model table ``t`` (:func:`model_capacity_table` at ``gpu_memory_gib``): how
    many models were measured, the decode tokens their tok/s was timed over, and what the pair columns mean."""
    measured = t["source"].str.contains("measured,")
    timed = sorted({int(n) for x in t.loc[measured, "decode_tokens"].dropna() for n in str(x).split(" / ")})
    how = (f"; tok/s timed over {', '.join(map(str, timed))} decode tokens per user (users are fitted for "
           f"{WORKLOAD_DECODE:,}, the seed protocol's decode)" if timed else "")
    others = "" if measured.all() else "; the others: arithmetic, not measured"
    return (f"**{gpu_memory_gib:g} GiB**: {int(measured.sum())} of {len(t)} models with a measured point{how}{others}. "
            "Each pair is fp8 / k4v4, each ratio k4v4 / fp8; tok/s: aggregate decode tok/s; users by arithmetic: "
            "kvrepro.capacity's count where vLLM fit another number of users (blank where they agree).")


def model_capacity_table(root: Path | None = None, gpu_memory_gib: float = 80.0):
    """Notebook 02's model table: one row per bundled model, its capacity point (:func:`workload`: 128K + 1,024
    tokens per user, or the model's window) on one GPU of ``gpu_memory_gib`` GiB for fp8 and kvrepro k4v4.

    Measured where ``results/reach/models_*.jsonl`` holds the model and mode at that memory (users = what vLLM's
    allocated KV cache fits, tok/s = the aggregate decode rate of that many users at full context); otherwise users
    by ``kvrepro.capacity`` arithmetic and no tok/s, labelled "not measured".

    The measured rows time ``decode_tokens`` tokens per user (``scripts/reach_models.py --decode-tokens``; 128 in the
    committed H200 file), fewer than the 1,024 the users are fitted for and the seed's protocol decodes: tok/s is the
    rate over that window, at full context.

    Returns:
        pandas DataFrame with columns model, tokens_per_user, decode_tokens (decode tokens per user in the timed
        window of the measured rows; None where neither mode was measured), users_fp8, users_k4v4, users_ratio (k4v4
        / fp8), tok_s_fp8, tok_s_k4v4, tok_s_ratio (k4v4 / fp8; None where either is missing), key_offset (the key
        offset the measured k4v4 run stored keys with, from its ``kvrepro_settings``: its decode cost differs, e.g.
        rope-mean's correction; None where k4v4 was not measured), users_fp8_arithmetic / users_k4v4_arithmetic
        (``kvrepro.capacity``'s count recorded with a measured row where vLLM's KV cache held another number of
        users; None where they agree or the mode was not measured), source (per mode:
        "measured, <GPU>, <date> (<file>)" with any preemptions, failed smoke or status, or "not measured (arithmetic,
        kvrepro.capacity)", said once for both modes where it is the same, "fp8, k4v4: ..."; models of the capacity
        sweep say so).

    Raises:
        ValueError: ``gpu_memory_gib`` not a number > 0.
    """
    import pandas as pd

    if isinstance(gpu_memory_gib, bool) or not isinstance(gpu_memory_gib, (int, float)) or not gpu_memory_gib > 0:
        raise ValueError(f"gpu_memory_gib must be a number of GiB > 0, got {gpu_memory_gib!r}")
    runs = {**sweep_points(root, gpu_memory_gib), **model_runs(root, gpu_memory_gib)}
    swept = _swept_models(root)
    rows = []
    for name in model_names():
        rec = {"model": name, "tokens_per_user": workload(name)["max_model_len"], "key_offset": None,
               "users_fp8_arithmetic": None, "users_k4v4_arithmetic": None}
        timed = {r.get("decode_tokens") for m in REACH_MODES if (r := runs.get((name, m))) is not None}
        rec["decode_tokens"] = (timed.pop() if len(timed) == 1 else " / ".join(map(str, sorted(timed)))) \
            if timed else None
        srcs = {}                                                       # per mode: where its figures come from
        for mode in REACH_MODES:
            col = kv_format(mode)
            r = runs.get((name, mode))
            if r is None:
                rec[f"users_{col}"], rec[f"tok_s_{col}"] = arithmetic_users(name, mode, gpu_memory_gib), None
                srcs[col] = "not measured (arithmetic, kvrepro.capacity)"
                continue
            if col != "fp8":
                rec["key_offset"] = (r.get("kvrepro_settings") or {}).get("key_offset")
            rec[f"users_{col}"] = int(r.get("users_fit") or 0)
            tok = r.get("aggregate_decode_tok_s")
            rec[f"tok_s_{col}"] = round(tok, 1) if isinstance(tok, (int, float)) else None
            notes = []
            if r["status"] != "measured":
                notes.append(r["status"])
            if r.get("preemptions"):
                notes.append(f"{r['preemptions']} preemptions")
            if r.get("smoke") and not r["smoke"].get("ok"):
                notes.append("smoke generation failed")
            arith = r.get("users_fit_arithmetic")
            rec[f"users_{col}_arithmetic"] = arith if isinstance(arith, int) and arith != rec[f"users_{col}"] else None
            if r.get("users_capped_by_max_num_seqs"):
                notes.append(f"tok/s of {r.get('users_measured')} users (max_num_seqs)")
            gpu = str(r.get("gpu", "?")).replace("NVIDIA ", "")
            srcs[col] = (f"measured, {gpu}, {str(r.get('date', ''))[:10]} ({r['_file']})"
                         + (f": {'; '.join(notes)}" if notes else ""))
        rec["users_ratio"] = _ratio(rec["users_k4v4"], rec["users_fp8"])
        rec["tok_s_ratio"] = _ratio(rec["tok_s_k4v4"], rec["tok_s_fp8"])
        texts = set(srcs.values())
        rec["source"] = ("not measured (arithmetic, kvrepro.capacity)" if all("not measured" in x for x in texts)
                         else f"{', '.join(srcs)}: {texts.pop()}" if len(texts) == 1        # both from one file
                         else "; ".join(f"{c}: {s}" for c, s in srcs.items()))
        if any(runs.get((name, m), {}).get("_sweep") for m in REACH_MODES):
            rec["source"] += "; the capacity sweep's max clean capacity (the README's results table)"
        elif name in swept:
            rec["source"] += ("; measured by the capacity sweep instead (results/capacity, 1,024 decode tokens: the "
                              "README's results table)")
        rows.append(rec)
    cols = ["model", "tokens_per_user", "decode_tokens", "users_fp8", "users_k4v4", "users_ratio", "tok_s_fp8",
            "tok_s_k4v4", "tok_s_ratio", "key_offset", "users_fp8_arithmetic", "users_k4v4_arithmetic", "source"]
    df = pd.DataFrame(rows, columns=cols)
    for c in ("users_fp8_arithmetic", "users_k4v4_arithmetic"):
        df[c] = df[c].astype("Int64")                                     # counts, blank where they agree
    if all(r["decode_tokens"] is None or isinstance(r["decode_tokens"], int) for r in rows):
        df["decode_tokens"] = df["decode_tokens"].astype("Int64")          # 128, not 128.0, beside the missing ones
    return df


CARVEOUT_RESULTS = "results/reach/carveout_splits_h200.json"   # scripts/reach_carveout_splits.py on the H200


def _budget_label(kb) -> str:
    return "H200's own (228 KB)" if kb is None else f"{kb} KB"


def carveout_table(root: Path | None = None, path: str = CARVEOUT_RESULTS) -> list[dict]:
    """The CUDA decode kernel's split-count timings under shared-memory budgets (``scripts/reach_carveout_splits.py``:
    an H200 with each kernel's carveout capping an SM at an A100's 164 KB or an Ada GPU's 100 KB, or uncapped; CUDA
    graph replay, ms per decode step at the file's context), one dict per (budget, preset, batch), in the file's order:

    ``budget_kb`` (None: uncapped), ``budget``, ``preset``, ``batch``, ``ctas_per_sm`` (the driver's occupancy query
    under that budget), ``kv_heads`` (from the rows: CTAs / (batch x splits)), ``rule_splits`` (the current rule,
    ``kvrepro.ops.decode.wave_splits`` of the row's residency x the file's SM count), ``rule_waves``, ``rule_fill``,
    ``rule_ms`` (None and ``flag`` set where that count was not timed), ``best_splits`` / ``best_ms`` (the fastest timed
    count), ``rule_vs_best`` (rule_ms / best_ms), ``one_wave_splits`` / ``one_wave_fill`` / ``one_wave_vs_best`` (the
    earlier one-wave rule, ``floor(slots / pairs)``; the file's ``rule`` rows), ``flag`` ("" or why a figure is
    missing or disagrees with the file).

    Raises:
        FileNotFoundError: no such results file.
        ValueError: a (budget, preset, batch) with no timed row.
    """
    from kvrepro.ops.decode import MIN_TOKENS_PER_SPLIT, wave_splits

    root = root or repo_root()
    data = json.loads((root / path).read_text(encoding="utf-8"))
    par = data["provenance"]["parameters"]
    sms, cap = par["sms"], min(max(1, par["ctx"] // MIN_TOKENS_PER_SPLIT), 256)
    groups: dict[tuple, list[dict]] = {}
    for r in data["rows"]:
        groups.setdefault((r["budget_kb"], r["preset"], r["batch"]), []).append(r)
    out = []
    for (kb, preset, batch), grp in groups.items():
        timed = {r["splits"]: r["ms_graph"] for r in grp if r.get("ms_graph") is not None}
        if not timed:
            raise ValueError(f"{path}: no timed row for budget {kb}, {preset}, batch {batch}")
        ctas = grp[0]["ctas_per_sm"]
        hkv = {r["ctas"] // (batch * r["splits"]) for r in grp}
        if len(hkv) != 1:
            raise ValueError(f"{path}: rows of budget {kb}, {preset}, batch {batch} disagree on KV heads: "
                             f"{sorted(hkv)}")
        pairs, slots = batch * hkv.pop(), ctas * sms

        def fill(s):
            return pairs * s / (-(-pairs * s // slots) * slots)

        rule = wave_splits(pairs, slots, cap)
        one = max(1, min(slots // pairs, cap))
        best = min(timed, key=timed.get)
        flags = []
        if rule not in timed:
            flags.append(f"the rule's {rule} splits were not timed")
        if one not in timed:
            flags.append(f"the one-wave {one} splits were not timed")
        marked = [r["splits"] for r in grp if r.get("rule")]
        if marked != [one]:
            flags.append(f"the file marks {marked} as its rule's count, not the one-wave {one}")
        out.append({"budget_kb": kb, "budget": _budget_label(kb), "preset": preset, "batch": batch,
                    "ctas_per_sm": ctas, "kv_heads": pairs // batch, "rule_splits": rule,
                    "rule_waves": -(-pairs * rule // slots), "rule_fill": fill(rule), "rule_ms": timed.get(rule),
                    "best_splits": best, "best_ms": timed[best],
                    "rule_vs_best": timed[rule] / timed[best] if rule in timed else None,
                    "one_wave_splits": one, "one_wave_fill": fill(one),
                    "one_wave_vs_best": timed[one] / timed[best] if one in timed else None, "flag": "; ".join(flags)})
    return out


def carveout_repeat_spread(root: Path | None = None, path: str = CARVEOUT_RESULTS) -> dict:
    """The table's noise: configurations timed twice (the same preset, batch, split count and resident CTAs per SM
    under two budgets, e.g. k4v4 uncapped and capped at 164 KB, both 4 CTAs per SM): ``{"pairs": n, "max": the largest
    |slower / faster - 1|, "worst": (preset, batch, splits, ms_a, ms_b)}``; ``{"pairs": 0, ...}`` if none repeats."""
    root = root or repo_root()
    rows = json.loads((root / path).read_text(encoding="utf-8"))["rows"]
    seen: dict[tuple, list[float]] = {}
    for r in rows:
        if r.get("ms_graph") is not None:
            seen.setdefault((r["preset"], r["batch"], r["splits"], r["ctas_per_sm"]), []).append(r["ms_graph"])
    spread, worst, n = 0.0, None, 0
    for k, ms in seen.items():
        if len(ms) > 1:
            n += 1
            d = max(ms) / min(ms) - 1
            if d > spread:
                spread, worst = d, (*k[:3], min(ms), max(ms))
    return {"pairs": n, "max": spread, "worst": worst}


def carveout_markdown(rows: list[dict]) -> list[str]:
    """Markdown table lines of :func:`carveout_table` rows."""
    out = ["| shared memory per SM | preset | batch | resident CTAs per SM | rule: splits (waves, fill) | rule ms | "
           "fastest: splits, ms | rule / fastest | one wave: splits (fill), / fastest |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        rule_ms = "not timed" if r["rule_ms"] is None else f"{r['rule_ms']:.3f}"
        vs = "n/a" if r["rule_vs_best"] is None else f"{r['rule_vs_best']:.2f}"
        one = "n/a" if r["one_wave_vs_best"] is None else f"{r['one_wave_vs_best']:.2f}"
        out.append(f"| {r['budget']} | {r['preset']} | {r['batch']} | {r['ctas_per_sm']} | {r['rule_splits']} "
                   f"({r['rule_waves']}, {r['rule_fill']:.2f}) | {rule_ms} | {r['best_splits']}, {r['best_ms']:.3f} | "
                   f"{vs} | {r['one_wave_splits']} ({r['one_wave_fill']:.2f}), {one} |")
    return out


def _span(xs) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "n/a"
    lo, hi = f"{min(xs):.2f}", f"{max(xs):.2f}"
    return f"{lo}x" if lo == hi else f"{lo}-{hi}x"


def _carveout_lines(root: Path | None = None) -> list[str]:
    """The README's split-rule paragraph (from :func:`carveout_table`) and the rows where the rule's count is not the
    one-wave count."""
    rows = carveout_table(root)
    noise = carveout_repeat_spread(root)
    full = [r for r in rows if r["one_wave_fill"] >= 0.95]
    flagged = [r for r in rows if r["flag"]]
    by_fill: dict[str, list[dict]] = {}
    for r in rows:
        if r["one_wave_fill"] < 0.95:
            by_fill.setdefault(f"{r['one_wave_fill']:.2f}", []).append(r)
    part = "; ".join(f"fill {f} ({len(rs)} cells): one wave {_span(r['one_wave_vs_best'] for r in rs)} the fastest, "
                     f"the rule's {'/'.join(str(w) for w in sorted({r['rule_waves'] for r in rs}))}-wave count "
                     f"{_span(r['rule_vs_best'] for r in rs)}" for f, rs in sorted(by_fill.items()))
    out = [f"**Split rule under other GPUs' shared-memory budgets** ([{Path(CARVEOUT_RESULTS).name}]"
           f"({CARVEOUT_RESULTS}), `scripts/reach_carveout_splits.py`; the full table: `python -m kvrepro.reach "
           f"--carveout`): the A100's (164 KB) and Ada's (100 KB) budgets were emulated on the H200 by capping each "
           f"kernel's shared-memory carveout, so the residency is theirs but the SMs, clocks and memory are the H200's "
           f"(not run on those GPUs). The CUDA rule launches the fewest whole waves (1-3) of the resident CTAs whose "
           f"split count fills >= 95% of their slots (`kvrepro.ops.decode.wave_splits`). Where one wave fills them "
           f"({len(full)} of {len(rows)} budget / preset / batch cells) that is the one-wave count, "
           f"{_span(r['rule_vs_best'] for r in full)} the fastest count timed; where it does not: {part}. The same "
           f"configuration timed under two budgets (same resident CTAs; {noise['pairs']} repeats) differs by up to "
           f"{noise['max']:.0%}: differences below that are noise."
           + (f" Flagged: {len(flagged)} cells ({'; '.join(r['flag'] for r in flagged)})." if flagged else
              " Every count the rule picks there was timed."), "",
           "The cells where the rule's count is not one wave (ms per decode step, CUDA graph, 128K per sequence):", ""]
    return out + carveout_markdown([r for r in rows if r["rule_splits"] != r["one_wave_splits"]])


def block(root: Path | None = None) -> str:
    """The README block, markers included."""
    g = gpu_rows(root)
    m = model_rows(root)
    man = cuda_decode.read_manifest()
    sass = ", ".join(e["code"] for e in man["entries"] if e["code"].startswith("sm_"))
    ptx = ", ".join(e["code"] for e in man["entries"] if e["code"].startswith("compute_"))
    out = [BEGIN, "<!-- generated by `python -m kvrepro.reach --write` from kvrepro/ops/cuda/gpus.json, the fatbin's "
                  "manifest, kvrepro/configs and the committed results: edit those, not this block -->",
           f"The committed fatbin holds SASS for {sass} and PTX {ptx} (`kvrepro/ops/cuda/decode.json`, read back from "
           f"the fatbin). A GPU runs the SASS of its own major version with the highest minor at or below its own, "
           f"else the newest PTX at or below it, compiled by the driver at load; a GPU below compute capability 8.0 "
           f"is refused at engine start, and a driver that cannot load the fatbin gets the Triton kernel with a "
           f"warning (`KVREPRO_DECODE_IMPL=auto`) or a refusal (`=cuda`).", "",
           "| GPU family | compute capability | fatbin code it runs | k4v4 decode kernel (head_dim 128, GQA 4) | "
           "resident CTAs per SM, k4v4 / k8v4 / k4v2 / k5v4 | shared memory per SM | CUDA kernel status |",
           "| --- | --- | --- | --- | --- | ---: | --- |"]
    out += [f"| {r['family']} | {r['capability']} | {r['code']} | {r['decode']} | {r['ctas']} | {r['smem_kb']} KB | "
            f"{r['status']} |" for r in g]
    out += ["", "Resident CTAs: the arithmetic of NVIDIA's occupancy calculator (`kvrepro.ops.occupancy`) from each "
                "kernel's registers and shared memory as ptxas reports them; on a GPU the split rule asks the driver "
                "(`cuOccupancyMaxActiveBlocksPerMultiprocessor`) instead, and plans whole waves of that many CTAs per "
                "SM. The Triton kernels run on any of these GPUs for every preset and shape the engine accepts.", ""]
    if (repo_root() if root is None else root).joinpath(CARVEOUT_RESULTS).is_file():
        out += _carveout_lines(root) + [""]
    out += [

            "| model (bundled config) | head_dim | query / KV heads (GQA group) | layers | key bias | max positions | "
            f"KV bytes per token, bf16 / fp8 / k4v4 | decode kernel on an H100 / H200, {DEFAULT_PRESET} (default) / "
            "k4v4 | measured |",
            "| --- | ---: | --- | ---: | --- | ---: | ---: | --- | --- |"]
    out += [f"| `{r['model']}` | {r['head_dim']} | {r['heads']} | {r['layers']} | {r['key_bias']} | "
            f"{r['max_positions']:,} | {r['kv']} | {r['decode']} | {r['measured']} |" for r in m]
    out += [""] + _capacity_lines(root)
    out += ["", "Engine start: head_dim 64 and 128 with GQA groups of 1..32 are served (the CUDA decode kernel for "
                f"every preset at head_dim 128, block 16 and groups of 1..8, the default preset {DEFAULT_PRESET} "
                "included; Triton otherwise); any other "
                "head_dim (256 included), a sliding window, MLA or a GPU below compute capability 8.0 is refused with "
                "the reason (`kvrepro.vllm_backend.config.serving_plan`). Run a bundled model with random weights: "
                "`vllm serve kvrepro/configs/<model> --load-format dummy --skip-tokenizer-init --attention-backend "
                "CUSTOM` (capacity and speed only).", END]
    return "\n".join(out)


def replace_block(text: str, new: str) -> str:
    """``text`` with its one reach block replaced by ``new``. Raises ValueError unless the markers appear once each,
    in order."""
    a, b = text.count(BEGIN), text.count(END)
    if a != 1 or b != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"{README}: expected one '{BEGIN}' line followed by one '{END}' line (found {a} and {b})")
    return text[:text.index(BEGIN)] + new + text[text.index(END) + len(END):]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvrepro.reach", description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--write", action="store_true", help=f"rewrite {README}'s reach block")
    g.add_argument("--check", action="store_true", help=f"exit 1 if {README}'s reach block differs")
    g.add_argument("--carveout", action="store_true", help=f"print the full split-count table of {CARVEOUT_RESULTS}")
    a = ap.parse_args(argv)
    if a.carveout:
        print("\n".join(carveout_markdown(carveout_table())))
        return 0
    new = block()
    if not (a.write or a.check):
        print(new)
        return 0
    path = repo_root() / README
    text = path.read_text(encoding="utf-8")
    try:
        updated = replace_block(text, new)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if a.check:
        if updated != text:
            import difflib

            sys.stdout.write("".join(difflib.unified_diff(text.splitlines(True), updated.splitlines(True),
                                                          f"{README} (committed)", f"{README} (from the results)")))
            print(f"{README}'s reach block differs: run python -m kvrepro.reach --write", file=sys.stderr)
            return 1
        print(f"{README} reach block matches the results")
        return 0
    if updated != text:
        from kvrepro.fileio import atomic_write_text

        atomic_write_text(path, updated)
    print(f"wrote {README} (reach block)")
    return 0


if __name__ == "__main__":
    from kvrepro import cli

    raise SystemExit(cli.run(main))
