"""kvrepro.servebench and scripts/serve_bench.py on the CPU: settings checks, the workload draw, the server and
client arguments against vLLM 0.20.2's flags, /metrics parsing, vLLM result summaries and the serving table against
hand-computed ratios. The servers and the client run only on a GPU machine."""
import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import scripts_module
from kvrepro import servebench as sb

ROOT = Path(__file__).resolve().parents[1]


def test_check_config_defaults_and_errors():
    c = sb.check_config({})
    assert c["modes"] == ("fp8:flash_attn", "kvrepro:k4v4") and c["request_rates"] == (math.inf,)
    assert c["output_len"] == 1024 and c["num_prompts"] == 32
    assert c["goodput"] == {"tpot": 50.0} and (c["input_min"], c["input_max"]) == (8192, 131072)
    c = sb.check_config({"modes": "fp8,kvrepro:k4v2", "request_rates": "0.1,inf", "goodput": ["tpot:50", "ttft:2000"]})
    assert c["modes"] == ("fp8", "kvrepro:k4v2") and c["request_rates"] == (0.1, math.inf)
    assert c["goodput"] == {"tpot": 50.0, "ttft": 2000.0}
    for bad, msg in (({"modes": "fp16"}, "modes: .*allowed"), ({"modes": "turboquant_k8v4"}, "allowed"),
                     ({"modes": "fp8,fp8"}, "more than once"), ({"num_prompts": 0}, "num_prompts must be"),
                     ({"input_min": 9000, "input_max": 8000}, "input_min .* <= input_max"),
                     ({"request_rates": "0"}, "request_rates"), ({"request_rates": "fast"}, "request_rates"),
                     ({"goodput": ["tpot=50"]}, "NAME:MILLISECONDS"), ({"goodput": ["latency:5"]}, "allowed: ttft"),
                     ({"goodput": ["tpot:-1"]}, "tpot must be"), ({"gpu_memory_gb": 0}, "gpu_memory_gb"),
                     ({"goodput": ["ttft:0"]}, "ttft must be a finite number of ms > 0, got '0'"),
                     ({"block_size": 8}, "block_size"), ({"rates": 1}, "unknown serve-bench setting"),
                     ({"request_rates": "0.5,0.50,5e-1"}, "names a rate more than once"),
                     ({"request_rates": "1e400"}, "request_rates"), ({"gpu_memory_gb": math.inf}, "gpu_memory_gb"),
                     ({"goodput": ["tpot:50", "tpot:100"]}, "tpot is given more than once")):
        with pytest.raises(ValueError, match=msg):
            sb.check_config(bad)


def test_workload_draw_matches_vllms_random_dataset_range():
    lens = sb.input_lengths(2000, 8192, 131072, seed=0)
    assert min(lens) >= 8192 and max(lens) <= 131072 and len(lens) == 2000
    assert abs(sum(lens) / len(lens) - (8192 + 131072) / 2) < 3000          # uniform: mean at the middle
    assert sb.input_lengths(5, 10, 20, 1) == sb.input_lengths(5, 10, 20, 1)
    eq = sb.random_dataset_equivalent(8192, 131072)
    # vLLM's get_sampling_params interval: [floor(L (1 - r)), ceil(L (1 + r))] must be [8192, 131072]
    lo = math.floor(eq["random_input_len"] * (1 - eq["random_range_ratio"]))
    hi = math.ceil(eq["random_input_len"] * (1 + eq["random_range_ratio"]))
    assert (lo, hi) == (8192, 131072)
    p = sb.token_prompts([3, 5], 151936, 0)
    assert [len(x) for x in p] == [3, 5] and all(1000 <= t < 151936 - 1000 for x in p for t in x)
    assert p[0] != p[1][:3]


def test_serve_and_bench_arguments():
    cfg = sb.check_config({"request_rates": "0.5"})
    argv, env = sb.serve_argv("kvrepro:k4v4", "/cfg", 8001, 0.512, 131072 + 576, cfg)
    assert env == {"KVREPRO_PRESET": "k4v4"}
    assert argv[:2] == ["serve", "/cfg"] and "--skip-tokenizer-init" in argv and "--no-enable-prefix-caching" in argv
    assert argv[argv.index("--attention-backend") + 1] == "CUSTOM" and argv[argv.index("--kv-cache-dtype") + 1] == "auto"
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.512000"
    argv, env = sb.serve_argv("fp8:triton_attn", "/cfg", 8001, 0.5, 1000, cfg)
    assert env == {} and argv[argv.index("--attention-backend") + 1] == "TRITON_ATTN"
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8"
    assert "--attention-backend" not in sb.serve_argv("fp8", "/cfg", 1, 0.5, 1000, cfg)[0]
    b = sb.bench_argv("http://h:1", "/cfg", 0.5, cfg, "/r", "f.json")
    assert b[b.index("--request-rate") + 1] == "0.5" and b[b.index("--goodput") + 1] == "tpot:50"
    assert b[b.index("--metric-percentiles") + 1] == "50,99" and "--save-result" in b and "--ignore-eos" in b
    assert sb.bench_argv("http://h:1", "/cfg", math.inf, cfg, "/r", "f.json")[
        b.index("--request-rate") + 1] == "inf"


def test_bench_arguments_parse_with_vllms_own_parser():
    vs = pytest.importorskip("vllm.benchmarks.serve", reason="needs vLLM 0.20.2 (its bench serve parser)")
    import argparse

    parser = argparse.ArgumentParser()
    vs.add_cli_args(parser)
    a = parser.parse_args(sb.bench_argv("http://h:1", "/cfg", 0.5, sb.check_config({}), "/r", "f.json"))
    assert a.request_rate == 0.5 and a.goodput == ["tpot:50"] and a.save_result and a.num_prompts == 32


PAGE = """# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="model"} 3.0
vllm:num_preemptions_created{engine="0",model_name="model"} 1.7e9
vllm:kv_cache_usage_perc{engine="0",model_name="model"} 0.87
vllm:cache_config_info{block_size="16",cache_dtype="fp8",engine="0",num_gpu_blocks="56919",num_cpu_blocks="0"} 1.0
"""


def test_metrics_parsing():
    assert sb.prometheus_sum(PAGE, "vllm:num_preemptions") == 3.0          # the _created sample is not the counter
    assert sb.prometheus_sum(PAGE, "vllm:kv_cache_usage_perc") == 0.87
    assert sb.cache_info(PAGE) == {"num_gpu_blocks": 56919, "block_size": 16, "kv_tokens": 56919 * 16,
                                   "cache_dtype": "fp8"}
    with pytest.raises(ValueError, match="vllm:num_requests_waiting not in /metrics"):
        sb.prometheus_sum(PAGE, "vllm:num_requests_waiting")
    with pytest.raises(ValueError, match="cache_config_info"):
        sb.cache_info("")


