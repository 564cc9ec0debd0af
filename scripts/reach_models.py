"""Every bundled model through vLLM with dummy weights, one capacity point each for fp8 and kvrepro k4v4 (issue 22).

    PYTHONPATH=. python3 scripts/reach_models.py [--models qwen3-0.6b,llama-3.2-1b-instruct] [--modes fp8,kvrepro:k4v4]
        [--gpu-memory-gib 80] [--decode-tokens 1024] [--out-dir results/reach] [--budget-s 470] [--plan]

Per (model, mode), one vLLM 0.20.2 engine in its own process (``--worker``; GPU memory is returned between engines),
set up the way the capacity sweep sets up its engines (``kvrepro.sweep.engine_settings``: fp8 is vLLM's
``kv_cache_dtype="fp8"`` with the backend vLLM picks, a kvrepro preset is ``attention_backend="CUSTOM"`` with
``KVREPRO_PRESET``; ``kvrepro.sweep.memory_utilization``: an emulated card of ``--gpu-memory-gib`` GiB is
``gpu_memory_utilization = 0.9 x GiB / total``), with the bundled config (``load_format="dummy"``,
``skip_tokenizer_init``), prefix caching off, block 16, ``max_model_len = min(131072 + 1024, the model's
max_position_embeddings)``:

1. weights larger than the budget (``kvrepro.capacity`` arithmetic): recorded, no engine started;
2. start vLLM; a start that fails because the KV cache cannot hold one request is recorded (``fits 0 users``);
3. smoke: four token-id prompts of mixed lengths, greedy, ``ignore_eos``, each asked a different number of tokens;
   passes when every output is non-empty with exactly the asked count;
4. capacity point: the KV tokens vLLM allocated (``num_gpu_blocks x block_size``) and the users that fit at the
   workload (prompt ``max_model_len - 1024`` tokens + 1,024 decode tokens each: ``kvrepro.sweep.users_fit``, vLLM's
   block arithmetic with its null block); that many users (distinct random prompts, ``kvrepro.sweep_worker.Runner``)
   are submitted at once, each asked for the 1,024 workload tokens; once every user has its first token, the
   window runs until every user has ``--decode-tokens`` more tokens or one user is one token from its end (users
   prefilled first decode while later ones prefill, so with many users the window can be shorter than
   ``--decode-tokens``: ``window_steps`` says how long it was); aggregate decode tok/s = tokens generated in the
   window / its seconds (``kvrepro.sweep.window_stats``), all users decoding throughout; preemptions = the delta of
   vLLM's ``vllm:num_preemptions`` counter from submission to the window's end.

Rows (one per model and mode) go to ``<out-dir>/models_<gpu>.jsonl`` (e.g. ``models_h200.jsonl``), rewritten through a
temp file + rename after each row, each with its provenance (``kvrepro.provenance.collect``); a (model, mode) already
there with status measured / weights exceed budget / fits 0 users is not run again (resume), an ``error`` row is.
``--budget-s``: wall seconds for the call; a pair whose estimate (``estimate_s``) no longer fits is left for the next
call. ``--plan``: print the pairs, their arithmetic users and estimated seconds, and exit (no GPU needed).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kvrepro import capacity, sweep  # noqa: E402
from kvrepro.configs import config_dir, model_names  # noqa: E402
from kvrepro.listarg import comma_list  # noqa: E402
from kvrepro.configs.facts import model_facts  # noqa: E402
from kvrepro.fileio import atomic_write_text  # noqa: E402
from kvrepro.reach import REACH_MODES, WORKLOAD_DECODE, arithmetic_users, kv_format, workload  # noqa: E402

DEFAULT_MODES = REACH_MODES
BLOCK_SIZE = 16
STATUSES = ("measured", "weights exceed budget", "fits 0 users", "error")
DONE = ("measured", "weights exceed budget", "fits 0 users")   # not run again on resume
SMOKE = ((7, 16), (64, 5), (300, 32), (1500, 9))                # (prompt tokens, asked tokens)
# Wall-time model for --budget-s and --plan, from the seed sweep on the H200 (results/capacity/h200-20261201-w13.jsonl,
# Qwen3-4B k4v4): engine start 62 s (90 s here: a model's first start compiles), 13 prefills of 128K in 128 s
# (6.2e15 FLOP each: 6.3e14 FLOP/s), decode steps at ~3.1e12 B/s of KV read.
INIT_S, PREFILL_FLOPS, DECODE_BYTES_S, SLACK_S = 90.0, 6.3e14, 3.1e12, 20.0


def gpu_slug(name: str) -> str:
    """File-name form of a driver's GPU name: "NVIDIA H200" -> "h200", "NVIDIA A100-SXM4-80GB" -> "a100-sxm4-80gb"."""
    s = re.sub(r"^nvidia\s+", "", name.strip(), flags=re.I).lower()
    s = re.sub(r"[^a-z0-9]+", "-", s).strip("-")
    if not s:
        raise ValueError(f"GPU name {name!r} has no letters or digits to name a file by")
    return s


