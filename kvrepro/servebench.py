"""Serving under load (issue 23): ``vllm serve`` per KV mode at the sweep's memory budget, driven by vLLM 0.20.2's own
benchmark client (``vllm bench serve``, ``vllm/benchmarks/serve.py``), and the table of its results. CPU-side logic
only; ``scripts/serve_bench.py`` runs the servers and the client on the GPU machine.

The workload: ``num_prompts`` requests, prompt lengths drawn uniformly from ``[input_min, input_max]`` tokens (8K to 128K
by default), ``output_len`` tokens each (``--ignore-eos``), arriving at ``request_rate`` per second (Poisson, vLLM's
``--burstiness 1``; ``inf`` = all at once), against a server on the bundled Qwen3-4B config with dummy weights at the
emulated card (``kvrepro.sweep.memory_utilization``), 16-token blocks, prefix caching off, ``max_num_seqs``.

Two things differ from a plain ``vllm bench serve --dataset-name random`` call, both because no Qwen3 tokenizer exists
on the GPU machine (no model hub; the server runs with ``--skip-tokenizer-init``, as ``tests/test_reach_serve_gpu.py``):

- the prompts are token ids (``token_prompts``: distinct random ids per request, lengths from
  ``input_lengths``, the same uniform integer draw as vLLM's RandomDataset, ``vllm/benchmarks/datasets/utils.py``
  ``get_sampling_params``), handed to vLLM's client in place of ``get_samples``' output; the OpenAI completions
  endpoint takes a list of token ids as ``prompt``;
- vLLM's client prints and saves TTFT / TPOT / ITL percentiles only when it holds a tokenizer (``benchmark()``,
  ``if task_type == TaskType.GENERATION and tokenizer``), which it would use only to count output tokens when the
  server reports no usage. The server streams usage (``stream_options.include_usage``), so the client is given
  :class:`UsageOnlyTokenizer`, which raises if it is ever asked to tokenize.

Everything else (request timing, arrival process, the metrics, goodput at the ``--goodput`` SLOs, ``--save-result``)
is vLLM's code. ``bench_argv`` builds the argument list of ``vllm bench serve``; the result records it.

Goodput (vLLM's): completed requests per second whose TPOT (and any other SLO given) is within the SLO, here
``tpot:50`` (ms). Preemptions: ``vllm:num_preemptions`` from the server's ``/metrics`` before and after the client.
"""
from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

from kvrepro import sweep
from kvrepro.formats import DEFAULT_PRESET
from kvrepro.listarg import comma_list
from kvrepro.style import formatted

SERVE_MODES = tuple(m for m in sweep.ALL_MODES if not m.startswith("turboquant"))
DEFAULT_MODES = ("fp8:flash_attn", "kvrepro:k4v4")
DEFAULT_MODE = f"kvrepro:{DEFAULT_PRESET}"        # the kvrepro mode a user gets without setting a preset
GOODPUT_NAMES = ("ttft", "tpot", "e2el")   # vLLM 0.20.2 check_goodput_args VALID_NAMES
PERCENTILES = (50, 99)
# Default rate: all at once. The rates an H200 sustains at these prompt lengths are prefill-bound (a 128K prefill of
# Qwen3-4B takes ~10 s there, notes/vllm.md: ~0.2 requests/s at the mean of 8K-128K), and at such a rate a request
# decodes long before the next arrives, so the KV cache fills only with outputs of thousands of tokens; a burst fills
# it as the queued prefills complete. Finite rates are given with --request-rates.
DEFAULTS = {"num_prompts": 32, "input_min": 8192, "input_max": 131072, "output_len": 1024, "request_rates": ("inf",),
            "goodput": ("tpot:50",), "gpu_memory_gb": 80.0, "max_num_seqs": 32, "block_size": 16, "seed": 0}
# Workload fields a results file's runs must share to be compared in one table (check_same_workload).
WORKLOAD_FIELDS = ("num_prompts", "input_min", "input_max", "output_len", "goodput", "gpu_memory_gb", "max_num_seqs",
                   "block_size", "seed", "model", "gpu", "vllm_version")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_rate(text) -> float:
    """``"0.5"`` -> 0.5, ``"inf"`` -> inf (vLLM's ``--request-rate``: requests per second, inf = all at once).

    Raises:
        ValueError: not a number > 0 or ``inf`` (naming ``request_rates``).
    """
    try:
        v = float(text)
    except (TypeError, ValueError):
        v = float("nan")
    if math.isinf(v) and str(text).strip().lower() not in ("inf", "+inf"):
        raise ValueError(f"request_rates: {text!r} overflows a float to infinity; write 'inf' for every request at once")
    if not (v > 0):
        raise ValueError(f"request_rates: each must be a number of requests per second > 0 or 'inf', got {text!r}")
    return v


def parse_goodput(items) -> dict[str, float]:
    """``["tpot:50"]`` -> ``{"tpot": 50.0}`` (vLLM's ``--goodput KEY:VALUE`` in ms).

    Raises:
        ValueError: an item not ``name:value``, a name outside ``GOODPUT_NAMES`` or given twice, a value <= 0.
            Items may also be comma-separated within one string (``"tpot:50,ttft:30000"``).
    """
    out = {}
    for item in [x for it in items for x in str(it).split(",") if x.strip()]:   # "tpot:50 ttft:30000" or commas
        name, _, val = item.strip().partition(":")
        try:
            v = float(val)
        except ValueError:
            raise ValueError(f"goodput: {item!r} is not NAME:MILLISECONDS (e.g. tpot:50)") from None
        if name not in GOODPUT_NAMES:
            raise ValueError(f"goodput: unknown SLO {name!r}; allowed: {', '.join(GOODPUT_NAMES)}")
        if v <= 0 or not math.isfinite(v):  # an SLO of 0 ms no request meets
            raise ValueError(f"goodput: {name} must be a finite number of ms > 0, got {val!r}")
        if name in out:
            raise ValueError(f"goodput: {name} is given more than once ({items})")
        out[name] = v
    return out