def _vllm_result(req_s, tok_s, goodput, tpot99, completed=32):
    return {"duration": completed / req_s, "completed": completed, "failed": 0, "request_throughput": req_s,
            "output_throughput": tok_s, "request_goodput": goodput, "max_concurrent_requests": 20,
            "p50_ttft_ms": 900.0, "p99_ttft_ms": 9000.0, "mean_ttft_ms": 1500.0, "p50_tpot_ms": tpot99 / 2,
            "p99_tpot_ms": tpot99, "mean_tpot_ms": tpot99 / 2, "p50_itl_ms": 20.0, "p99_itl_ms": 400.0}


def _run(mode, rate, req_s, tok_s, goodput, tpot99, preempt=0, **wl):
    workload = {**dict(num_prompts=32, input_min=8192, input_max=131072, output_len=512, goodput={"tpot": 50.0},
                       gpu_memory_gb=80.0, max_num_seqs=32, block_size=16, seed=0, model="Qwen/Qwen3-4B-Instruct-2507",
                       gpu="NVIDIA H200", vllm_version="0.20.2"), **wl}
    from kvrepro import sweep

    return {"mode": mode, "attention_backend": sweep.engine_settings(mode)["attention_backend"] or "vllm-auto",
            "request_rate": rate, "summary": sb.summarize(_vllm_result(req_s, tok_s, goodput, tpot99)),
            "preemptions": preempt, "kv_tokens": 1000, "workload": workload}


def test_summarize_reads_vllms_keys():
    s = sb.summarize(_vllm_result(0.2, 100.0, 0.1, 80.0))
    assert (s["request_throughput"], s["output_throughput"], s["request_goodput"]) == (0.2, 100.0, 0.1)
    assert (s["p50_ttft_ms"], s["p99_ttft_ms"], s["p50_tpot_ms"], s["p99_tpot_ms"]) == (900.0, 9000.0, 40.0, 80.0)
    assert s["p99_e2el_ms"] is None                                       # not in this result: blank, not invented
    with pytest.raises(ValueError, match="missing .*output_throughput"):
        sb.summarize({"completed": 1, "failed": 0, "duration": 1.0, "request_throughput": 1.0})


def test_serve_table_goodput_ratio_against_the_best_fp8_per_rate():
    runs = [_run("kvrepro:k4v4", "0.25", 0.24, 120.0, 0.20, 45.0),
            _run("fp8:flash_attn", "0.25", 0.20, 100.0, 0.08, 70.0, preempt=4),
            _run("fp8:triton_attn", "0.25", 0.21, 101.0, 0.10, 60.0),
            _run("kvrepro:k4v4", "inf", 0.30, 150.0, 0.05, 90.0),
            _run("fp8:flash_attn", "inf", 0.25, 125.0, 0.0, 200.0)]
    df = sb.serve_table(runs)
    assert list(zip(df["mode"], df["request_rate"])) == [("fp8:flash_attn", 0.25), ("fp8:flash_attn", math.inf),
                                                        ("fp8:triton_attn", 0.25), ("kvrepro:k4v4", 0.25),
                                                        ("kvrepro:k4v4", math.inf)]
    k = df[(df["mode"] == "kvrepro:k4v4") & (df["request_rate"] == 0.25)].iloc[0]
    assert k["goodput_vs_best_fp8"] == pytest.approx(0.20 / 0.10) and k["best_fp8"] == "fp8:triton_attn"
    assert df.iloc[0]["goodput_vs_best_fp8"] == pytest.approx(0.8) and df.iloc[0]["preemptions"] == 4
    inf_row = df[(df["mode"] == "kvrepro:k4v4") & (df["request_rate"] == math.inf)].iloc[0]
    assert inf_row["goodput_vs_best_fp8"] is None and inf_row["best_fp8"] == "fp8:flash_attn"   # fp8's goodput 0
    assert k["tpot_p99_ms"] == 45.0 and k["ttft_p50_ms"] == 900.0 and k["slo"] == "tpot <= 50 ms"
    md = sb.table_markdown(df)
    assert ("| kvrepro:k4v4 | CUSTOM | 0.25 | 0.240 | 120.0 | 900.0 | 9000.0 | 22.5 | 45.0 |  |  | 0 |  |  | 0.200 | "
            "2.00x |") in md
    assert "| kvrepro:k4v4 | CUSTOM | inf | 0.300 | 150.0 |" in md
    assert "TPOT SLO alone" not in md                       # no run scored at a second SLO set: no such columns


def test_serve_table_refuses_mixed_workloads_and_merge_keeps_one_workload():
    with pytest.raises(ValueError, match="differ in output_len"):
        sb.serve_table([_run("fp8", "0.25", 1, 1, 1, 1), _run("kvrepro:k4v4", "0.25", 1, 1, 1, 1, output_len=9)])
    with pytest.raises(ValueError, match="no serve-bench runs"):
        sb.serve_table([])
    a, b = _run("fp8", "0.25", 1, 1, 1, 1), _run("kvrepro:k4v4", "0.25", 2, 2, 2, 2)
    wl = a["workload"]
    doc = sb.merge_runs(None, [a], wl)
    doc = sb.merge_runs(doc, [b], wl)
    doc = sb.merge_runs(doc, [dict(a, preemptions=7)], wl)              # fp8 at 0.25 measured again: replaced
    assert [(r["mode"], r["preemptions"]) for r in doc["runs"]] == [("kvrepro:k4v4", 0), ("fp8", 7)]
    with pytest.raises(ValueError, match=r"differs in \['num_prompts'\]"):
        sb.merge_runs(doc, [a], dict(wl, num_prompts=8))


def test_read_results(tmp_path):
    p = tmp_path / "s.json"
    p.write_text(json.dumps({"workload": {}, "runs": [_run("fp8", "0.25", 1, 1, 1, 1)]}))
    assert sb.read_results([p])[0]["source_file"] == str(p)
    for text, msg in (("{}", "no 'runs' list"), ('{"runs": []}', "or an empty one"), ("{", "bad.json: .*not JSON")):
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(ValueError, match=msg):
            sb.read_results([tmp_path / "bad.json"])
    # a run recorded without its preemption count shows a blank cell, not an error
    md = sb.table_markdown(sb.serve_table([dict(_run("fp8", "0.25", 1, 1, 1, 1), preemptions=None)]))
    assert "| fp8 | vllm-auto | 0.25 |" in md and "|  |  |  | 1.000 | 1.00x |" in md


def test_usage_only_tokenizer_is_truthy_and_never_tokenizes():
    t = sb.UsageOnlyTokenizer()
    assert bool(t)
    with pytest.raises(RuntimeError, match="sent no usage"):
        t("text")