def check_args(models, modes, gpu_memory_gib, decode_tokens, budget_s=None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Validate the CLI values; returns ``(models, modes)``.

    Raises:
        ValueError: an unknown model (lists the bundled ones), a mode not in ``kvrepro.sweep.ALL_MODES`` or named twice,
            ``gpu_memory_gib`` not a number > 0, ``decode_tokens`` not an int in 1..1024, ``budget_s`` not > 0.
    """
    if isinstance(models, str):
        models = comma_list(models, "models") if models.strip() else []
    models = tuple(models) or model_names()
    bad = [m for m in models if m not in model_names()]
    if bad:
        raise ValueError(f"models: unknown {bad}; allowed: {', '.join(model_names())}")
    if len(set(models)) != len(models):
        raise ValueError(f"models: {sorted({m for m in models if models.count(m) > 1})} named more than once")
    modes = sweep.check_modes(modes)
    if isinstance(gpu_memory_gib, bool) or not isinstance(gpu_memory_gib, (int, float)) \
            or not math.isfinite(gpu_memory_gib) or gpu_memory_gib <= 0:
        raise ValueError(f"gpu_memory_gib must be a number of GiB > 0, got {gpu_memory_gib!r}")
    if isinstance(decode_tokens, bool) or not isinstance(decode_tokens, int) \
            or not 1 <= decode_tokens <= WORKLOAD_DECODE:
        raise ValueError(f"decode_tokens must be an int in 1..{WORKLOAD_DECODE} (the workload's decode tokens), "
                         f"got {decode_tokens!r}")
    if budget_s is not None and (isinstance(budget_s, bool) or not isinstance(budget_s, (int, float))
                                 or not budget_s > 0):
        raise ValueError(f"budget_s must be a number of seconds > 0 or None, got {budget_s!r}")
    return models, modes


def weights_exceed(name: str, gpu_memory_gib: float) -> str | None:
    """Why ``name``'s bf16 weights (``kvrepro.capacity``) do not fit the engine's share of the emulated card (0.9 x
    GiB, the sweep's utilization), or None."""
    w = capacity.load_model_config(name).weights_bytes
    budget = capacity.DEFAULT_GPU_MEMORY_UTILIZATION * gpu_memory_gib * capacity.GIB
    if w >= budget:
        return (f"weights {w / capacity.GIB:.1f} GiB (bf16, kvrepro.capacity) >= the engine's "
                f"{budget / capacity.GIB:.1f} GiB (0.9 x {gpu_memory_gib} GiB)")
    return None


def max_num_seqs(name: str, gpu_memory_gib: float) -> int:
    """vLLM's ``max_num_seqs`` for a model, the same for every mode so that their engines differ only in the KV
    format: the most users any of fp8 / k4v4 fits by the arithmetic, plus 10 % and 8 (smaller models leave more than
    the calibrated overhead), at least 8, at most 1024."""
    most = max(arithmetic_users(name, m, gpu_memory_gib) or 0 for m in DEFAULT_MODES)
    return max(8, min(1024, math.ceil(most * 1.1) + 8))


def estimate_s(name: str, mode: str, gpu_memory_gib: float, decode_tokens: int) -> float:
    """Wall seconds one (model, mode) takes, roughly (module constants): engine start + the prefill FLOPs of every
    user (2 x parameters x prompt + causal attention 2 x prompt^2 x query heads x head_dim per layer) + the decode
    window's KV reads + slack."""
    users = arithmetic_users(name, mode, gpu_memory_gib) or 0
    if weights_exceed(name, gpu_memory_gib):
        return 5.0
    cfg, f, w = capacity.load_model_config(name), model_facts(name), workload(name)
    p = w["prompt_tokens"]
    flops = 2 * cfg.num_params * p + 2 * p * p * f.num_q_heads * f.head_dim * f.num_layers
    kv = f.kv_bytes_per_token.get(kv_format(mode) or "fp8") or f.kv_bytes_per_token["fp8"]
    return INIT_S + users * flops / PREFILL_FLOPS + decode_tokens * users * p * kv / DECODE_BYTES_S + SLACK_S


def row_key(row: dict) -> tuple:
    """(model, mode, GPU memory in GiB): one row per pair and emulated card (a file may hold several budgets)."""
    mem = row.get("gpu_memory_gib")
    return row.get("model"), row.get("mode"), None if mem is None else float(mem)


def read_rows(path: str) -> list[dict]:
    """The rows of a results file ([] if it does not exist). Raises ValueError naming a line that is not JSON."""
    return sweep.read_jsonl(Path(path))


def put_row(path: str, row: dict) -> None:
    """Add ``row`` to ``path``, replacing the row of the same (model, mode); the file is rewritten through a temp file
    + rename. Raises ValueError for a row without model / mode or with a status not in ``STATUSES``."""
    if not row.get("model") or not row.get("mode") or row.get("status") not in STATUSES:
        raise ValueError(f"a row needs model, mode and a status in {STATUSES}; got {row_key(row)}, "
                         f"{row.get('status')!r}")
    rows = [r for r in read_rows(path) if row_key(r) != row_key(row)] + [row]
    atomic_write_text(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))


def todo(rows: list[dict], models, modes, gpu_memory_gib: float) -> list[tuple[str, str]]:
    """The (model, mode) pairs still to run at ``gpu_memory_gib``: not in ``rows`` at that memory with a status of
    ``DONE``."""
    mem = float(gpu_memory_gib)
    done = {(m, mode) for m, mode, at in (row_key(r) for r in rows if r.get("status") in DONE) if at == mem}
    return [(m, mode) for m in models for mode in modes if (m, mode) not in done]


def base_row(name: str, mode: str, gpu_memory_gib: float, decode_tokens: int) -> dict:
    """The fields every row of (model, mode) has before anything runs: the model's geometry, the workload, the
    engine settings and the arithmetic users."""
    f, w, st = model_facts(name), workload(name), sweep.engine_settings(mode)
    return {"model": name, "mode": mode, "kv_cache_dtype": st["kv_cache_dtype"],
            "attention_backend": st["attention_backend"] or "vllm-auto", "env": st["env"],
            "head_dim": f.head_dim, "num_q_heads": f.num_q_heads, "num_kv_heads": f.num_kv_heads,
            "num_layers": f.num_layers, "max_model_len": w["max_model_len"], "prompt_tokens": w["prompt_tokens"],
            "workload_decode_tokens": w["decode_tokens"], "decode_tokens": decode_tokens, "block_size": BLOCK_SIZE,
            "gpu_memory_gib": gpu_memory_gib, "max_num_seqs": max_num_seqs(name, gpu_memory_gib),
            "users_fit_arithmetic": arithmetic_users(name, mode, gpu_memory_gib), "load_format": "dummy"}


def smoke_result(asked, got) -> dict:
    """The smoke's verdict: ``ok`` when every output is non-empty and has exactly the asked number of tokens."""
    asked, got = list(asked), list(got)
    return {"asked_tokens": asked, "got_tokens": got,
            "ok": len(asked) == len(got) and all(0 < g == a for a, g in zip(asked, got))}


def window_done(since_start, totals, decode_tokens: int, max_tokens: int) -> bool:
    """End of the decode window: every user has ``decode_tokens`` tokens past the window's start (``since_start``,
    per user) or one user is one token from its ``max_tokens`` (``totals``: tokens per user so far), so that no user
    finishes inside the window."""
    return all(c >= decode_tokens for c in since_start) or any(n >= max_tokens - 1 for n in totals)


# ---------------------------------------------------------------- the worker (one engine, on the GPU)

def register_plugin() -> str:
    """How the kvrepro backend reaches this process's engine: vLLM's ``vllm.general_plugins`` entry point where it is
    installed (``pip install -e .``, or ``scripts/h200_sweep.sh``'s), else ``kvrepro.vllm_backend.register()`` called
    here, which serves the in-process engine this script runs (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    from importlib.metadata import entry_points

    if any(e.value.startswith("kvrepro") for e in entry_points(group="vllm.general_plugins")):
        return "entry point vllm.general_plugins"
    from kvrepro.vllm_backend import register

    register()
    return "kvrepro.vllm_backend.register() in the engine's process (no entry point installed)"


def measure(name: str, mode: str, gpu_memory_gib: float, decode_tokens: int, seed: int = 0) -> dict:
    """Run one (model, mode) as the module docstring says; returns its row (without provenance)."""
    row = base_row(name, mode, gpu_memory_gib, decode_tokens)
    why = weights_exceed(name, gpu_memory_gib)
    if why:
        return dict(row, status="weights exceed budget", reason=why, users_fit=0, kv_cache_tokens=0)
    st = sweep.engine_settings(mode)
    os.environ.update(st["env"])
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    from vllm import LLM, SamplingParams

    from kvrepro.sweep_worker import Runner, make_prompt, preemptions

    if st["attention_backend"]:
        row["plugin"] = register_plugin()
    t0 = time.perf_counter()
    total = torch.cuda.get_device_properties(0).total_memory
    util = sweep.memory_utilization(gpu_memory_gib, total)
    kwargs = dict(model=str(config_dir(name)), load_format="dummy", skip_tokenizer_init=True, seed=seed,
                  max_model_len=row["max_model_len"], gpu_memory_utilization=util,
                  kv_cache_dtype=st["kv_cache_dtype"], enable_prefix_caching=False,
                  max_num_seqs=row["max_num_seqs"], block_size=BLOCK_SIZE, disable_log_stats=False)
    if st["attention_backend"]:
        kwargs["attention_backend"] = st["attention_backend"]
    row["gpu_memory_utilization"] = util
    try:
        llm = LLM(**kwargs)
    except Exception as e:  # noqa: BLE001 - vLLM refuses a KV cache that cannot hold one request at start
        msg = str(e)
        if re.search(r"KV cache|cache blocks|memory", msg, re.I):
            return dict(row, status="fits 0 users", reason=msg[:600], users_fit=0, kv_cache_tokens=0,
                        engine_init_s=round(time.perf_counter() - t0, 1))
        raise
    row["engine_init_s"] = round(time.perf_counter() - t0, 1)
    vc = llm.llm_engine.vllm_config
    blocks = int(vc.cache_config.num_gpu_blocks)
    row.update(num_gpu_blocks=blocks, kv_cache_tokens=blocks * BLOCK_SIZE,
               users_fit=sweep.users_fit(blocks, row["prompt_tokens"], WORKLOAD_DECODE, BLOCK_SIZE),
               max_num_batched_tokens=vc.scheduler_config.max_num_batched_tokens)
    if mode.startswith("kvrepro:"):
        from kvrepro.vllm_backend.runtime import settings_record

        row["kvrepro_settings"] = settings_record()
    vocab = json.loads((config_dir(name) / "config.json").read_text())["vocab_size"]
    prompts = [{"prompt_token_ids": make_prompt(seed + 7, i, min(n, row["prompt_tokens"]), vocab)}
               for i, (n, _) in enumerate(SMOKE)]
    params = [SamplingParams(max_tokens=k, ignore_eos=True, temperature=0.0, detokenize=False) for _, k in SMOKE]
    outs = llm.generate(prompts, params, use_tqdm=False)
    row["smoke"] = smoke_result([k for _, k in SMOKE], [len(o.outputs[0].token_ids) if o.outputs else 0 for o in outs])
    n = min(row["users_fit"], row["max_num_seqs"])
    row["users_capped_by_max_num_seqs"] = n < row["users_fit"]
    if n == 0:
        return dict(row, status="fits 0 users", reason=f"{row['kv_cache_tokens']} KV tokens < one request of "
                    f"{row['prompt_tokens'] + WORKLOAD_DECODE}", users_measured=0)
    run = Runner(llm, WORKLOAD_DECODE, 0)
    p0 = preemptions(llm)
    ids = [f"u{i}" for i in range(n)]
    for i, rid in enumerate(ids):
        run.submit(rid, make_prompt(seed, i, row["prompt_tokens"], vocab))
    tl = run.timelines
    t_first = run.run_until(lambda: all(tl[r].times for r in ids), 3600)
    concurrent, steps0 = not run.finished, run.steps
    start = {r: len(tl[r].times) for r in ids}
    t_end = run.run_until(lambda: window_done([len(tl[r].times) - start[r] for r in ids],
                                              [len(tl[r].times) for r in ids], decode_tokens, WORKLOAD_DECODE), 3600)
    p1 = preemptions(llm)
    # no window when a user prefilled first was already at its last tokens when the last user got its first one
    w = sweep.window_stats(tl, t_first, t_end) if t_end > t_first else \
        {"aggregate_decode_tok_s": None, "tokens": 0, "seconds": 0.0}
    tt = sweep.ttft_stats(tl)
    run.abort([r for r in ids if r not in run.finished])
    return dict(row, status="measured", users_measured=n, aggregate_decode_tok_s=w["aggregate_decode_tok_s"],
                window_tokens=w["tokens"], window_s=w["seconds"], window_steps=run.steps - steps0,
                tokens_at_window_start_max=max(start.values()), all_running_concurrently=bool(concurrent and not
                any(r in run.finished for r in ids)), preemptions=p1 - p0, clean=bool(concurrent and p1 == p0),
                ttft_s_max=tt["ttft_s_max"], last_first_token_s=t_first - tl[ids[0]].submit,
                wall_s=round(time.perf_counter() - t0, 1))


def worker_main(a) -> int:
    from kvrepro.provenance import collect

    params = {"model": a.worker, "mode": a.modes, "gpu_memory_gib": a.gpu_memory_gib,
              "decode_tokens": a.decode_tokens, "seed": a.seed}
    try:
        row = measure(a.worker, a.modes, a.gpu_memory_gib, a.decode_tokens, a.seed)
    except Exception as e:  # noqa: BLE001 - recorded as an error row; the next call runs the pair again
        import traceback

        traceback.print_exc()
        row = dict(base_row(a.worker, a.modes, a.gpu_memory_gib, a.decode_tokens), status="error",
                   reason=f"{type(e).__name__}: {str(e)[:600]}")
    prov = collect(params)
    row.update(gpu=prov["gpu"], date=sweep.now_utc(), run_id=a.run_id, provenance=prov,
               vllm_version=prov["vllm_version"], kvrepro_src_sha256=prov["kvrepro_src_sha256"])
    put_row(a.out, row)
    print("[reach] " + json.dumps({k: row.get(k) for k in ("model", "mode", "status", "kv_cache_tokens", "users_fit",
                                                           "users_fit_arithmetic", "aggregate_decode_tok_s",
                                                           "preemptions", "smoke", "engine_init_s", "wall_s",
                                                           "reason")}), flush=True)
    return 0 if row["status"] != "error" else 1


def plan_table(models, modes, gpu_memory_gib, decode_tokens, rows=()) -> str:
    """The pairs, their workload, arithmetic users and estimated seconds, with the total of those still to run
    (``--plan``); a pair ``rows`` already holds at ``gpu_memory_gib`` with a final status (``todo``) says "done"."""
    lines = [f"{'model':<26} {'mode':<14} {'max_model_len':>13} {'users (arith.)':>14} {'est. s':>7}"]
    left = set(todo(list(rows), models, modes, gpu_memory_gib))
    total = 0.0
    for m in models:
        for mode in modes:
            s = estimate_s(m, mode, gpu_memory_gib, decode_tokens)
            u = arithmetic_users(m, mode, gpu_memory_gib)
            if (m, mode) in left:
                total += s
            lines.append(f"{m:<26} {mode:<14} {workload(m)['max_model_len']:>13,} {'-' if u is None else u:>14} "
                         + (f"{s:>7.0f}" if (m, mode) in left else f"{'done':>7}"))
    lines.append(f"to run: {len(left)} of {len(models) * len(modes)} engines, ~{total / 60:.1f} min of engine time "
                 "(done: a final row in the out-dir's models_*.jsonl at this memory)")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="", help=f"comma-separated bundled models (default all: {', '.join(model_names())})")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated; allowed: {', '.join(sweep.ALL_MODES)}")
    ap.add_argument("--gpu-memory-gib", type=float, default=80.0, help="emulated card (GiB), as the capacity sweep")
    ap.add_argument("--decode-tokens", type=int, default=WORKLOAD_DECODE,
                    help="decode steps of the measured window, 1..1024 (fewer saves time; users still fit 1,024)")
    ap.add_argument("--out-dir", default="results/reach", help="folder of models_<gpu>.jsonl (resumed if present)")
    ap.add_argument("--budget-s", type=float, default=None, help="wall seconds for this call (pairs that no longer "
                    "fit their estimate are left for the next call)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--run-id", default=time.strftime("reach-%Y%m%d-%H%M%S", time.gmtime()))
    ap.add_argument("--plan", action="store_true", help="print the pairs and estimated seconds, run nothing")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)   # one model (internal: the engine process)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    try:
        models, modes = check_args(a.models if a.worker is None else a.worker, a.modes, a.gpu_memory_gib,
                                   a.decode_tokens, a.budget_s)
    except ValueError as e:
        ap.error(str(e))
    if a.worker is not None:
        if len(modes) != 1 or not a.out:
            ap.error("--worker runs one mode and needs --out")
        a.modes = modes[0]
        return worker_main(a)
    if a.plan:   # no GPU here, so no file name: every GPU's rows in the out-dir count
        rows = [r for p in sorted(Path(a.out_dir).glob("models_*.jsonl")) for r in read_rows(str(p))]
        print(plan_table(models, modes, a.gpu_memory_gib, a.decode_tokens, rows))
        return 0
    t0 = time.perf_counter()
    blockers = sweep.measurement_blockers()
    if blockers:
        print(f"error: this runs vLLM on a GPU; missing: {', '.join(blockers)} (--plan works without)", file=sys.stderr)
        return 2
    import torch

    out = os.path.join(a.out_dir, f"models_{gpu_slug(torch.cuda.get_device_name(0))}.jsonl")
    os.makedirs(a.out_dir, exist_ok=True)
    failed = []
    for name, mode in todo(read_rows(out), models, modes, a.gpu_memory_gib):
        need = estimate_s(name, mode, a.gpu_memory_gib, a.decode_tokens)
        left = None if a.budget_s is None else a.budget_s - (time.perf_counter() - t0)
        if left is not None and left < need:
            print(f"[reach] {name} {mode}: not started, {left:.0f} s left, estimate {need:.0f} s (next call)",
                  flush=True)
            continue
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--modes", mode, "--out", out,
               "--gpu-memory-gib", str(a.gpu_memory_gib), "--decode-tokens", str(a.decode_tokens),
               "--seed", str(a.seed), "--run-id", a.run_id]
        print(f"[reach] {name} {mode}: estimate {need:.0f} s", flush=True)
        t = time.perf_counter()
        try:
            rc = subprocess.call(cmd, timeout=None if left is None else max(30.0, left - 5))
        except subprocess.TimeoutExpired:
            rc = "timeout"
            row = dict(base_row(name, mode, a.gpu_memory_gib, a.decode_tokens), status="error",
                       reason=f"no row within the call's budget ({left:.0f} s)", date=sweep.now_utc(), run_id=a.run_id)
            put_row(out, row)
        print(f"[reach] {name} {mode}: exit {rc} after {time.perf_counter() - t:.0f} s", flush=True)
        if rc:
            failed.append(f"{name} {mode}")
    print(f"[reach] rows in {out}; failed: {', '.join(failed) or 'none'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
