"""Where a decode step's time goes inside vLLM: kernel classes from a PyTorch profiler trace, per engine step, against
the bandwidth bound (issue 23). CPU only: ``scripts/step_profile.py`` captures the trace on the GPU and calls this.

A trace is the Chrome-trace JSON that vLLM 0.20.2's torch profiler writes (``profiler_config={"profiler": "torch",
"torch_profiler_dir": ...}``, then ``LLM.start_profile`` / ``LLM.stop_profile``; ``vllm/profiler/wrapper.py``,
``TorchProfilerWrapper`` with ``torch.profiler.tensorboard_trace_handler``, ``*.pt.trace.json.gz``). Three kinds of
events are read:

- the worker's step annotations (``vllm/v1/worker/gpu_worker.py``, ``annotate_profile``): a CPU range (category
  ``user_annotation``) named ``execute_context_<C>(<c tokens>)_generation_<G>(<g tokens>)`` opened once per engine
  step;
- the host launches (category ``cuda_runtime`` / ``cuda_driver``: ``cudaLaunchKernel``, ``cudaGraphLaunch``, ...),
  each with a ``correlation`` id;
- the GPU kernels (category ``kernel``), each with the ``correlation`` id of its launch (every kernel of a replayed
  CUDA graph carries the graph launch's id), its start ``ts`` and duration ``dur`` in microseconds.

A kernel belongs to the step whose annotation opened last before its launch (so the sampler's kernels, launched
after the forward's range closed, count for their step). Per step: kernel milliseconds per class
(:func:`classify_kernel`), the GPU span (first kernel start to last kernel end) and the host interval between step
starts. Kernel times are summed; kernels of one step run on one stream in vLLM's decode path, so the sum is the GPU's
busy time and span minus sum is its idle time.

The bound (:func:`decode_bound`) is notes/runs.md's and issue 23's: a decode step reads every weight and every KV byte
of the batch once, at the measured device-to-device copy bandwidth (read + write bytes over time, as
``benchmarks/common.py`` ``copy_bandwidth``).
"""
from __future__ import annotations

import bisect
import collections
import gzip
import json
import math
import os
import re
from pathlib import Path

from kvrepro.listarg import comma_list
from kvrepro.style import formatted

# Kernel classes, in the order they are tried: the first class one of whose patterns occurs in the kernel name (case
# sensitive) wins. FlashAttention 3's kernels are cutlass::device_kernel<flash::...> templates, so attention is tried
# before the GEMM patterns that match "cutlass".
KERNEL_PATTERNS = (
    ("kv_store", (
        "reshape_and_cache",          # vLLM's KV write (FlashAttention, FlashInfer, Triton backends)
        "concat_and_cache",
        "store_kv_kernel",            # kvrepro's compressed store (kvrepro/ops/triton/store.py)
    )),
    ("attention", (
        "kvrepro_decode_",            # kvrepro's CUDA decode kernel (kvrepro/ops/cuda/decode.cu)
        "paged_attn_kernel",          # kvrepro's Triton decode kernel (kvrepro/ops/triton/attention.py)
        "rotate_query_kernel",        # kvrepro's query rotation / split merge (kvrepro/ops/triton/rotate.py)
        "merge_splits_kernel",
        "dequant_pages_kernel",       # kvrepro's prefill context dequantization
        "flash::", "FlashAttn", "flash_fwd", "flash_attn",                 # FlashAttention 2 / 3 (vllm_flash_attn)
        "kernel_unified_attention", "reduce_segments", "unified_attention",  # vLLM's TRITON_ATTN
        "BatchDecodeWithPagedKVCache", "BatchPrefillWithPagedKVCache", "BatchPrefillWithRaggedKVCache",
        "MergeStates", "flashinfer",                                        # FlashInfer
    )),
    ("gemm", (
        "gemm", "Gemm", "GEMM", "gemv", "Gemv", "cutlass", "cublas", "xmma", "nvjet", "splitKreduce",
        "triton_tem_fused_mm", "triton_tem_fused_addmm",                   # inductor's matmul templates
    )),
)
KERNEL_CLASSES = tuple(c for c, _ in KERNEL_PATTERNS) + ("other",)
# The three headline parts of a step: attention, GEMMs and the rest (KV store and everything else).
PARTS = {"attention": ("attention",), "gemm": ("gemm",), "rest": ("kv_store", "other")}

STEP_RE = re.compile(r"^execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)$")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
STEP_CAT = "user_annotation"   # Kineto also mirrors each range on the GPU timeline as "gpu_user_annotation"