@pytest.mark.parametrize("args,msg", [
    (["--modes", "fp16"], "--modes: ['fp16']; allowed: bf16,"), (["--request-rates", "-1"], "--request-rates: each"),
    (["--goodput", "tpot"], "--goodput: 'tpot' is not NAME:MILLISECONDS"), (["--input-min", "0"], "--input-min must be"),
    (["--input-min", "9", "--input-max", "3"], "--input-min (9) must be <= --input-max (3)"),
    (["--num-prompts", "0"], "--num-prompts must be an integer >= 1, got 0"),
    (["--out", "/nonexistent/s.json"], "its folder does not exist"), (["--out", "results"], "is a folder"),
    (["--out", "README.md"], "exists: README.md: not a serve-bench result (not JSON"),
    (["--out", "kvrepro/ops/cuda/decode.json"],
     "exists: kvrepro/ops/cuda/decode.json: not a serve-bench result (no 'runs' list"),
    (["--out", "pyproject.toml"], "not a serve-bench result"),
    (["--seed", "-1"], "--seed must be an integer >= 0, got -1"),
    (["--input-max", "1000000000"], "--input-max (1000000000) + --output-len (1024) + 64 must be <= the bundled "
                                    "model's max_position_embeddings (262144)"),
    (["--request-rates", "1e400"], "'1e400' overflows a float to infinity; write 'inf'"),
    (["--modes", "seed"], "--modes: ['seed']; allowed:"), (["--request-rates", "seed"], "got 'seed'"),
    (["--out", "results/serve/nvidia-h200_20261203.json"], "exists: it holds another workload: --num-prompts 24 there, "
                                                          "32 asked; --output-len 2048 there, 1024 asked"),
    (["--request-rates", "0.5,0.5"], "names a rate more than once"), (["--gpu-memory-gb", "inf"], "--gpu-memory-gb must"),
])
def test_script_refuses_bad_arguments_naming_them(args, msg):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "serve_bench.py"), *args], capture_output=True,
                       text=True, cwd=ROOT)
    assert r.returncode == 2 and msg in r.stderr, r.stderr


def test_help_shows_every_default():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "serve_bench.py"), "--help"], capture_output=True,
                       text=True, cwd=ROOT)
    text = " ".join(r.stdout.split())
    for flag, value in (("--num-prompts", sb.DEFAULTS["num_prompts"]), ("--output-len", sb.DEFAULTS["output_len"]),
                        ("--input-max", sb.DEFAULTS["input_max"]), ("--max-num-seqs", sb.DEFAULTS["max_num_seqs"])):
        assert f"{flag} {flag[2:].upper().replace('-', '_')}" in text and f"(default: {value})" in text
    assert r.returncode == 0 and text.count("(default:") == 11 and "(default: tpot:50)" in text


@pytest.mark.gpu
@pytest.mark.vllm
def test_serve_bench_on_the_gpu(tmp_path):
    """The script end to end at a small size (4 requests of 1,024-4,096 tokens, 16 output tokens, all at once):
    every request completes, the table has the mode's row."""
    out = tmp_path / "serve.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "serve_bench.py"), "--modes", "kvrepro:k4v4",
                        "--num-prompts", "4", "--input-min", "1024", "--input-max", "4096", "--output-len", "16",
                        "--request-rates", "inf", "--out", str(out)], capture_output=True, text=True, cwd=ROOT,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(out.read_text())
    run = doc["runs"][0]
    assert run["summary"]["completed"] == 4 and run["summary"]["failed"] == 0
    assert run["summary"]["p99_tpot_ms"] is not None and run["preemptions"] == 0
    assert "| kvrepro:k4v4 | CUSTOM | inf |" in r.stdout


FAKE_SERVER = r'''
import argparse, http.server, json, os, sys
ap = argparse.ArgumentParser()
ap.add_argument("cmd"); ap.add_argument("model"); ap.add_argument("--port", type=int)
a, rest = ap.parse_known_args()
with open(os.environ["FAKE_ARGS_LOG"], "a") as f:
    f.write(json.dumps({"argv": sys.argv[1:], "preset": os.environ.get("KVREPRO_PRESET")}) + "\n")
if "--attention-backend" in rest:       # vLLM's line naming the backend it runs, into the server log
    print(f"INFO [cuda.py:308] Using AttentionBackendEnum.{rest[rest.index('--attention-backend') + 1]} backend.",
          flush=True)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = b"ok" if self.path == "/health" else (
            'vllm:num_preemptions_total{engine="0"} 2.0\nvllm:kv_cache_usage_perc{engine="0"} 0.9\n'
            'vllm:num_requests_running{engine="0"} 3\nvllm:num_requests_waiting{engine="0"} 1\n'
            'vllm:cache_config_info{block_size="16",cache_dtype="auto",num_gpu_blocks="100"} 1.0\n').encode()
        self.send_response(200); self.end_headers(); self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", a.port), H).serve_forever()
'''

FAKE_CLIENT = r'''
import argparse, json, os, urllib.request
from vllm.benchmarks.datasets import SampleRequest
def get_samples(args, tokenizer): raise AssertionError("the script must replace get_samples")
def get_tokenizer(*a, **k): raise AssertionError("the script must replace get_tokenizer")
def add_cli_args(p):
    for flag in ("--backend", "--base-url", "--endpoint", "--model", "--served-model-name", "--dataset-name",
                 "--random-range-ratio", "--percentile-metrics", "--metric-percentiles", "--result-dir",
                 "--result-filename", "--request-rate", "--burstiness"):
        p.add_argument(flag)
    for flag in ("--num-prompts", "--random-input-len", "--random-output-len", "--seed", "--ready-check-timeout-sec"):
        p.add_argument(flag, type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--goodput", nargs="+")
    for flag in ("--ignore-eos", "--disable-tqdm", "--save-result", "--save-detailed"):
        p.add_argument(flag, action="store_true")
def main(args):
    if os.environ.get("FAKE_FAIL_RATE") == args.request_rate:
        raise RuntimeError("the client failed at this rate")
    tok = get_tokenizer(args.model)
    assert tok
    reqs = get_samples(args, tok)
    urllib.request.urlopen(args.base_url + "/health").read()
    n = len(reqs)
    res = {"duration": 10.0, "completed": n, "failed": 0, "request_throughput": n / 10.0,
           "output_throughput": n * reqs[0].expected_output_len / 10.0, "request_goodput": n / 20.0,
           "max_concurrent_requests": n, "p50_ttft_ms": 100.0, "p99_ttft_ms": 300.0, "p50_tpot_ms": 20.0,
           "p99_tpot_ms": 45.0, "input_lens": [r.prompt_len for r in reqs], "rate": args.request_rate}
    with open(os.path.join(args.result_dir, args.result_filename), "w") as f:
        json.dump(res, f)
    return res
'''


