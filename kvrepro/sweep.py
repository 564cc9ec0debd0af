"""Measured capacity sweep: how many 128K-context users fit without preemption, and their aggregate
decode tok/s, per KV mode, on one GPU with vLLM (the seed experiment of REPRODUCTION-CARD.md).

Workload per user (defaults = the seed): Qwen3-4B-Instruct-2507 (bundled config, ``load_format="dummy"``
unless real weights are given), a distinct random 131,072-token prompt, 1,024 decode tokens
(``ignore_eos``), prefix caching off. ``gpu_memory_gb`` emulates a smaller card on a larger one:
``gpu_memory_utilization = 0.9 x gpu_memory_gb / total``.

Protocol per mode (one engine, one prefill of the largest N, so the whole comparison fits the device
budget):

1. start vLLM; read its KV-cache size (``num_gpu_blocks x block_size`` tokens); N = users that fit by
   block arithmetic (``(num_gpu_blocks - 1) // ceil((prompt + decode) / block_size)``; vLLM keeps one
   null block), capped by ``max_users``;
2. submit N requests at once (max_tokens = decode + margin for steps 4-5) and step the engine; TTFT
   of each request from the common submit time;
3. "full" window: from the moment every request has its first token until every request has
   ``decode_tokens`` tokens. All N decode together throughout; aggregate decode tok/s = tokens
   generated in the window / its duration. clean = all N ran concurrently (none finished before the
   last first token) and vLLM's ``vllm:num_preemptions`` counter did not move from submit to the end
   of the window (the KV footprint of every request then covers prompt + decode tokens). Requests
   prefilled first keep decoding while later ones prefill, so at the end they hold a little more
   than the workload (``footprint`` in the row: ~8 x N(N-1)/2 tokens): "clean" here is that much
   stricter than the workload's;
4. optional edge check (``confirm_edge``, only when N is set by the KV cache, not by ``max_users``):
   one fresh request on top of the N still decoding; clean only if it gets ``decode_tokens`` tokens
   with no preemption while all N run (``edge_outcome``: preempted / waiting for blocks / ran). At
   most one extra 128K prefill instead of N+1 fresh ones;
5. "abort" windows: abort one request, decode ``window_steps`` steps with N-1 users, measure, abort the
   next, ... down to 1 (``measured_by = "abort-window"``; these N are below a measured clean N, and
   the counter is checked again in each window).

Each row also records vLLM's own memory accounting (``vllm_memory``: available KV cache, CUDA-graph
estimate vs actual, peak activations, non-torch memory, from its log and its worker).

Rows go to one JSONL file per run (``ResultsFile``: write-then-rename; a (mode, num_users, measured_by)
row is never duplicated). Each row carries provenance and the ``engine_run_id`` of the engine that measured it
(a new uuid4 hex per engine start): all rows of one mode in a file come from ONE engine run, and
``ResultsFile.add`` refuses a row that would mix two.

Resume (``run_sweep`` on an existing file): a mode is done only when the rows of one engine run hold its full
row, every abort window N-1 .. 1 and, when asked (``confirm_edge``) and N was set by the KV cache, its edge-check
row (``mode_status``); a mode sized only needs its sizing row, and a mode whose engine fits no user is done with
its sizing row. Any other mode (including one whose timeout cut its abort windows short) is measured again as a
whole: first its earlier rows (a killed run's partial rows, or rows of
several engine runs) are superseded, i.e. moved to ``<results>.superseded`` (JSON lines, each with the reason;
not a ``*.jsonl`` file, so replay never reads them as results), and the supersession is printed; so the results
file never mixes two engine runs of a mode.
"""
from __future__ import annotations

import collections
import dataclasses
import datetime as _dt
import json
import math
import os
import sys
import time
from pathlib import Path

from kvrepro.formats import COMPRESSED_PRESETS

VLLM_MODES = {"bf16": "auto", "fp8": "fp8", "turboquant_k8v4": "turboquant_k8v4",
              "turboquant_4bit_nc": "turboquant_4bit_nc"}