def check_config(cfg: dict) -> dict:
    """Validate a serving benchmark's settings (``DEFAULTS`` names, merged over the defaults) and the modes.

    Returns:
        the merged dict with ``modes`` (tuple), ``request_rates`` (tuple of floats), ``goodput`` (dict).

    Raises:
        ValueError: naming the parameter and its allowed values: modes from ``SERVE_MODES`` (each once);
            num_prompts, output_len, max_num_seqs integers >= 1; 1 <= input_min <= input_max integers; request_rates
            non-empty, each once (:func:`parse_rate`); goodput (:func:`parse_goodput`); gpu_memory_gb finite > 0;
            block_size in
            (16, 32, 64); seed an integer >= 0.
    """
    unknown = sorted(set(cfg) - set(DEFAULTS) - {"modes"})
    if unknown:
        raise ValueError(f"unknown serve-bench setting(s) {unknown}; allowed: {sorted(DEFAULTS) + ['modes']}")
    c = {**DEFAULTS, "modes": DEFAULT_MODES, **cfg}
    modes = comma_list(c["modes"], "modes") if isinstance(c["modes"], str) else list(c["modes"])
    bad = [m for m in modes if m not in SERVE_MODES]
    if not modes or bad:
        raise ValueError(f"modes: {bad or 'none given'}; allowed: {', '.join(SERVE_MODES)}")
    if len(set(modes)) != len(modes):
        raise ValueError(f"modes: {modes} names a mode more than once")
    for name in ("num_prompts", "output_len", "max_num_seqs", "input_min", "input_max"):
        if not _is_int(c[name]) or c[name] < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {c[name]!r}")
    if c["input_min"] > c["input_max"]:
        raise ValueError(f"input_min ({c['input_min']}) must be <= input_max ({c['input_max']})")
    g = c["gpu_memory_gb"]
    if isinstance(g, bool) or not isinstance(g, (int, float)) or not g > 0 or not math.isfinite(g):
        raise ValueError(f"gpu_memory_gb must be a number of GiB > 0, got {g!r}")
    if c["block_size"] not in (16, 32, 64):
        raise ValueError(f"block_size must be one of (16, 32, 64), got {c['block_size']!r}")
    if not _is_int(c["seed"]) or c["seed"] < 0:       # numpy's default_rng draws the prompts: seeds >= 0
        raise ValueError(f"seed must be an integer >= 0, got {c['seed']!r}")
    rates = (comma_list(c["request_rates"], "request_rates") if isinstance(c["request_rates"], str)
             else list(c["request_rates"]))
    if not rates:
        raise ValueError("request_rates must name at least one rate (requests per second, or inf)")
    parsed = tuple(parse_rate(r) for r in rates)
    if len(set(parsed)) != len(parsed):
        raise ValueError(f"request_rates: {rates} names a rate more than once (each rate's run and result file is one)")
    return dict(c, modes=tuple(modes), request_rates=parsed,
                goodput=parse_goodput(c["goodput"] if not isinstance(c["goodput"], str) else c["goodput"].split()))


def input_lengths(num: int, lo: int, hi: int, seed: int):
    """``num`` prompt lengths drawn uniformly from the integers ``[lo, hi]`` (``numpy.random.default_rng(seed)``), as
    vLLM's RandomDataset draws its input lengths. Returns a list of ints."""
    import numpy as np

    return [int(x) for x in np.random.default_rng(seed).integers(lo, hi + 1, size=num)]


def token_prompts(lengths, vocab_size: int, seed: int) -> list[list[int]]:
    """One prompt of random token ids in ``[1000, vocab_size - 1000)`` per length, distinct per request (the sweep's
    ``make_prompt`` range), from ``numpy.random.default_rng([seed, i])``."""
    import numpy as np

    return [np.random.default_rng([seed, i]).integers(1000, vocab_size - 1000, size=n).tolist()
            for i, n in enumerate(lengths)]