def _drive_fake(tmp_path, monkeypatch, extra=()) -> dict:
    """scripts/serve_bench.py's main against the stand-ins for `vllm serve` and vLLM's client (FAKE_SERVER,
    FAKE_CLIENT): fp8 on FA3 and kvrepro k4v4, 3 prompts of 20-40 tokens, 8 output tokens, ``extra`` arguments last.
    Returns rc, the module and the results document (None where no file was written)."""
    fake = tmp_path / "fake"
    for pkg in ("vllm", "vllm/entrypoints", "vllm/entrypoints/cli", "vllm/benchmarks"):
        (fake / pkg).mkdir(parents=True)
        (fake / pkg / "__init__.py").write_text("__version__ = '0.20.2'\n" if pkg == "vllm" else "")
    (fake / "vllm/entrypoints/cli/main.py").write_text(FAKE_SERVER)
    (fake / "vllm/benchmarks/serve.py").write_text(FAKE_CLIENT)
    (fake / "vllm/benchmarks/datasets.py").write_text(
        "import dataclasses\n@dataclasses.dataclass\nclass SampleRequest:\n    prompt: object\n    prompt_len: int\n"
        "    expected_output_len: int\n    request_id: str = ''\n")
    for m in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, m)
    monkeypatch.syspath_prepend(str(fake))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(fake), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("FAKE_ARGS_LOG", str(tmp_path / "servers.jsonl"))
    monkeypatch.setenv("KVREPRO_PRESET", "k8v4")            # the caller's preset must not leak into another mode
    sbs = scripts_module.load("serve_bench")
    monkeypatch.setattr(sbs.sweep, "measurement_blockers", lambda info=None: [])
    monkeypatch.setattr(sbs, "total_memory_bytes", lambda: 143771 * 2**20)
    out = tmp_path / "serve.json"
    argv = ["--modes", "fp8:flash_attn,kvrepro:k4v4", "--num-prompts", "3", "--input-min", "20", "--input-max", "40",
            "--output-len", "8", "--request-rates", "0.5,inf", "--out", str(out), *extra]
    rc = sbs.main(argv)
    return {"rc": rc, "module": sbs, "doc": json.loads(out.read_text()) if out.exists() else None}


def test_serve_bench_drives_servers_and_client(tmp_path, monkeypatch, capsys):
    """scripts/serve_bench.py's main on the CPU against stand-ins for `vllm serve` (an HTTP server answering /health
    and /metrics, started as the script starts vLLM's CLI) and vLLM's bench client module (same entry points): one
    server per mode with its KV settings, one client run per rate with the token-id prompts, the file and the table."""
    got = _drive_fake(tmp_path, monkeypatch)
    assert got["rc"] == 0
    out = tmp_path / "serve.json"
    servers = [json.loads(x) for x in (tmp_path / "servers.jsonl").read_text().splitlines()]
    assert [s["preset"] for s in servers] == [None, "k4v4"]
    fa = servers[0]["argv"]
    assert fa[fa.index("--attention-backend") + 1] == "FLASH_ATTN" and fa[fa.index("--kv-cache-dtype") + 1] == "fp8"
    assert fa[fa.index("--gpu-memory-utilization") + 1] == f"{0.9 * 81920 / 143771:.6f}"
    doc = json.loads(out.read_text())
    assert [(r["mode"], r["request_rate"]) for r in doc["runs"]] == [
        ("fp8:flash_attn", "0.5"), ("fp8:flash_attn", "inf"), ("kvrepro:k4v4", "0.5"), ("kvrepro:k4v4", "inf")]
    run = doc["runs"][0]
    assert run["kv_tokens"] == 1600 and run["preemptions"] == 0 and run["summary"]["p99_tpot_ms"] == 45.0
    assert run["bench_command"][:3] == ["vllm", "bench", "serve"] and run["serve_command"][:2] == ["vllm", "serve"]
    detail = json.loads((tmp_path / "serve_vllm" / run["vllm_result_file"]).read_text())
    lengths = sb.input_lengths(3, 20, 40, 0)
    assert detail["input_lens"] == lengths and detail["rate"] == "0.5"      # the token-id prompts reached the client
    assert doc["workload"]["prompt_tokens_total"] == sum(lengths) and doc["provenance"]["kvrepro_src_sha256"]
    assert all(r["provenance"]["kvrepro_src_sha256"] == doc["provenance"]["kvrepro_src_sha256"] and
               r["provenance"]["script"] == "scripts/serve_bench.py" for r in doc["runs"])
    assert [r["attention_backend_used"] for r in doc["runs"]] == ["FLASH_ATTN", "FLASH_ATTN", "CUSTOM", "CUSTOM"]
    # kvrepro's runs name the fatbin the server loads; fp8's run none of kvrepro's kernels
    fatbin = hashlib.sha256((ROOT / "kvrepro" / "ops" / "cuda" / "decode.fatbin").read_bytes()).hexdigest()
    assert [r["provenance"].get("cuda_fatbin_sha256") for r in doc["runs"]] == [None, None, fatbin, fatbin]
    assert not any("flashinfer_version" in r for r in doc["runs"])
    assert (tmp_path / "serve_logs" / "serve_kvrepro_k4v4.log").is_file()
    printed = capsys.readouterr().out
    # the run's own table: no decode-step split before the vLLM result files are read back (read_results)
    assert ("| kvrepro:k4v4 | CUSTOM | 0.5 | 0.300 | 2.4 | 100.0 | 300.0 | 20.0 | 45.0 |  |  | 0 | 90% | 1 | 0.150 | "
            "1.00x |") in printed


def test_notebook_section_replays_the_committed_files_or_says_none(tmp_path):
    assert sb.section_markdown(tmp_path).startswith("Not measured yet: no `vllm bench serve` run is committed")
    d = tmp_path / "results" / "serve"
    d.mkdir(parents=True)
    runs = [dict(_run("kvrepro:k4v4", "0.25", 0.24, 120.0, 0.20, 45.0), vllm_result_file="k.json"),
            _run("fp8:triton_attn", "0.25", 0.21, 101.0, 0.10, 60.0)]
    (d / "nvidia-h200_20261202.json").write_text(json.dumps({"workload": runs[0]["workload"], "runs": runs}))
    # the kvrepro run's vLLM result (inter-token gaps) and server log (settings line) beside the file
    (d / "nvidia-h200_20261202_vllm").mkdir()
    (d / "nvidia-h200_20261202_vllm" / "k.json").write_text(json.dumps({"itls": [[0.02, 0.02, 0.2], [0.02, 0.1]]}))
    (d / "nvidia-h200_20261202_logs").mkdir()
    (d / "nvidia-h200_20261202_logs" / "serve_kvrepro_k4v4.log").write_text(
        "INFO [config.py:73] kvrepro settings: preset=k4v4 prefill=fa key_offset=rope-mean warmup=1\n")
    md = sb.section_markdown(tmp_path)
    assert ("#### 32 requests of 512 output tokens, SLO TPOT <= 50 ms\n\nReplayed from "
            "`results/serve/nvidia-h200_20261202.json`: prompts of 8,192-131,072 tokens, 80 GiB emulated") in md
    # gaps 20, 20, 200, 20, 100 ms: median 20, the two > 40 ms hold 300 of 360 ms
    assert ("| kvrepro:k4v4 (rope-mean) | CUSTOM | 0.25 | 0.240 | 120.0 | 900.0 | 9000.0 | 22.5 | 45.0 | 20.0 | 83% | "
            "0 |  |  | 0.200 | 2.00x |") in md
    assert "| fp8:triton_attn | TRITON_ATTN | 0.25 | 0.210 | 101.0 | 900.0 | 9000.0 | 30.0 | 60.0 |  |  | 0 |" in md
    # a later file of another workload (a TTFT SLO too): its own table, first; its runs scored at the TPOT SLO alone
    # from their per-request lists: TPOT of k = 0.06 / 2 and 0.02 / 2 s, of f = 0.2 / 2 and 0.02 / 2 s
    wl = dict(runs[0]["workload"], output_len=3, goodput={"ttft": 2000.0, "tpot": 50.0})
    later = [dict(_run("kvrepro:k4v4", "0.12", 0.1, 1.0, 0.1, 1.0), workload=wl, vllm_result_file="k.json",
                  date="2026-12-03T05:00:00+00:00"),
             dict(_run("fp8", "0.12", 0.1, 1.0, 0.05, 1.0), workload=wl, vllm_result_file="f.json",
                  date="2026-12-03T05:05:00+00:00")]
    (d / "nvidia-h200_20261203.json").write_text(json.dumps({"workload": wl, "runs": later}))
    (d / "nvidia-h200_20261203_vllm").mkdir()
    for name, ttfts, itls in (("k.json", [3.0, 1.0], [[0.03, 0.03], [0.01, 0.01]]),
                              ("f.json", [0.5, 1.0], [[0.1, 0.1], [0.01, 0.01]])):
        (d / "nvidia-h200_20261203_vllm" / name).write_text(json.dumps(
            {"duration": 10.0, "ttfts": ttfts, "itls": itls, "output_lens": [3, 3]}))
    md = sb.section_markdown(tmp_path)
    assert md.index("#### 32 requests of 3 output tokens, SLO TTFT <= 2 s and TPOT <= 50 ms\n") < md.index(
        "#### 32 requests of 512 output tokens")
    assert "| kvrepro:k4v4 | CUSTOM | 0.12 |" in md and "| 0.100 | 2.00x | 32 of 32 | 0.200 | 2.00x |" in md   # 2 / 10 s, 1 / 10 s
    assert "| fp8 | vllm-auto | 0.12 |" in md and "| 0.050 | 1.00x | 16 of 32 | 0.100 | 1.00x |" in md
    bad = dict(runs[1], workload={"num_prompts": 32})
    (d / "nvidia-h200_20261202.json").write_text(json.dumps({"workload": {}, "runs": [bad]}))
    with pytest.raises(ValueError, match="the workload lacks"):
        sb.section_markdown(tmp_path)