def classify_kernel(name: str) -> str:
    """The class of a GPU kernel by its name: ``"kv_store"``, ``"attention"``, ``"gemm"`` or ``"other"``
    (:data:`KERNEL_PATTERNS`; first match wins). kvrepro's float32 rotation of stored tokens (``x.float() @ R`` in
    ``kvrepro.ops.store``) is a PyTorch matmul and counts as a GEMM.

    Raises:
        ValueError: ``name`` is not a non-empty string.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty kernel name, got {name!r}")
    for cls, pats in KERNEL_PATTERNS:
        if any(p in name for p in pats):
            return cls
    return "other"


def load_trace(path: str | os.PathLike) -> list[dict]:
    """The ``traceEvents`` of a Chrome-trace file (``.json`` or gzip ``.json.gz``).

    Raises:
        ValueError: the file is not a JSON object with a ``traceEvents`` list (naming the file).
    """
    p = Path(path)
    opener = gzip.open if p.name.endswith(".gz") else open
    with opener(p, "rt", encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}: not a JSON trace ({e})") from None
    events = data.get("traceEvents") if isinstance(data, dict) else None
    if not isinstance(events, list):
        raise ValueError(f"{p}: no traceEvents list (a torch profiler Chrome trace has one)")
    return events


def parse_step_name(name: str) -> dict | None:
    """``execute_context_0(0)_generation_13(13)`` -> ``{"context_requests": 0, "context_tokens": 0,
    "generation_requests": 13, "generation_tokens": 13}``; None for any other name."""
    m = STEP_RE.match(name or "")
    if not m:
        return None
    c, ct, g, gt = map(int, m.groups())
    return {"context_requests": c, "context_tokens": ct, "generation_requests": g, "generation_tokens": gt}


def _corr(ev: dict):
    args = ev.get("args") or {}
    return args.get("correlation", args.get("correlation id"))


def step_breakdown(events: list[dict], users: int | None = None, top: int = 8) -> dict:
    """Per engine step of a trace: kernel time per class, GPU span and host interval; the mean over the pure decode
    steps with ``users`` sequences; the top kernels.

    Args:
        events: Chrome-trace events (:func:`load_trace`).
        users: the decode batch to average over (steps with no context request and this many generation requests);
            None = every pure decode step.
        top: how many kernels to list per class (by time per step).

    Returns:
        dict with ``steps`` (per step in trace order: index, the parsed annotation, decode (bool), kernels (count),
        ms per class of :data:`KERNEL_CLASSES`, kernel_ms (sum), gpu_span_ms, host_ms (to the next step's start;
        None for the last)), ``decode_steps`` (how many were averaged), ``mean`` (over them: ms per class, ms and %
        of kernel time per part of :data:`PARTS`, kernel_ms, gpu_span_ms, gpu_idle_ms, host_ms over the steps that
        have one), ``top_kernels`` ({class: [{name, ms_per_step, count_per_step, grid, block}]}, over the averaged
        steps; grid and block of the kernel's first launch among them, as Kineto records them) and
        ``unassigned_kernels`` (kernels launched before the first step or without a known launch).

    Raises:
        ValueError: no step annotation in the trace, or none of the averaged kind (naming what was found).
    """
    steps = sorted((ev["ts"], ev["name"]) for ev in events      # the CPU ranges, not their GPU-timeline copies
                   if ev.get("ph") == "X" and ev.get("cat") == STEP_CAT and parse_step_name(ev.get("name", "")))
    if not steps:
        raise ValueError("no vLLM step annotation (execute_context_*_generation_*) in the trace: was it captured with "
                         "vLLM's torch profiler around engine steps?")
    starts = [t for t, _ in steps]
    launch_ts = {}
    for ev in events:
        if ev.get("ph") == "X" and ev.get("cat") in LAUNCH_CATS and _corr(ev) is not None:
            launch_ts[_corr(ev)] = ev["ts"]
    per = [dict(index=i, **parse_step_name(n), kernels=0, **{c: 0.0 for c in KERNEL_CLASSES}, _t0=math.inf,
                _t1=-math.inf) for i, (_, n) in enumerate(steps)]
    names: dict[int, collections.Counter] = {i: collections.Counter() for i in range(len(steps))}
    counts: dict[int, collections.Counter] = {i: collections.Counter() for i in range(len(steps))}
    shapes: dict[tuple, tuple] = {}   # (step, kernel name) -> (grid, block) of its first launch in that step
    unassigned = 0
    for ev in events:
        if ev.get("ph") != "X" or ev.get("cat") != "kernel":
            continue
        t = launch_ts.get(_corr(ev))
        i = bisect.bisect_right(starts, t) - 1 if t is not None else -1
        if i < 0:
            unassigned += 1
            continue
        s, dur = per[i], float(ev.get("dur", 0.0))
        cls = classify_kernel(ev.get("name") or "?")
        s[cls] += dur / 1e3
        s["kernels"] += 1
        s["_t0"], s["_t1"] = min(s["_t0"], ev["ts"]), max(s["_t1"], ev["ts"] + dur)
        names[i][ev["name"]] += dur / 1e3
        counts[i][ev["name"]] += 1
        args = ev.get("args") or {}
        shapes.setdefault((i, ev["name"]), (args.get("grid"), args.get("block")))
    for i, s in enumerate(per):
        s["decode"] = s["context_requests"] == 0 and s["generation_requests"] > 0
        s["kernel_ms"] = sum(s[c] for c in KERNEL_CLASSES)
        s["gpu_span_ms"] = (s["_t1"] - s["_t0"]) / 1e3 if s["kernels"] else 0.0
        s["host_ms"] = (starts[i + 1] - starts[i]) / 1e3 if i + 1 < len(starts) else None
        del s["_t0"], s["_t1"]
    chosen = [s for s in per if s["decode"] and s["kernels"] and (users is None or s["generation_requests"] == users)]
    if not chosen:
        seen = sorted({(s["context_requests"], s["generation_requests"]) for s in per})
        raise ValueError(f"no pure decode step with users={users} in the trace; steps seen (context requests, "
                         f"generation requests): {seen}")
    n = len(chosen)
    mean = {c: sum(s[c] for s in chosen) / n for c in KERNEL_CLASSES}
    mean["kernel_ms"] = sum(s["kernel_ms"] for s in chosen) / n
    for part, classes in PARTS.items():
        ms = sum(mean[c] for c in classes)
        mean[f"{part}_ms"] = ms
        mean[f"{part}_pct"] = 100.0 * ms / mean["kernel_ms"] if mean["kernel_ms"] else 0.0
    mean["gpu_span_ms"] = sum(s["gpu_span_ms"] for s in chosen) / n
    mean["gpu_idle_ms"] = mean["gpu_span_ms"] - mean["kernel_ms"]
    hosts = [s["host_ms"] for s in chosen if s["host_ms"] is not None]
    mean["host_ms"] = sum(hosts) / len(hosts) if hosts else None
    total_ms, total_n = collections.Counter(), collections.Counter()
    for s in chosen:
        total_ms.update(names[s["index"]])
        total_n.update(counts[s["index"]])
    top_kernels: dict[str, list] = {c: [] for c in KERNEL_CLASSES}
    for name, ms in total_ms.most_common():
        lst = top_kernels[classify_kernel(name)]
        if len(lst) < top:
            grid, block = next((shapes[(s["index"], name)] for s in chosen if (s["index"], name) in shapes),
                               (None, None))
            lst.append({"name": name[:2000], "ms_per_step": ms / n, "count_per_step": total_n[name] / n,
                        "grid": grid, "block": block})
    return {"steps": per, "decode_steps": n, "users": users, "mean": mean, "top_kernels": top_kernels,
            "unassigned_kernels": unassigned}


def decode_bound(users: int, context_tokens: float, kv_bytes_per_token: int, weights_bytes: int,
                 copy_gbps: float) -> dict:
    """The bandwidth bound of one decode step: every weight byte and every KV byte of ``users`` sequences of
    ``context_tokens`` tokens read once at ``copy_gbps`` (device-to-device copy, read + write GB/s, 1 GB = 1e9 B).

    Returns:
        dict: users, context_tokens, kv_bytes (users x context_tokens x kv_bytes_per_token), weights_bytes,
        bytes (their sum), copy_gbps, step_ms (bytes / bandwidth), tok_s (users / step time).

    Raises:
        ValueError: a non-positive argument, naming it.
    """
    for name, v in (("users", users), ("context_tokens", context_tokens), ("kv_bytes_per_token", kv_bytes_per_token),
                    ("weights_bytes", weights_bytes), ("copy_gbps", copy_gbps)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{name} must be a number > 0, got {v!r}")
    kv = users * context_tokens * kv_bytes_per_token
    total = kv + weights_bytes
    step_s = total / (copy_gbps * 1e9)
    return {"users": users, "context_tokens": context_tokens, "kv_bytes": kv, "weights_bytes": weights_bytes,
            "bytes": total, "copy_gbps": copy_gbps, "step_ms": step_s * 1e3, "tok_s": users / step_s}


def parse_users(text) -> tuple[int, ...]:
    """``"13"`` or ``"6,4"`` -> (13,) / (6, 4): decode batches to profile, largest first (one engine prefills the
    largest and aborts requests down to the next).

    Raises:
        ValueError: empty or with an empty item, not integers >= 1, or repeated (naming ``users``).
    """
    parts = comma_list(str(text), "users")
    try:
        vals = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"users must be comma-separated integers >= 1 (e.g. 13 or 6,4), got {text!r}") from None
    if not vals or min(vals) < 1:
        raise ValueError(f"users must be comma-separated integers >= 1 (e.g. 13 or 6,4), got {text!r}")
    if len(set(vals)) != len(vals):
        raise ValueError(f"users: {text!r} names a batch more than once")
    return tuple(sorted(vals, reverse=True))


def report_lines(result: dict) -> list[str]:
    """One line per profiled batch of ``scripts/step_profile.py``'s result: users, the timed step (host ms, tok/s),
    the profiled GPU span, the three parts in ms and % of kernel time, the bound and the share of it reached by the
    timed step."""
    out = []
    for b in result.get("batches", []):
        line = f"{result['mode']} {b['users']} users:"
        timed = b.get("timed")
        if timed:
            line += f" timed step {timed['step_ms']:.2f} ms ({timed['tok_s']:.1f} tok/s);"
        if "breakdown" not in b:
            out.append(f"{line} not profiled: {b.get('error', '?')}")
            continue
        m = b["breakdown"]["mean"]
        line += (f" profiled GPU span {m['gpu_span_ms']:.2f} ms: attention {m['attention_ms']:.2f} ms "
                 f"({m['attention_pct']:.0f}%), GEMMs {m['gemm_ms']:.2f} ms ({m['gemm_pct']:.0f}%), rest "
                 f"{m['rest_ms']:.2f} ms ({m['rest_pct']:.0f}%), GPU idle {m['gpu_idle_ms']:.2f} ms")
        bound = b.get("bound")
        if bound:
            line += f"; bound {bound['step_ms']:.2f} ms ({bound['tok_s']:.0f} tok/s)"
            if timed:
                line += f", reached {100 * bound['step_ms'] / timed['step_ms']:.1f}%"
        out.append(line)
    return out


PROFILE_DIR = "results/profile"


def _read_json(path: Path, what: str):
    """The JSON in ``path``; ValueError naming the file and ``what`` it should be when it is not JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not {what} (not JSON: {e})") from None


def profile_table(paths):
    """One row per profiled batch of ``scripts/step_profile.py`` result files (``results/profile/*.json``).

    Columns: file (name), date (UTC, to the minute), src (the kvrepro source hash the file records, its
    ``provenance.kvrepro_src_sha256``; None if absent), mode, backend (the attention backend vLLM resolved),
    fa_max_splits (the FlashAttention split cap the engine ran with, ``step_profile.py --fa-max-splits``; None:
    vLLM's default), key_offset
    (a kvrepro engine's, from its logged settings; None for fp8 / bf16), users, step_ms and tok_s (the timed steps,
    without the profiler), attention_ms / gemm_ms / rest_ms / idle_ms (per profiled step: kernel classes and GPU
    idle, :func:`step_breakdown`), attention_bw (the batch's KV bytes over the attention time, as a fraction of the
    copy bandwidth), gemm_bw (the weights over the GEMM time, likewise), bound_ms (:func:`decode_bound`),
    of_bound (bound_ms / step_ms), ceiling (bound_ms over the step a batch would take with its GEMMs as measured,
    attention reading the KV at the copy bandwidth and nothing else running: it leaves out the rest and the idle
    time, so it overstates what a faster attention alone could reach), copy_gbps (the profile's copy bandwidth), gpu
    (the profile's GPU name), kvrepro_rest_ms (kvrepro's own kernels among the rest: :data:`KVREPRO_REST_KERNELS` in
    the profile's ``top_kernels``, a top list per class, so a kvrepro kernel below it counts as vLLM's, as do
    kvrepro's PyTorch ops in older profiles; None without ``top_kernels``), goal_attention_gbps (the rate in GB/s at
    which the attention would have to read the batch's KV bytes for the step to take bound_ms / :data:`E2E_GOAL`, the
    GEMMs, the rest and the GPU's idle time as measured; inf when those alone take that long or longer),
    goal_attention_bw (that over copy_gbps) and goal_attention_gbps_free (the same with kvrepro's own rest kernels
    taken as free, everything else, the idle time too, as measured). A goal figure is None when one of its inputs is
    missing or not finite. Batches that were not profiled keep their timed figures and blank breakdowns.

    Raises:
        ValueError: a file that is not a step-profile result (no ``batches`` list), naming it.
    """
    import pandas as pd

    rows = []
    for path in paths:
        path = Path(path)
        r = _read_json(path, "a step-profile result")
        if not isinstance(r, dict) or not isinstance(r.get("batches"), list):
            raise ValueError(f"{path}: not a step-profile result (no 'batches' list)")
        eng = r.get("engine") or {}
        backend = ", ".join(eng.get("attention_backend_resolved") or []) or eng.get("attention_backend")
        for b in r["batches"]:
            timed, bound = b.get("timed") or {}, b.get("bound") or {}
            m = (b.get("breakdown") or {}).get("mean") or {}
            gbps = bound.get("copy_gbps")

            def bw(nbytes, ms):
                return nbytes / (ms * 1e-3) / (gbps * 1e9) if nbytes and ms and gbps else None

            top = (b.get("breakdown") or {}).get("top_kernels")
            own = (sum(k.get("ms_per_step", 0.0) for c in PARTS["rest"] for k in top.get(c) or []
                       if any(n in str(k.get("name")) for n in KVREPRO_REST_KERNELS))
                   if isinstance(top, dict) and m else None)
            goal = _goal_gbps(bound.get("kv_bytes"), bound.get("step_ms"),
                              [m.get("gemm_ms"), m.get("rest_ms"), m.get("gpu_idle_ms")])
            goal_free = (_goal_gbps(bound.get("kv_bytes"), bound.get("step_ms"),
                                    [m.get("gemm_ms"), m.get("rest_ms"), m.get("gpu_idle_ms"), -own])
                         if own is not None else None)

            rows.append({"file": path.name, "date": str(r.get("date", ""))[:16].replace("T", " "),
                         "mode": r.get("mode"), "backend": backend,
                         "fa_max_splits": (r.get("params") or {}).get("fa_max_splits"),
                         "src": (r.get("provenance") or {}).get("kvrepro_src_sha256"),
                         "fatbin": (eng.get("kvrepro_settings") or {}).get("cuda_fatbin_sha256"),
                         "key_offset": (eng.get("kvrepro_settings") or {}).get("key_offset"), "users": b.get("users"),
                         "step_ms": timed.get("step_ms"), "tok_s": timed.get("tok_s"),
                         "attention_ms": m.get("attention_ms"), "gemm_ms": m.get("gemm_ms"),
                         "rest_ms": m.get("rest_ms"), "idle_ms": m.get("gpu_idle_ms"),
                         "attention_bw": bw(bound.get("kv_bytes"), m.get("attention_ms")),
                         "gemm_bw": bw(bound.get("weights_bytes"), m.get("gemm_ms")),
                         "bound_ms": bound.get("step_ms"),
                         "of_bound": bound["step_ms"] / timed["step_ms"] if bound and timed else None,
                         "ceiling": (bound["step_ms"] / (bound["kv_bytes"] / (gbps * 1e9) * 1e3 + m["gemm_ms"])
                                     if bound.get("kv_bytes") and gbps and m.get("gemm_ms") else None),
                         "copy_gbps": gbps, "gpu": (r.get("provenance") or {}).get("gpu"), "kvrepro_rest_ms": own,
                         "goal_attention_gbps": goal,
                         "goal_attention_bw": goal / gbps if goal is not None and _finite(gbps) and gbps > 0 else None,
                         "goal_attention_gbps_free": goal_free})
    return pd.DataFrame(rows, columns=["file", "date", "src", "fatbin", "mode", "backend", "fa_max_splits", "key_offset", "users", "step_ms", "tok_s",
                                       "attention_ms", "gemm_ms", "rest_ms", "idle_ms", "attention_bw", "gemm_bw",
                                       "bound_ms", "of_bound", "ceiling", "copy_gbps", "gpu", "kvrepro_rest_ms",
                                       "goal_attention_gbps", "goal_attention_bw", "goal_attention_gbps_free"])


def _finite(*vals) -> bool:
    """Every value is a real number (not a bool), finite."""
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in vals)