# fp8 KV on a named vLLM attention backend, ``fp8:<backend>`` (the ``<kv>:<backend>`` syntax of
# kvrepro.accuracy_vllm's ``bf16:triton_attn`` control). The backends of vLLM 0.20.2 that accept an fp8 KV cache on
# an H200 (vllm/v1/attention/backends/): FLASH_ATTN (flash_attn.py, supports_kv_cache_dtype: fp8 only where
# flash_attn_supports_fp8(), i.e. FlashAttention 3 on compute capability 9.x), FLASHINFER (flashinfer.py,
# supported_kv_cache_dtypes lists fp8 / fp8_e4m3 / fp8_e5m2; needs the flashinfer-python package and nvcc or its
# cubins, vllm/utils/flashinfer.py has_flashinfer) and TRITON_ATTN (triton_attn.py, fp8 / fp8_e4m3 / fp8_e5m2 and
# per-token-head variants). FLEX_ATTENTION, TREE_ATTN and FLASH_ATTN_DIFFKV list only auto / float16 / bfloat16.
# Plain "fp8" lets vLLM choose: FLASH_ATTN first on compute capability 9.x (platforms/cuda.py,
# _get_backend_priorities), so it is the same engine as "fp8:flash_attn" on the H200 (the row records which ran).
FP8_BACKEND_MODES = {"fp8:flash_attn": "FLASH_ATTN", "fp8:flashinfer": "FLASHINFER", "fp8:triton_attn": "TRITON_ATTN"}
FP8_MODES = ("fp8", *FP8_BACKEND_MODES)   # every fp8 KV mode: vLLM's choice, then each named backend
KVREPRO_MODES = tuple(f"kvrepro:{p}" for p in COMPRESSED_PRESETS)
ALL_MODES = (*VLLM_MODES, *FP8_BACKEND_MODES, *KVREPRO_MODES)
REQUIRED_FIELDS = {
    "mode": str, "kv_cache_dtype": str, "num_users": int, "clean": bool, "preemptions": int,
    "aggregate_decode_tok_s": (int, float), "ttft_s_mean": (int, float), "ttft_s_max": (int, float),
    "tpot_ms_mean": (int, float), "kv_cache_tokens": int, "users_fit_arithmetic": int,
    "prompt_tokens": int, "decode_tokens": int, "gpu": str, "gpu_memory_gb": (int, float),
    "gpu_memory_utilization": (int, float), "vllm_version": str, "torch_version": str,
    "kvrepro_version": str, "model": str, "load_format": str, "date": str, "run_id": str, "measured": bool,
    "engine_run_id": str,
}
ROW_KEY = ("mode", "num_users", "measured_by")
SUPERSEDED_SUFFIX = ".superseded"   # appended to the results file's name: not *.jsonl, so replay skips it


def check_modes(modes) -> tuple[str, ...]:
    """Validate a list of KV modes; raises ValueError naming ``modes`` and the allowed values."""
    if isinstance(modes, str):
        modes = [m for m in modes.split(",") if m]
    if not modes:
        raise ValueError(f"modes must be a non-empty list from {ALL_MODES}")
    bad = [m for m in modes if m not in ALL_MODES]
    if bad:
        raise ValueError(f"modes: unknown {bad}; allowed: {', '.join(ALL_MODES)}")
    dup = sorted({m for m in modes if list(modes).count(m) > 1})
    if dup:
        raise ValueError(f"modes: {dup} named more than once; name each mode once")
    return tuple(modes)


def engine_settings(mode: str) -> dict:
    """vLLM settings of a mode: ``{"kv_cache_dtype", "attention_backend", "env"}``.

    kvrepro presets run with kv_cache_dtype "auto", vLLM's ``attention_backend="CUSTOM"`` and
    ``KVREPRO_PRESET``; vLLM's own modes let vLLM choose the backend; ``fp8:<backend>`` modes run
    kv_cache_dtype "fp8" on the named backend (:data:`FP8_BACKEND_MODES`). Raises ValueError for an unknown mode
    (naming the allowed ones).
    """
    check_modes([mode])
    if mode in VLLM_MODES:
        return {"kv_cache_dtype": VLLM_MODES[mode], "attention_backend": None, "env": {}}
    if mode in FP8_BACKEND_MODES:
        return {"kv_cache_dtype": "fp8", "attention_backend": FP8_BACKEND_MODES[mode], "env": {}}
    return {"kv_cache_dtype": "auto", "attention_backend": "CUSTOM",
            "env": {"KVREPRO_PRESET": mode.split(":", 1)[1]}}


def memory_utilization(gpu_memory_gb: float, total_memory_bytes: int, fraction: float = 0.9) -> float:
    """``fraction x gpu_memory_gb GiB / total`` (the emulated card's share of the real one).

    Raises:
        ValueError: non-positive inputs, or a budget larger than the card.
    """
    if not (isinstance(gpu_memory_gb, (int, float)) and gpu_memory_gb > 0):
        raise ValueError(f"gpu_memory_gb must be > 0, got {gpu_memory_gb!r}")
    if not (isinstance(total_memory_bytes, int) and total_memory_bytes > 0):
        raise ValueError(f"total_memory_bytes must be a positive int, got {total_memory_bytes!r}")
    util = fraction * gpu_memory_gb * 2**30 / total_memory_bytes
    if not 0 < util <= 1:
        raise ValueError(f"gpu_memory_gb={gpu_memory_gb} exceeds this GPU ({total_memory_bytes / 2**30:.1f} GiB)")
    return util


def users_fit(num_gpu_blocks: int, prompt_tokens: int, decode_tokens: int, block_size: int = 16) -> int:
    """Users whose whole request (prompt + decode) fits in vLLM's pool at once: one block of the pool
    is vLLM's null block (``vllm/v1/core/block_pool.py``), each request holds whole blocks."""
    for name, v in (("num_gpu_blocks", num_gpu_blocks), ("prompt_tokens", prompt_tokens),
                    ("block_size", block_size)):
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if not isinstance(decode_tokens, int) or decode_tokens < 0:
        raise ValueError(f"decode_tokens must be a non-negative int, got {decode_tokens!r}")
    return max(0, num_gpu_blocks - 1) // math.ceil((prompt_tokens + decode_tokens) / block_size)


def validate_row(row: dict) -> dict:
    """Check a result row has every required field with the right type; returns it.

    Raises:
        ValueError: naming the missing or mistyped fields.
    """
    problems = []
    for name, typ in REQUIRED_FIELDS.items():
        if name not in row:
            problems.append(f"missing {name}")
        elif row[name] is None and name in ("ttft_s_mean", "ttft_s_max", "tpot_ms_mean", "aggregate_decode_tok_s"):
            continue
        elif isinstance(row[name], bool) and typ is not bool:
            problems.append(f"{name} is a bool")
        elif not isinstance(row[name], typ):
            problems.append(f"{name}={row[name]!r} is not {typ}")
    if "mode" in row and row["mode"] not in ALL_MODES:
        problems.append(f"mode {row['mode']!r} not in {ALL_MODES}")
    if problems:
        raise ValueError("invalid result row: " + "; ".join(problems))
    return row