def test_stall_split_against_a_hand_count():
    """Inter-token gaps (s) of two requests: median 0.03; the gaps > 2 x 0.03 (0.5, 0.6) are the steps that also ran
    prefill; their share of all inter-token time is 1.1 / 1.26."""
    r = sb.stall_split({"itls": [[0.03, 0.03, 0.5], [0.03, 0.04, 0.6, 0.03]]})
    assert r["step_p50_ms"] == pytest.approx(30.0) and r["gaps"] == 7 and r["stalled_gaps"] == 2
    assert r["stalled_share"] == pytest.approx(1.1 / 1.26) and r["stalled_p50_ms"] == pytest.approx(550.0)
    assert sb.stall_split({"itls": [[0.03, 0.03, 0.05]]}, factor=1.5)["stalled_gaps"] == 1
    assert sb.stall_split({"itls": [[0.03, 0.03]]})["stalled_p50_ms"] is None
    for bad, msg in (({"itls": []}, "no inter-token latencies"), ({}, "no inter-token latencies"),
                     ({"itls": [[]]}, "no inter-token latencies")):
        with pytest.raises(ValueError, match=msg):
            sb.stall_split(bad)
    for f in (1, 0.5, True, "2"):
        with pytest.raises(ValueError, match="factor must be a number > 1"):
            sb.stall_split({"itls": [[0.1]]}, factor=f)


def test_logged_settings_reads_the_plugins_start_line(tmp_path):
    log = tmp_path / "serve.log"
    log.write_text("INFO boot\n(EngineCore pid=1) INFO 12-02 09:35:26 [config.py:73] kvrepro settings: preset=k4v4 "
                   "decode_impl=auto key_offset=rope-mean warmup=1\nINFO later\n")
    assert sb.logged_settings(log) == {"preset": "k4v4", "decode_impl": "auto", "key_offset": "rope-mean",
                                       "warmup": "1"}
    log.write_text("INFO an fp8 server logs no kvrepro line\n")
    assert sb.logged_settings(log) is None and sb.logged_settings(tmp_path / "absent.log") is None


def test_slo_goodput_by_hand_and_against_vllms_own_goodput():
    """Three requests (TTFT s; inter-token gaps s; output tokens): TPOT 0.04, 0.1, 0 (one token). At TPOT <= 50 ms:
    the first and the third; with TTFT <= 1 s too: the third only; a failed request (0 tokens) never counts."""
    res = {"duration": 4.0, "ttfts": [0.5, 0.2, 3.0, 0.1], "itls": [[0.04, 0.04], [0.1, 0.1], [], []],
           "output_lens": [3, 3, 1, 0]}
    assert sb.slo_goodput(res, {"tpot": 50}) == {"good": 2, "req_s": 0.5}
    assert sb.slo_goodput(res, {"tpot": 50, "ttft": 1000}) == {"good": 1, "req_s": 0.25}
    assert sb.slo_goodput(res, {"tpot": 100})["good"] == 3               # 0.1 s is within 100 ms: <=, as vLLM's
    for bad, msg in (({"e2el": 1}, "allowed: ttft, tpot"), ({}, "none given"), ({"tpot": -1}, ">= 0")):
        with pytest.raises(ValueError, match=msg):
            sb.slo_goodput(res, bad)
    with pytest.raises(ValueError, match="per-request lists"):
        sb.slo_goodput({"duration": 1.0, "ttfts": [0.1], "itls": [[0.1]]}, {"tpot": 50})
    with pytest.raises(ValueError, match=r"duration \(s > 0\)"):
        sb.slo_goodput(dict(res, duration=-4.0), {"tpot": 50})
    for bad in ("50", None, True):
        with pytest.raises(ValueError, match="each must be a number of ms"):
            sb.slo_goodput(res, {"tpot": bad})
    # the committed runs: the same SLOs recount vLLM's own request_goodput exactly
    root = Path(__file__).resolve().parents[1] / "results" / "serve"
    checked = 0
    for p in sorted(root.glob("*.json")):
        doc = json.loads(p.read_text(encoding="utf-8"))
        for r in doc["runs"]:
            f = sb.side_dirs(p)[0] / r["vllm_result_file"]
            res = json.loads(f.read_text(encoding="utf-8"))
            got = sb.slo_goodput(res, doc["workload"]["goodput"])
            assert got["req_s"] == pytest.approx(res["request_goodput"], rel=1e-12), (p.name, r["mode"])
            checked += 1
    assert checked >= 4


def _block_parts(text):
    """The README serving block split into its lead sentence, its table (header cells, rows of cells) and the rest."""
    lines = text.split("\n")
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines if ln.startswith("| ")]
    return lines[0], rows[0], rows[2:], "\n".join(ln for ln in lines[1:] if not ln.startswith("|"))