def _goal_gbps(kv_bytes, bound_ms, parts_ms) -> float | None:
    """GB/s at which ``kv_bytes`` must be read for a step of ``bound_ms / E2E_GOAL`` that also holds ``parts_ms``
    (their sum); inf when they fill that step; None when an input is missing or not finite."""
    if not _finite(kv_bytes, bound_ms, *parts_ms) or kv_bytes <= 0 or bound_ms <= 0:
        return None
    left_ms = bound_ms / E2E_GOAL - sum(parts_ms)
    return kv_bytes / (left_ms * 1e-3) / 1e9 if left_ms > 0 else math.inf


def section_markdown(root: str | os.PathLike) -> str:
    """Notebook 02's step-breakdown section: :func:`profile_table` of every ``results/profile/*.json`` under ``root``
    as a markdown table with the files named, or a sentence saying none is committed and which command makes one."""
    paths = sorted(Path(root, PROFILE_DIR).glob("*.json"))
    if not paths:
        return ("Not measured yet: no step profile is committed under `results/profile/` "
                "(`python scripts/step_profile.py --mode MODE --users N` on a GPU machine with vLLM writes one).")
    t = profile_table(paths)
    tags = {f: i + 1 for i, f in enumerate(dict.fromkeys(t["file"]))}
    from kvrepro.ops.cuda_decode import read_manifest
    committed = read_manifest().get("fatbin_sha256", "")

    head = ["mode", "key offset", "users", "step (ms)", "tok/s", "attention (ms)", "attention, % of copy bw",
            "GEMMs (ms)", "GEMMs, % of copy bw", "rest (ms)", "GPU idle (ms)", "bound (ms)", "% of bound", "ceiling",
            f"attention for {100 * E2E_GOAL:.0f}%, % of copy bw", "file"]
    lines = ["| " + " | ".join(head) + " |", "| --- | --- | " + " | ".join(["---:"] * (len(head) - 3)) + " | --- |"]
    for r in t.to_dict("records"):
        lines.append("| " + " | ".join([
            _mode_label(r), formatted(r["key_offset"]), str(r["users"]), formatted(r["step_ms"], "{:.2f}"),
            formatted(r["tok_s"], "{:.0f}"),
            formatted(r["attention_ms"], "{:.2f}"), formatted(r["attention_bw"], "{:.0f}%", 100),
            formatted(r["gemm_ms"], "{:.2f}"), formatted(r["gemm_bw"], "{:.0f}%", 100),
            formatted(r["rest_ms"], "{:.2f}"), formatted(r["idle_ms"], "{:.2f}"), formatted(r["bound_ms"], "{:.2f}"),
            formatted(r["of_bound"], "{:.1f}%", 100), formatted(r["ceiling"], "{:.1f}%", 100),
            _goal_bw(r["goal_attention_bw"]), f"[{tags[r['file']]}]"]) + " |")
    return (f"Replayed from `{PROFILE_DIR}/` ({len(paths)} files). Per decode step (the bundled Qwen3-4B, all 36 "
            "layers): the timed step (without the profiler), then the profiled kernel time by class (attention; GEMMs; the rest: KV store, "
            "norms, activations, sampling, a kvrepro mode's own PyTorch ops) and the GPU's idle time; the bound reads "
            "every weight and KV byte of the batch once at the copy bandwidth measured in the same process "
            "(`kvrepro.profile.decode_bound`).\n\n" + "\n".join(lines) + "\n\n" + _ceiling_text(t) + "\n\n"
            + _goal_text(t, read_bandwidth(root), committed) + "\n\n"
            + "\n".join(f"- [{i}] `{PROFILE_DIR}/{f}` ({t.loc[t['file'] == f, 'date'].iloc[0]} UTC"
                        + formatted(t.loc[t["file"] == f, "src"].iloc[0], "; kvrepro source {:.8}")
                        + _fatbin_note(t.loc[t["file"] == f, "fatbin"].iloc[0], committed) + ")"
                        for f, i in tags.items())
            + ("\n\nRows \"at most N KV splits\" ran FlashAttention 3 with vLLM's split cap for CUDA graphs set "
               "(`scripts/step_profile.py --fa-max-splits`): a test of why FA3 fp8 is slower at 6 users than at 4 "
               "(notes/vllm.md, \"FA3 fp8 at 6 users is slower than at 4\"), not a setting any ratio uses; the ratios "
               "use fp8's best clean point too, which is above every capped step."
               if any(", at most " in _mode_label(r) for r in t.to_dict("records")) else "")
            + "\n\nProfiles of different kvrepro sources measure different code: a kvrepro mode's rest and attention "
            "compare only between files of one source (git log names what changed).")