def row_key(row: dict) -> tuple:
    return tuple(row.get(k) for k in ROW_KEY)


def read_jsonl(path: Path) -> list[dict]:
    """The rows of a JSON-lines results file ([] when it does not exist; blank lines skipped).

    Raises:
        ValueError: a line that is not JSON, naming the file and line number."""
    rows = []
    if path.exists():
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{i + 1}: not JSON ({e})") from None
    return rows


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    """Write ``rows`` to ``path`` through a temp file + rename (never a torn file)."""
    from kvrepro.fileio import atomic_write_text

    atomic_write_text(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))


class ResultsFile:
    """One run's JSONL results. ``add`` validates, skips rows whose key (mode, num_users, measured_by)
    is already present, refuses rows that would mix two engine runs of a mode, and rewrites the file
    through a temp file + rename (never a torn file).

    Rows written before rows carried ``engine_run_id`` count as one engine run per mode (their ``engine_run_id``
    reads as None)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.rows: list[dict] = read_jsonl(self.path)

    @property
    def superseded_path(self) -> Path:
        """Where :meth:`supersede` moves rows: ``<results file name>.superseded`` next to it (JSON lines)."""
        return self.path.with_name(self.path.name + SUPERSEDED_SUFFIX)

    def keys(self) -> set:
        return {row_key(r) for r in self.rows}

    def engine_runs(self, mode: str) -> list:
        """The ``engine_run_id`` values of ``mode``'s rows, in file order (None for rows without one)."""
        return list(dict.fromkeys(r.get("engine_run_id") for r in self.rows if r.get("mode") == mode))

    def modes_done(self, confirm_edge=(), sizing_only=()) -> set[str]:
        """Modes whose rows are complete (:func:`mode_status`); ``confirm_edge`` / ``sizing_only``: the modes
        asked for an edge check / sized only."""
        return {m for m in {r.get("mode") for r in self.rows}
                if mode_status(self.rows, m, m in confirm_edge, m in sizing_only)[0]}

    def add(self, rows) -> int:
        """Append new rows (validated); returns how many were new.

        Raises:
            ValueError: an invalid row (nothing is written), or a row whose mode already has rows of another
                engine run in the file (naming both runs; nothing is written).
        """
        keys, new = self.keys(), []
        runs = {m: set(self.engine_runs(m)) for m in {r.get("mode") for r in self.rows}}
        for r in rows:
            validate_row(r)
            have = runs.setdefault(r["mode"], set())
            if have and r["engine_run_id"] not in have:
                raise ValueError(f"{self.path} holds {r['mode']} rows of engine run(s) "
                                 f"{', '.join(sorted(map(str, have)))}; a row of engine run {r['engine_run_id']} "
                                 "would mix two engine runs of one mode (kvrepro.sweep.run_sweep supersedes an "
                                 "incomplete mode's rows before it measures the mode again)")
            have.add(r["engine_run_id"])
            if row_key(r) not in keys:
                keys.add(row_key(r))
                new.append(r)
        if new:
            self.rows.extend(new)
            _write_jsonl(self.path, self.rows)
        return len(new)

    def supersede(self, mode: str, reason: str) -> int:
        """Move every row of ``mode`` to :attr:`superseded_path` (each gains ``superseded`` = ``reason`` and
        ``superseded_date``); returns how many moved. The superseded file is written first, so a crash in
        between leaves the rows in both files, never in neither."""
        moved = [r for r in self.rows if r.get("mode") == mode]
        if not moved:
            return 0
        when = now_utc()
        old = read_jsonl(self.superseded_path)
        _write_jsonl(self.superseded_path, old + [dict(r, superseded=reason, superseded_date=when) for r in moved])
        self.rows = [r for r in self.rows if r.get("mode") != mode]
        _write_jsonl(self.path, self.rows)
        return len(moved)


ENGINE_ERRORS_SUFFIX = ".engine_errors"   # appended to the results file's name: not *.jsonl, so replay skips it


def record_engine_error(results_path, mode: str, run_id: str, settings: dict, error: BaseException) -> dict:
    """Append why ``mode``'s engine did not start to ``<results_path>.engine_errors`` (JSON lines, written then
    renamed) and return the record: mode, run_id, kv_cache_dtype, attention_backend, error (type and message, cut to
    2,000 characters), date. A mode whose backend vLLM refuses (e.g. ``fp8:flashinfer`` without the flashinfer
    package) leaves no result row; this file says why, and :func:`engine_errors` reads it back."""
    path = Path(os.fspath(results_path))
    path = path.with_name(path.name + ENGINE_ERRORS_SUFFIX)
    rec = {"mode": mode, "run_id": run_id, "kv_cache_dtype": settings.get("kv_cache_dtype"),
           "attention_backend": settings.get("attention_backend"),
           "error": f"{type(error).__name__}: {error}"[:2000], "date": now_utc()}
    _write_jsonl(path, read_jsonl(path) + [rec])
    return rec