def test_readme_text_of_the_committed_run_against_its_raw_figures():
    """The README's serving block, recomputed from the newest committed workload's files: each mode's row (backend,
    requests within the SLOs and within the TPOT SLO alone, counted from the vLLM result file's per-request lists by
    vLLM's rule: TPOT = the sum of its inter-token gaps over output - 1; goodput; ratio to the best fp8 of its rate;
    the run's length; preemptions), the lead's ratio with the SLOs and workload as the file states them, the TPOT-alone
    line and the fp8 backends not run."""
    import re

    from kvrepro import sweep
    from kvrepro.formats import DEFAULT_PRESET

    groups = sb.workload_groups(ROOT)
    paths = groups[0]["paths"]
    text = sb.readme_text(ROOT)
    lead, head, rows, rest = _block_parts(text)
    docs = {p: json.loads(Path(p).read_text()) for p in paths}
    runs = [(p, r) for p, d in docs.items() for r in d["runs"]]
    w = runs[0][1]["workload"]
    slo = w["goodput"]
    assert len({r["request_rate"] for _, r in runs}) == 1        # one rate: the table has no rate column
    assert len(slo) == 2 and "tpot" in slo                      # two SLOs: the TPOT-alone column is there

    def vllm_of(p, r):
        return json.loads((sb.side_dirs(p)[0] / r["vllm_result_file"]).read_text())

    def good(p, r, slos):
        """Requests within ``slos`` counted from the run's vLLM result file, and all it sent."""
        v = vllm_of(p, r)
        ok = sum(1 for ttft, gaps, n in zip(v["ttfts"], v["itls"], v["output_lens"]) if n and
                 (n == 1 or sum(gaps) / (n - 1) * 1e3 <= slos["tpot"]) and ttft * 1e3 <= slos.get("ttft", math.inf))
        return ok, len(v["ttfts"])

    def backend(p, r):
        return r.get("attention_backend_used") or sb.logged_backend(sb.server_log(p, r["mode"]))

    fp8 = [(p, r) for p, r in runs if r["mode"] in sweep.FP8_MODES]
    best = max(fp8, key=lambda x: x[1]["summary"]["request_goodput"])[1]["summary"]["request_goodput"]
    assert head == ["mode (attention backend)", "within both SLOs", "goodput (req/s)",
                    "vs&nbsp;fp8" if len(fp8) == 1 else "vs best&nbsp;fp8", "within TPOT SLO alone", "run length (s)",
                    "preemptions"]
    want = []
    default = f"kvrepro:{DEFAULT_PRESET}"          # fp8 first, then the preset a user gets by default
    for p, r in sorted(runs, key=lambda x: (x[1]["mode"] not in sweep.FP8_MODES, x[1]["mode"] != default,
                                            x[1]["mode"])):
        (both, sent), (alone, _) = good(p, r, slo), good(p, r, {"tpot": slo["tpot"]})
        label = "; default preset" if r["mode"] == default else ""
        want.append([f"{r['mode']} ({backend(p, r)}{label})", f"{both} of {sent}", f"{r['summary']['request_goodput']:.3f}",
                     f"{r['summary']['request_goodput'] / best:.2f}x", f"{alone} of {sent}",
                     f"{vllm_of(p, r)['duration']:.0f}", str(r["preemptions"])])
    assert rows == want

    def slo_words(name):
        v = slo[name]
        return f"{name.upper()} <= " + (f"{v / 1e3:g} s" if v >= 1e3 else f"{v:g} ms")

    kv = sorted([(p, r) for p, r in runs if r["mode"] not in sweep.FP8_MODES],
                key=lambda x: (x[1]["mode"] != default, x[1]["mode"]))
    assert kv
    clauses = []
    for p, r in kv:
        offset = re.search(r"kvrepro settings: .*key_offset=(\S+)", sb.server_log(p, r["mode"]).read_text()).group(1)
        ratio = r["summary"]["request_goodput"] / best
        label = "the default preset, " if r["mode"] == default else ""
        clauses.append(f"{r['mode']} ({label}key offset {offset}) has **{ratio:.2f}x** "
                       f"{'fp8' if len(fp8) == 1 else 'the best fp8'}'s"
                       + ("" if clauses else f" goodput within SLO {' and '.join(slo_words(k) for k in slo)}"))
    r = kv[0][1]
    assert lead == (f"**Under serving load**, {'; '.join(clauses)}, for {w['num_prompts']} requests of "
                    f"{w['input_min'] // 1024}K-{w['input_max'] // 1024}K-token prompts and {w['output_len']:,} output "
                    f"tokens each arriving at {float(r['request_rate']):g} requests/s.")
    assert "TTFT <= 30 s and TPOT <= 50 ms" in lead              # the SLOs this workload ran with, as the file says

    def tpot_alone(q, run):
        ok, _ = good(q, run, {"tpot": slo["tpot"]})
        return ok, ok / vllm_of(q, run)["duration"]

    bp, bt = max(fp8, key=lambda x: tpot_alone(*x)[1])
    fc, fg = tpot_alone(bp, bt)
    fd = vllm_of(bp, bt)["duration"]
    n = good(*kv[0], slo)[1]
    equal = [(p, r) for p, r in kv if tpot_alone(p, r)[0] == fc]
    for p, r in kv:
        kc, kg = tpot_alone(p, r)
        kd = vllm_of(p, r)["duration"]
        if kc == fc and len(equal) == 1:
            assert (f"At the TPOT SLO alone {r['mode']} and {bt['mode']} both met it with {kc} of {n} requests, so "
                    f"the {kg / fg:.2f}x goodput there comes only from the run lengths ({kd:.0f} s against {fd:.0f} s)."
                    ) in rest
        elif kc == fc:      # several kvrepro modes as good as fp8 there: one sentence lists them
            assert f"{r['mode']} {kg / fg:.2f}x ({kd:.0f} s against {fd:.0f} s)" in rest
        else:
            assert f"At the TPOT SLO alone {r['mode']}'s goodput is {kg / fg:.2f}x " in rest
    if len(equal) > 1:
        assert (f"At the TPOT SLO alone {', '.join(r['mode'] for _, r in equal)} and {bt['mode']} met it with the same "
                f"number of requests ({fc} of {n}), so the goodput ratios there come only from the run lengths: ") in rest
    not_run = [m for m in sweep.FP8_MODES if ":" in m and m not in {x["mode"] for _, x in runs}]
    assert f"\n\nNot run at this workload: {', '.join(not_run)}.\n\n" in text
    assert f"Workload: `vllm serve` + `vllm bench serve` on one {w['gpu']}" in text
    days = {}                                   # each day's modes, as the runs record them
    for _, r in runs:
        days.setdefault(r["date"][:10], set()).add(r["mode"])
    order = [row[0].split(" ")[0] for row in want]    # the table's order of modes
    if len(days) > 1:
        assert ", runs: " in text
        for day, modes in days.items():
            assert f"{' and '.join(m for m in order if m in modes)} {day}" in text, day


