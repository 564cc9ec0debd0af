"""GPU worker of the capacity sweep: measures one KV mode with one vLLM engine (``kvrepro.sweep`` has the
protocol, rows, file and resume logic; this module drives the engine).

Run one KV mode in this process (vLLM in-process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)::

    python -m kvrepro.sweep_worker --mode kvrepro:k4v4 --results results.jsonl --run-id R

``kvrepro.sweep.run_sweep`` runs each mode in its own subprocess so that GPU memory is fully returned, and decides
which modes a resumed results file still needs. Every row of one call carries the same ``engine_run_id`` (a new
uuid4 hex per engine), so rows of different engine runs are told apart; the worker refuses a results file that
already holds rows of its mode (``run_sweep`` supersedes an incomplete mode's rows before it re-measures it).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import time
import uuid

from kvrepro import sweep
from kvrepro.provenance import src_sha256


def counter(llm, name: str) -> int:
    """Current value of vLLM's counter ``name`` (``llm.get_metrics()``; names that start with it, e.g. with a
    ``_total`` suffix, count too), summed over label sets."""
    total = 0
    for m in llm.get_metrics():
        if m.name.startswith(name):
            total += int(getattr(m, "value", 0))
    return total


def preemptions(llm) -> int:
    """Current value of vLLM's ``vllm:num_preemptions`` counter (summed over label sets)."""
    return counter(llm, "vllm:num_preemptions")


def make_prompt(seed: int, user: int, length: int, vocab_size: int) -> list[int]:
    """A distinct random prompt of ``length`` token ids in ``[1000, vocab_size - 1000)`` per user."""
    import numpy as np

    rng = np.random.default_rng([seed, user])
    return rng.integers(1000, vocab_size - 1000, size=length).tolist()


MEMORY_LOGGERS = ("vllm.v1.worker.gpu_worker", "vllm.v1.worker.gpu_model_runner")


class MemoryLog(logging.Handler):
    """Keeps vLLM's log lines about memory (``sweep.MEMORY_PATTERNS``, CUDA-graph estimates).

    Attached to the ``vllm`` logger; the two worker loggers are lowered to DEBUG so that their
    breakdown lines (first-capture + per-graph estimate, profiling result) are emitted too. vLLM's own
    console handler keeps its level, so the console output does not change."""

    KEYS = ("KV cache", "CUDA graph", "non KV cache", "Maximum concurrency", "memory profiling")

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad log record must not break the measurement
            return
        if any(k.lower() in msg.lower() for k in self.KEYS):
            self.lines.append(msg[:400])

    def attach(self) -> "MemoryLog":
        logging.getLogger("vllm").addHandler(self)
        for name in MEMORY_LOGGERS:
            logging.getLogger(name).setLevel(logging.DEBUG)
        return self


def worker_memory(llm) -> dict:
    """vLLM's memory accounting read from the worker (bytes): weights, peak activations, non-torch,
    CUDA-graph estimate, available KV; {} where the worker is not reachable."""
    def read(w):
        runner = getattr(w, "model_runner", None)
        return {"weights": getattr(runner, "model_memory_usage", None),
                "peak_activation": getattr(w, "peak_activation_memory", None),
                "non_torch": getattr(w, "non_torch_memory", None),
                "cudagraph_estimate": getattr(w, "cudagraph_memory_estimate", None),
                "available_kv_cache": getattr(w, "available_kv_cache_memory_bytes", None),
                "requested": getattr(w, "requested_memory", None)}
    try:
        got = llm.collective_rpc(read)[0]
    except Exception as e:  # noqa: BLE001 - provenance extra, never fatal
        return {"error": str(e)[:200]}
    return {k: int(v) for k, v in got.items() if isinstance(v, (int, float))}


