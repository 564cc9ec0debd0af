"""Step-time breakdown of vLLM decode steps at 128K per user: attention, GEMMs and the rest, from a PyTorch
profiler trace captured with vLLM 0.20.2's own profiler hooks, against the bandwidth bound.

GPU and vLLM only. One engine per call, built like the capacity sweep's (``kvrepro.sweep_worker``: the mode's
settings from ``kvrepro.sweep.engine_settings``, the bundled Qwen3-4B config with dummy weights, the emulated
``--gpu-memory-gb`` budget, 16-token blocks, prefix caching off, torch.compile + CUDA graphs), with vLLM's torch
profiler configured (``profiler_config={"profiler": "torch", "torch_profiler_dir": ...}``). It submits the largest
batch of ``--users`` (distinct random ``--prompt-tokens`` prompts, ``kvrepro.sweep_worker.make_prompt``), steps until
every request decodes, then for each batch, largest first (requests aborted down to it, as the sweep's abort windows):

1. ``--settle-steps`` decode steps (the graph of the new batch size replays once before timing);
2. ``--steps`` timed decode steps without the profiler: aggregate tok/s and host ms per step;
3. ``LLM.start_profile()``, ``--steps`` decode steps, ``LLM.stop_profile()``: one trace (``*.pt.trace.json.gz``) per
   batch in ``--trace-dir``, read by ``kvrepro.profile.step_breakdown`` (kernel time per class per step, GPU span, top
   kernels with their grids).

Then the device-to-device copy bandwidth is measured in the same process (``benchmarks.common.copy_bandwidth``, after the
engine's batches, so it does not change vLLM's memory accounting) and each batch gets ``kvrepro.profile.decode_bound``
(weights of ``kvrepro.capacity``'s Qwen3-4B + the batch's KV bytes at the mean context of the profiled steps).

Usage (GPU machine, vLLM importable, repo root)::

    python3 scripts/step_profile.py --mode kvrepro:k4v4 --users 13,6,3 --out $OUT/profile_k4v4.json
    python3 scripts/step_profile.py --mode fp8 --users 6,4 --out $OUT/profile_fp8.json
    python3 scripts/step_profile.py --mode fp8 --users 6,4 --fa-max-splits 2 --out $OUT/profile_fp8_s2.json

Writes ``--out`` (JSON, written then renamed; default ``results/profile/<gpu>_<mode>_<users>u_<UTC date>.json``, the
mode followed by ``-fa-splits<N>`` under ``--fa-max-splits``) with
the parameters, the engine's settings, per batch the timed window, the breakdown and the bound, the copy bandwidth
and provenance; the traces stay in ``--trace-dir`` (default beside ``--out``: ``<out stem>_traces/``). Exit 2 on bad
arguments (argparse, naming the parameter and the allowed values), 1 when a batch could not be profiled (the file is
written with that batch's error).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvrepro import profile, sweep  # noqa: E402
from kvrepro.fileio import out_path_error  # noqa: E402

PROFILER_CONFIG = {"profiler": "torch", "torch_profiler_with_stack": False, "torch_profiler_use_gzip": True,
                   "torch_profiler_dump_cuda_time_total": False, "torch_profiler_record_shapes": False}
MAX_NEW_TOKENS = 2048   # every request's budget: the prefill phase decodes ~16 tokens per later 128K prefill
ENGINE_MODES = tuple(m for m in sweep.ALL_MODES if not m.startswith("turboquant"))


def kv_format(mode: str) -> str:
    """The KV format whose bytes a mode reads per token (``kvrepro.capacity``): the preset of ``kvrepro:<preset>``,
    ``fp8`` for every fp8 mode, ``bf16``. Raises ValueError for a mode outside :data:`ENGINE_MODES`."""
    if mode not in ENGINE_MODES:
        raise ValueError(f"mode must be one of {', '.join(ENGINE_MODES)}, got {mode!r}")
    if mode.startswith("kvrepro:"):
        return mode.split(":", 1)[1]
    return "fp8" if mode in sweep.FP8_MODES else "bf16"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python3 scripts/step_profile.py", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--mode", default="kvrepro:k4v4", help=f"KV mode (kvrepro.sweep); allowed: {', '.join(ENGINE_MODES)}")
    ap.add_argument("--users", default="13", help="decode batches to profile, comma-separated (e.g. 13 or 6,4)")
    ap.add_argument("--prompt-tokens", type=int, default=131072, help="prompt tokens per user (128K)")
    ap.add_argument("--gpu-memory-gb", type=float, default=80.0, help="emulated card (GiB), as the sweep")
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed and profiled per batch")
    ap.add_argument("--settle-steps", type=int, default=4, help="decode steps before each batch's timing")
    ap.add_argument("--max-num-seqs", type=int, default=32, help="vLLM max_num_seqs (the sweep's 32)")
    ap.add_argument("--cudagraph-mode", default=None, help=f"vLLM cudagraph_mode; default vLLM's; allowed: "
                    f"{', '.join(sweep.CUDAGRAPH_MODES)}")
    ap.add_argument("--fa-max-splits", type=int, default=None,
                    help="vLLM's attention_config.flash_attn_max_num_splits_for_cuda_graph (the most KV splits per "
                         "sequence FlashAttention may use under full CUDA graphs; vLLM's default 32); FlashAttention "
                         "modes only")
    ap.add_argument("--seed", type=int, default=0, help="prompt draw and engine seed, an integer >= 0")
    ap.add_argument("--out", default=None, help="result JSON (default results/profile/<gpu>_<mode>[-fa-splits<N>]_<users>u_"
                                                "<date>.json)")
    ap.add_argument("--trace-dir", default=None, help="folder for vLLM's traces (default <out stem>_traces/)")
    return ap


def check_args(a: argparse.Namespace) -> dict:
    """The validated settings of a call: mode, users (tuple, largest first), prompt_tokens, gpu_memory_gb, steps,
    settle_steps, max_num_seqs, cudagraph_mode, fa_max_splits (None: vLLM's), seed, out / trace_dir (None: chosen at
    run time).

    Raises:
        ValueError: naming the parameter and its allowed values.
    """
    kv_format(a.mode)
    users = profile.parse_users(a.users)
    for name in ("prompt_tokens", "steps", "max_num_seqs"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {getattr(a, name)}")
    if a.settle_steps < 0:
        raise ValueError(f"--settle-steps must be an integer >= 0, got {a.settle_steps}")
    if not a.gpu_memory_gb > 0 or not math.isfinite(a.gpu_memory_gb):
        raise ValueError(f"--gpu-memory-gb must be a finite number of GiB > 0, got {a.gpu_memory_gb}")
    if users[0] > a.max_num_seqs:
        raise ValueError(f"--users {users[0]} exceeds --max-num-seqs {a.max_num_seqs}: vLLM would not run them in one "
                         "batch")
    if a.cudagraph_mode is not None and a.cudagraph_mode not in sweep.CUDAGRAPH_MODES:
        raise ValueError(f"--cudagraph-mode must be one of {', '.join(sweep.CUDAGRAPH_MODES)}, got {a.cudagraph_mode!r}")
    if a.fa_max_splits is not None:
        if a.fa_max_splits < 1:
            raise ValueError(f"--fa-max-splits must be an integer >= 1, got {a.fa_max_splits}")
        backend = sweep.engine_settings(a.mode)["attention_backend"]
        if backend not in (None, "FLASH_ATTN"):
            raise ValueError(f"--fa-max-splits applies to FlashAttention, the backend of fp8, fp8:flash_attn and bf16; "
                             f"mode {a.mode} runs on {backend}")
        if a.cudagraph_mode in ("NONE", "PIECEWISE"):
            raise ValueError(f"--fa-max-splits caps FlashAttention's splits under full CUDA graphs only (vLLM's "
                             f"flash_attn.py); --cudagraph-mode {a.cudagraph_mode} has none: use FULL, "
                             "FULL_DECODE_ONLY, FULL_AND_PIECEWISE or vLLM's default")
    if a.seed < 0:
        # numpy's default_rng (the prompts' draw) refuses a negative seed, after the engine was built
        raise ValueError(f"--seed must be an integer >= 0, got {a.seed}")
    limit = sweep.max_positions(None)
    if limit is not None and a.prompt_tokens + MAX_NEW_TOKENS + 64 > limit:
        raise ValueError(f"--prompt-tokens ({a.prompt_tokens}) + {MAX_NEW_TOKENS + 64} (each request's decode budget "
                         f"and margin) must be <= the bundled model's max_position_embeddings ({limit})")
    if a.trace_dir is not None and Path(a.trace_dir).exists() and not Path(a.trace_dir).is_dir():
        raise ValueError(f"--trace-dir {a.trace_dir!r} is a file: give a folder (created if missing)")
    if a.out is not None and out_path_error(a.out):
        raise ValueError(out_path_error(a.out))
    return {"mode": a.mode, "users": users, "prompt_tokens": a.prompt_tokens, "gpu_memory_gb": a.gpu_memory_gb,
            "steps": a.steps, "settle_steps": a.settle_steps, "max_num_seqs": a.max_num_seqs,
            "cudagraph_mode": a.cudagraph_mode, "fa_max_splits": a.fa_max_splits, "seed": a.seed, "out": a.out,
            "trace_dir": a.trace_dir}


def default_out(gpu: str, mode: str, users: tuple, when: str, fa_max_splits: int | None = None) -> Path:
    """``results/profile/<gpu slug>_<mode slug>[-fa-splits<N>]_<users joined by '-'>u_<YYYYmmdd_HHMM>.json`` under the
    repo (the split cap in the name when one was set)."""
    slug = lambda s: "".join(c if c.isalnum() else "-" for c in s.lower()).strip("-")  # noqa: E731
    cap = f"-fa-splits{fa_max_splits}" if fa_max_splits is not None else ""
    return ROOT / "results" / "profile" / f"{slug(gpu)}_{slug(mode)}{cap}_{'-'.join(map(str, users))}u_{when}.json"


def engine_kwargs(cfg: dict, model_dir: str, util: float, trace_dir: str) -> dict:
    """``vllm.LLM`` keyword arguments of a call: the sweep worker's (``kvrepro.sweep_worker.measure_mode``) with vLLM's
    torch profiler configured to write into ``trace_dir``."""
    settings = sweep.engine_settings(cfg["mode"])
    kw = dict(model=model_dir, load_format="dummy", skip_tokenizer_init=True, seed=cfg["seed"],
              max_model_len=cfg["prompt_tokens"] + MAX_NEW_TOKENS + 64, gpu_memory_utilization=util,
              kv_cache_dtype=settings["kv_cache_dtype"], enable_prefix_caching=False,
              max_num_seqs=cfg["max_num_seqs"], block_size=16, disable_log_stats=False,
              profiler_config=dict(PROFILER_CONFIG, torch_profiler_dir=str(trace_dir)))
    if settings["attention_backend"]:
        kw["attention_backend"] = settings["attention_backend"]
    if cfg["cudagraph_mode"] is not None:
        kw["compilation_config"] = {"cudagraph_mode": cfg["cudagraph_mode"]}
    if cfg.get("fa_max_splits") is not None:
        kw["attention_config"] = {"flash_attn_max_num_splits_for_cuda_graph": cfg["fa_max_splits"]}
    return kw


def measure(cfg: dict) -> tuple[dict, int]:
    """Run the engine (module docstring); returns (result dict, exit status)."""
    settings = sweep.engine_settings(cfg["mode"])
    os.environ.update(settings["env"])
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    import vllm
    from vllm import LLM

    from benchmarks.common import copy_bandwidth
    from kvrepro import capacity
    from kvrepro.configs import config_dir
    from kvrepro.provenance import collect, src_sha256
    from kvrepro.sweep_worker import Runner, make_prompt, preemptions, resolved_backends

    when = time.strftime("%Y%m%d_%H%M", time.gmtime())
    gpu = torch.cuda.get_device_properties(0).name
    out = Path(cfg["out"]) if cfg["out"] else default_out(gpu, cfg["mode"], cfg["users"], when, cfg["fa_max_splits"])
    trace_dir = Path(cfg["trace_dir"] or out.with_name(out.stem + "_traces")).resolve()
    trace_dir.mkdir(parents=True, exist_ok=True)
    model_dir = str(config_dir())
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        vocab = json.load(f)["vocab_size"]
    util = sweep.memory_utilization(cfg["gpu_memory_gb"], torch.cuda.get_device_properties(0).total_memory)
    kw = engine_kwargs(cfg, model_dir, util, str(trace_dir))
    t0 = time.perf_counter()
    llm = LLM(**kw)
    result = {"mode": cfg["mode"], "kv_format": kv_format(cfg["mode"]), "users": list(cfg["users"]),
              "params": {k: v for k, v in cfg.items() if k not in ("out", "trace_dir")},
              "engine": {"kv_cache_dtype": kw["kv_cache_dtype"], "attention_backend": kw.get("attention_backend",
                                                                                           "vllm-auto"),
                         "attention_backend_resolved": resolved_backends(llm),
                         "num_gpu_blocks": int(llm.llm_engine.vllm_config.cache_config.num_gpu_blocks),
                         "gpu_memory_utilization": util, "engine_init_s": round(time.perf_counter() - t0, 1),
                         "env": {k: v for k, v in os.environ.items() if k.startswith("KVREPRO_")},
                         "vllm_version": vllm.__version__},
              "batches": [], "trace_dir": str(trace_dir), "out": str(out)}
    if cfg["mode"].startswith("kvrepro:"):
        from kvrepro.vllm_backend.runtime import settings_record

        result["engine"]["kvrepro_settings"] = settings_record()
    run = Runner(llm, MAX_NEW_TOKENS - 1, 1)
    ids = [f"u{i}" for i in range(cfg["users"][0])]
    p0 = preemptions(llm)
    for i, rid in enumerate(ids):
        run.submit(rid, make_prompt(cfg["seed"], i, cfg["prompt_tokens"], vocab))
    tl = run.timelines
    run.run_until(lambda: all(tl[r].times for r in ids), 560)
    result["prefill_s"] = round(time.perf_counter() - t0 - result["engine"]["engine_init_s"], 1)
    status = 0
    alive = list(ids)
    for users in cfg["users"]:
        while len(alive) > users:
            run.abort([alive.pop()])
        for _ in range(cfg["settle_steps"]):
            run.step()
        batch: dict = {"users": users}
        ta = run.step()
        for _ in range(cfg["steps"]):
            tb = run.step()
        w = sweep.window_stats({r: tl[r] for r in alive}, ta, tb)
        batch["timed"] = {"steps": cfg["steps"], "tok_s": w["aggregate_decode_tok_s"],
                          "step_ms": w["seconds"] / cfg["steps"] * 1e3, "tokens": w["tokens"]}
        before = set(trace_dir.glob("*.pt.trace.json*"))
        llm.start_profile()
        for _ in range(cfg["steps"]):
            run.step()
        llm.stop_profile()
        new = sorted(set(trace_dir.glob("*.pt.trace.json*")) - before)
        batch["context_tokens_mean"] = cfg["prompt_tokens"] + sum(len(tl[r].times) for r in alive) / len(alive)
        if not new:
            batch["error"] = f"no new trace in {trace_dir} after stop_profile (vLLM's log says why)"
            status = 1
        else:
            batch["trace_file"] = new[-1].name
            try:
                batch["breakdown"] = profile.step_breakdown(profile.load_trace(new[-1]), users=users)
            except ValueError as e:
                batch["error"] = str(e)
                status = 1
        result["batches"].append(batch)
        print(f"[profile] {cfg['mode']} {users} users: {json.dumps(batch.get('timed'))} "
              f"{batch.get('error') or json.dumps(batch['breakdown']['mean'])}", flush=True)
    result["preemptions"] = preemptions(llm) - p0
    run.abort(alive)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    bw = copy_bandwidth()   # 4 GiB, as benchmarks/results/decode_side_by_side.json's 4.28 TB/s
    result["copy_bandwidth"] = bw
    model = capacity.load_model_config()
    per_token = capacity.bytes_per_token(result["kv_format"], model)
    for b in result["batches"]:
        b["bound"] = profile.decode_bound(b["users"], b["context_tokens_mean"], per_token, model.weights_bytes,
                                          bw["GBps_read_plus_write"])
    result["kv_bytes_per_token"] = per_token
    result["weights_bytes"] = model.weights_bytes
    result["provenance"] = dict(collect({k: v for k, v in kw.items() if k != "model"}), kvrepro_src_sha256=src_sha256())
    result["date"] = sweep.now_utc()
    return result, status


def main(argv=None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    try:
        cfg = check_args(a)
    except ValueError as e:
        ap.error(str(e))
    missing = sweep.measurement_blockers()
    if missing:
        print(f"error: step_profile runs vLLM on a GPU; missing: {', '.join(missing)}", file=sys.stderr)
        return 2
    from kvrepro.fileio import atomic_write_text

    result, status = measure(cfg)
    Path(result["out"]).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(result["out"], json.dumps(result, indent=1, default=str) + "\n")
    for line in profile.report_lines(result):
        print(line)
    print(f"wrote {result['out']}")
    return status


if __name__ == "__main__":
    sys.exit(main())
