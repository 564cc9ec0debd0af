"""The sweep's cheaper protocol parts on CPU: vLLM memory-log parsing, footprint, edge verdict,
budgeted resumable runs (subprocesses replaced by a recorder)."""
import json
import logging
import math

import pytest

from kvrepro import sweep


def test_parse_vllm_memory_log_from_vllm_format_strings():
    # Format strings copied from vLLM 0.20.2 (gpu_worker.py, gpu_model_runner.py, mem_utils.py).
    lines = [
        "Available KV cache memory: %s GiB" % "59.99",
        "Estimated CUDA graph memory: %.2f GiB total" % 1.5123,
        "Estimated %s CUDA graph memory: %.2f MiB first-capture + (%d-1) \u00d7 %.2f MiB per-graph"
        % ("FULL", 210.5, 7, 180.25),
        "Estimated %s CUDA graph memory: %.2f MiB first-capture + (%d-1) \u00d7 %.2f MiB per-graph"
        % ("PIECEWISE", 30.0, 11, 2.0),
        "CUDA graph pool memory: %s GiB (actual), %s GiB (estimated), difference: %s GiB (%.1f%%)."
        % (0.11, 1.51, 1.4, 1272.7),
        "Memory profiling takes 3.10 seconds. Total non KV cache memory: 9.52GiB; torch peak memory "
        "increase: 1.21GiB; non-torch forward increase memory: 0.31GiB; weights memory: 8.00GiB.",
        "GPU KV cache size: 1,669,008 tokens",
    ]
    got = sweep.parse_vllm_memory_log(lines)
    assert got["available_kv_cache_gib"] == 59.99 and got["cudagraph_estimate_gib"] == 1.51
    assert got["cudagraph_actual_gib"] == 0.11
    assert got["cudagraph_profile"] == {"FULL": [210.5, 7, 180.25], "PIECEWISE": [30.0, 11, 2.0]}
    assert (got["non_kv_cache_gib"], got["torch_peak_increase_gib"], got["non_torch_increase_gib"],
            got["weights_gib"]) == (9.52, 1.21, 0.31, 8.0)
    # vLLM's estimate = max(first captures) + sum((graphs - 1) x per-graph), in MiB
    p = got["cudagraph_profile"]
    est = max(v[0] for v in p.values()) + sum((v[1] - 1) * v[2] for v in p.values())
    assert est == pytest.approx(210.5 + 6 * 180.25 + 10 * 2.0)
    assert sweep.parse_vllm_memory_log(["unrelated", ""]) == {}


def test_memory_log_handler_keeps_debug_breakdown_without_changing_console(capsys):
    from kvrepro.sweep_worker import MEMORY_LOGGERS, MemoryLog

    root = logging.getLogger("vllm")
    console = logging.StreamHandler()
    console.setLevel(logging.INFO)
    root.addHandler(console)
    saved = [logging.getLogger(n).level for n in MEMORY_LOGGERS]
    h = MemoryLog().attach()
    try:
        runner = logging.getLogger(MEMORY_LOGGERS[1])
        runner.debug("Estimated %s CUDA graph memory: %.2f MiB first-capture + (%d-1) x %.2f MiB per-graph",
                     "FULL", 1.0, 7, 2.0)
        logging.getLogger(MEMORY_LOGGERS[0]).info("Available KV cache memory: %s GiB", "62.78")
        runner.info("Loading weights took 1.0 s")
        assert h.lines == ["Estimated FULL CUDA graph memory: 1.00 MiB first-capture + (7-1) x 2.00 MiB "
                           "per-graph", "Available KV cache memory: 62.78 GiB"]
        err = capsys.readouterr().err
        assert "Available KV cache memory" in err and "first-capture" not in err  # console level unchanged
    finally:
        root.removeHandler(h)
        root.removeHandler(console)
        for n, lv in zip(MEMORY_LOGGERS, saved):
            logging.getLogger(n).setLevel(lv)