def engine_errors(results_path) -> list[dict]:
    """The records of :func:`record_engine_error` beside ``results_path`` ([] when there are none)."""
    path = Path(os.fspath(results_path))
    return read_jsonl(path.with_name(path.name + ENGINE_ERRORS_SUFFIX))


def mode_status(rows: list[dict], mode: str, confirm_edge: bool = False, sizing_only: bool = False) -> tuple[bool, str]:
    """Whether ``rows`` hold a complete measurement of ``mode``: ``(done, why)``.

    Done: all of the mode's rows come from one engine run (``engine_run_id``; rows without one count as one run)
    and they hold either, for ``sizing_only``, a sizing row or a full row; or a sizing row of an engine that fits
    no user (``users_fit_arithmetic == 0``: nothing more to measure); or the full row (N users), the abort-window
    rows N-1 .. 1 and, with ``confirm_edge`` and N not capped below the arithmetic fit (``users_fit_arithmetic``),
    the edge-check row. ``why`` says what is missing or mixed ("" when done).
    """
    mine = [r for r in rows if r.get("mode") == mode]
    if not mine:
        return False, "no rows"
    runs = list(dict.fromkeys(r.get("engine_run_id") for r in mine))
    if len(runs) > 1:
        return False, f"rows of {len(runs)} engine runs ({', '.join(str(x) for x in runs)})"
    by = collections.defaultdict(set)
    for r in mine:
        by[r.get("measured_by")].add(r.get("num_users"))
    full = [r for r in mine if r.get("measured_by") == "full"]
    if sizing_only and (by["sizing"] or full):
        return True, ""
    if not full:
        sized_empty = any(r.get("measured_by") == "sizing" and r.get("users_fit_arithmetic") == 0 for r in mine)
        return (True, "") if sized_empty and not sizing_only else (False, "no full-window row")
    n = full[0]["num_users"]
    missing = sorted(set(range(1, n)) - by["abort-window"])
    if missing:
        return False, f"abort windows {_ranges(missing)} of N={n} missing"
    if confirm_edge and n >= full[0].get("users_fit_arithmetic", n) and (n + 1) not in by["edge-check"]:
        return False, f"edge-check row (N+1={n + 1}) missing"
    return True, ""