def random_dataset_equivalent(lo: int, hi: int) -> dict:
    """vLLM's ``--random-input-len`` / ``--random-range-ratio`` whose uniform range is ``[lo, hi]``: mean (lo + hi) / 2,
    ratio (hi - lo) / (hi + lo) (``get_sampling_params``: [floor(mean (1 - r)), ceil(mean (1 + r))], no special
    tokens)."""
    return {"random_input_len": (lo + hi) // 2, "random_range_ratio": (hi - lo) / (hi + lo)}


def serve_argv(mode: str, model_dir: str, port: int, util: float, max_model_len: int, cfg: dict) -> tuple[list, dict]:
    """``vllm serve`` arguments (after ``python3 -m vllm.entrypoints.cli.main``) and the extra environment of a mode:
    dummy weights, no tokenizer, the emulated budget, the mode's KV dtype and backend (``kvrepro.sweep.engine_settings``;
    kvrepro's preset through ``KVREPRO_PRESET``, its plugin loaded by vLLM's entry point), prefix caching off."""
    s = sweep.engine_settings(mode)
    argv = ["serve", model_dir, "--load-format", "dummy", "--skip-tokenizer-init", "--host", "127.0.0.1",
            "--port", str(port), "--gpu-memory-utilization", f"{util:.6f}", "--max-model-len", str(max_model_len),
            "--max-num-seqs", str(cfg["max_num_seqs"]), "--block-size", str(cfg["block_size"]),
            "--kv-cache-dtype", s["kv_cache_dtype"], "--no-enable-prefix-caching", "--seed", str(cfg["seed"]),
            "--served-model-name", "model"]
    if s["attention_backend"]:
        argv += ["--attention-backend", s["attention_backend"]]
    return argv, dict(s["env"])


def bench_argv(base_url: str, model_dir: str, rate: float, cfg: dict, result_dir: str, result_file: str) -> list[str]:
    """The ``vllm bench serve`` arguments of one run (vLLM 0.20.2's flags, ``vllm/benchmarks/serve.py`` add_cli_args and
    ``vllm/benchmarks/datasets/datasets.py``): the random dataset's lengths (:func:`random_dataset_equivalent`, replaced
    by token-id prompts of :func:`input_lengths`), ``--ignore-eos``, greedy, the rate, the goodput SLOs, TTFT / TPOT /
    ITL / E2EL at p50 and p99, ``--save-result --save-detailed`` into ``result_dir/result_file``; no ready-check request
    (``--ready-check-timeout-sec 0``: the caller has waited for ``/health``, and the check would prefill one more long
    prompt before the timed run)."""
    eq = random_dataset_equivalent(cfg["input_min"], cfg["input_max"])
    return ["--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions", "--model", model_dir,
            "--served-model-name", "model", "--dataset-name", "random", "--num-prompts", str(cfg["num_prompts"]),
            "--random-input-len", str(eq["random_input_len"]), "--random-range-ratio", f"{eq['random_range_ratio']:.6f}",
            "--random-output-len", str(cfg["output_len"]), "--ignore-eos", "--temperature", "0",
            "--request-rate", "inf" if math.isinf(rate) else f"{rate:g}", "--burstiness", "1.0",
            "--goodput", *[f"{k}:{v:g}" for k, v in cfg["goodput"].items()],
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", ",".join(map(str, PERCENTILES)),
            "--seed", str(cfg["seed"]), "--disable-tqdm", "--ready-check-timeout-sec", "0",
            "--save-result", "--save-detailed",
            "--result-dir", result_dir, "--result-filename", result_file]


class UsageOnlyTokenizer:
    """Stands in for a tokenizer in vLLM's benchmark client (module docstring): truthy, so the client reports latency
    percentiles; raises if the client tries to tokenize (it would only to count output tokens without usage)."""

    def __call__(self, *a, **k):
        raise RuntimeError("the benchmark client tried to tokenize: the server sent no usage, so output tokens cannot "
                           "be counted without a tokenizer")

    def __bool__(self) -> bool:
        return True


def prometheus_sum(text: str, name: str) -> float:
    """Sum over label sets of the Prometheus samples of ``name`` (or ``name_total``) in a ``/metrics`` page.

    Raises:
        ValueError: no such sample (naming it).
    """
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        metric = line.split("{")[0].split(" ")[0]
        if metric in (name, name + "_total"):
            total += float(line.rsplit(" ", 1)[1])
            seen = True
    if not seen:
        raise ValueError(f"{name} not in /metrics")
    return total


def cache_info(text: str) -> dict:
    """``vllm:cache_config_info``'s labels from a ``/metrics`` page: num_gpu_blocks, block_size (ints), kv_tokens
    (their product), cache_dtype.

    Raises:
        ValueError: the metric is missing.
    """
    line = next((ln for ln in text.splitlines() if ln.startswith("vllm:cache_config_info{")), None)
    if line is None:
        raise ValueError("vllm:cache_config_info not in /metrics")
    labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
    blocks, bs = int(labels["num_gpu_blocks"]), int(labels["block_size"])
    return {"num_gpu_blocks": blocks, "block_size": bs, "kv_tokens": blocks * bs, "cache_dtype": labels.get("cache_dtype")}


def summarize(vllm_result: dict) -> dict:
    """The figures of one ``vllm bench serve`` result (its ``--save-result`` JSON): completed, failed, duration_s,
    request_throughput (req/s), output_throughput (tok/s), request_goodput (req/s), ttft / tpot / itl / e2el p50 and
    p99 (ms; vLLM's keys ``p50_ttft_ms`` ... ), mean ttft / tpot (ms), max_concurrent_requests.

    Raises:
        ValueError: a key vLLM always writes for a generation run is missing (naming it): the result is not one.
    """
    need = ("completed", "failed", "duration", "request_throughput", "output_throughput")
    missing = [k for k in need if k not in vllm_result]
    if missing:
        raise ValueError(f"not a vllm bench serve result: missing {missing}")
    out = {"completed": vllm_result["completed"], "failed": vllm_result["failed"],
           "duration_s": vllm_result["duration"], "request_throughput": vllm_result["request_throughput"],
           "output_throughput": vllm_result["output_throughput"],
           "request_goodput": vllm_result.get("request_goodput"),
           "max_concurrent_requests": vllm_result.get("max_concurrent_requests")}
    for m in ("ttft", "tpot", "itl", "e2el"):
        out[f"mean_{m}_ms"] = vllm_result.get(f"mean_{m}_ms")
        for p in PERCENTILES:
            out[f"p{p}_{m}_ms"] = vllm_result.get(f"p{p}_{m}_ms")
    return out


STALL_FACTOR = 2.0    # an inter-token gap longer than this x the run's median gap: the step also ran prefill work


def stall_split(vllm_result: dict, factor: float = STALL_FACTOR) -> dict:
    """Where a run's inter-token time went, from vLLM's per-request inter-token latencies (``itls``, seconds, in
    its ``--save-result`` JSON). vLLM's scheduler (chunked prefill) puts prefill chunks into the same steps as the
    running requests' decodes, so a gap longer than ``factor`` x the median gap is a step that carried prefill work;
    the median gap is a decode-only step.

    Returns:
        dict: step_p50_ms (median gap, ms), stalled_share (fraction of all inter-token time in the long gaps),
        stalled_gaps (their count), stalled_p50_ms (their median, ms; None without any), gaps (count of all).

    Raises:
        ValueError: no ``itls`` list with at least one gap, or ``factor`` not a number > 1.
    """
    import statistics

    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 1:
        raise ValueError(f"factor must be a number > 1, got {factor!r}")
    itls = vllm_result.get("itls")
    gaps = [float(x) for r in itls for x in r] if isinstance(itls, list) else []
    if not gaps:
        raise ValueError("the vllm bench serve result has no inter-token latencies ('itls'): cannot split its steps")
    med = statistics.median(gaps)
    long = [g for g in gaps if g > factor * med]
    return {"step_p50_ms": 1e3 * med, "stalled_share": sum(long) / sum(gaps), "stalled_gaps": len(long),
            "stalled_p50_ms": 1e3 * statistics.median(long) if long else None, "gaps": len(gaps)}


def slo_goodput(vllm_result: dict, slos: dict[str, float]) -> dict:
    """Goodput at ``slos`` (``{"ttft" | "tpot": ms}``) recomputed from a ``vllm bench serve`` result's per-request
    lists (``--save-detailed``), by vLLM 0.20.2's rule (``vllm/benchmarks/serve.py`` ``calculate_metrics``): a request
    is good when it completed (output tokens > 0) and each of its metrics is within its SLO; TPOT is the time from the
    first token to the last over the output tokens after the first (here the sum of the request's inter-token gaps,
    ``itls``; 0 for a one-token output). So the same run can be scored at other SLOs than the ones it ran with (e.g.
    the TPOT SLO alone of a run with a TTFT SLO too).

    Returns:
        dict: good (requests), req_s (good / the run's ``duration``, s).

    Raises:
        ValueError: an SLO name outside ttft / tpot or a negative SLO; a result without ``duration`` or without
            ``ttfts``, ``itls`` and ``output_lens`` lists of one length.
    """
    bad = sorted(set(slos) - {"ttft", "tpot"})
    if bad or not slos:
        raise ValueError(f"slos: {bad or 'none given'}; allowed: ttft, tpot (ms)")
    if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0 for v in slos.values()):
        raise ValueError(f"slos: each must be a number of ms >= 0, got {slos}")
    lists = [vllm_result.get(k) for k in ("ttfts", "itls", "output_lens")]
    dur = vllm_result.get("duration")
    if not all(isinstance(x, list) for x in lists) or len({len(x) for x in lists}) != 1 \
            or isinstance(dur, bool) or not isinstance(dur, (int, float)) or not dur > 0:
        raise ValueError("the vllm bench serve result lacks its per-request lists (ttfts, itls, output_lens of one "
                         "length; --save-detailed) or its duration (s > 0)")
    good = 0
    for ttft, itl, n in zip(*lists):
        if not n:
            continue
        tpot = sum(itl) / (n - 1) if n > 1 else 0.0
        if ("ttft" not in slos or ttft <= slos["ttft"] / 1e3) and ("tpot" not in slos or tpot <= slos["tpot"] / 1e3):
            good += 1
    return {"good": good, "req_s": good / float(vllm_result["duration"])}