def test_footprint_counts_what_early_requests_decode_during_later_prefills():
    tls = {"a": sweep.Timeline(0.0, [1.0] * 1100), "b": sweep.Timeline(0.0, [1.0] * 1024)}
    f = sweep.footprint(tls, 131072, 1024, 16)
    held = math.ceil((131072 + 1100) / 16) + math.ceil((131072 + 1024) / 16)
    assert f == {"blocks_held": held, "blocks_workload": 2 * 8256, "extra_blocks": held - 2 * 8256}
    assert f["extra_blocks"] == 5  # 76 tokens past the workload's last block -> 5 more blocks


def test_edge_outcome_verdicts():
    assert sweep.edge_outcome(False, True, 1024, 1024, False, False) == (True, "ran")
    assert sweep.edge_outcome(True, True, 1024, 1024, False, False) == (False, "preempted")
    assert sweep.edge_outcome(False, False, 0, 1024, False, False) == (False, "waiting")
    assert sweep.edge_outcome(False, True, 10, 1024, True, False) == (False, "old-finished")
    assert sweep.edge_outcome(False, True, 10, 1024, False, True) == (False, "timeout")


def test_budgeted_sweep_skips_what_no_longer_fits_and_continues_after_a_failure(tmp_path, monkeypatch):
    import subprocess

    calls = []
    clock = {"t": 0.0}

    def fake_call(cmd):
        mode = cmd[cmd.index("--mode") + 1]
        calls.append((mode, json.loads(cmd[cmd.index("--params") + 1])))
        clock["t"] += 200.0  # each mode takes 200 s of wall time
        return 1 if mode == "fp8" else 0

    monkeypatch.setattr(sweep, "measurement_blockers", lambda info=None: [])
    monkeypatch.setattr(subprocess, "call", fake_call)
    monkeypatch.setattr(sweep.time, "perf_counter", lambda: clock["t"])
    path = tmp_path / "r.jsonl"
    with pytest.raises(RuntimeError, match="measuring fp8 failed"):
        sweep.run_sweep(["kvrepro:k4v4", "fp8", "bf16", "kvrepro:k8v4", "kvrepro:k4v2"], path, "r",
                        {"window_steps": 8}, confirm_edge=["kvrepro:k4v4"], budget_s=560,
                        sizing_only=["kvrepro:k8v4"], param_overrides={"bf16": {"window_steps": 4}},
                        min_start_s={"bf16": 160.0})
    # k4v4 at t=0 (560 s left >= 360), fp8 at 200 (360 left, fails), bf16 at 400 (160 >= 160 left),
    # k8v4 sizing at 600: budget spent (-40 < 80), k4v2 not started either
    assert [c[0] for c in calls] == ["kvrepro:k4v4", "fp8", "bf16"]
    k4, fp8, bf16 = (c[1] for c in calls)
    assert k4["confirm_edge"] and not fp8["confirm_edge"] and k4["timeout_s"] == 540.0
    assert fp8["timeout_s"] == pytest.approx(355.0) and bf16["timeout_s"] == pytest.approx(155.0)
    assert (k4["window_steps"], bf16["window_steps"]) == (8, 4)
    with pytest.raises(ValueError, match="unknown sweep parameter"):
        sweep.run_sweep(["bf16"], path, "r", param_overrides={"bf16": {"windows": 1}})
    with pytest.raises(ValueError, match=r"param_overrides: unknown mode\(s\) \[.fp16.\]; allowed: "):
        sweep.run_sweep(["bf16"], path, "r", param_overrides={"fp16": {}})


def test_budget_does_not_start_a_mode_that_would_time_out(tmp_path, monkeypatch):
    import subprocess

    calls = []
    monkeypatch.setattr(sweep, "measurement_blockers", lambda info=None: [])
    monkeypatch.setattr(subprocess, "call", lambda cmd: calls.append(cmd) or 0)
    assert sweep.run_sweep(["kvrepro:k4v4"], tmp_path / "r.jsonl", "r", budget_s=300) == []
    assert calls == []  # k4v4 needs ~MIN_START_S["kvrepro:k4v4"] = 360 s
    assert sweep.run_sweep(["kvrepro:k4v4"], tmp_path / "r.jsonl", "r", budget_s=300,
                           min_start_s={"kvrepro:k4v4": 250}) == ["kvrepro:k4v4"]