def _fatbin_note(sha, now: str) -> str:
    """``"; CUDA fatbin <8 hex>"`` for a profile whose kvrepro rows decoded with the CUDA kernels, plus a warning when
    that fatbin is not the committed one, ``now`` (its kernels may since have changed: ``measured_fatbins.json`` has
    what each held); ``""`` for a file without kvrepro rows."""
    if not isinstance(sha, str) or not sha:
        return ""
    return f"; CUDA fatbin {sha:.8}" + ("" if sha == now else f", not the committed {now:.8}: measured_fatbins.json says "
                                                           "which kernels differ")


def _mode_label(r: dict) -> str:
    """A :func:`profile_table` row's mode as the step section names it: vLLM's own modes with the attention backend
    vLLM resolved and any split cap, e.g. ``fp8 (FLASH_ATTN)``, ``fp8 (FLASH_ATTN, at most 2 KV splits)``; kvrepro
    modes as they are."""
    if not r["backend"] or str(r["mode"]).startswith("kvrepro"):
        return r["mode"]
    cap = r.get("fa_max_splits")
    cap = f", at most {int(cap)} KV splits" if cap is not None and not pd_isna(cap) else ""
    return f"{r['mode']} ({r['backend']}{cap})"


def pd_isna(v) -> bool:
    """pandas' isna for one value (a table row's missing fa_max_splits is NaN once the column holds a number)."""
    import pandas as pd

    return bool(pd.isna(v))