def resolved_backends(llm) -> list[str]:
    """Names of the attention backends the engine's layers resolved to (``AttentionGroup.backend.get_name()`` of the
    worker's model runner, e.g. ``["FLASH_ATTN"]``): what ran where the mode let vLLM choose; [] where the worker is
    not reachable."""
    def read(w):
        groups = getattr(getattr(w, "model_runner", None), "attn_groups", None) or []
        return sorted({g.backend.get_name() for gs in groups for g in gs})
    try:
        return list(llm.collective_rpc(read)[0])
    except Exception:  # noqa: BLE001 - provenance extra, never fatal
        return []


def scheduler_of(llm):
    """vLLM's in-process scheduler (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), or None."""
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    return getattr(core, "scheduler", None)


def free_blocks(llm) -> int | None:
    sched = scheduler_of(llm)
    try:
        return int(sched.kv_cache_manager.block_pool.get_num_free_blocks())
    except AttributeError:
        return None


def is_waiting(llm, rid: str) -> bool | None:
    """Whether request ``rid`` (vLLM may append a suffix) is still in the waiting queue, unscheduled."""
    sched = scheduler_of(llm)
    if sched is None or not hasattr(sched, "waiting"):
        return None
    return any((r.request_id == rid or r.request_id.startswith(rid + "-")) and r.num_computed_tokens == 0
               for r in sched.waiting)


class Runner:
    """Drives an in-process vLLM engine and records token arrival times per request."""

    def __init__(self, llm, decode_tokens: int, margin: int):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self.llm, self.engine = llm, llm.llm_engine
        self.params = SamplingParams(max_tokens=decode_tokens + margin, ignore_eos=True, temperature=0.0,
                                     output_kind=RequestOutputKind.DELTA, detokenize=False)
        self.timelines: dict[str, sweep.Timeline] = {}
        self.finished: set[str] = set()
        self.steps = 0

    def submit(self, rid: str, prompt: list[int]) -> None:
        self.timelines[rid] = sweep.Timeline(submit=time.perf_counter())
        self.engine.add_request(rid, {"prompt_token_ids": prompt}, self.params)

    def step(self) -> float:
        outs = self.engine.step()
        t = time.perf_counter()
        self.steps += 1
        for o in outs:
            rid = o.request_id if o.request_id in self.timelines else o.request_id.rsplit("-", 1)[0]
            n = len(o.outputs[0].token_ids) if o.outputs else 0
            self.timelines[rid].times.extend([t] * n)
            if o.finished:
                self.finished.add(rid)
        return t

    def run_until(self, cond, timeout_s: float) -> float:
        t_end = time.perf_counter() + timeout_s
        t = time.perf_counter()
        while not cond():
            if time.perf_counter() > t_end:
                raise TimeoutError(f"condition not reached within {timeout_s} s (step {self.steps})")
            t = self.step()
        return t

    def abort(self, rids: list[str]) -> None:
        self.engine.abort_request(rids)
        for r in rids:
            self.finished.add(r)


