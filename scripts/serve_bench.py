"""Serving under load: per KV mode, ``vllm serve`` at the sweep's memory budget, then vLLM 0.20.2's own
``vllm bench serve`` client at each request rate; results with provenance (``kvrepro.servebench`` has the workload,
why the prompts are token ids, and the table).

GPU and vLLM only. Per mode (one server per mode, one at a time):

1. ``python3 -m vllm.entrypoints.cli.main serve`` (``servebench.serve_argv``: bundled Qwen3-4B config, dummy weights,
   ``--skip-tokenizer-init``, ``--gpu-memory-utilization`` emulating ``--gpu-memory-gb``, the mode's KV dtype and
   attention backend, ``KVREPRO_PRESET`` for kvrepro's modes; the default multiprocessing engine, as served); its log in
   ``<out stem>_logs/``;
2. wait for ``/health``; read the KV-cache size from ``/metrics`` (``vllm:cache_config_info``);
3. per request rate: ``vllm:num_preemptions`` before; vLLM's benchmark client in this process
   (``vllm.benchmarks.serve.main`` with the ``vllm bench serve`` arguments of ``servebench.bench_argv``; its
   ``get_samples`` and ``get_tokenizer`` replaced by the token-id prompts and ``servebench.UsageOnlyTokenizer``), while a
   thread samples ``/metrics`` every 2 s (peak KV-cache usage, running and waiting requests); the preemption counter
   after; vLLM's ``--save-result`` JSON beside the results;
4. stop the server (SIGTERM, then SIGKILL).

Usage (GPU machine, repo root, vLLM importable; kvrepro's entry point installed as in ``scripts/h200_sweep.sh``)::

    python3 scripts/serve_bench.py --modes fp8:flash_attn --out $OUT/serve.json
    python3 scripts/serve_bench.py --modes kvrepro:k4v4 --out $OUT/serve.json     # adds to the same file

Writes ``--out`` (default ``results/serve/<gpu>_<UTC date>.json``; written then renamed; runs of earlier calls with the
same workload are kept, a (mode, rate) measured again replaced; a file of another workload is refused before any GPU
work): ``workload``, ``runs`` (per mode and rate: the server command, KV tokens, the client's arguments,
``servebench.summarize`` of vLLM's result, preemptions, peak usage, the vLLM result file's name, the attention backend
the server logged, the run's provenance, for kvrepro's modes with the SHA-256 of the CUDA fatbin the server loads),
``provenance`` (the last call's). Prints the table (``servebench.serve_table``). Exit 2 on bad arguments, 1 when a mode
failed (the others still run; the file keeps what was measured, a failed mode's earlier rates included).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvrepro import servebench as sb  # noqa: E402
from kvrepro import sweep  # noqa: E402
from kvrepro.fileio import out_path_error  # noqa: E402

START_TIMEOUT_S = 900


def build_parser() -> argparse.ArgumentParser:
    d = sb.DEFAULTS
    ap = argparse.ArgumentParser(prog="python3 scripts/serve_bench.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default=",".join(sb.DEFAULT_MODES), help=f"comma-separated; allowed: "
                    f"{', '.join(sb.SERVE_MODES)} (default: {','.join(sb.DEFAULT_MODES)})")
    ap.add_argument("--num-prompts", type=int, default=d["num_prompts"],
                    help=f"requests per rate (default: {d['num_prompts']})")
    ap.add_argument("--input-min", type=int, default=d["input_min"],
                    help=f"shortest prompt, tokens (default: {d['input_min']})")
    ap.add_argument("--input-max", type=int, default=d["input_max"],
                    help=f"longest prompt, tokens (default: {d['input_max']})")
    ap.add_argument("--output-len", type=int, default=d["output_len"],
                    help=f"output tokens per request (default: {d['output_len']})")
    ap.add_argument("--request-rates", default=",".join(d["request_rates"]),
                    help=f"comma-separated requests per second, inf = all at once (default: "
                         f"{','.join(d['request_rates'])})")
    ap.add_argument("--goodput", nargs="+", default=list(d["goodput"]),
                    help=f"vLLM's SLOs, NAME:MS separated by spaces or commas, e.g. ttft:30000 tpot:50; names: "
                         f"{', '.join(sb.GOODPUT_NAMES)} (default: {' '.join(d['goodput'])})")
    ap.add_argument("--gpu-memory-gb", type=float, default=d["gpu_memory_gb"],
                    help=f"emulated card, GiB (default: {d['gpu_memory_gb']:g})")
    ap.add_argument("--max-num-seqs", type=int, default=d["max_num_seqs"],
                    help=f"vLLM's --max-num-seqs (default: {d['max_num_seqs']})")
    ap.add_argument("--seed", type=int, default=d["seed"], help=f"prompt draw and server seed (default: {d['seed']})")
    ap.add_argument("--out", default=None, help="result JSON; an existing one of the same workload gets these runs "
                                                "added (default: results/serve/<gpu>_<UTC date>.json)")
    return ap


def config_of(a: argparse.Namespace) -> dict:
    """Validated settings (``servebench.check_config``); raises ValueError naming the bad parameter."""
    bad_out = a.out is not None and out_path_error(a.out, give="the result file's path (new runs are merged into it)")
    if bad_out:
        raise ValueError(bad_out)
    try:
        cfg = sb.check_config({"modes": a.modes, "num_prompts": a.num_prompts, "input_min": a.input_min,
                               "input_max": a.input_max, "output_len": a.output_len,
                               "request_rates": a.request_rates, "goodput": a.goodput,
                               "gpu_memory_gb": a.gpu_memory_gb, "max_num_seqs": a.max_num_seqs, "seed": a.seed})
    except ValueError as e:
        raise ValueError(flag_names(str(e))) from None
    limit = max_positions()
    if cfg["input_max"] + cfg["output_len"] + 64 > limit:
        raise ValueError(f"--input-max ({cfg['input_max']}) + --output-len ({cfg['output_len']}) + 64 must be <= the "
                         f"bundled model's max_position_embeddings ({limit}): the server's --max-model-len")
    if a.out is not None and Path(a.out).exists():
        # runs are merged into it after each mode: refuse now, not after the first mode's GPU run
        try:
            sb.check_appendable(sb.read_doc(a.out, empty_runs=True), cfg)
        except ValueError as e:
            raise ValueError(flag_names(f"--out {a.out!r} exists: {e}")) from None
    return cfg


def max_positions() -> int:
    """``max_position_embeddings`` of the bundled model config the servers run (``kvrepro.configs.config_dir``)."""
    from kvrepro.configs import config_dir

    with open(os.path.join(config_dir(), "config.json"), encoding="utf-8") as f:
        return int(json.load(f)["max_position_embeddings"])


def flag_names(message: str) -> str:
    """``check_config``'s message with each setting name written as this script's flag (``num_prompts`` ->
    ``--num-prompts``), so that an error names what the user typed."""
    names = sorted(set(sb.DEFAULTS) - {"block_size"} | {"modes"}, key=len, reverse=True)
    # a setting's name where the message names it (before ':', 'must', '(', 'names', ' is ', ' '-quoted value), never
    # inside the user's own quoted or listed values
    return re.sub(r"(?<![\w'\-])(" + "|".join(names) + r")(?=:| must| \(| names| is | [\d'\[{])",
                  lambda m: "--" + m.group(1).replace("_", "-"), message)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, timeout: float = 30) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def total_memory_bytes() -> int:
    """Device 0's memory as torch reports it, read in a child process so that this one never holds a CUDA context
    (the servers' memory accounting then sees only themselves)."""
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.get_device_properties(0).total_memory)"],
                         capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