def _ceiling_text(t) -> str:
    """The sentence under the step table on its ``ceiling`` column (:func:`profile_table`)."""
    if not t["ceiling"].notna().any():
        return ""
    return ("Ceiling: the share of the bound a step would reach with its GEMMs as measured, the attention reading the "
            "KV at the copy bandwidth, no other kernel and no idle time.")


def _goal_bw(v) -> str:
    """A ``goal_attention_bw`` cell: a percentage, "none" where the other parts alone fill the goal's step time."""
    if v is None or pd_isna(v):
        return ""
    return "none" if math.isinf(v) else f"{100 * v:.0f}%"


def read_bandwidth(root: str | os.PathLike) -> dict | None:
    """The read bandwidth of :data:`STEP_FLOOR` under ``root`` (``benchmarks/step_floor.py``): ``{"gpu", "GBps",
    "of_copy", "op", "ops", "date"}``: the fastest of its reads (``op``, out of ``ops`` timed), in GB/s and over the
    copy bandwidth of the same run; None if the file is not committed.

    Raises:
        ValueError: the file is there but holds no read rows with a finite positive ``GBps_read``, or no finite
            positive copy bandwidth (naming it).
    """
    path = Path(root, STEP_FLOOR)
    if not path.is_file():
        return None
    r = _read_json(path, "a step_floor.py result")
    reads = r.get("read") if isinstance(r, dict) else None
    reads = [x for x in reads if isinstance(x, dict) and _finite(x.get("GBps_read")) and x["GBps_read"] > 0] \
        if isinstance(reads, list) else []
    copy = (r.get("copy_bandwidth") or {}).get("GBps_read_plus_write") if isinstance(r, dict) else None
    if not reads or not _finite(copy) or copy <= 0:
        raise ValueError(f"{path}: no read rows with a positive GBps_read and a copy bandwidth "
                         "(benchmarks/step_floor.py writes both)")
    best = max(reads, key=lambda x: x["GBps_read"])
    prov = r.get("provenance") or {}
    return {"gpu": prov.get("gpu"), "GBps": best["GBps_read"], "of_copy": best["GBps_read"] / copy,
            "op": best.get("op"), "ops": len(reads), "date": str(prov.get("date_utc", ""))[:10]}


