"""``vllm serve`` with kvrepro's backend, the OpenAI server and the default multiprocessing engine (issue 22, part 3).

GPU and vLLM only (markers ``gpu`` and ``vllm``); one command on the GPU machine::

    .venv/bin/pytest -m "gpu and vllm" -s tests/test_reach_serve_gpu.py

Starts ``vllm serve`` on a bundled config (``kvrepro/configs/qwen3-0.6b``, head_dim 128, GQA 2) with random weights
(``--load-format dummy --skip-tokenizer-init``) twice, at the same ``--gpu-memory-utilization``: once with vLLM's
default attention and bf16 KV, once with ``--attention-backend CUSTOM`` and ``KVREPRO_PRESET=k4v4``. Against the
kvrepro server it sends 20 concurrent ``/v1/completions`` requests with token-id prompts of 17 to 3,000 tokens and
checks: every status is 200 and every completion has the token count asked; the plugin was loaded in the engine-core
process (its settings and engine lines carry the engine core's process prefix, not the API server's); its KV cache
holds >= 3.6x the bf16 server's tokens (k4v4's 134 B per token and KV head vs 512 B); ``vllm:num_preemptions`` in
``/metrics`` did not move; a greedy request sent twice returns the same tokens. The figures, the servers' log lines
that were read and the provenance go to ``results/vllm_smoke/serve_<UTC date>.json`` (``KVREPRO_SERVE_OUT``
overrides the path), written whether the checks pass or not.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "kvrepro" / "configs" / "qwen3-0.6b"
GPU_UTIL = "0.30"
MAX_MODEL_LEN = 8192
PROMPT_LENS = [17, 100, 700, 3000, 1500, 33, 256, 2048, 64, 1024, 5, 400, 2999, 128, 900, 12, 3000, 77, 511, 1800]
MAX_TOKENS = [8, 16, 32, 64, 24, 40, 48, 8, 56, 16, 64, 32, 8, 24, 40, 48, 16, 64, 32, 8]
START_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_cli() -> list[str]:
    """The ``vllm`` command of this interpreter's environment (its bin folder, else PATH)."""
    exe = Path(sys.executable).with_name("vllm")
    if exe.is_file():
        return [str(exe)]
    found = shutil.which("vllm")
    if not found:
        pytest.skip("no `vllm` command next to this interpreter or on PATH")
    return [found]