class Poller(threading.Thread):
    """Samples ``/metrics`` every ``period`` s: peak ``vllm:kv_cache_usage_perc``, running and waiting requests."""

    def __init__(self, url: str, period: float = 2.0):
        super().__init__(daemon=True)
        self.url, self.period, self.stop_flag = url, period, threading.Event()
        self.peak = {"kv_cache_usage_perc": 0.0, "num_requests_running": 0.0, "num_requests_waiting": 0.0}
        self.samples = 0

    def run(self) -> None:
        while not self.stop_flag.is_set():
            try:
                text = get(self.url + "/metrics", timeout=5)
                for k in self.peak:
                    self.peak[k] = max(self.peak[k], sb.prometheus_sum(text, "vllm:" + k))
                self.samples += 1
            except (OSError, ValueError):
                pass
            self.stop_flag.wait(self.period)


def run_client(argv: list[str], prompts: list[list[int]], output_len: int) -> dict:
    """vLLM's ``vllm bench serve`` (``vllm.benchmarks.serve.main``) with ``argv``, the token-id ``prompts`` as its
    samples and :class:`kvrepro.servebench.UsageOnlyTokenizer` (``kvrepro.servebench`` says why). Returns vLLM's result
    dict."""
    import vllm.benchmarks.serve as vs
    from vllm.benchmarks.datasets import SampleRequest

    parser = argparse.ArgumentParser()
    vs.add_cli_args(parser)
    args = parser.parse_args(argv)
    samples = [SampleRequest(prompt=p, prompt_len=len(p), expected_output_len=output_len, request_id=f"r{i}")
               for i, p in enumerate(prompts)]
    saved = vs.get_samples, vs.get_tokenizer
    vs.get_samples = lambda a, tok: samples
    vs.get_tokenizer = lambda *a, **k: sb.UsageOnlyTokenizer()
    try:
        return vs.main(args)
    finally:
        vs.get_samples, vs.get_tokenizer = saved