def side_dirs(out: str | os.PathLike) -> tuple[Path, Path]:
    """Beside a results file ``out``: the folders of vLLM's own result files (``<stem>_vllm/``) and of the servers'
    logs (``<stem>_logs/``), where ``scripts/serve_bench.py`` writes them and :func:`read_results` reads them."""
    out = Path(out)
    return out.with_name(out.stem + "_vllm"), out.with_name(out.stem + "_logs")


def server_log(out: str | os.PathLike, mode: str) -> Path:
    """The log of ``mode``'s server beside ``out``: ``<stem>_logs/serve_<mode, ':' as '_'>.log``."""
    return side_dirs(out)[1] / f"serve_{mode.replace(':', '_')}.log"


# What the table and the README read from each run of a results file (read_doc checks them).
RUN_KEYS = ("mode", "request_rate", "summary", "preemptions", "workload")
SUMMARY_KEYS = ("completed", "failed", "duration_s", "request_throughput", "output_throughput")


def read_doc(path, empty_runs: bool = False) -> dict:
    """A serve-bench result file (``scripts/serve_bench.py``'s JSON, ``{"runs": [...], ...}``) as a dict; ``empty_runs``
    accepts an empty ``runs`` list.

    Raises:
        ValueError: naming the file: not JSON; no ``runs`` list (or an empty one) or no ``workload`` object; a run
            that is not a dict or lacks
            one of ``RUN_KEYS``, or whose ``summary`` lacks one of ``SUMMARY_KEYS`` or whose ``workload`` is not a
            dict (naming the run and the keys).
    """
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{p}: not a serve-bench result (not JSON: {e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list) or not (data["runs"] or empty_runs):
        raise ValueError(f"{p}: not a serve-bench result (no 'runs' list, or an empty one)")
    if not isinstance(data.get("workload"), dict):
        raise ValueError(f"{p}: not a serve-bench result (no 'workload' object)")
    for i, r in enumerate(data["runs"]):
        if not isinstance(r, dict):
            raise ValueError(f"{p}: run {i} is not an object")
        missing = [k for k in RUN_KEYS if k not in r]
        if not missing:
            missing = ([f"summary.{k}" for k in SUMMARY_KEYS if k not in r["summary"]]
                       if isinstance(r["summary"], dict) else ["summary (not an object)"])
            missing += [] if isinstance(r["workload"], dict) else ["workload (not an object)"]
        if missing:
            raise ValueError(f"{p}: run {i} ({r.get('mode', '?')}, rate {r.get('request_rate', '?')}) lacks "
                             f"{', '.join(missing)}")
    return data


def read_results(paths) -> list[dict]:
    """The runs of serve-bench result files (``scripts/serve_bench.py``'s JSON: ``{"runs": [...], ...}``), each run
    with ``source_file`` added, ``stalls`` (:func:`stall_split` of its vLLM result file, :func:`side_dirs`; None where
    that file is not there), ``goodput_tpot_alone`` (req/s, :func:`slo_goodput` of that file at the workload's TPOT
    SLO alone, where the run had a TPOT SLO and others; else None), ``kvrepro_settings`` (:func:`logged_settings` of
    its :func:`server_log`) and ``attention_backend_used`` (the run's own record, else :func:`logged_backend` of that
    log; None where neither is there).

    Raises:
        ValueError: a file that is not JSON or has no ``runs`` list or an empty one (naming it).
    """
    runs = []
    for p in paths:
        p = Path(p)
        for r in read_doc(p)["runs"]:
            res = side_dirs(p)[0] / str(r.get("vllm_result_file", ""))
            detail = json.loads(res.read_text(encoding="utf-8")) if res.is_file() else None
            slos = (r.get("workload") or {}).get("goodput") or {}
            tpot_alone = (slo_goodput(detail, {"tpot": slos["tpot"]})["req_s"]
                          if detail is not None and "tpot" in slos and len(slos) > 1 else None)
            log = server_log(p, str(r.get("mode", "")))
            runs.append(dict(r, source_file=str(p), stalls=stall_split(detail) if detail is not None else None,
                             goodput_tpot_alone=tpot_alone, kvrepro_settings=logged_settings(log),
                             attention_backend_used=r.get("attention_backend_used") or logged_backend(log)))
    return runs


# vllm/platforms/cuda.py 0.20.2: the backend asked for, and the one chosen when none was asked for
BACKEND_LINE = re.compile(r"Using AttentionBackendEnum\.(\w+) backend|Using (\w+) attention backend out of potential")


def logged_backend(log_path: str | os.PathLike) -> str | None:
    """The attention backend a vLLM 0.20.2 server ran, from its log (``vllm/platforms/cuda.py``: ``Using
    AttentionBackendEnum.<NAME> backend.`` where one was asked for, ``CUSTOM`` for kvrepro's plugin; ``Using <NAME>
    attention backend out of potential backends`` where vLLM chose); None where the file or the line is not there.

    Raises:
        ValueError: the log names two different backends (naming them): one server, one backend."""
    p = Path(log_path)
    if not p.is_file():
        return None
    found = sorted({a or b for a, b in BACKEND_LINE.findall(p.read_text(encoding="utf-8", errors="replace"))})
    if len(found) > 1:
        raise ValueError(f"{p}: the server log names several attention backends ({', '.join(found)})")
    return found[0] if found else None


def logged_settings(log_path: str | os.PathLike) -> dict | None:
    """The settings line the plugin logs at engine start (``kvrepro.settings.described_in``), from a server log;
    None where the file or the line is not there (fp8 and bf16 servers)."""
    from kvrepro.settings import described_in

    p = Path(log_path)
    return described_in(p.read_text(encoding="utf-8", errors="replace")) if p.is_file() else None


def check_same_workload(runs: list[dict]) -> None:
    """Refuse runs that do not share ``WORKLOAD_FIELDS`` (their ``workload`` dicts): their goodput does not compare.

    Raises:
        ValueError: naming the field and the values found.
    """
    for f in WORKLOAD_FIELDS:
        vals = sorted({json.dumps(r["workload"].get(f), sort_keys=True) for r in runs})
        if len(vals) > 1:
            raise ValueError(f"the runs differ in {f} ({', '.join(vals)}): one table compares one workload")


def serve_table(runs: list[dict]):
    """The serving table: one row per (mode, request rate), fp8 modes first, then the default preset's
    (``DEFAULT_MODE``), then by mode and rate.

    Columns: mode, key_offset (a kvrepro server's, from its logged settings: :func:`logged_settings`; else None),
    backend (the run's ``attention_backend_used``, with "(vLLM's choice)" where the server was not asked for one;
    without it, what the server was asked for, ``vllm-auto`` for vLLM's choice), request_rate (req/s asked;
    inf = all at once), req_s, out_tok_s, ttft_p50_ms, ttft_p99_ms, tpot_p50_ms, tpot_p99_ms, preemptions, kv_peak and
    waiting_peak (the highest KV-cache use, a fraction, and the most requests waiting, of the server's ``/metrics``
    samples every 2 s, which start at 0; None in a run recorded without them), goodput_req_s
    (vLLM's, at the SLOs in ``slo``), goodput_vs_best_fp8 (goodput over the highest goodput of any fp8 mode at the same
    rate; None where no fp8 mode ran at that rate or its goodput is 0), best_fp8 (that mode), goodput_tpot_req_s and
    goodput_tpot_vs_best_fp8 (the same at the TPOT SLO alone: the run's ``goodput_tpot_alone``, :func:`read_results`;
    None where the run had no other SLO or its vLLM result file is missing), step_p50_ms and
    stalled_share (:func:`stall_split`: the median inter-token gap, and the share of inter-token time in steps that
    also ran prefill; None without the run's vLLM result file), completed, failed, good_requests (the requests that
    met every SLO: vLLM's goodput x the run's duration, rounded; None without a goodput), good_tpot_requests and
    best_fp8_tpot (the same count at the TPOT SLO alone, and the fp8 mode with the highest such goodput at the rate),
    duration_s (the run's, s), kv_tokens, slo (in words), workload_goodput (the SLOs, ``{name: ms}``).

    Raises:
        ValueError: runs of different workloads (:func:`check_same_workload`) or no runs.
    """
    import pandas as pd

    if not runs:
        raise ValueError("no serve-bench runs to tabulate")
    check_same_workload(runs)
    rows = []
    for r in runs:
        s = r["summary"]
        offset = (r.get("kvrepro_settings") or {}).get("key_offset")
        asked, used = r.get("attention_backend") or "vllm-auto", r.get("attention_backend_used")
        rows.append({"mode": r["mode"], "key_offset": offset,
                     "backend": asked if not used else (f"{used} (vLLM's choice)" if asked == "vllm-auto" else used),
                     "request_rate": parse_rate(r["request_rate"]), "req_s": s["request_throughput"],
                     "out_tok_s": s["output_throughput"], "ttft_p50_ms": s.get("p50_ttft_ms"),
                     "ttft_p99_ms": s.get("p99_ttft_ms"), "tpot_p50_ms": s.get("p50_tpot_ms"),
                     "tpot_p99_ms": s.get("p99_tpot_ms"), "preemptions": r["preemptions"],
                     "kv_peak": (r.get("peak") or {}).get("kv_cache_usage_perc"),
                     "waiting_peak": (r.get("peak") or {}).get("num_requests_waiting"),
                     "goodput_req_s": s.get("request_goodput"), "goodput_vs_best_fp8": None, "best_fp8": None,
                     "goodput_tpot_req_s": r.get("goodput_tpot_alone"), "goodput_tpot_vs_best_fp8": None,
                     "step_p50_ms": (r.get("stalls") or {}).get("step_p50_ms"),
                     "stalled_share": (r.get("stalls") or {}).get("stalled_share"),
                     "completed": s["completed"], "failed": s["failed"],
                     "good_requests": (None if _missing(s.get("request_goodput")) else
                                       round(s["request_goodput"] * s["duration_s"])),
                     "good_tpot_requests": (None if _missing(r.get("goodput_tpot_alone")) else
                                            round(r["goodput_tpot_alone"] * s["duration_s"])),
                     "best_fp8_tpot": None, "duration_s": s["duration_s"], "kv_tokens": r.get("kv_tokens"),
                     "slo": ", ".join(f"{k} <= {v:g} ms" for k, v in r["workload"]["goodput"].items()),
                     "workload_goodput": r["workload"]["goodput"]})
    df = pd.DataFrame(rows)
    for rate, g in df.groupby("request_rate"):
        for col, ratio in (("goodput_req_s", "goodput_vs_best_fp8"), ("goodput_tpot_req_s", "goodput_tpot_vs_best_fp8")):
            fp8 = g[g["mode"].isin(sweep.FP8_MODES) & g[col].notna()]
            if not len(fp8):
                continue
            best = fp8.loc[fp8[col].astype(float).idxmax()]
            df.loc[g.index, "best_fp8" if col == "goodput_req_s" else "best_fp8_tpot"] = best["mode"]
            if best[col] > 0:
                df.loc[g.index, ratio] = pd.to_numeric(g[col]) / float(best[col])
    df["_fp8"] = ~df["mode"].isin(sweep.FP8_MODES)
    df["_other"] = df["mode"] != DEFAULT_MODE          # the default preset's rows right after fp8's
    return df.sort_values(["_fp8", "_other", "mode", "request_rate"], kind="stable").drop(
        columns=["_fp8", "_other"]).reset_index(drop=True)


def table_markdown(df) -> str:
    """:func:`serve_table` as a markdown table (ms to one decimal, ratios as ``1.23x``, missing values blank); the
    goodput at the TPOT SLO alone gets its two columns only where some row has it."""
    tpot_alone = "goodput_tpot_req_s" in df and df["goodput_tpot_req_s"].notna().any()
    head = ["mode", "backend", "rate (req/s)", "req/s", "output tok/s", "TTFT p50 (ms)", "TTFT p99 (ms)",
            "TPOT p50 (ms)", "TPOT p99 (ms)", "decode step p50 (ms)", "time in prefill steps", "preemptions",
            "peak KV cache use", "peak waiting", "goodput (req/s)", "goodput vs best fp8", "within SLOs (requests)"]
    if tpot_alone:
        head += ["goodput, TPOT SLO alone (req/s)", "vs best fp8, TPOT SLO alone"]
    lines = ["| " + " | ".join(head) + " |", "| --- | --- | " + " | ".join(["---:"] * (len(head) - 2)) + " |"]
    for _, r in df.iterrows():
        rate = "inf" if math.isinf(r["request_rate"]) else f"{r['request_rate']:g}"
        cells = [
            r["mode"] + formatted(r.get("key_offset"), " ({})"), r["backend"], rate, formatted(r["req_s"], "{:.3f}"),
            formatted(r["out_tok_s"], "{:.1f}"), formatted(r["ttft_p50_ms"], "{:.1f}"),
            formatted(r["ttft_p99_ms"], "{:.1f}"), formatted(r["tpot_p50_ms"], "{:.1f}"),
            formatted(r["tpot_p99_ms"], "{:.1f}"), formatted(r.get("step_p50_ms"), "{:.1f}"),
            formatted(r.get("stalled_share"), "{:.0f}%", 100),
            formatted(r["preemptions"], "{:.0f}"), formatted(r.get("kv_peak"), "{:.0f}%", 100),
            formatted(r.get("waiting_peak"), "{:.0f}"), formatted(r["goodput_req_s"], "{:.3f}"),
            formatted(r["goodput_vs_best_fp8"], "{:.2f}x"),
            "" if _missing(r.get("good_requests")) else _of(r)]
        if tpot_alone:
            cells += [formatted(r["goodput_tpot_req_s"], "{:.3f}"), formatted(r["goodput_tpot_vs_best_fp8"], "{:.2f}x")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# The workload fields that the settings alone decide (the others, e.g. gpu and vllm_version, come from the machine).
CONFIG_WORKLOAD_FIELDS = ("num_prompts", "input_min", "input_max", "output_len", "goodput", "gpu_memory_gb",
                          "max_num_seqs", "block_size", "seed")


def config_workload(cfg: dict) -> dict:
    """The ``CONFIG_WORKLOAD_FIELDS`` of checked settings (:func:`check_config`), as a results file records them."""
    return {k: cfg[k] for k in CONFIG_WORKLOAD_FIELDS}


def check_appendable(doc: dict, cfg: dict) -> None:
    """Refuse, before any GPU work, to add runs of settings ``cfg`` (:func:`check_config`) to a results document whose
    workload differs in a field the settings decide (:func:`merge_runs` would refuse it after the first server).

    Raises:
        ValueError: naming the fields, the file's values and the settings' values."""
    want = json.loads(json.dumps(config_workload(cfg)))
    have = doc.get("workload") or {}
    diff = [k for k in CONFIG_WORKLOAD_FIELDS if have.get(k) != want[k]]
    if diff:
        raise ValueError("it holds another workload: " + "; ".join(f"{k} {have.get(k)!r} there, {want[k]!r} asked"
                                                                    for k in diff) + "; use another --out")


def merge_runs(existing: dict | None, new_runs: list[dict], workload: dict) -> dict:
    """A results document with ``new_runs`` added to ``existing`` (a file of an earlier call, one mode per call):
    a run of the same (mode, request_rate) is replaced. ``workload`` must equal the file's.

    Raises:
        ValueError: the file's workload differs (naming the fields).
    """
    doc = existing or {"workload": workload, "runs": []}
    diff = sorted(k for k in set(workload) | set(doc["workload"]) if workload.get(k) != doc["workload"].get(k))
    if diff:
        raise ValueError(f"the results file holds another workload (differs in {diff}); use another --out")
    keep = [r for r in doc["runs"] if (r["mode"], r["request_rate"]) not in
            {(n["mode"], n["request_rate"]) for n in new_runs}]
    return dict(doc, runs=keep + list(new_runs))


def default_out(gpu: str, when: str, root: str | os.PathLike) -> Path:
    """``results/serve/<gpu slug>_<YYYYmmdd>.json`` under ``root``."""
    slug = "".join(c if c.isalnum() else "-" for c in gpu.lower()).strip("-")
    return Path(root) / "results" / "serve" / f"{slug}_{when}.json"


def workload_groups(root: str | os.PathLike) -> list[dict]:
    """The committed serve-bench runs under ``root``/results/serve/*.json grouped by workload (the files whose runs
    share ``WORKLOAD_FIELDS``), newest group first (by its newest run's date): each a dict with ``paths`` (the files),
    ``runs`` (:func:`read_results`) and ``date``; [] where none is committed.

    Raises:
        ValueError: a file that is not a serve-bench result (:func:`read_doc`) or whose workload lacks a field."""
    groups: dict[str, dict] = {}
    for p in sorted(Path(root, "results", "serve").glob("*.json")):
        runs = read_results([p])
        w = runs[0]["workload"] if runs else {}
        missing = [k for k in WORKLOAD_FIELDS if k not in w]
        if missing:
            raise ValueError(f"{p}: the workload lacks {missing}")
        key = json.dumps({k: w[k] for k in WORKLOAD_FIELDS}, sort_keys=True)
        g = groups.setdefault(key, {"paths": [], "runs": [], "date": ""})
        g["paths"].append(p)
        g["runs"] += runs
        g["date"] = max([g["date"]] + [str(r.get("date", "")) for r in runs])
    return sorted(groups.values(), key=lambda g: g["date"], reverse=True)


def _missing(v) -> bool:
    return v is None or (isinstance(v, float) and v != v)   # a table cell never filled: None or NaN


def _of(row, col: str = "good_requests") -> str:
    """``"22 of 24"``: a table row's requests within the SLOs (``col``) of all it sent."""
    return f"{int(row[col])} of {int(row['completed'] + row['failed'])}"


def _ratio_words(df) -> str:
    """Each kvrepro row of a :func:`serve_table` in a few words: its rate, SLOs and goodput ratios against the best
    fp8 (``"kvrepro:k4v4 at 0.12 requests/s, 1.56x the best fp8's goodput within SLO TTFT <= 30 s and TPOT <= 50 ms,
    1.32x at the TPOT SLO alone"``)."""
    words = []
    for _, r in df[~df["mode"].isin(sweep.FP8_MODES)].iterrows():
        rate = "with every request at once" if r["request_rate"] == float("inf") else \
            f"at {r['request_rate']:g} requests/s"
        ratio = "no ratio" if _missing(r["goodput_vs_best_fp8"]) else f"{r['goodput_vs_best_fp8']:.2f}x"
        alone = "" if _missing(r["goodput_tpot_vs_best_fp8"]) else \
            f", {r['goodput_tpot_vs_best_fp8']:.2f}x at the TPOT SLO alone"
        words.append(f"{r['mode']} {rate}, {ratio} the best fp8's goodput within SLO "
                     f"{_slo_words(r['workload_goodput'])}{alone}")
    return ", ".join(words) or "no kvrepro mode"


def _command(w: dict, df) -> str:
    """The ``scripts/serve_bench.py`` command line of a workload (its modes, rates and every setting that is not
    ``DEFAULTS``'), as a user with vLLM and kvrepro installed runs it."""
    rates = ",".join("inf" if r == float("inf") else f"{r:g}" for r in sorted(df["request_rate"].unique()))
    argv = ["python scripts/serve_bench.py --modes", ",".join(dict.fromkeys(df["mode"]))]
    for k in CONFIG_WORKLOAD_FIELDS:
        if k in ("block_size", "goodput") or w.get(k) == DEFAULTS[k]:
            continue
        argv.append(f"--{k.replace('_', '-')} {w[k]:g}" if isinstance(w[k], float) else f"--{k.replace('_', '-')} {w[k]}")
    argv.append(f"--request-rates {rates}")
    if w["goodput"] != parse_goodput(DEFAULTS["goodput"]):
        argv.append("--goodput " + " ".join(f"{k}:{v:g}" for k, v in w["goodput"].items()))
    return " ".join(argv)


def _slo_words(goodput: dict) -> str:
    return " and ".join(f"{k.upper()} <= " + (f"{v / 1e3:g} s" if v >= 1e3 else f"{v:g} ms")
                        for k, v in goodput.items())


def _tokens_short(n: int) -> str:
    """A prompt length in the README's words: ``131072`` -> ``"128K"`` (a multiple of 1,024), else ``"8,000"``."""
    return f"{n // 1024}K" if n % 1024 == 0 else f"{n:,}"


def _arrivals(rates) -> str:
    """``"at 0.12 requests/s"``, ``"all at once"``, or both joined: how a workload's requests arrived."""
    return " and ".join("all at once" if r == float("inf") else f"at {r:g} requests/s" for r in sorted(rates))


def _within_words(slos: dict) -> str:
    """``"within both SLOs"`` / ``"within every SLO"`` / ``"within the SLO"`` by how many SLOs a workload set."""
    return "within both SLOs" if len(slos) == 2 else ("within every SLO" if len(slos) > 2 else "within the SLO")


def _no_ratio_reason(r, same) -> str | None:
    """Why a kvrepro row of :func:`serve_table` has no goodput ratio (``same``: the fp8 rows of its rate), or None
    where it has one."""
    if not len(same):
        return "no fp8 mode ran at this rate"
    if _missing(r["best_fp8"]):
        return "no fp8 mode recorded a goodput at this rate"
    if _missing(r["goodput_req_s"]):
        return "its goodput was not recorded"
    if _missing(r["goodput_vs_best_fp8"]):
        return "every fp8 mode's goodput was 0"
    return None


def _readme_table(df, slos: dict) -> str:
    """The README's serving table: per mode (and rate, where the workload ran several) the requests within the SLOs of
    all sent, the goodput, its ratio to the best fp8 at that rate, the requests within the TPOT SLO alone (where the
    workload had another SLO too), the run's length and its preemptions (where recorded)."""
    rates = df["request_rate"].nunique() > 1
    one_fp8 = df[df["mode"].isin(sweep.FP8_MODES)].groupby("request_rate").size().max() == 1
    tpot_alone = len(slos) > 1 and "tpot" in slos and df["good_tpot_requests"].notna().any()
    preempt = df["preemptions"].notna().any()
    # &nbsp;: at GitHub's README width the table wraps its headers, and "vs / fp8" on two lines reads badly
    head = (["mode (attention backend)"] + (["rate (req/s)"] if rates else [])
            + [_within_words(slos), "goodput (req/s)", "vs&nbsp;fp8" if one_fp8 else "vs best&nbsp;fp8"]
            + (["within TPOT SLO alone"] if tpot_alone else []) + ["run length (s)"]
            + (["preemptions"] if preempt else []))
    lines = ["| " + " | ".join(head) + " |", "| --- | " + " | ".join(["---:"] * (len(head) - 1)) + " |"]
    for _, r in df.iterrows():
        backend = str(r["backend"]).replace(" (vLLM's choice)", ", vLLM's choice")
        name = f"{r['mode']} ({backend}{'; default preset' if r['mode'] == DEFAULT_MODE else ''})"
        cells = ([name] + (["inf" if math.isinf(r["request_rate"]) else f"{r['request_rate']:g}"] if rates else [])
                 + ["" if _missing(r["good_requests"]) else _of(r),
                    formatted(r["goodput_req_s"], "{:.3f}"), formatted(r["goodput_vs_best_fp8"], "{:.2f}x")]
                 + (["" if _missing(r["good_tpot_requests"]) else _of(r, "good_tpot_requests")]
                    if tpot_alone else [])
                 + [formatted(r["duration_s"], "{:.0f}")]
                 + ([formatted(r["preemptions"], "{:.0f}")] if preempt else []))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _run_dates(runs: list[dict], order: list[str]) -> str:
    """``", YYYY-MM-DD"`` where every run of a workload ended on one day, else each day's modes (in ``order``):
    ``", runs: fp8:flash_attn DAY1; kvrepro:k5v4 and kvrepro:k4v4 DAY2"``; a day's CUDA fatbins (8 hex
    digits, from the runs' provenance) follow it where recorded. "" where no run has a date."""
    days: dict[str, dict] = {}
    for r in sorted(runs, key=lambda r: order.index(r["mode"])):
        day = str(r.get("date", ""))[:10]
        if day:
            d = days.setdefault(day, {"modes": [], "fatbins": []})
            d["modes"] += [r["mode"]] if r["mode"] not in d["modes"] else []
            fb = (r.get("provenance") or {}).get("cuda_fatbin_sha256")
            d["fatbins"] += [fb[:8]] if fb and fb[:8] not in d["fatbins"] else []

    def fatbins(d):
        return f" (CUDA fatbin {', '.join(d['fatbins'])})" if d["fatbins"] else ""

    if len(days) <= 1:
        return "".join(f", {day}{fatbins(d)}" for day, d in days.items())
    return ", runs: " + "; ".join(f"{' and '.join(d['modes'])} {day}{fatbins(d)}" for day, d in sorted(days.items()))


def readme_text(root: str | os.PathLike) -> str:
    """The README's serving block for the newest committed workload (:func:`workload_groups`): a lead sentence with
    each kvrepro mode's goodput against the best fp8 at its rate (:func:`serve_table`'s ratios, or why there is none),
    the workload and its SLOs; a table of every mode's run (:func:`_readme_table`); what the TPOT SLO alone gives and
    the fp8 backends not run; then the other workloads, the workload's files, date and command. Or a sentence saying
    no run is committed.

    Raises:
        ValueError: as :func:`workload_groups`."""
    groups = workload_groups(root)
    if not groups:
        return ("Under serving load: not measured yet (no `vllm bench serve` run is committed under `results/serve/`; "
                "`python scripts/serve_bench.py --modes MODE` on a GPU machine with vLLM writes one).")
    g = groups[0]
    w = g["runs"][0]["workload"]
    df = serve_table(g["runs"])
    files = ", ".join(f"[{p.name}](results/serve/{p.name})" for p in g["paths"])
    rates = ", ".join("all at once" if r == float("inf") else f"{r:g} requests/s"
                      for r in sorted(df["request_rate"].unique()))
    dates = _run_dates(g["runs"], list(df["mode"]))
    how = (f"`vllm serve` + `vllm bench serve` on one {w['gpu']} at an emulated {w['gpu_memory_gb']:g} GiB, "
           f"{w['model']} with dummy weights: {w['num_prompts']} requests of {w['input_min']:,}-{w['input_max']:,}-"
           f"token prompts arriving at {rates}, {w['output_len']:,} output tokens each ({files}{dates})")
    several_rates = df["request_rate"].nunique() > 1
    fp8 = df[df["mode"].isin(sweep.FP8_MODES)]
    clauses, alone, both_met = [], [], []
    for _, r in df[~df["mode"].isin(sweep.FP8_MODES)].iterrows():
        at = "" if not several_rates else (" with every request at once" if math.isinf(r["request_rate"])
                                           else f" at {r['request_rate']:g} requests/s")
        same = fp8[fp8["request_rate"] == r["request_rate"]]
        fp8s = "fp8's" if len(same) == 1 else f"the best fp8's ({r['best_fp8']})"
        why = _no_ratio_reason(r, same)
        notes = (["the default preset"] if r["mode"] == DEFAULT_MODE else []) + \
            ([] if _missing(r["key_offset"]) else [f"key offset {r['key_offset']}"])
        name = r["mode"] + (f" ({', '.join(notes)})" if notes else "") + at
        goodput = "" if clauses else f" goodput within SLO {_slo_words(w['goodput'])}"
        clauses.append(f"{name} has no ratio to fp8's{goodput} ({why})" if why else
                       f"{name} has **{r['goodput_vs_best_fp8']:.2f}x** {fp8s}{goodput}")
        if why or _missing(r["goodput_tpot_vs_best_fp8"]):
            continue
        bt = same[same["mode"] == r["best_fp8_tpot"]].iloc[0]
        t = r["goodput_tpot_vs_best_fp8"]
        if r["good_tpot_requests"] == bt["good_tpot_requests"]:
            both_met.append((r, bt, at, t))
        else:
            alone.append(f"At the TPOT SLO alone {r['mode']}{at}'s goodput is {t:.2f}x "
                         f"{'fp8' if len(same) == 1 else bt['mode']}'s ({_of(r, 'good_tpot_requests')} requests in "
                         f"{r['duration_s']:.0f} s against {_of(bt, 'good_tpot_requests')} in {bt['duration_s']:.0f} s).")
    if len(both_met) == 1:
        r, bt, at, t = both_met[0]
        alone.insert(0, f"At the TPOT SLO alone {r['mode']}{at} and {bt['mode']} both met it with "
                        f"{_of(r, 'good_tpot_requests')} requests, so the {t:.2f}x goodput there comes only from the "
                        f"run lengths ({r['duration_s']:.0f} s against {bt['duration_s']:.0f} s).")
    elif both_met:      # one sentence, not one per mode saying the same
        fp8_names = list(dict.fromkeys(bt["mode"] for _, bt, _, _ in both_met))
        counts = list(dict.fromkeys(_of(r, "good_tpot_requests") for r, _, _, _ in both_met))
        same_count = f"the same number of requests ({counts[0]})" if len(counts) == 1 else \
            "as many requests as " + ("fp8" if len(fp8_names) == 1 else "its fp8") + " (" + "; ".join(
                f"{r['mode']}{at} {_of(r, 'good_tpot_requests')}" for r, _, at, _ in both_met) + ")"
        alone.insert(0, "At the TPOT SLO alone " + ", ".join(f"{r['mode']}{at}" for r, _, at, _ in both_met)
                     + f" and {' and '.join(fp8_names)} met it with {same_count}, so the goodput ratios there come only "
                     "from the run lengths: " + ", ".join(
                         f"{r['mode']}{at} {t:.2f}x ({r['duration_s']:.0f} s against {bt['duration_s']:.0f} s)"
                         for r, bt, at, t in both_met) + ".")
    lead = ("**Under serving load**, " + ("; ".join(clauses) if clauses else "no kvrepro mode was measured (fp8 only)")
            + f", for {w['num_prompts']} requests of {_tokens_short(w['input_min'])}-{_tokens_short(w['input_max'])}-"
            f"token prompts and {w['output_len']:,} output tokens each arriving {_arrivals(df['request_rate'].unique())}.")
    ran = set(df["mode"]) | {f"fp8:{b.lower()}" for b in df["backend"].str.split(" ").str[0]}
    missing = [m for m in sweep.FP8_MODES if ":" in m and m not in ran]
    after = " ".join([f"Goodput: the requests {_within_words(w['goodput'])} over the run's length."] + alone) \
        + (f"\n\nNot run at this workload: {', '.join(missing)}." if missing else "")
    others = [f"{og['runs'][0]['workload']['output_len']:,} output tokens: {_ratio_words(serve_table(og['runs']))}"
              for og in groups[1:]]
    other = f"\n- The other committed workloads: {'; '.join(others)}." if others else ""
    return (f"{lead}\n\n{_readme_table(df, w['goodput'])}\n\n{after}\n\n"
            f"- One run per mode: a few requests either side of an SLO move these ratios by several percent.{other}\n"
            f"- Workload: {how}; to run it: `{_command(w, df)}`.\n"
            f"- Every mode's throughput, TTFT, TPOT and preemptions, and the other workloads: notebook 02, \"Under "
            f"serving load\"; what they mean: [notes/vllm.md](notes/vllm.md#inside-a-decode-step-and-under-serving-load-"
            f"issue-23).")


def section_markdown(root: str | os.PathLike) -> str:
    """Notebook 02's serving-load section: per workload (the files whose runs share ``WORKLOAD_FIELDS``), newest file
    first, the workload and its SLOs in words and :func:`table_markdown` of its runs, with the files named; or a
    sentence saying no run is committed and which command makes one.

    Raises:
        ValueError: a file's runs differ in workload (:func:`check_same_workload`) or lack a workload field."""
    groups = workload_groups(root)
    if not groups:
        return ("Not measured yet: no `vllm bench serve` run is committed under `results/serve/` "
                "(`python scripts/serve_bench.py --modes MODE` on a GPU machine with vLLM writes one).")
    parts = [f"Decode step p50: the median gap between a request's tokens (a step of decodes only); time in prefill "
             f"steps: the share of all gaps spent in steps longer than {STALL_FACTOR:g}x that median, which also ran "
             f"other requests' prefill chunks (vLLM's chunked prefill mixes them into the decode steps). Goodput: "
             f"vLLM's, the requests per second that met every SLO of the run."]
    for g in groups:
        w = g["runs"][0]["workload"]
        files = ", ".join(f"`{p.relative_to(root)}`" for p in g["paths"])
        total = f" ({w['prompt_tokens_total']:,} in all)" if "prompt_tokens_total" in w else ""
        slo = _slo_words(w["goodput"])
        parts.append(f"#### {w['num_prompts']} requests of {w['output_len']:,} output tokens, SLO {slo}\n\nReplayed "
                     f"from {files}: prompts of {w['input_min']:,}-{w['input_max']:,} tokens{total}, "
                     f"{w['gpu_memory_gb']:g} GiB emulated, {w['model']} (dummy weights), vLLM {w['vllm_version']}, "
                     f"{w['gpu']}.\n\n" + table_markdown(serve_table(g["runs"])))
    return "\n\n".join(parts)