class Server:
    """A ``vllm serve`` subprocess, its log file and its base URL; ``stop()`` ends it (SIGTERM, then SIGKILL)."""

    def __init__(self, log_path: Path, extra_args: list[str], env: dict[str, str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [*vllm_cli(), "serve", str(MODEL), "--load-format", "dummy", "--skip-tokenizer-init",
               "--port", str(self.port), "--host", "127.0.0.1", "--gpu-memory-utilization", GPU_UTIL,
               "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "32", "--seed", "0", *extra_args]
        self.cmd = cmd
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    def wait_ready(self) -> float:
        t0 = time.time()
        while time.time() - t0 < START_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise AssertionError(f"vllm serve exited with {self.proc.returncode} before it was ready; log tail:\n"
                                     f"{self.text()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.time() - t0
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(2)
        raise AssertionError(f"vllm serve not ready after {START_TIMEOUT_S} s; log tail:\n{self.text()[-4000:]}")

    def text(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
        self.log.close()


def post(url: str, body: dict, timeout: float = 300) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {"error": e.read().decode(errors="replace")[:2000]}


def metrics(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        return r.read().decode()


def counter(text: str, name: str) -> float:
    """Sum over label sets of the Prometheus samples of ``name`` (``kvrepro.servebench.prometheus_sum``)."""
    from kvrepro.servebench import prometheus_sum

    return prometheus_sum(text, name)


def kv_tokens(server: Server) -> int:
    """The server's KV-cache size in tokens: ``vllm:cache_config_info``'s num_gpu_blocks x block_size, checked
    against the engine's "GPU KV cache size: N tokens" log line where it logged one."""
    text = metrics(server.url)
    line = next((ln for ln in text.splitlines() if ln.startswith("vllm:cache_config_info{")), None)
    assert line is not None, "vllm:cache_config_info not in /metrics"
    labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
    tokens = int(labels["num_gpu_blocks"]) * int(labels["block_size"])
    logged = re.findall(r"GPU KV cache size: ([\d,]+) tokens", server.text())
    if logged:
        assert int(logged[-1].replace(",", "")) == tokens, (logged, tokens)
    return tokens


def prompt(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(1000, 150000) for _ in range(n)]


def test_vllm_serve_with_kvrepro(tmp_path):
    from kvrepro.fileio import atomic_write_text
    from kvrepro.provenance import collect

    env = {k: v for k, v in os.environ.items() if not k.startswith("KVREPRO_")}
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"         # the engine core in its own process, as `vllm serve` runs it
    record: dict = {"model": str(MODEL.relative_to(ROOT)), "gpu_memory_utilization": float(GPU_UTIL),
                    "max_model_len": MAX_MODEL_LEN, "passed": False}
    out = Path(os.environ.get("KVREPRO_SERVE_OUT") or
               ROOT / "results" / "vllm_smoke" / f"serve_{time.strftime('%Y%m%d_%H%M', time.gmtime())}.json")
    try:
        bf16 = Server(tmp_path / "bf16.log", ["--kv-cache-dtype", "auto"], env)
        try:
            record["bf16_start_s"] = bf16.wait_ready()
            record["bf16_kv_tokens"] = kv_tokens(bf16)
            record["bf16_command"] = bf16.cmd
        finally:
            bf16.stop()

        server = Server(tmp_path / "kvrepro.log", ["--attention-backend", "CUSTOM"], env | {"KVREPRO_PRESET": "k4v4"})
        try:
            record["kvrepro_start_s"] = server.wait_ready()
            record["kvrepro_command"] = server.cmd
            record["kvrepro_kv_tokens"] = kv_tokens(server)
            record["kv_ratio"] = record["kvrepro_kv_tokens"] / record["bf16_kv_tokens"]
            log = server.text()
            lines = [ln for ln in log.splitlines() if "kvrepro settings: preset=k4v4" in ln
                     or "kvrepro engine: preset=k4v4" in ln]
            record["plugin_log_lines"] = lines
            pids = {int(p) for ln in lines for p in re.findall(r"pid=(\d+)", ln)}
            record["server_pid"], record["plugin_pids"] = server.proc.pid, sorted(pids)

            pre = counter(metrics(server.url), "vllm:num_preemptions")
            jobs = [{"model": str(MODEL), "prompt": prompt(n, i), "max_tokens": m, "temperature": 0.8, "seed": i,
                     "ignore_eos": True, "return_token_ids": True}
                    for i, (n, m) in enumerate(zip(PROMPT_LENS, MAX_TOKENS))]
            t0 = time.time()
            with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
                answers = list(pool.map(lambda b: post(server.url + "/v1/completions", b), jobs))
            record["concurrent_s"] = time.time() - t0
            post_pre = counter(metrics(server.url), "vllm:num_preemptions")
            record["statuses"] = [s for s, _ in answers]
            record["completion_tokens"] = [a.get("usage", {}).get("completion_tokens") for _, a in answers]
            record["returned_token_counts"] = [len((a.get("choices") or [{}])[0].get("token_ids") or [])
                                               for _, a in answers]
            record["preemptions"] = post_pre - pre

            greedy = {"model": str(MODEL), "prompt": prompt(1200, 99), "max_tokens": 48, "temperature": 0.0,
                      "ignore_eos": True, "return_token_ids": True}
            first, second = post(server.url + "/v1/completions", greedy), post(server.url + "/v1/completions", greedy)
            record["greedy_tokens"] = [(a.get("choices") or [{}])[0].get("token_ids") for _, a in (first, second)]
        finally:
            server.stop()

        print("\nSERVE " + json.dumps({k: v for k, v in record.items() if k not in ("greedy_tokens",)}, default=str))
        assert record["statuses"] == [200] * len(jobs), [a for s, a in answers if s != 200][:2]
        assert record["completion_tokens"] == MAX_TOKENS
        assert record["returned_token_counts"] == MAX_TOKENS
        assert lines and all("pid=" in ln for ln in lines), f"no kvrepro line from a process-prefixed logger: {lines}"
        assert server.proc.pid not in pids, "the plugin's lines come from the API server, not the engine core"
        assert any("EngineCore" in ln for ln in lines), lines
        assert record["kv_ratio"] >= 3.6, record["kv_ratio"]
        assert record["preemptions"] == 0
        assert record["greedy_tokens"][0] == record["greedy_tokens"][1] and len(record["greedy_tokens"][0]) == 48
        record["passed"] = True
    finally:
        record["provenance"] = collect({"test": "tests/test_reach_serve_gpu.py"})
        atomic_write_text(out, json.dumps(record, indent=1, default=str) + "\n")