def measure_mode(mode: str, results_path: str, run_id: str, *, model_dir: str | None = None,
                 load_format: str = "dummy", gpu_memory_gb: float = 80.0, prompt_tokens: int = 131072,
                 decode_tokens: int = 1024, max_users: int = 32, window_steps: int = 32,
                 max_num_seqs: int = 32, block_size: int = 16, seed: int = 0, confirm_edge: bool = False,
                 timeout_s: float = 540.0, sizing_only: bool = False, cudagraph_mode: str | None = None) -> list[dict]:
    """Measure one KV mode (module docstring of ``kvrepro.sweep``); appends rows to ``results_path`` as they are
    measured and returns them. Every row carries this engine's ``engine_run_id`` (uuid4 hex) and, for kvrepro
    modes, the backend's settings (``kvrepro_settings``: ``kvrepro.vllm_backend.runtime.settings_record``).

    ``cudagraph_mode``: vLLM's ``compilation_config.cudagraph_mode`` (e.g. ``"PIECEWISE"``); None =
    vLLM's default (FULL_AND_PIECEWISE in 0.20.2). Recorded in every row.

    Raises:
        ValueError: ``results_path`` already holds rows of ``mode`` (checked before vLLM starts: resuming is
            ``kvrepro.sweep.run_sweep``'s job, which supersedes an incomplete mode's rows first).
    """
    held = [r for r in sweep.ResultsFile(results_path).rows if r.get("mode") == mode]
    if held:
        raise ValueError(f"{results_path} already holds {len(held)} {mode} rows; measuring it again here would mix "
                         "two engine runs. Resume through kvrepro.sweep (it supersedes an incomplete mode's rows) "
                         "or use another results file")
    engine_run_id = uuid.uuid4().hex
    settings = sweep.engine_settings(mode)
    os.environ.update(settings["env"])
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    import vllm
    from vllm import LLM

    from kvrepro.configs import config_dir
    from kvrepro.provenance import collect

    t_start = time.perf_counter()
    model_dir = model_dir or str(config_dir())
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        vocab = json.load(f)["vocab_size"]
    total = torch.cuda.get_device_properties(0).total_memory
    util = sweep.memory_utilization(gpu_memory_gb, total)
    # max_tokens beyond decode_tokens: the abort windows (window_steps per user) and the edge check
    # (EDGE_STEPS) decode after the full window; the same for every mode, so max_model_len is too.
    margin = window_steps * max_users + 64 + EDGE_STEPS
    kwargs = dict(model=model_dir, load_format=load_format, skip_tokenizer_init=True, seed=seed,
                  max_model_len=sweep.max_model_len(dict(prompt_tokens=prompt_tokens, decode_tokens=decode_tokens,
                                                         window_steps=window_steps, max_users=max_users)),
                  gpu_memory_utilization=util,
                  kv_cache_dtype=settings["kv_cache_dtype"], enable_prefix_caching=False,
                  max_num_seqs=max_num_seqs, block_size=block_size, disable_log_stats=False)
    if settings["attention_backend"]:
        kwargs["attention_backend"] = settings["attention_backend"]
    if cudagraph_mode is not None:
        kwargs["compilation_config"] = {"cudagraph_mode": cudagraph_mode}
    mem_log = MemoryLog().attach()
    try:
        llm = LLM(**kwargs)
    except Exception as e:
        # A backend that vLLM refuses here (e.g. FLASHINFER without its package) leaves no row: say why beside the
        # results, then fail the mode as before.
        sweep.record_engine_error(results_path, mode, run_id, settings, e)
        raise
    t_init = time.perf_counter() - t_start
    cache = llm.llm_engine.vllm_config.cache_config
    blocks = int(cache.num_gpu_blocks)
    n_fit = sweep.users_fit(blocks, prompt_tokens, decode_tokens, block_size)
    prov = collect({k: v for k, v in kwargs.items() if k != "model"})
    base = {
        "mode": mode, "kv_cache_dtype": settings["kv_cache_dtype"],
        "attention_backend": settings["attention_backend"] or "vllm-auto",
        "env": {k: v for k, v in os.environ.items() if k.startswith("KVREPRO_")} if mode.startswith("kvrepro:")
        else {},
        "kv_cache_tokens": blocks * block_size, "num_gpu_blocks": blocks, "block_size": block_size,
        "users_fit_arithmetic": n_fit, "prompt_tokens": prompt_tokens, "decode_tokens": decode_tokens,
        "gpu": prov["gpu"], "gpu_total_memory_gib": prov["gpu_total_memory_gib"],
        "gpu_memory_gb": gpu_memory_gb, "gpu_memory_utilization": util, "vllm_version": vllm.__version__,
        "torch_version": torch.__version__, "kvrepro_version": prov["kvrepro_version"],
        "triton_version": prov["triton_version"], "model": sweep.model_label(model_dir), "load_format": load_format, "run_id": run_id,
        "engine_run_id": engine_run_id, "measured": True,
        "max_num_seqs": max_num_seqs, "max_model_len": kwargs["max_model_len"],
        "max_num_batched_tokens": llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens,
        "enable_prefix_caching": False, "cuda_graphs": True,
        "cudagraph_mode": str(getattr(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode, "name",
                                      llm.llm_engine.vllm_config.compilation_config.cudagraph_mode)), "seed": seed, "engine_init_s": round(t_init, 1),
        "attention_backend_resolved": resolved_backends(llm),
        "hostname": prov["hostname"], "kvrepro_src_sha256": src_sha256(),
        "vllm_memory": dict(sweep.parse_vllm_memory_log(mem_log.lines), worker_bytes=worker_memory(llm)),
    }
    if "FLASHINFER" in base["attention_backend_resolved"]:   # FlashInfer ships apart from vLLM: record which one
        import flashinfer
        base["flashinfer_version"] = flashinfer.__version__
    if mode.startswith("kvrepro:"):   # the settings the engine's layers resolved (and logged) at its start
        from kvrepro.vllm_backend.runtime import settings_record

        base["kvrepro_settings"] = settings_record()
    print("[measure] " + json.dumps({"mode": mode, "engine_run_id": engine_run_id, "kv_cache_tokens": base["kv_cache_tokens"],
                                     "users_fit_arithmetic": n_fit, "engine_init_s": base["engine_init_s"],
                                     "vllm_memory": base["vllm_memory"]}), flush=True)
    results = sweep.ResultsFile(results_path)
    if sizing_only or n_fit == 0:
        row = dict(base, num_users=0, clean=n_fit > 0, preemptions=0, aggregate_decode_tok_s=None,
                   ttft_s_mean=None, ttft_s_max=None, tpot_ms_mean=None, measured_by="sizing", date=sweep.now_utc())
        results.add([row])
        return [row]
    n = min(n_fit, max_users)
    run = Runner(llm, decode_tokens, margin)
    deadline = t_start + timeout_s
    p0 = preemptions(llm)
    ids = [f"u{i}" for i in range(n)]
    for i, rid in enumerate(ids):
        run.submit(rid, make_prompt(seed, i, prompt_tokens, vocab))
    tl = run.timelines
    t_first = run.run_until(lambda: all(tl[r].times for r in ids), deadline - time.perf_counter())
    concurrent = not run.finished
    t_full = run.run_until(lambda: all(len(tl[r].times) >= decode_tokens for r in ids),
                           deadline - time.perf_counter())
    p1 = preemptions(llm)
    w = sweep.window_stats(tl, t_first, t_full)
    tt = sweep.ttft_stats(tl)
    tpot_full = [(tl[r].times[decode_tokens - 1] - tl[r].times[0]) / (decode_tokens - 1) * 1e3 for r in ids]
    rows = [dict(base, num_users=n, clean=bool(concurrent and p1 == p0), preemptions=p1 - p0,
                 aggregate_decode_tok_s=w["aggregate_decode_tok_s"], window_tokens=w["tokens"],
                 window_s=w["seconds"], ttft_s_mean=tt["ttft_s_mean"], ttft_s_max=tt["ttft_s_max"],
                 ttft_s_first=tt["ttft_s_first"], last_first_token_s=t_first - tl[ids[0]].submit,
                 tpot_ms_mean=sum(tpot_full) / n, all_running_concurrently=concurrent,
                 footprint=sweep.footprint(tl, prompt_tokens, decode_tokens, block_size),
                 measured_by="full", date=sweep.now_utc())]
    results.add(rows)
    if confirm_edge:
        if n < n_fit:
            print(f"[measure] edge check skipped: N={n} is capped by max_users, not by the KV cache", flush=True)
        elif time.perf_counter() + 60 < deadline:
            rows.append(_edge_check(run, llm, base, ids, seed, prompt_tokens, decode_tokens, vocab, deadline,
                                    wait_s=2 * (tt["ttft_s_first"] or 10.0) + 10, block_size=block_size))
            results.add(rows[-1:])
    # Abort windows: N-1 .. 1 users, one engine, no new prefill.
    alive = list(ids)
    while len(alive) > 1 and time.perf_counter() + 30 < deadline:
        victim = alive.pop()  # the last submitted: the survivors are the first k users of the prefill queue
        run.abort([victim])
        pa = preemptions(llm)
        t_a = run.step()
        for _ in range(window_steps):
            t_b = run.step()
        pb = preemptions(llm)
        k = len(alive)
        wk = sweep.window_stats({r: tl[r] for r in alive}, t_a, t_b)
        tk = sweep.ttft_stats({r: tl[r] for r in alive})
        rows.append(dict(base, num_users=k, clean=pb == pa and rows[0]["clean"], preemptions=pb - pa,
                         aggregate_decode_tok_s=wk["aggregate_decode_tok_s"], window_tokens=wk["tokens"],
                         window_s=wk["seconds"], ttft_s_mean=tk["ttft_s_mean"], ttft_s_max=tk["ttft_s_max"],
                         ttft_s_first=tk["ttft_s_first"], tpot_ms_mean=wk["tpot_ms_mean"],
                         measured_by="abort-window", date=sweep.now_utc()))
        results.add(rows[-1:])
    run.abort(alive)
    return rows