def _goal_text(t, read: dict | None, committed: str) -> str:
    """The paragraphs under the step table on its goal column: what it is, the GPU's read bandwidth (``read``, from
    :func:`read_bandwidth`) and, for each kvrepro batch of ``read``'s GPU decoded with the ``committed`` fatbin, the
    read rate the goal needs of the attention (with the rest of the step as measured, and with kvrepro's own rest
    kernels free) against that read bandwidth, in GB/s, and a verdict drawn from them."""
    goal = f"{100 * E2E_GOAL:.0f}%"
    text = (f"Attention for {goal}: the share of the copy bandwidth at which the attention would have to read the "
            f"batch's KV for the step to reach {goal} of the bound, with the GEMMs, the rest and the GPU's idle time "
            f"as measured (\"none\": those alone take longer than a {goal} step).")
    if read is None:
        return text
    text += (f" A bare read of memory on {read['gpu']} (`{STEP_FLOOR}`, {read['date']}: the fastest of "
             f"{read['ops']} PyTorch reductions over 4 GiB, {read['op']}) reaches {read['GBps']:,.0f} GB/s, "
             f"{100 * read['of_copy']:.1f}% of the copy bandwidth of its own run.")
    ok = (t["mode"].astype(str).str.startswith("kvrepro") & (t["gpu"] == read["gpu"]) & (t["fatbin"] == committed)
          & t["goal_attention_gbps"].notna() & t["goal_attention_gbps_free"].notna())
    rows = t[ok].to_dict("records")
    if not rows:
        return text

    def rate(v):
        return "no read rate (the rest alone fills the step)" if math.isinf(v) else f"{v:,.0f} GB/s"
    text += (f"\n\nThe read rate {goal} needs of the attention, for the kvrepro batches decoded with the committed "
             "kernel (first with the rest of the step as measured, then with kvrepro's own kernels outside the "
             "attention taken as free: its KV store and the rope-mean offset kernels; vLLM's GEMMs and other kernels "
             "and the GPU's idle time as measured):\n\n"
             + "\n".join(f"- {r['mode']}, {r['users']} users: {rate(r['goal_attention_gbps'])}; "
                         f"{rate(r['goal_attention_gbps_free'])} without kvrepro's "
                         f"{r['kvrepro_rest_ms']:.2f} ms of store and offset kernels"
                         for r in rows))
    over = [r for r in rows if r["goal_attention_gbps"] > read["GBps"]]
    over_free = [r for r in rows if r["goal_attention_gbps_free"] > read["GBps"]]
    if len(over_free) == len(rows):
        verdict = (f"each of these needs a faster read than the bare read's {read['GBps']:,.0f} GB/s, even with "
                   "kvrepro's own kernels outside the attention free: no attention kernel can take them to "
                   f"{goal} unless vLLM's GEMMs, vLLM's other kernels or the idle time get shorter.")
    elif len(over) == len(rows):
        verdict = (f"each of these needs a faster read than the bare read's {read['GBps']:,.0f} GB/s with the "
                   "rest of its step as it is; " + ", ".join(f"{r['mode']} at {r['users']} users" for r in rows
                                                            if r not in over_free)
                   + " would need less than that only with kvrepro's store and offset kernels free.")
    else:
        verdict = (", ".join(f"{r['mode']} at {r['users']} users" for r in rows if r not in over)
                   + f" could reach {goal} with an attention reading at the rate given, below the bare read's "
                   f"{read['GBps']:,.0f} GB/s.")
    return text + "\n\nSo " + verdict