def installed_version(dist: str) -> str | None:
    """The installed version of distribution ``dist`` as this process (and the server it starts) imports it, or
    None where it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


class ModeFailed(RuntimeError):
    """A mode's server or one of its client runs failed; ``runs`` holds the rates measured before the failure."""

    def __init__(self, message: str, runs: list[dict]):
        super().__init__(message)
        self.runs = runs


def bench_mode(mode: str, cfg: dict, util: float, prompts, model_dir: str, out: Path) -> list[dict]:
    """One server for ``mode`` and one client run per request rate; returns the runs (module docstring).

    Raises:
        ModeFailed: the server did not start or a rate's run failed, with the runs of the rates measured before."""
    port = free_port()
    argv, extra_env = sb.serve_argv(mode, model_dir, port, util, cfg["input_max"] + cfg["output_len"] + 64, cfg)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVREPRO_") or k == "KVREPRO_PREFILL"}
    env.update(extra_env, VLLM_ENABLE_V1_MULTIPROCESSING="1")
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", *argv]
    log_path = sb.server_log(out, mode)
    url = f"http://127.0.0.1:{port}"
    runs = []
    with open(log_path, "w") as log:
        t0 = time.time()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            _serve_rates(mode, cfg, argv, extra_env, prompts, model_dir, out, proc, log_path, url, t0, runs)
        except Exception as e:  # noqa: BLE001 - keep the rates measured so far with the error
            raise ModeFailed(f"{type(e).__name__}: {e}", runs) from e
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=30)
    return runs


def _serve_rates(mode, cfg, argv, extra_env, prompts, model_dir, out, proc, log_path, url, t0, runs) -> None:
    """``bench_mode``'s body while its server runs: wait for ``/health``, then one client run per rate, each appended
    to ``runs`` as it completes."""
    res_dir = sb.side_dirs(out)[0]
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode} before it was ready; log "
                               f"{log_path}:\n{log_path.read_text(errors='replace')[-3000:]}")
        try:
            if get(url + "/health", timeout=5) is not None:
                break
        except (OSError, urllib.error.URLError):
            pass
        if time.time() - t0 > START_TIMEOUT_S:
            raise RuntimeError(f"vllm serve not ready after {START_TIMEOUT_S} s; log {log_path}")
        time.sleep(2)
    start_s = time.time() - t0
    info = sb.cache_info(get(url + "/metrics"))
    print(f"[serve] {mode}: ready after {start_s:.0f} s, KV cache {info['kv_tokens']:,} tokens", flush=True)
    for rate in cfg["request_rates"]:
        rate_txt = "inf" if rate == float("inf") else f"{rate:g}"
        fname = f"vllm_bench_{mode.replace(':', '_')}_rate{rate_txt}.json"
        bargv = sb.bench_argv(url, model_dir, rate, cfg, str(res_dir), fname)
        pre = sb.prometheus_sum(get(url + "/metrics"), "vllm:num_preemptions")
        poll = Poller(url)
        poll.start()
        t = time.time()
        try:
            result = run_client(bargv, prompts, cfg["output_len"])
        finally:
            poll.stop_flag.set()
            poll.join(10)
        post = sb.prometheus_sum(get(url + "/metrics"), "vllm:num_preemptions")
        run = {"mode": mode, "attention_backend": sweep.engine_settings(mode)["attention_backend"] or
               "vllm-auto", "request_rate": rate_txt, "serve_command": ["vllm", *argv],
               "serve_env": extra_env, "server_start_s": round(start_s, 1), "kv_tokens": info["kv_tokens"],
               "num_gpu_blocks": info["num_gpu_blocks"], "bench_command": ["vllm", "bench", "serve", *bargv],
               "prompts": "token ids (kvrepro.servebench.token_prompts) replacing the random dataset's text",
               "summary": sb.summarize(result), "preemptions": int(post - pre), "peak": dict(poll.peak),
               "metrics_samples": poll.samples, "wall_s": round(time.time() - t, 1),
               "vllm_result_file": fname, "date": sweep.now_utc()}
        run["attention_backend_used"] = sb.logged_backend(log_path)
        if run["attention_backend_used"] == "FLASHINFER":  # as the capacity rows: which FlashInfer it ran
            run["flashinfer_version"] = installed_version("flashinfer-python")
        runs.append(run)
        print(f"[serve] {mode} rate {rate_txt}: {json.dumps(run['summary'])} preemptions "
              f"{run['preemptions']} peak {json.dumps(run['peak'])}", flush=True)