EDGE_STEPS = sweep.EDGE_STEPS


def _edge_check(run: Runner, llm, base: dict, old_ids: list[str], seed: int, prompt_tokens: int,
                decode_tokens: int, vocab: int, deadline: float, wait_s: float, block_size: int) -> dict:
    """N+1 check on top of the N requests still decoding after the full window: submit one fresh
    request and step until vLLM preempts, the new request has ``decode_tokens`` tokens, it is still
    unscheduled (waiting for KV blocks) 3 steps after submission, an old request finishes, or
    ``wait_s`` passes (``sweep.edge_outcome`` gives the verdict). One 128K prefill at most, instead of
    N+1 fresh ones. The old requests hold at least the workload's footprint (prompt + decode_tokens
    tokens), so a clean result means N+1 fit concurrently; the new request is aborted afterwards."""
    n = len(old_ids) + 1
    rid = f"e{n}"
    p0, free0 = preemptions(llm), free_blocks(llm)
    run.submit(rid, make_prompt(seed + 1, n, prompt_tokens, vocab))
    tl = run.timelines
    t_end = min(deadline - 30, time.perf_counter() + wait_s)
    steps, waiting, timed_out = 0, False, False
    while True:
        run.step()
        steps += 1
        if preemptions(llm) > p0 or len(tl[rid].times) >= decode_tokens or any(r in run.finished for r in old_ids):
            break
        if steps >= 3 and not tl[rid].times and is_waiting(llm, rid):
            waiting = True
            break
        if time.perf_counter() > t_end:
            timed_out = True
            break
    p1 = preemptions(llm)
    clean, outcome = sweep.edge_outcome(p1 > p0, bool(tl[rid].times), len(tl[rid].times), decode_tokens,
                                        any(r in run.finished for r in old_ids), timed_out)
    run.abort([rid])
    need = -(-(prompt_tokens + decode_tokens) // block_size)
    return dict(base, num_users=n, clean=clean, preemptions=p1 - p0, aggregate_decode_tok_s=None,
                ttft_s_mean=None, ttft_s_max=None, tpot_ms_mean=None, edge_outcome=outcome,
                edge_waiting_for_blocks=waiting, edge_steps=steps, free_blocks_at_edge=free0,
                blocks_per_user=need, measured_by="edge-check", date=sweep.now_utc())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mode", required=True, choices=sweep.ALL_MODES)
    ap.add_argument("--results", required=True)
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--params", default="{}", help="JSON dict of measure_mode keyword arguments")
    a = ap.parse_args(argv)
    rows = measure_mode(a.mode, a.results, a.run_id, **json.loads(a.params))
    for r in rows:
        print(json.dumps({k: r.get(k) for k in ("mode", "num_users", "clean", "preemptions",
                                                "aggregate_decode_tok_s", "ttft_s_max", "kv_cache_tokens",
                                                "users_fit_arithmetic", "measured_by")}), flush=True)
    return 0


if __name__ == "__main__":
    from kvrepro import cli

    raise SystemExit(cli.run(main))