def _ranges(xs: list[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``"1-3, 7"``."""
    out, start = [], None
    for i, x in enumerate(xs):
        if start is None:
            start = x
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            out.append(f"{start}-{x}" if x != start else f"{x}")
            start = None
    return ", ".join(out)


@dataclasses.dataclass
class Timeline:
    """Token arrival times of one request (host ``perf_counter`` seconds)."""

    submit: float
    times: list = dataclasses.field(default_factory=list)  # time of the i-th output token

    def count_at(self, t: float) -> int:
        return sum(1 for x in self.times if x <= t)


def window_stats(timelines: dict, t0: float, t1: float) -> dict:
    """Aggregate decode tok/s and TPOT over ``(t0, t1]``: tokens that arrived in the window over its
    duration; TPOT = duration / tokens per request (ms), averaged over requests with tokens."""
    if t1 <= t0:
        raise ValueError(f"empty window ({t0}, {t1}]")
    per_req = [sum(1 for x in tl.times if t0 < x <= t1) for tl in timelines.values()]
    total = sum(per_req)
    tpots = [(t1 - t0) / n * 1e3 for n in per_req if n]
    return {"tokens": total, "seconds": t1 - t0, "aggregate_decode_tok_s": total / (t1 - t0),
            "tpot_ms_mean": sum(tpots) / len(tpots) if tpots else None}


def ttft_stats(timelines: dict) -> dict:
    """TTFT mean/max/first (s) from each request's submit to its first token."""
    ttft = sorted(tl.times[0] - tl.submit for tl in timelines.values() if tl.times)
    if not ttft:
        return {"ttft_s_mean": None, "ttft_s_max": None, "ttft_s_first": None}
    return {"ttft_s_mean": sum(ttft) / len(ttft), "ttft_s_max": ttft[-1], "ttft_s_first": ttft[0]}


MEMORY_PATTERNS = {
    # vLLM 0.20.2 log lines (vllm/v1/worker/gpu_worker.py, gpu_model_runner.py) -> row fields, GiB
    "available_kv_cache_gib": r"Available KV cache memory: ([0-9.]+) GiB",
    "cudagraph_estimate_gib": r"Estimated CUDA graph memory: ([0-9.]+) GiB total",
    "cudagraph_actual_gib": r"CUDA graph pool memory: ([0-9.]+) GiB \(actual\)",
    "non_kv_cache_gib": r"Total non KV cache memory: ([0-9.]+)GiB",
    "torch_peak_increase_gib": r"torch peak memory increase: ([0-9.]+)GiB",
    "non_torch_increase_gib": r"non-torch forward increase memory: ([0-9.]+)GiB",
    "weights_gib": r"weights memory: ([0-9.]+)GiB",
}
GRAPH_ESTIMATE = (r"Estimated (\w+) CUDA graph memory: ([0-9.]+) MiB first-capture \+ \((\d+)-1\) .{1,3} "
                  r"([0-9.]+) MiB per-graph")


def parse_vllm_memory_log(lines) -> dict:
    """vLLM's memory accounting from its log lines: the figures of ``MEMORY_PATTERNS`` (GiB, last
    occurrence wins) and, per CUDA-graph mode, the profiled first capture and per-graph MiB with the
    number of graphs (``cudagraph_profile``: ``{mode: [first_mib, graphs, per_graph_mib]}``).
    Lines without these figures are ignored."""
    import re

    out: dict = {}
    for line in lines:
        for key, pat in MEMORY_PATTERNS.items():
            m = re.search(pat, line)
            if m:
                out[key] = float(m.group(1))
        m = re.search(GRAPH_ESTIMATE, line)
        if m:
            out.setdefault("cudagraph_profile", {})[m.group(1)] = [float(m.group(2)), int(m.group(3)),
                                                                    float(m.group(4))]
    return out


def footprint(timelines: dict, prompt_tokens: int, decode_tokens: int, block_size: int) -> dict:
    """KV blocks the requests hold (prompt + generated tokens, whole blocks) vs the workload's
    ``len(timelines) x ceil((prompt + decode) / block_size)``. Requests prefilled first keep decoding
    while later ones prefill, so at the end of the full window they hold more than the workload
    needs (``extra_blocks``): the sweep's "clean" is that much stricter than the workload's."""
    held = sum(math.ceil((prompt_tokens + len(tl.times)) / block_size) for tl in timelines.values())
    need = len(timelines) * math.ceil((prompt_tokens + decode_tokens) / block_size)
    return {"blocks_held": held, "blocks_workload": need, "extra_blocks": held - need}


def edge_outcome(preempted: bool, edge_first_token: bool, edge_tokens: int, decode_tokens: int,
                 old_finished: bool, timed_out: bool) -> tuple[bool, str]:
    """Verdict of the N+1 edge check (one fresh request on top of N decoding ones).

    Clean only if the new request got ``decode_tokens`` tokens with no preemption while all N old ones
    were still running. Otherwise the reason: ``preempted`` (vLLM ran out of KV blocks and preempted),
    ``waiting`` (never scheduled: no free blocks for its first chunk), ``old-finished`` (an old request
    ended first, so N+1 were not concurrent), ``timeout``."""
    if preempted:
        return False, "preempted"
    if old_finished:
        return False, "old-finished"
    if edge_tokens >= decode_tokens:
        return True, "ran"
    if not edge_first_token:
        return False, "waiting"
    return False, "timeout" if timed_out else "incomplete"


def now_utc() -> str:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat()


DEFAULT_PARAMS = {"gpu_memory_gb": 80.0, "prompt_tokens": 131072, "decode_tokens": 1024, "max_users": 32,
                  "window_steps": 32, "max_num_seqs": 32, "block_size": 16, "seed": 0,
                  "load_format": "dummy", "model_dir": None, "cudagraph_mode": None}


CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")  # vLLM 0.20.2 CUDAGraphMode
# Workload fields a resumed results file must share with this call (row field names; see check_resume).
RESUME_FIELDS = ("prompt_tokens", "decode_tokens", "gpu_memory_gb", "block_size", "load_format", "model")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_params(params: dict) -> dict:
    """Validate sweep parameters (``DEFAULT_PARAMS`` names, values merged over the defaults); returns
    the merged dict.

    Raises:
        ValueError: an unknown name (listing the allowed ones), or a bad value, naming the parameter and
            the allowed values: gpu_memory_gb a number > 0 (GiB); prompt_tokens, decode_tokens,
            max_users, window_steps, max_num_seqs integers >= 1; block_size in ``SUPPORTED_BLOCK_SIZES``;
            seed an integer; load_format a non-empty string; model_dir None or an existing folder with
            config.json; cudagraph_mode None or one of ``CUDAGRAPH_MODES``.
    """
    from kvrepro.formats.layout import SUPPORTED_BLOCK_SIZES

    if not isinstance(params, dict):
        raise ValueError(f"params must be a dict of {sorted(DEFAULT_PARAMS)}, got {params!r}")
    unknown = sorted(set(params) - set(DEFAULT_PARAMS))
    if unknown:
        raise ValueError(f"unknown sweep parameter(s) {unknown}; allowed: {sorted(DEFAULT_PARAMS)}")
    p = {**DEFAULT_PARAMS, **params}
    g = p["gpu_memory_gb"]
    if isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g) or g <= 0:
        raise ValueError(f"gpu_memory_gb must be a number of GiB > 0, got {g!r}")
    for name in ("prompt_tokens", "decode_tokens", "max_users", "window_steps", "max_num_seqs"):
        if not _is_int(p[name]) or p[name] < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {p[name]!r}")
    if p["block_size"] not in SUPPORTED_BLOCK_SIZES or not _is_int(p["block_size"]):
        raise ValueError(f"block_size must be one of {tuple(SUPPORTED_BLOCK_SIZES)}, got {p['block_size']!r}")
    if not _is_int(p["seed"]) or p["seed"] < 0:
        # numpy's default_rng (the prompts' draw) refuses a negative seed, after the engine was built
        raise ValueError(f"seed must be an integer >= 0, got {p['seed']!r}")
    if not isinstance(p["load_format"], str) or not p["load_format"]:
        raise ValueError(f"load_format must be a non-empty string (e.g. 'dummy', 'auto'), got {p['load_format']!r}")
    md = p["model_dir"]
    if md is not None and not (isinstance(md, str) and os.path.isfile(os.path.join(md, "config.json"))):
        raise ValueError(f"model_dir must be None (bundled Qwen3-4B config) or a folder with config.json, got {md!r}")
    if p["cudagraph_mode"] is not None and p["cudagraph_mode"] not in CUDAGRAPH_MODES:
        raise ValueError(f"cudagraph_mode must be None or one of {CUDAGRAPH_MODES}, got {p['cudagraph_mode']!r}")
    limit = max_positions(md)
    need = max_model_len(p)
    if limit is not None and need > limit:
        # vLLM refuses a max_model_len past the model's positions, but only once the engine is being built
        raise ValueError(f"prompt_tokens ({p['prompt_tokens']}) + decode_tokens ({p['decode_tokens']}) + the sweep's "
                         f"headroom ({need - p['prompt_tokens'] - p['decode_tokens']}: window_steps x max_users + "
                         f"{64 + EDGE_STEPS}) must be <= the model's max_position_embeddings ({limit})")
    return p


EDGE_STEPS = 1024  # decode steps of headroom for the edge check (part of max_tokens: sweep_worker's margin)


def max_model_len(p: dict) -> int:
    """The engine's ``max_model_len`` for sweep parameters ``p``: prompt and decode tokens plus the headroom the abort
    windows (``window_steps`` per user) and the edge check (``EDGE_STEPS``) decode after the full window."""
    return p["prompt_tokens"] + p["decode_tokens"] + p["window_steps"] * p["max_users"] + 64 + EDGE_STEPS


def max_positions(model_dir: str | None) -> int | None:
    """``max_position_embeddings`` of ``model_dir``'s config.json (None: the bundled Qwen3-4B config); None if the
    config does not give it."""
    from kvrepro.configs import config_dir

    with open(os.path.join(model_dir or str(config_dir()), "config.json"), encoding="utf-8") as f:
        v = json.load(f).get("max_position_embeddings")
    return int(v) if isinstance(v, int) else None


def model_label(model_dir: str | None) -> str:
    """The ``model`` field of a row: the Hub name for the bundled Qwen3-4B config, else the folder."""
    if model_dir is None:
        from kvrepro.configs import config_dir

        model_dir = str(config_dir())
    return "Qwen/Qwen3-4B-Instruct-2507" if "qwen3-4b" in model_dir else model_dir


def check_resume(rows: list[dict], mode: str, params: dict, results_path) -> None:
    """Refuse to resume ``results_path`` for ``mode`` with a different workload: every existing row of
    that mode must have the same ``RESUME_FIELDS`` as ``params`` (merged sweep parameters).

    Raises:
        ValueError: naming the mode, the differing field, the file's value and this call's value.
    """
    want = {"prompt_tokens": params["prompt_tokens"], "decode_tokens": params["decode_tokens"],
            "gpu_memory_gb": params["gpu_memory_gb"], "block_size": params["block_size"],
            "load_format": params["load_format"], "model": model_label(params["model_dir"])}
    for r in rows:
        if r.get("mode") != mode:
            continue
        for f in RESUME_FIELDS:
            if f in r and r[f] != want[f]:
                raise ValueError(f"{results_path} already holds {mode} rows with {f}={r[f]!r}, this call has "
                                 f"{f}={want[f]!r}: resuming would mix workloads; use another --results file")


def check_cli_values(results_path, run_id, timeout_s, budget_s=None, modes=(), confirm_edge=(),
                     sizing_only=(), min_start_s=None) -> None:
    """Validate run_sweep's non-workload arguments (before any GPU/vLLM check).

    Raises:
        ValueError: results_path empty, a folder, or in a folder that does not exist; run_id empty or with
            whitespace or '/'; timeout_s not > 0; budget_s not None or > 0; confirm_edge / sizing_only
            naming an unknown mode or one not in ``modes``; min_start_s not ``{mode: seconds >= 0}``.
    """
    rp = os.fspath(results_path) if isinstance(results_path, (str, os.PathLike)) else None
    if not rp:
        raise ValueError(f"results_path must be a file path (JSONL), got {results_path!r}")
    if os.path.isdir(rp):
        raise ValueError(f"results_path {rp!r} is a folder; give a .jsonl file path")
    parent = os.path.dirname(os.path.abspath(rp))
    if not os.path.isdir(parent):
        raise ValueError(f"results_path {rp!r}: folder {parent!r} does not exist (create it first)")
    if not isinstance(run_id, str) or not run_id.strip() or any(c.isspace() or c == "/" for c in run_id):
        raise ValueError(f"run_id must be a non-empty string without whitespace or '/', got {run_id!r}")
    for name, v, allow_none in (("timeout_s", timeout_s, False), ("budget_s", budget_s, True)):
        if v is None and allow_none:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{name} must be a number of seconds > 0, got {v!r}")
    for name, sel in (("confirm_edge", confirm_edge), ("sizing_only", sizing_only)):
        bad = [m for m in sel if m not in ALL_MODES]
        if bad:
            raise ValueError(f"{name}: unknown mode(s) {bad}; allowed: {', '.join(ALL_MODES)}")
        extra = [m for m in sel if m not in modes]
        if extra:
            raise ValueError(f"{name}: {extra} not among the modes run ({', '.join(modes)})")
    both = sorted(set(confirm_edge) & set(sizing_only))
    if both:
        raise ValueError(f"confirm_edge and sizing_only both name {both}: a sized-only mode runs no users, so no edge "
                         "check; name each mode in at most one of them")
    for m, v in (min_start_s or {}).items():
        if m not in ALL_MODES:
            raise ValueError(f"min_start_s: unknown mode {m!r}; allowed: {', '.join(ALL_MODES)}")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ValueError(f"min_start_s[{m!r}] must be a number of seconds >= 0, got {v!r}")


def measurement_blockers(info: dict | None = None) -> list[str]:
    """What this machine lacks to measure a sweep: empty when it has a CUDA GPU and vLLM.

    ``info``: a :func:`kvrepro.provenance.collect` dict (collected here when None).
    """
    from kvrepro.provenance import NOT_INSTALLED, collect

    info = collect({}) if info is None else info
    missing = []
    if info["gpu"] == "none":
        missing.append("a CUDA GPU (found none)")
    if info["vllm_version"] == NOT_INSTALLED:
        missing.append("vLLM (not installed; pip install 'kvrepro[vllm]' or use the conda environment.yml)")
    return missing


# Wall seconds a mode needs with the default workload on the H200 (engine start + N prefills + 1,024
# decode steps + abort windows, as measured there): a mode is not started with less left (it would time
# out and write nothing). Sizing only: engine start.
MIN_START_S = {"bf16": 130.0, "fp8": 180.0, "kvrepro:k4v4": 360.0, "kvrepro:k8v4": 250.0,
               "kvrepro:k4v2": 430.0, "turboquant_k8v4": 450.0, "turboquant_4bit_nc": 560.0,
               # not measured yet: fp8's engine and prefills, with a slower decode assumed for the Triton kernel
               # and FlashInfer's first-use kernel build
               "fp8:flash_attn": 180.0, "fp8:flashinfer": 240.0, "fp8:triton_attn": 260.0}
MIN_START_SIZING_S = 80.0


def run_sweep(modes, results_path: str | os.PathLike, run_id: str, params: dict | None = None,
              confirm_edge=(), timeout_s: float = 540.0, sizing_only=(), budget_s: float | None = None,
              param_overrides: dict | None = None, min_start_s: dict | None = None) -> list[str]:
    """Measure every mode ``results_path`` does not hold complete (resume: ``mode_status``), each in its own
    subprocess (``python -m kvrepro.sweep_worker``) so GPU memory is returned between modes. Before an incomplete
    mode is measured again, its earlier rows are superseded (``ResultsFile.supersede``: moved to
    ``<results>.superseded``, and said so on stdout), so the file never mixes two engine runs of a mode.

    ``budget_s``: wall seconds for this whole call; a mode is not started with less than its
    ``MIN_START_S`` (``MIN_START_SIZING_S`` for sizing; ``min_start_s`` overrides per mode) left (it is
    left for a resumed call) and each gets at most what is left.
    ``param_overrides``: ``{mode: {param: value}}`` on top of ``params`` for single modes.
    A failing mode does not stop the others; the rows it wrote stay in the file (a later call supersedes them
    if they are incomplete). A mode whose engine did not start (``<results>.engine_errors``, written by the worker:
    :func:`record_engine_error`) is skipped by later calls on the same file, with the recorded reason printed.

    Returns the modes run now. Raises ValueError (before any GPU/vLLM check) on bad modes, unknown
    parameter names or bad values (``check_params``, ``check_cli_values``), or when ``results_path``
    already holds rows of a mode with a different workload (``check_resume``); RuntimeError without a
    CUDA GPU or vLLM (before anything runs), or at the end if a mode failed.
    """
    import subprocess

    modes = check_modes(modes)
    overrides = param_overrides or {}
    if overrides:
        bad = [m for m in overrides if m not in ALL_MODES]
        if bad:
            raise ValueError(f"param_overrides: unknown mode(s) {bad}; allowed: {', '.join(ALL_MODES)}")
    unknown = sorted(set(params or {}).union(*[set(v) for v in overrides.values()]) - set(DEFAULT_PARAMS))
    if unknown:
        raise ValueError(f"unknown sweep parameter(s) {unknown}; allowed: {sorted(DEFAULT_PARAMS)}")
    confirm_edge, sizing_only = tuple(confirm_edge), tuple(sizing_only)
    check_cli_values(results_path, run_id, timeout_s, budget_s, modes, confirm_edge, sizing_only, min_start_s)
    merged = {m: check_params({**(params or {}), **overrides.get(m, {})}) for m in modes}
    existing = ResultsFile(results_path).rows
    for m in modes:
        check_resume(existing, m, merged[m], results_path)
    missing = measurement_blockers()
    if missing:
        raise RuntimeError(f"the capacity sweep measures with vLLM on a GPU; missing: {', '.join(missing)}. "
                           "Nothing was measured; committed results can be replayed with notebook 02.")
    t0 = time.perf_counter()
    ran, failed = [], []
    for mode in modes:
        only_size = mode in sizing_only
        done, why = mode_status(ResultsFile(results_path).rows, mode, mode in confirm_edge, only_size)
        if done:
            print(f"[sweep] {mode}: already in {results_path}, skipped", flush=True)
            continue
        refused = [e for e in engine_errors(results_path) if e.get("mode") == mode]
        if refused:   # a backend vLLM refused stays refused on the same machine: not retried in every resumed call
            print(f"[sweep] {mode}: skipped, its engine did not start earlier in this run ({refused[-1]['error'][:300]}); "
                  f"delete {results_path}{ENGINE_ERRORS_SUFFIX} to try again", flush=True)
            continue
        limit = timeout_s
        if budget_s is not None:
            left = budget_s - (time.perf_counter() - t0)
            need = (MIN_START_SIZING_S if only_size else
                    {**MIN_START_S, **(min_start_s or {})}.get(mode, 150.0))
            if left < need:
                print(f"[sweep] {mode}: not started, {left:.0f} s of the budget left, needs ~{need:.0f} s "
                      "(resume later)", flush=True)
                continue
            limit = min(timeout_s, left - 5)
        if why != "no rows":   # a killed or mixed earlier measurement: measured again as a whole, not mixed
            results = ResultsFile(results_path)
            runs = results.engine_runs(mode)
            n = results.supersede(mode, f"incomplete: {why}; measured again")
            print(f"[sweep] {mode}: {n} earlier rows (engine run {', '.join(map(str, runs))}) superseded: {why}; "
                  f"moved to {results.superseded_path}; measuring the mode again", flush=True)
        mp = dict(merged[mode])
        mp.update(confirm_edge=mode in confirm_edge, timeout_s=limit, sizing_only=only_size)
        cmd = [sys.executable, "-m", "kvrepro.sweep_worker", "--mode", mode, "--results",
               str(results_path), "--run-id", run_id, "--params", json.dumps(mp)]
        print(f"[sweep] {mode}: {' '.join(cmd)}", flush=True)
        t = time.perf_counter()
        rc = subprocess.call(cmd)
        print(f"[sweep] {mode}: exit {rc} after {time.perf_counter() - t:.0f} s", flush=True)
        (failed if rc else ran).append(mode)
    if failed:
        raise RuntimeError(f"measuring {', '.join(failed)} failed (rows written before the failure are kept)")
    return ran


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kvrepro.sweep", description="Measured capacity sweep: per KV mode, the most concurrent users served without "
                                 "preemption and their aggregate decode tok/s (the module docstring has the protocol).")
    ap.add_argument("--modes", nargs="+", default=list(ALL_MODES),
                    help=f"modes, space- or comma-separated; allowed: {', '.join(ALL_MODES)}")
    ap.add_argument("--results", required=True, help="JSONL file of this run (resumed if it exists)")
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--params", default="{}",
                    help="JSON object overriding the sweep parameters; keys and defaults: "
                         + ", ".join(f"{k}={v!r}" for k, v in DEFAULT_PARAMS.items()))
    ap.add_argument("--confirm-edge", default="", help="comma-separated modes that also run the N+1 check")
    ap.add_argument("--sizing-only", default="", help="comma-separated modes: KV-cache size only")
    ap.add_argument("--timeout-s", type=float, default=540.0, help="wall seconds per mode")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall seconds for the whole call: modes that no longer fit are left for a resumed call")
    ap.add_argument("--min-start-s", default="{}",
                    help="JSON {mode: seconds}: start a mode only with this much budget left (over MIN_START_S)")
    ap.add_argument("--mode-params", default="{}",
                    help="JSON {mode: {param: value}} overriding --params for single modes")
    a = ap.parse_args(argv)
    parsed = {}
    for flag, text in (("--params", a.params), ("--mode-params", a.mode_params),
                       ("--min-start-s", a.min_start_s)):
        try:
            parsed[flag] = json.loads(text)
        except json.JSONDecodeError as e:
            ap.error(f"{flag} must be a JSON object: {e}")
        if not isinstance(parsed[flag], dict):
            ap.error(f"{flag} must be a JSON object, e.g. '{{\"gpu_memory_gb\": 40}}'")
    if not all(isinstance(v, dict) for v in parsed["--mode-params"].values()):
        ap.error("--mode-params must map each mode to a JSON object")
    modes = [m.strip() for arg in a.modes for m in arg.split(",")]
    if not all(modes):
        ap.error(f"--modes has an empty item: {' '.join(a.modes)!r}; allowed: {', '.join(ALL_MODES)}")
    try:
        run_sweep(modes, a.results, a.run_id, parsed["--params"],
                  confirm_edge=[m for m in a.confirm_edge.split(",") if m],
                  sizing_only=[m for m in a.sizing_only.split(",") if m], timeout_s=a.timeout_s,
                  budget_s=a.budget_s, param_overrides=parsed["--mode-params"],
                  min_start_s=parsed["--min-start-s"])
    except (ValueError, RuntimeError) as e:
        print(f"error: {_flag_names(str(e))}", file=sys.stderr)
        return 2
    return 0


# run_sweep's argument names as main's flags (the sweep parameters keep their names: they are --params' JSON keys)
_FLAGS = {"results_path": "--results", "run_id": "--run-id", "confirm_edge": "--confirm-edge",
          "sizing_only": "--sizing-only", "timeout_s": "--timeout-s", "budget_s": "--budget-s",
          "min_start_s": "--min-start-s", "param_overrides": "--mode-params", "modes": "--modes"}


def _flag_names(message: str) -> str:
    """``run_sweep``'s message with each of its argument names written as the flag a user typed, where the message
    names it (before ':', '[', ' must', ' and', ' both', ' {', ' ''), never inside quoted or listed values."""
    import re

    names = sorted(_FLAGS, key=len, reverse=True)
    return re.sub(r"(?<![\w'\-\[])(" + "|".join(names) + r")(?=:|\[| must| and | both| \{| ')",
                  lambda m: _FLAGS[m.group(1)], message)


if __name__ == "__main__":
    from kvrepro import cli

    raise SystemExit(cli.run(main))