E2E_GOAL = 0.95      # issue 23: a decode step at >= 95% of the bound at clean capacity
# kvrepro's own kernels outside the attention class: the compressed store and the rope-mean offset ops
# (kvrepro/ops/triton/store.py, offset.py); the rest of a step's "rest" is vLLM's
KVREPRO_REST_KERNELS = ("store_kv_kernel", "rope_offset_kernel", "rope_terms_kernel")
STEP_FLOOR = "benchmarks/results/step_floor.json"   # the GPU's read bandwidth beside its copy bandwidth
KERNEL_BENCH = "benchmarks/results/decode_rope_mean.json"
KERNEL_GOAL = 0.92    # issue 23: the decode kernel at >= 92% of the copy bandwidth at batch 3, 6 and 13, every preset


def kernel_bandwidth_table(path):
    """The decode kernel of each preset alone, one attention layer at one context length, from a
    ``benchmarks/decode_side_by_side.py --rope`` result (``benchmarks/results/decode_rope_mean.json``): one row per
    (preset, context, batch) with the kernel that ran (``impl``: cuda / triton), its CUDA-graph time without the
    rope-mean correction (``ms``; what the ``slow-pairs`` / ``off`` key offsets run) and with it (``ms_rope``), each as a
    fraction of the copy bandwidth measured in the same run (``bw`` / ``bw_rope``: the KV bytes it must read over its
    time), and ``rope_ratio`` = ms_rope / ms. Presets without a ``kvrepro_<preset>_rope`` row keep blank rope columns.

    Raises:
        ValueError: a file without ``rows`` or ``copy_bandwidth`` (not such a result), naming it.
    """
    return _bandwidth_frame(_kernel_bench(Path(path)))