def test_readme_text_without_runs_or_without_fp8(tmp_path):
    assert "not measured yet" in sb.readme_text(tmp_path)
    d = tmp_path / "results" / "serve"
    d.mkdir(parents=True)
    runs = [_run("kvrepro:k4v4", "0.25", 0.24, 120.0, 0.20, 45.0), _run("fp8", "inf", 0.2, 100.0, 0.1, 60.0)]
    (d / "x_20261202.json").write_text(json.dumps({"workload": runs[0]["workload"], "runs": runs}))
    text = sb.readme_text(tmp_path)
    lead, head, rows, _ = _block_parts(text)
    assert lead == ("**Under serving load**, kvrepro:k4v4 at 0.25 requests/s has no ratio to fp8's goodput within SLO "
                    "TPOT <= 50 ms (no fp8 mode ran at this rate), for 32 requests of 8K-128K-token prompts and 512 "
                    "output tokens each arriving at 0.25 requests/s and all at once.")
    assert head == ["mode (attention backend)", "rate (req/s)", "within the SLO", "goodput (req/s)", "vs&nbsp;fp8",
                    "run length (s)", "preemptions"]                  # one SLO: no TPOT-alone column
    assert rows == [["fp8 (vllm-auto)", "inf", "16 of 32", "0.100", "1.00x", "160", "0"],
                    ["kvrepro:k4v4 (CUSTOM)", "0.25", "27 of 32", "0.200", "", "133", "0"]]
    assert "Goodput: the requests within the SLO over the run's length." in text
    assert "arriving at 0.25 requests/s, all at once" in text
    assert "[x_20261202.json](results/serve/x_20261202.json)" in text


def test_installed_version_of_a_distribution_or_none():
    """What serve_bench records as a FlashInfer server's flashinfer_version: the installed distribution's version."""
    sbs = scripts_module.load("serve_bench")
    assert sbs.installed_version("pytest") == pytest.__version__
    assert sbs.installed_version("kvrepro-no-such-distribution") is None


def test_readme_text_says_why_there_is_no_ratio(tmp_path):
    """fp8 with zero goodput, fp8 without a recorded goodput, every request at once: a sentence, never a silent ratio."""
    d = tmp_path / "results" / "serve"
    d.mkdir(parents=True)
    k = _run("kvrepro:k4v4", "inf", 0.24, 120.0, 0.20, 45.0)
    f = _run("fp8:flash_attn", "inf", 0.2, 100.0, 0.0, 60.0)
    (d / "a_20261202.json").write_text(json.dumps({"workload": k["workload"], "runs": [k, f]}))
    text = sb.readme_text(tmp_path)
    lead, _, rows, _ = _block_parts(text)
    assert lead.startswith("**Under serving load**, kvrepro:k4v4 has no ratio to fp8's goodput within SLO TPOT <= 50 "
                           "ms (every fp8 mode's goodput was 0), for 32 requests of 8K-128K-token prompts and 512 "
                           "output tokens each arriving all at once.")
    assert rows[1][:4] == ["kvrepro:k4v4 (CUSTOM)", "27 of 32", "0.200", ""] and rows[0][1:4] == ["0 of 32", "0.000", ""]
    f["summary"].pop("request_goodput")
    (d / "a_20261202.json").write_text(json.dumps({"workload": k["workload"], "runs": [k, f]}))
    text = sb.readme_text(tmp_path)
    assert "has no ratio to fp8's goodput within SLO TPOT <= 50 ms (no fp8 mode recorded a goodput at this rate)" in text
    assert _block_parts(text)[2][0][:3] == ["fp8:flash_attn (FLASH_ATTN)", "", ""]     # blank, not invented


def test_logged_backend_reads_vllms_choice(tmp_path):
    """The backend line of vLLM 0.20.2's log, asked for (``AttentionBackendEnum.<NAME>``) or chosen by vLLM (``Using
    <NAME> attention backend out of potential backends``); none; two different ones refused."""
    log = tmp_path / "serve.log"
    assert sb.logged_backend(log) is None
    log.write_text("(EngineCore pid=1) INFO 12-03 [cuda.py:308] Using AttentionBackendEnum.FLASHINFER backend.\n")
    assert sb.logged_backend(log) == "FLASHINFER"
    log.write_text("INFO [cuda.py:368] Using FLASH_ATTN attention backend out of potential backends: ['FLASH_ATTN', "
                   "'TRITON_ATTN'].\nINFO Using FLASH_ATTN attention backend out of potential backends: []\n")
    assert sb.logged_backend(log) == "FLASH_ATTN"
    log.write_text("INFO nothing here\n")
    assert sb.logged_backend(log) is None
    log.write_text("Using AttentionBackendEnum.CUSTOM backend.\nUsing AttentionBackendEnum.FLASH_ATTN backend.\n")
    with pytest.raises(ValueError, match="several attention backends \\(CUSTOM, FLASH_ATTN\\)"):
        sb.logged_backend(log)
    for f in ROOT.glob("results/serve/*_logs/serve_*.log"):        # every committed server log names its backend
        want = "CUSTOM" if "kvrepro" in f.name else ("FLASHINFER" if "flashinfer" in f.name else "FLASH_ATTN")
        assert sb.logged_backend(f) == want, f


@pytest.mark.parametrize("drop,lacks", [("summary", "summary"), ("workload", "workload"),
                                        ("preemptions", "preemptions"), ("summary.duration_s", "summary.duration_s")])
def test_read_doc_names_the_file_and_run_missing_a_key(tmp_path, drop, lacks):
    import re

    runs = [_run("kvrepro:k4v4", "0.25", 1, 1, 1, 1), _run("fp8", "0.25", 1, 1, 1, 1)]
    top, _, sub = drop.partition(".")
    runs[1][top].pop(sub) if sub else runs[1].pop(top)
    p = tmp_path / "s.json"
    p.write_text(json.dumps({"workload": runs[0]["workload"], "runs": runs}))
    msg = "^" + re.escape(f"{p}: run 1 (fp8, rate 0.25) lacks {lacks}") + "$"
    for read in (sb.read_doc, lambda q: sb.read_results([q])):
        with pytest.raises(ValueError, match=msg):
            read(p)
    p.write_text(json.dumps({"workload": {}, "runs": [runs[0], "x"]}))
    with pytest.raises(ValueError, match="run 1 is not an object"):
        sb.read_doc(p)
    p.write_text(json.dumps({"runs": []}))      # an empty file must still say its workload, or nothing can join it
    with pytest.raises(ValueError, match="no 'workload' object"):
        sb.read_doc(p, empty_runs=True)