def main(argv=None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    try:
        cfg = config_of(a)
    except ValueError as e:
        ap.error(str(e))
    missing = sweep.measurement_blockers()
    if missing:
        print(f"error: serve_bench runs vLLM on a GPU; missing: {', '.join(missing)}", file=sys.stderr)
        return 2
    import vllm

    from kvrepro.configs import config_dir
    from kvrepro.fileio import atomic_write_text
    from kvrepro.ops.cuda_decode import read_manifest
    from kvrepro.provenance import collect, src_sha256

    try:        # before any folder is made: a card smaller than the budget is a bad argument, not a failed run
        util = sweep.memory_utilization(cfg["gpu_memory_gb"], total_memory_bytes())
    except ValueError as e:
        ap.error(f"--gpu-memory-gb {cfg['gpu_memory_gb']:g}: {e} (allowed: more than 0, at most this GPU's memory)")
    info = collect({k: v for k, v in cfg.items()})
    out = Path(a.out) if a.out else sb.default_out(info["gpu"], time.strftime("%Y%m%d", time.gmtime()), ROOT)
    out.parent.mkdir(parents=True, exist_ok=True)
    for d in sb.side_dirs(out):
        d.mkdir(exist_ok=True)
    model_dir = str(config_dir())
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        vocab = json.load(f)["vocab_size"]
    lengths = sb.input_lengths(cfg["num_prompts"], cfg["input_min"], cfg["input_max"], cfg["seed"])
    prompts = sb.token_prompts(lengths, vocab, cfg["seed"])
    workload = sb.config_workload(cfg)
    workload.update(model=sweep.model_label(None), gpu=info["gpu"], vllm_version=vllm.__version__,
                    gpu_memory_utilization=util,
                    prompt_lengths_sha256=hashlib.sha256(json.dumps(lengths).encode()).hexdigest(),
                    prompt_tokens_total=sum(lengths))
    # the committed fatbin the kvrepro servers load (the runtime's kvrepro settings name it the same way); its log says
    # whether decode ran on it
    fatbin = read_manifest()["fatbin_sha256"]
    status = 0
    for mode in cfg["modes"]:
        try:
            runs = bench_mode(mode, cfg, util, prompts, model_dir, out)
        except Exception as e:  # noqa: BLE001 - one failing mode must not lose the others' runs, nor its own
            print(f"[serve] {mode} failed: {type(e).__name__}: {str(e)[:3000]}", flush=True)
            status = 1
            runs = getattr(e, "runs", [])     # ModeFailed: the rates measured before the failure
            if not runs:
                continue
        prov = dict(info, kvrepro_src_sha256=src_sha256(), script="scripts/serve_bench.py")
        if mode.startswith("kvrepro:"):
            prov["cuda_fatbin_sha256"] = fatbin
        # each run self-contained (the table compares runs of several calls): its workload and its own provenance
        runs = [dict(r, workload=workload, provenance=prov) for r in runs]
        existing = sb.read_doc(out, empty_runs=True) if out.exists() else None
        doc = sb.merge_runs(existing, runs, workload)
        doc["provenance"] = prov     # the file's last call; each run's own is in the run
        atomic_write_text(out, json.dumps(doc, indent=1, default=str) + "\n")
    if out.exists():
        doc = sb.read_doc(out, empty_runs=True)
        print(sb.table_markdown(sb.serve_table(doc["runs"])))
        print(f"wrote {out}")
    return status


if __name__ == "__main__":
    sys.exit(main())