def _kernel_bench(path: Path) -> dict:
    """The content of a ``decode_side_by_side.py --rope`` result file; ValueError naming it when it is not one."""
    r = _read_json(path, "a decode_side_by_side.py --rope result")
    if not isinstance(r, dict) or not isinstance(r.get("rows"), list) or "copy_bandwidth" not in r:
        raise ValueError(f"{path}: not a decode_side_by_side.py --rope result (no 'rows' / 'copy_bandwidth')")
    return r


def _bandwidth_frame(r: dict):
    """:func:`kernel_bandwidth_table` of an already read result."""
    import pandas as pd

    gbps = r["copy_bandwidth"]["GBps_read_plus_write"]
    by = {(x["kernel"], x["ctx"], x["batch"]): x for x in r["rows"] if x.get("ms_graph")}

    def frac(x):
        return x["kv_bytes"] / (x["ms_graph"] * 1e-3) / (gbps * 1e9)

    out = []
    for (kernel, ctx, batch), x in by.items():
        preset = kernel.removeprefix("kvrepro_")
        if "_" in preset:                  # a rope or other variant row: read beside its plain row
            continue
        rope = by.get((f"{kernel}_rope", ctx, batch))
        out.append({"preset": preset, "impl": x.get("impl"), "ctx": ctx, "batch": batch, "ms": x["ms_graph"],
                    "bw": frac(x), "ms_rope": rope and rope["ms_graph"], "bw_rope": rope and frac(rope),
                    "rope_ratio": rope and rope["ms_graph"] / x["ms_graph"]})
    cols = ["preset", "impl", "ctx", "batch", "ms", "bw", "ms_rope", "bw_rope", "rope_ratio"]
    return pd.DataFrame(out, columns=cols).sort_values(["preset", "ctx", "batch"], ignore_index=True)


def kernel_section_markdown(root: str | os.PathLike) -> str:
    """Notebook 02's decode-kernel table: :func:`kernel_bandwidth_table` of ``KERNEL_BENCH`` under ``root`` with its
    provenance and which (preset, batch) reach ``KERNEL_GOAL`` of the copy bandwidth with and without the correction;
    a sentence naming the command where no result is committed."""
    path = Path(root, KERNEL_BENCH)
    if not path.is_file():
        return (f"Not measured yet: no `{KERNEL_BENCH}` is committed (`python benchmarks/decode_side_by_side.py "
                "--rope` on a GPU machine writes it).")
    bench = _kernel_bench(path)          # read once: the table and its provenance
    t, prov = _bandwidth_frame(bench), bench.get("provenance", {})
    head = ["preset", "kernel", "batch", "without correction (ms)", "% of copy bw", "rope-mean (ms)", "% of copy bw ",
            "rope-mean / without"]
    lines = ["| " + " | ".join(head) + " |", "| --- | --- | " + " | ".join(["---:"] * (len(head) - 2)) + " |"]
    for r in t.to_dict("records"):
        lines.append("| " + " | ".join([
            r["preset"], str(r["impl"]), str(r["batch"]), formatted(r["ms"], "{:.3f}"),
            formatted(r["bw"], "{:.1f}%", 100), formatted(r["ms_rope"], "{:.3f}"),
            formatted(r["bw_rope"], "{:.1f}%", 100), formatted(r["rope_ratio"], "{:.2f}x")]) + " |")

    def met(col):
        ok = t[t[col].notna() & (t[col] >= KERNEL_GOAL)]
        return ", ".join(f"{p} at batch {b}" for p, b in zip(ok["preset"], ok["batch"])) or "none"

    ctxs = ", ".join(f"{c:,}" for c in sorted(set(t["ctx"])))
    return (f"Replayed from `{KERNEL_BENCH}` ({prov.get('gpu', 'GPU not recorded')}, "
            f"{str(prov.get('date_utc', ''))[:16].replace('T', ' ')} UTC, `{prov.get('script', '')}`, kvrepro source "
            f"sha256 {str(prov.get('kvrepro_src_sha256') or '?')[:8]}): one attention "
            f"layer's decode step at {ctxs} tokens of context per sequence, Qwen3-4B shapes, the preset's default kernel "
            "replayed in a CUDA graph, without and with the key offset rope-mean's score correction (the default offset; "
            "`slow-pairs` and `off` run the kernel without it); % of copy bw = the KV bytes the step must read over its "
            "time, against the device-to-device copy bandwidth of the same run.\n\n" + "\n".join(lines) + "\n\n"
            f"The project's goal is every preset's kernel at >= {KERNEL_GOAL:.0%} of the copy bandwidth at batch 3, 6 "
            f"and 13. Reached here without the correction: {met('bw')}; with it: {met('bw_rope')}. (The step profile "
            "above times the same kernel inside vLLM, all layers back to back under the profiler, and can read a few "
            "points higher than this one-layer timing.)")