def test_serve_bench_refuses_a_budget_above_the_card_before_making_folders(tmp_path, monkeypatch, capsys):
    """--gpu-memory-gb above the card (the stand-in's 140.4 GiB) is a bad argument: exit 2 naming the flag, no result
    file and none of its side folders made."""
    with pytest.raises(SystemExit) as e:
        _drive_fake(tmp_path, monkeypatch, extra=["--gpu-memory-gb", "500"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--gpu-memory-gb 500: gpu_memory_gb=500.0 exceeds this GPU (140.4 GiB)" in err
    assert not (tmp_path / "serve.json").exists() and not (tmp_path / "serve_vllm").exists()
    assert not (tmp_path / "serve_logs").exists() and not (tmp_path / "servers.jsonl").exists()


def test_serve_bench_keeps_the_rates_measured_before_a_failure(tmp_path, monkeypatch):
    """A mode whose second rate fails: the file keeps its first rate, the next mode still runs, exit 1."""
    monkeypatch.setenv("FAKE_FAIL_RATE", "inf")
    out = _drive_fake(tmp_path, monkeypatch, ["--request-rates", "0.5,inf"])
    assert out["rc"] == 1
    assert [(r["mode"], r["request_rate"]) for r in out["doc"]["runs"]] == [("fp8:flash_attn", "0.5"),
                                                                           ("kvrepro:k4v4", "0.5")]


def test_goodput_items_by_spaces_or_commas_and_the_appendable_check():
    assert sb.parse_goodput(["tpot:50,ttft:30000"]) == sb.parse_goodput(["tpot:50", "ttft:30000"]) == \
        {"tpot": 50.0, "ttft": 30000.0}
    cfg = sb.check_config({"num_prompts": 24, "output_len": 4096, "goodput": ["ttft:30000", "tpot:50"]})
    doc = {"workload": dict(sb.config_workload(cfg), gpu="NVIDIA H200"), "runs": []}
    sb.check_appendable(json.loads(json.dumps(doc)), cfg)          # the same settings: accepted
    with pytest.raises(ValueError, match=r"^it holds another workload: seed 0 there, 1 asked; use another --out$"):
        sb.check_appendable(doc, dict(cfg, seed=1))
    with pytest.raises(ValueError, match="num_prompts None there, 24 asked"):
        sb.check_appendable({"workload": {}}, cfg)


def test_readme_command_and_other_workloads_from_the_committed_files():
    """The README block's command, parsed by serve_bench's own parser and checks, gives the newest workload's
    settings and modes; each older workload's kvrepro ratio is recomputed from its file's raw summaries."""
    import re

    groups = sb.workload_groups(ROOT)
    text = sb.readme_text(ROOT)
    modes, rest = re.search(r"to run it: `python scripts/serve_bench.py --modes (\S+) ([^`]*)`", text).groups()
    sbs = scripts_module.load("serve_bench")
    cfg = sbs.config_of(sbs.build_parser().parse_args(["--modes", modes, *rest.split()]))
    w = groups[0]["runs"][0]["workload"]
    assert json.loads(json.dumps(sb.config_workload(cfg))) == {k: w[k] for k in sb.CONFIG_WORKLOAD_FIELDS}
    assert set(cfg["modes"]) == {r["mode"] for r in groups[0]["runs"]}
    assert {f"{x:g}" if x != math.inf else "inf" for x in cfg["request_rates"]} == \
        {r["request_rate"] for r in groups[0]["runs"]}
    assert len(groups) > 1 and "The other committed workloads: " in text
    for g in groups[1:]:
        for r in g["runs"]:
            if r["mode"].startswith("kvrepro:"):
                best = max(f["summary"]["request_goodput"] for f in g["runs"]
                           if f["mode"].startswith("fp8") and f["request_rate"] == r["request_rate"])
                ratio = r["summary"]["request_goodput"] / best
                assert f"{g['runs'][0]['workload']['output_len']:,} output tokens: {r['mode']} " in text
                assert f", {ratio:.2f}x the best fp8's goodput within SLO" in text


def _git(*args, text=True):
    """``git args`` in this checkout, its stdout; None without git or where the command fails (a shallow copy)."""
    import shutil

    if shutil.which("git") is None:
        return None
    r = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=text)
    return r.stdout if r.returncode == 0 else None


def _src_sha256_at(commit, tmp_path):
    """kvrepro.provenance.src_sha256 of the kvrepro package as committed at ``commit`` (that commit's own function over
    its own files), or None without that commit here."""
    import importlib.util
    import io
    import tarfile

    data = _git("archive", commit, "kvrepro", text=False)
    if data is None:
        return None
    d = tmp_path / commit[:12]
    tarfile.open(fileobj=io.BytesIO(data)).extractall(d)
    spec = importlib.util.spec_from_file_location(f"provenance_{commit[:12]}", d / "kvrepro" / "provenance.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.src_sha256()


def test_every_committed_serve_run_carries_its_own_provenance(tmp_path):
    """Each committed run names the kvrepro source that served it (its own provenance, as serve_bench writes it). A run
    whose provenance was reconstructed after it ran says so: every field is explained or listed as not reconstructed,
    and, with git history here, the commit it names added the file, and the source hash and fatbin are recomputed
    from the source commit it names."""
    import hashlib
    import re

    # Files whose runs carry no provenance of their own: one serve_bench call wrote all their runs, so the file's
    # top-level provenance (that call's) is each run's, as the parameters.modes check below shows.
    one_call = {"nvidia-h200_20261202.json"}
    reconstructed = 0
    for p in sorted(ROOT.glob("results/serve/*.json")):
        rel = str(p.relative_to(ROOT))
        doc = sb.read_doc(p)
        if p.name in one_call:
            assert not any("provenance" in r for r in doc["runs"]) and \
                {r["mode"] for r in doc["runs"]} <= set(doc["provenance"]["parameters"]["modes"])
            continue
        for r in doc["runs"]:
            prov = r.get("provenance")
            assert isinstance(prov, dict), (rel, r["mode"])
            assert re.fullmatch("[0-9a-f]{64}", prov["kvrepro_src_sha256"]) and prov["script"] == "scripts/serve_bench.py"
            assert (prov["vllm_version"], prov["gpu"]) == (r["workload"]["vllm_version"], r["workload"]["gpu"])
            rec = prov.get("provenance_reconstructed_from")
            if rec is None:
                continue
            reconstructed += 1
            assert set(prov) - {"provenance_reconstructed_from"} == set(rec["fields"]), (rel, r["mode"])
            absent = {k for names in rec["not_reconstructed"] for k in names.split(", ")}
            assert not absent & set(prov) and rec["about"], (rel, r["mode"])
            if "cuda_fatbin_sha256" not in prov:
                assert "cuda_fatbin_sha256" in absent          # said why: an fp8 server runs no kvrepro kernel
            added = _git("log", "--format=%H", "--", rel)
            if added is None or rec["commit"] not in added.split():
                continue                                  # no history here (a copy of the tree): the checks above hold
            assert _src_sha256_at(rec["source_commit"], tmp_path) == prov["kvrepro_src_sha256"], (rel, r["mode"])
            if "cuda_fatbin_sha256" in prov:
                fatbin = _git("show", f"{rec['source_commit']}:kvrepro/ops/cuda/decode.fatbin", text=False)
                assert hashlib.sha256(fatbin).hexdigest() == prov["cuda_fatbin_sha256"], (rel, r["mode"])
    # nvidia-h200_20261203.json's three runs, recorded before per-run provenance, and the fatbin of the two kvrepro runs
    # of nvidia-h200_20261203_out4096.json measured before serve_bench recorded it
    assert reconstructed == 5
