"""Pure parts of the capacity sweep: arithmetic, row validation, resumable JSONL (complete modes only, one engine
run per mode), window statistics."""
import json

import pytest

from kvrepro import sweep


def _row(**kw):
    row = {"mode": "fp8", "kv_cache_dtype": "fp8", "num_users": 6, "clean": True, "preemptions": 0,
           "aggregate_decode_tok_s": 170.0, "ttft_s_mean": 30.0, "ttft_s_max": 55.0, "tpot_ms_mean": 35.0,
           "kv_cache_tokens": 910688, "users_fit_arithmetic": 6, "prompt_tokens": 131072, "decode_tokens": 1024,
           "gpu": "NVIDIA H200", "gpu_memory_gb": 80.0, "gpu_memory_utilization": 0.5128, "vllm_version": "0.20.2",
           "torch_version": "2.11.0", "kvrepro_version": "0.1.0", "model": "Qwen/Qwen3-4B-Instruct-2507",
           "load_format": "dummy", "date": "2026-11-29T22:00:00+00:00", "run_id": "r1", "measured": True,
           "measured_by": "full", "engine_run_id": "e1"}
    row.update(kw)
    return row


def test_users_fit_counts_whole_blocks_and_the_null_block():
    # The card's bf16 run: 455,392 tokens = 28,462 blocks; a 131,072 + 1,024 user holds 8,256 blocks.
    assert sweep.users_fit(28462, 131072, 1024) == 3
    assert sweep.users_fit(13 * 8256 + 1, 131072, 1024) == 13
    assert sweep.users_fit(13 * 8256, 131072, 1024) == 12  # block 0 is vLLM's null block
    assert sweep.users_fit(10, 17, 0) == 4  # ceil(17 / 16) = 2 blocks each, 9 usable
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        sweep.users_fit(0, 131072, 1024)
    with pytest.raises(ValueError, match="decode_tokens"):
        sweep.users_fit(10, 16, -1)


def test_memory_utilization_emulates_a_smaller_card():
    total = 143771 * 2**20  # H200 as reported by torch
    assert sweep.memory_utilization(80, total) == pytest.approx(0.9 * 81920 / 143771)
    with pytest.raises(ValueError, match="exceeds"):
        sweep.memory_utilization(200, total)
    with pytest.raises(ValueError, match="gpu_memory_gb"):
        sweep.memory_utilization(0, total)


def test_modes_and_engine_settings():
    assert sweep.check_modes("bf16,kvrepro:k4v4") == ("bf16", "kvrepro:k4v4")
    with pytest.raises(ValueError, match="allowed"):
        sweep.check_modes(["fp16"])
    assert sweep.engine_settings("bf16") == {"kv_cache_dtype": "auto", "attention_backend": None, "env": {}}
    s = sweep.engine_settings("kvrepro:k4v2")
    assert s == {"kv_cache_dtype": "auto", "attention_backend": "CUSTOM", "env": {"KVREPRO_PRESET": "k4v2"}}
    assert {"bf16", "fp8", "turboquant_k8v4", "turboquant_4bit_nc", "kvrepro:k4v4"} <= set(sweep.ALL_MODES)


def test_validate_row():
    sweep.validate_row(_row())
    with pytest.raises(ValueError, match="missing gpu"):
        sweep.validate_row({k: v for k, v in _row().items() if k != "gpu"})
    with pytest.raises(ValueError, match="num_users"):
        sweep.validate_row(_row(num_users="6"))
    with pytest.raises(ValueError, match="is a bool"):
        sweep.validate_row(_row(preemptions=False))
    with pytest.raises(ValueError, match="mode"):
        sweep.validate_row(_row(mode="fp16"))
    with pytest.raises(ValueError, match="missing engine_run_id"):
        sweep.validate_row({k: v for k, v in _row().items() if k != "engine_run_id"})


def test_results_file_resumes_without_duplicates(tmp_path):
    path = tmp_path / "run.jsonl"
    f = sweep.ResultsFile(path)
    assert f.add([_row(), _row(num_users=5, measured_by="abort-window")]) == 2
    again = sweep.ResultsFile(path)  # a rerun reads what is there
    assert again.modes_done() == set()   # abort windows 4..1 of N=6 are missing
    assert again.add([_row(aggregate_decode_tok_s=1.0), _row(mode="bf16", kv_cache_dtype="auto", engine_run_id="e2")]) \
        == 1
    lines = path.read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[0])["aggregate_decode_tok_s"] == 170.0
    assert not (tmp_path / "run.jsonl.tmp").exists()
    with pytest.raises(ValueError):
        again.add([{"mode": "bf16"}])
    assert len(path.read_text().splitlines()) == 3  # a bad row writes nothing
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match="run.jsonl:1"):
        sweep.ResultsFile(path)


def test_window_and_ttft_stats():
    a = sweep.Timeline(submit=0.0, times=[10.0, 10.1, 10.2, 10.3])
    b = sweep.Timeline(submit=0.0, times=[20.0, 20.1, 20.2])
    w = sweep.window_stats({"a": a, "b": b}, 20.0, 20.3)
    # (20.0, 20.3]: a has none (finished), b has 20.1, 20.2 -> 2 tokens in 0.3 s
    assert w["tokens"] == 2 and w["aggregate_decode_tok_s"] == pytest.approx(2 / 0.3)
    assert w["tpot_ms_mean"] == pytest.approx(150.0)
    t = sweep.ttft_stats({"a": a, "b": b})
    assert (t["ttft_s_mean"], t["ttft_s_max"], t["ttft_s_first"]) == (15.0, 20.0, 10.0)
    with pytest.raises(ValueError, match="empty window"):
        sweep.window_stats({"a": a}, 1.0, 1.0)


def _cli(tmp_path, *extra):
    return ["--modes", "fp8", "kvrepro:k4v4", "--results", str(tmp_path / "r.jsonl"), "--run-id", "r", *extra]


@pytest.mark.parametrize("extra,name", [
    (["--params", '{"gpu_memory_gb": -5}'], "gpu_memory_gb"), (["--params", '{"gpu_memory_gb": "lots"}'], "gpu_memory_gb"),
    (["--params", '{"max_users": 0}'], "max_users"), (["--params", '{"block_size": 7}'], r"block_size must be one of \(16, 32, 64\)"),
    (["--params", '{"decode_tokens": 0}'], "decode_tokens"), (["--params", '{"cudagraph_mode": "ful"}'], "cudagraph_mode"),
    (["--params", '{"model_dir": "/nonexistent"}'], "model_dir"),
    (["--mode-params", '{"fp8": {"prompt_tokens": -1}}'], "prompt_tokens"),
    (["--run-id", ""], "--run-id must"), (["--timeout-s", "-1"], "--timeout-s must"), (["--budget-s", "0"], "--budget-s must"),
    (["--confirm-edge", "kvrepro:k4v5"], "--confirm-edge: unknown"),
    (["--sizing-only", "bf16"], "--sizing-only: .*not among"),
    (["--min-start-s", '{"fp8": -3}'], r"--min-start-s\['fp8'\] must"),
    (["--mode-params", '{"bogus": {}}'], r"--mode-params: unknown mode\(s\) \['bogus'\]; allowed: "),
    (["--params", '{"seed": -1}'], r"seed must be an integer >= 0, got -1"),
    (["--params", '{"prompt_tokens": 999999999}'],
     r"prompt_tokens \(999999999\) \+ decode_tokens \(1024\) \+ the sweep's headroom \(2112: .*\(262144\)"),
])
def test_cli_rejects_bad_values_before_the_gpu_check(tmp_path, monkeypatch, capsys, extra, name):
    import re

    def blocked(info=None):
        raise AssertionError("GPU/vLLM checked before the values were validated")
    monkeypatch.setattr(sweep, "measurement_blockers", blocked)
    assert sweep.main(_cli(tmp_path, *extra)) == 2
    err = capsys.readouterr().err
    assert re.search(name, err), err


def test_cli_refuses_an_empty_mode_item(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        sweep.main(["--modes", "fp8,,kvrepro:k4v4", "--results", str(tmp_path / "r.jsonl"), "--run-id", "r"])
    assert e.value.code == 2
    assert "--modes has an empty item: 'fp8,,kvrepro:k4v4'; allowed: bf16, fp8" in capsys.readouterr().err


def test_cli_rejects_results_in_a_missing_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sweep, "measurement_blockers", lambda info=None: ["a CUDA GPU (found none)"])
    assert sweep.main(["--modes", "fp8", "--results", str(tmp_path / "no" / "r.jsonl"), "--run-id", "r"]) == 2
    assert "--results '" in capsys.readouterr().err
    assert sweep.main(_cli(tmp_path)) == 2  # valid values: stops at the missing GPU, saying so
    assert "missing: a CUDA GPU" in capsys.readouterr().err


def test_resume_refuses_a_file_with_another_workload(tmp_path, monkeypatch):
    import subprocess

    calls = []
    monkeypatch.setattr(sweep, "measurement_blockers", lambda info=None: [])
    monkeypatch.setattr(subprocess, "call", lambda cmd: calls.append(cmd) or 0)
    path = tmp_path / "r.jsonl"
    sweep.ResultsFile(path).add(_complete(block_size=16))  # fp8: 80 GB, 131072 + 1024 tokens, Qwen3-4B, dummy
    assert sweep.run_sweep(["fp8", "bf16"], path, "r") == ["bf16"]  # same workload: fp8 complete (skipped)
    for params, field in (({"gpu_memory_gb": 40}, "gpu_memory_gb"), ({"prompt_tokens": 4096}, "prompt_tokens"),
                          ({"decode_tokens": 64}, "decode_tokens"), ({"block_size": 32}, "block_size"),
                          ({"load_format": "auto"}, "load_format")):
        with pytest.raises(ValueError, match=f"fp8 rows with {field}="):
            sweep.run_sweep(["fp8"], path, "r", params)
    sweep.ResultsFile(path).add([_row(mode="bf16", kv_cache_dtype="auto", model="/other/model")])
    with pytest.raises(ValueError, match="bf16 rows with model='/other/model'"):
        sweep.run_sweep(["fp8", "bf16"], path, "r")
    assert len(calls) == 1  # nothing started by the refused calls


def _complete(mode="fp8", n=3, run="e1", **kw):
    """A full row of ``n`` users and its abort windows n-1 .. 1, all of engine run ``run``."""
    return [_row(mode=mode, num_users=n, engine_run_id=run, users_fit_arithmetic=n, **kw)] + [
        _row(mode=mode, num_users=k, measured_by="abort-window", engine_run_id=run, **kw) for k in range(n - 1, 0, -1)]


def test_mode_status_needs_every_window_of_one_engine_run():
    assert sweep.mode_status([], "fp8") == (False, "no rows")
    rows = _complete(n=4)
    assert sweep.mode_status(rows, "fp8") == (True, "")
    assert sweep.mode_status(rows[:1], "fp8") == (False, "abort windows 1-3 of N=4 missing")
    assert sweep.mode_status(rows[:1] + rows[2:3], "fp8") == (False, "abort windows 1, 3 of N=4 missing")
    assert sweep.mode_status(rows[1:], "fp8") == (False, "no full-window row")
    assert sweep.mode_status(rows, "fp8", confirm_edge=True) == (False, "edge-check row (N+1=5) missing")
    edge = _row(num_users=5, measured_by="edge-check", clean=False)
    assert sweep.mode_status(rows + [edge], "fp8", confirm_edge=True) == (True, "")
    capped = [dict(rows[0], users_fit_arithmetic=9)] + rows[1:]      # N capped by max_users: no edge check
    assert sweep.mode_status(capped, "fp8", confirm_edge=True) == (True, "")
    mixed = rows[:2] + [dict(r, engine_run_id="e2") for r in rows[2:]]
    assert sweep.mode_status(mixed, "fp8") == (False, "rows of 2 engine runs (e1, e2)")
    assert sweep.mode_status(_complete(n=1), "fp8") == (True, "")    # one user: no abort window
    sizing = _row(num_users=0, measured_by="sizing", clean=False, users_fit_arithmetic=0)
    assert sweep.mode_status([sizing], "fp8") == (True, "")          # nothing fits: nothing more to measure
    assert sweep.mode_status([dict(sizing, users_fit_arithmetic=5)], "fp8") == (False, "no full-window row")
    assert sweep.mode_status([dict(sizing, users_fit_arithmetic=5)], "fp8", sizing_only=True) == (True, "")
    assert sweep.mode_status(rows, "fp8", sizing_only=True) == (True, "")
    legacy = [{k: v for k, v in r.items() if k != "engine_run_id"} for r in rows]   # rows of older code
    assert sweep.mode_status(legacy, "fp8") == (True, "")
    assert sweep.mode_status(legacy[:2], "fp8") == (False, "abort windows 1-2 of N=4 missing")


def test_results_file_refuses_to_mix_engine_runs_of_a_mode(tmp_path):
    f = sweep.ResultsFile(tmp_path / "r.jsonl")
    f.add(_complete(n=2)[:1])
    with pytest.raises(ValueError, match="holds fp8 rows of engine run.s. e1; a row of engine run e2 would mix two "
                                         "engine runs of one mode"):
        f.add([_row(num_users=1, measured_by="abort-window", engine_run_id="e2")])
    assert f.add([_row(mode="bf16", kv_cache_dtype="auto", engine_run_id="e2")]) == 1   # another mode: fine
    assert len(sweep.ResultsFile(tmp_path / "r.jsonl").rows) == 2
    assert f.supersede("fp8", "test") == 1 and f.engine_runs("fp8") == []
    assert f.add([_row(engine_run_id="e3")]) == 1 and sweep.ResultsFile(tmp_path / "r.jsonl").engine_runs("fp8") == \
        ["e3"]
    assert f.superseded_path == tmp_path / "r.jsonl.superseded"   # not *.jsonl: replay never reads it as results
    moved = [json.loads(x) for x in f.superseded_path.read_text().splitlines()]
    assert len(moved) == 1 and moved[0]["superseded"] == "test" and moved[0]["engine_run_id"] == "e1"


def test_resume_supersedes_incomplete_and_mixed_modes_and_skips_complete_ones(tmp_path, monkeypatch, capsys):
    """A file whose fp8 rows come from two engine runs (e.g. an earlier version that resumed into a partial mode) and
    whose bf16 rows lack abort windows: both are measured again, their rows moved to the superseded file, and the
    supersession is stated; the complete kvrepro:k4v4 mode is skipped."""
    import subprocess

    path = tmp_path / "r.jsonl"
    fp8 = _complete(n=3)
    fp8 = fp8[:2] + [dict(fp8[2], engine_run_id="e0")]           # window 1 from another engine run
    bf16 = _complete(mode="bf16", n=3, run="b1", kv_cache_dtype="auto")[:2]
    k4 = _complete(mode="kvrepro:k4v4", n=2, run="k1", kv_cache_dtype="auto")
    path.write_text("".join(json.dumps(r) + "\n" for r in fp8 + bf16 + k4))   # written as older code could
    calls = []

    def fake_call(cmd):
        mode = cmd[cmd.index("--mode") + 1]
        calls.append(mode)
        assert not [r for r in sweep.ResultsFile(path).rows if r["mode"] == mode]   # nothing left to mix with
        return 0

    monkeypatch.setattr(sweep, "measurement_blockers", lambda info=None: [])
    monkeypatch.setattr(subprocess, "call", fake_call)
    assert sweep.run_sweep(["fp8", "bf16", "kvrepro:k4v4"], path, "r") == ["fp8", "bf16"] == calls
    out = capsys.readouterr().out
    assert ("[sweep] fp8: 3 earlier rows (engine run e1, e0) superseded: rows of 2 engine runs (e1, e0); moved to "
            f"{tmp_path / 'r.jsonl.superseded'}") in out
    assert "[sweep] bf16: 2 earlier rows (engine run b1) superseded: abort windows 1 of N=3 missing" in out
    assert "[sweep] kvrepro:k4v4: already in" in out
    assert sweep.ResultsFile(path).rows == k4
    moved = [json.loads(x) for x in (tmp_path / "r.jsonl.superseded").read_text().splitlines()]
    assert [(r["mode"], r["engine_run_id"]) for r in moved] == [("fp8", "e1"), ("fp8", "e1"), ("fp8", "e0"),
                                                                 ("bf16", "b1"), ("bf16", "b1")]


def test_modes_named_twice_and_edge_with_sizing_only_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"modes: \['fp8'\] named more than once"):
        sweep.check_modes(["fp8", "bf16", "fp8"])
    with pytest.raises(ValueError, match=r"confirm_edge and sizing_only both name \['fp8'\]"):
        sweep.check_cli_values(tmp_path / "r.jsonl", "r", 60.0, modes=("fp8",), confirm_edge=("fp8",),
                               sizing_only=("fp8",))


# ---------------------------------------------------------------- fp8 on every backend (issue 23)

def test_fp8_backend_modes_ask_vllm_for_fp8_on_the_named_backend():
    assert sweep.check_modes("fp8,fp8:flash_attn,fp8:flashinfer,fp8:triton_attn,kvrepro:k4v4") == (
        "fp8", "fp8:flash_attn", "fp8:flashinfer", "fp8:triton_attn", "kvrepro:k4v4")
    for mode, backend in (("fp8:flash_attn", "FLASH_ATTN"), ("fp8:flashinfer", "FLASHINFER"),
                          ("fp8:triton_attn", "TRITON_ATTN")):
        assert sweep.engine_settings(mode) == {"kv_cache_dtype": "fp8", "attention_backend": backend, "env": {}}
    assert sweep.engine_settings("fp8")["attention_backend"] is None     # vLLM's choice (FLASH_ATTN on an H200)
    assert sweep.FP8_MODES == ("fp8", "fp8:flash_attn", "fp8:flashinfer", "fp8:triton_attn")
    with pytest.raises(ValueError, match="allowed: .*fp8:triton_attn"):
        sweep.check_modes(["fp8:flex_attention"])       # FLEX_ATTENTION lists no fp8 KV dtype in vLLM 0.20.2
    sweep.validate_row(_row(mode="fp8:triton_attn"))
    assert all(m in sweep.MIN_START_S for m in sweep.FP8_BACKEND_MODES)


def test_an_engine_that_did_not_start_is_recorded_and_not_retried(tmp_path, monkeypatch, capsys):
    import subprocess

    path = tmp_path / "r.jsonl"
    rec = sweep.record_engine_error(path, "fp8:flashinfer", "r", sweep.engine_settings("fp8:flashinfer"),
                                    RuntimeError("FlashInfer backend is not available"))
    assert rec["error"] == "RuntimeError: FlashInfer backend is not available"
    assert rec["attention_backend"] == "FLASHINFER" and rec["kv_cache_dtype"] == "fp8"
    assert sweep.engine_errors(path) == [rec]
    assert (tmp_path / "r.jsonl.engine_errors").is_file() and not path.exists()   # not *.jsonl: replay skips it
    calls = []
    monkeypatch.setattr(sweep, "measurement_blockers", lambda info=None: [])
    monkeypatch.setattr(subprocess, "call", lambda cmd: calls.append(cmd[cmd.index("--mode") + 1]) or 0)
    assert sweep.run_sweep(["fp8:flashinfer", "fp8:triton_attn"], path, "r") == ["fp8:triton_attn"] == calls
    assert "fp8:flashinfer: skipped, its engine did not start earlier in this run (RuntimeError: FlashInfer" in \
        capsys.readouterr().out


def _run_file(tmp_path, points: dict, run_id="w1", **kw):
    """A results file of one run: ``{mode: {users: tok/s}}`` (full row at the most users, abort windows below)."""
    rows = []
    for mode, pts in points.items():
        n = max(pts)
        for u, t in sorted(pts.items(), reverse=True):
            rows.append(_row(mode=mode, num_users=u, aggregate_decode_tok_s=t, run_id=run_id, engine_run_id=mode,
                             measured_by="full" if u == n else "abort-window",
                             kv_cache_dtype="auto" if mode.startswith("kvrepro") else "fp8",
                             **{"users_fit_arithmetic": n, **kw}))
    path = tmp_path / f"{run_id}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_fp8_ratios_both_ways_from_one_run(tmp_path):
    from kvrepro import summary

    path = _run_file(tmp_path, {
        "kvrepro:k4v4": {13: 630.0, 12: 600.0, 1: 60.0},
        "fp8": {6: 163.0, 5: 200.0, 4: 245.0, 3: 210.0},            # vLLM's choice (FA3): slow at its capacity
        "fp8:triton_attn": {6: 190.0, 5: 185.0, 4: 170.0},         # weaker at 4, stronger at capacity
        "fp8:flash_attn": {6: 160.0, 4: 250.0}})
    sweep.record_engine_error(path, "fp8:flashinfer", "w1", sweep.engine_settings("fp8:flashinfer"),
                              RuntimeError("FlashInfer backend is not available"))
    r = summary.fp8_ratios(path)
    assert r["point"] == (13, 630.0) and r["run_id"] == "w1" and r["missing"] == ["fp8:flashinfer"]
    assert r["engine_errors"] == {"fp8:flashinfer": "RuntimeError: FlashInfer backend is not available"}
    by = {f["mode"]: f for f in r["fp8"]}
    assert [f["mode"] for f in r["fp8"]] == ["fp8", "fp8:flash_attn", "fp8:triton_attn"]
    assert (by["fp8"]["users_max"], by["fp8"]["tok_s_max"], by["fp8"]["users_best"], by["fp8"]["tok_s_best"]) == \
        (6, 163.0, 4, 245.0)
    assert by["fp8:triton_attn"]["vs_max"] == pytest.approx(630 / 190)
    assert by["fp8:flash_attn"]["vs_best"] == pytest.approx(630 / 250) and by["fp8:flash_attn"]["backend"] == "FLASH_ATTN"
    # the seed's protocol against the strongest fp8 at its capacity; the other way against the best point anywhere
    assert r["at_capacity"] == dict(fp8_mode="fp8:triton_attn", backend="TRITON_ATTN", users=6, tok_s=190.0,
                                    ratio=pytest.approx(630 / 190))
    assert r["best_point"] == dict(fp8_mode="fp8:flash_attn", backend="FLASH_ATTN", users=4, tok_s=250.0,
                                   ratio=pytest.approx(630 / 250))
    md = summary.fp8_ratios_markdown(r)
    assert ("| fp8:triton_attn | TRITON_ATTN | 6 | 190.0 | 6 (best of the windows measured; abort windows 1-3 of N=6 "
            "missing) | 190.0 | 3.32x | 3.32x |") in md
    assert "engine did not start: RuntimeError: FlashInfer" in md and "**2.52x**" in md and "**3.32x**" in md


def test_a_run_capped_below_its_cache_has_a_best_point_but_no_capacity(tmp_path):
    """A mode measured with max_users below what its KV cache fits (the full row's users < users_fit_arithmetic): its
    largest point is not its capacity, so max_clean gives None and the fp8 table says so, while its best clean point
    still counts for the ratio against the best fp8 point."""
    import pandas as pd

    from kvrepro import replay, summary

    path = _run_file(tmp_path, {"kvrepro:k4v4": {13: 630.0, 1: 60.0}, "fp8": {6: 163.0, 4: 245.0}})
    capped = _run_file(tmp_path, {"fp8:triton_attn": {4: 260.0, 3: 240.0}}, run_id="cap", users_fit_arithmetic=6)
    path.write_text(path.read_text() + capped.read_text().replace('"run_id": "cap"', '"run_id": "w1"'))
    rows = replay.load_jsonl(path)
    tri = rows[rows["mode"] == "fp8:triton_attn"]
    assert summary.capped_at(tri) == 4 and summary.max_clean(tri) is None and summary.best_clean(tri) == (4, 260.0)
    assert summary.capped_at(rows[rows["mode"] == "fp8"]) is None
    cap = replay.max_clean_capacity(rows).set_index("mode")         # notebook 02's details table: no capacity either
    assert cap.loc["fp8:triton_attn", "max_clean_users"] is pd.NA and cap.loc["fp8:triton_attn", "capped_at"] == 4
    assert cap.loc["fp8", "max_clean_users"] == 6 and cap.loc["fp8", "capped_at"] is pd.NA
    r = summary.fp8_ratios(path)
    by = {f["mode"]: f for f in r["fp8"]}
    assert by["fp8:triton_attn"]["users_max"] is None and by["fp8:triton_attn"]["capped_at"] == 4
    assert r["at_capacity"]["fp8_mode"] == "fp8" and r["best_point"] == dict(
        fp8_mode="fp8:triton_attn", backend="TRITON_ATTN", users=4, tok_s=260.0, ratio=pytest.approx(630 / 260))
    assert ("| fp8:triton_attn | TRITON_ATTN | capacity not measured (capped at 4 users) |  | 4 (best of the windows "
            "measured; abort windows 1-2 of N=4 missing) | 260.0 |") in summary.fp8_ratios_markdown(r)


def test_an_incomplete_fp8_mode_and_an_engine_error_of_another_run_are_named(tmp_path):
    """A capped fp8 mode whose abort windows a timeout cut: its best point is the best of what was measured, and the
    table says which windows are missing. An fp8 mode this run lacks whose engine failed in another run of the
    folder: its line names that run and the error (the newest record wins)."""
    from kvrepro import summary

    path = _run_file(tmp_path, {"kvrepro:k4v4": {13: 400.0, 1: 80.0},
                                "fp8": {6: 163.0, 5: 244.0, 4: 245.0, 3: 216.0, 2: 200.0, 1: 141.0},
                                "fp8:triton_attn": {3: 133.0, 2: 120.0}}, users_fit_arithmetic=6)
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    rows = [x for x in rows if not (x["mode"] == "fp8:triton_attn" and x["num_users"] == 2)]   # the cut window
    for x in rows:
        x["users_fit_arithmetic"] = 13 if x["mode"] == "kvrepro:k4v4" else 6
    path.write_text("".join(json.dumps(x) + "\n" for x in rows))
    old = _run_file(tmp_path, {"kvrepro:k4v4": {13: 410.0}}, run_id="w0")
    for run, when, why in ((old, "2026-12-01T10:00:00+00:00", "ImportError: old"),
                           (old, "2026-12-02T10:00:00+00:00", "ImportError: newest")):
        with open(str(run) + sweep.ENGINE_ERRORS_SUFFIX, "a") as fh:
            fh.write(json.dumps({"mode": "fp8:flashinfer", "date": when, "error": why, "run_id": "w0"}) + "\n")
    r = summary.fp8_ratios(path)
    tri = {f["mode"]: f for f in r["fp8"]}["fp8:triton_attn"]
    assert tri["capped_at"] == 3 and (tri["users_best"], tri["tok_s_best"]) == (3, 133.0)
    assert tri["incomplete"] == "abort windows 1-2 of N=3 missing"
    assert {f["mode"]: f for f in r["fp8"]}["fp8"]["incomplete"] is None
    errs = summary.fp8_engine_errors(tmp_path)
    assert errs == {"fp8:flashinfer": ("w0.jsonl", "ImportError: newest")}
    md = summary.fp8_ratios_markdown(r, errs)
    assert "| 3 (best of the windows measured; abort windows 1-2 of N=3 missing) | 133.0 |" in md
    assert "not run here; its engine did not start in `w0.jsonl`: ImportError: newest\n" in md
    assert "- fp8:flashinfer (FLASHINFER): not run\n" in summary.fp8_ratios_markdown(r)


def test_an_fp8_mode_measured_in_another_run_is_given_with_that_runs_figures(tmp_path):
    """A newer run without the Triton fp8 backend: its line gives the figures of the run that measured it beside the
    same kvrepro mode (points, ratio there, named file), not "not run"; the headline stays the newer run's own; a run
    without the kvrepro mode, and the current file itself, are not used."""
    from kvrepro import summary

    older = _run_file(tmp_path, {"kvrepro:k4v4": {13: 400.0, 1: 80.0}, "fp8": {6: 160.0, 4: 240.0},
                                 "fp8:triton_attn": {3: 133.0, 2: 120.0, 1: 70.0}}, run_id="a1",
                      date="2026-12-01T10:00:00+00:00")
    _run_file(tmp_path, {"fp8:triton_attn": {6: 999.0}}, run_id="a0", date="2026-12-03T10:00:00+00:00")
    cur = _run_file(tmp_path, {"kvrepro:k4v4": {13: 410.0}, "fp8": {6: 164.0, 4: 246.0}}, run_id="a2",
                    date="2026-12-02T10:00:00+00:00")
    other = summary.fp8_measured_elsewhere(cur)
    assert set(other) == {"fp8", "fp8:triton_attn"} and other["fp8:triton_attn"][0] == older.name
    md = summary.fp8_ratios_markdown(summary.fp8_ratios(cur), {}, other)
    assert ("- fp8:triton_attn (TRITON_ATTN): not run here; measured in `a1.jsonl` beside kvrepro k4v4: max clean "
            "capacity 3 users, 133.0 tok/s; best clean point 3 users, 133.0 tok/s (kvrepro k4v4 there 400.0 tok/s at "
            "13 users; vs max clean 3.01x, vs best clean 3.01x)\n") in md
    assert "(fp8, 6 users, 164.0 tok/s): **2.50x**" in md and "999" not in md
    assert summary.fp8_measured_elsewhere(older) == {"fp8": (cur.name, summary.fp8_ratios(cur)["fp8"][0],
                                                             (13, 410.0), "kvrepro:k4v4")}


def test_an_fp8_backend_measured_only_beside_another_kvrepro_mode_is_compared_with_that_runs_fp8(tmp_path):
    """A backend that no run measured beside the capacity preset, but a run of another kvrepro mode measured beside
    vLLM's choice fp8: its line gives its points and fp8's there, with backend / fp8 at both points; a run measuring it
    beside the capacity preset wins however old."""
    from kvrepro import summary

    cur = _run_file(tmp_path, {"kvrepro:k4v4": {13: 410.0}, "fp8": {6: 164.0, 4: 246.0}}, run_id="b2",
                    date="2026-12-02T10:00:00+00:00")
    k2 = _run_file(tmp_path, {"kvrepro:k4v2": {17: 590.0}, "fp8": {6: 160.0, 4: 240.0},
                              "fp8:flashinfer": {6: 120.0, 5: 200.0, 4: 180.0, 3: 150.0, 2: 130.0, 1: 90.0}},
                   run_id="b3",
                   date="2026-12-03T10:00:00+00:00")
    other = summary.fp8_measured_elsewhere(cur)
    assert set(other) == {"fp8:flashinfer"} and other["fp8:flashinfer"][0] == k2.name
    assert other["fp8:flashinfer"][2:] == ((6, 160.0), "fp8")
    md = summary.fp8_ratios_markdown(summary.fp8_ratios(cur), {}, other)
    assert ("- fp8:flashinfer (FLASHINFER): not run beside kvrepro k4v4; measured in `b3.jsonl` beside vLLM's choice "
            "fp8: max clean capacity 6 users, 120.0 tok/s; best clean point 5 users, 200.0 tok/s (vLLM's choice fp8 "
            f"there: max clean capacity 6 users, 160.0 tok/s, best clean point 4 users, 240.0 tok/s; this backend / fp8 at max clean capacity "
            f"{120 / 160:.2f}x, at best clean points {200 / 240:.2f}x)\n") in md
    assert "(fp8, 6 users, 164.0 tok/s): **2.50x**" in md                     # the headline stays this run's
    _run_file(tmp_path, {"kvrepro:k4v4": {13: 400.0}, "fp8": {6: 150.0}, "fp8:flashinfer": {6: 100.0}}, run_id="b1",
              date="2026-12-01T10:00:00+00:00")
    assert summary.fp8_measured_elsewhere(cur)["fp8:flashinfer"][3] == "kvrepro:k4v4"


def test_fp8_ratios_use_the_resolved_backend_and_refuse_mixed_runs(tmp_path):
    import pandas as pd

    from kvrepro import replay, summary

    path = _run_file(tmp_path, {"kvrepro:k4v4": {2: 100.0, 1: 50.0}, "fp8": {2: 40.0, 1: 25.0}},
                     attention_backend_resolved=["FLASH_ATTN"])
    r = summary.fp8_ratios(path)
    assert r["fp8"][0]["backend"] == "FLASH_ATTN"
    assert r["at_capacity"]["ratio"] == pytest.approx(2.5) and r["best_point"]["ratio"] == pytest.approx(2.5)
    other = _run_file(tmp_path, {"fp8:triton_attn": {1: 30.0}}, run_id="w2")
    both = pd.concat([replay.load_jsonl(path), replay.load_jsonl(other)], ignore_index=True)
    with pytest.raises(ValueError, match="one run"):
        summary.fp8_ratios(both)
    with pytest.raises(ValueError, match="kvrepro:k4v2.* has no rows"):
        summary.fp8_ratios(path, "kvrepro:k4v2")
    dirty = _run_file(tmp_path, {"kvrepro:k4v4": {1: 50.0}, "fp8": {1: 25.0}}, run_id="w3")
    rows = [json.loads(x) for x in dirty.read_text().splitlines()]
    rows[-1]["gpu_memory_gb"] = 40.0                                # fp8 measured at another budget: no ratio
    dirty.write_text("".join(json.dumps(x) + "\n" for x in rows))
    r = summary.fp8_ratios(dirty)
    assert r["fp8"][0]["setup_differs"] == ["gpu_memory_gb"] and r["fp8"][0]["vs_max"] is None
    assert r["at_capacity"] is None and r["best_point"] is None


def test_fp8_ratios_cli(tmp_path, capsys):
    from kvrepro import summary

    path = _run_file(tmp_path, {"kvrepro:k4v4": {2: 100.0, 1: 50.0}, "fp8": {2: 40.0, 1: 25.0}})
    assert summary.main(["--fp8-ratios", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Against the strongest fp8 of this run at its max clean capacity (fp8, 2 users, 40.0 tok/s): **2.50x**." in out
    assert summary.main(["--fp8-ratios", str(tmp_path / "none.jsonl")]) == 1
    assert "none.jsonl: No such file or directory (expected a capacity-sweep results file" in capsys.readouterr().err
    gz = tmp_path / "rows.csv.gz"
    gz.write_bytes(b"\x1f\x8b\x08\x00binary")
    assert summary.main(["--fp8-ratios", str(gz)]) == 1
    assert "rows.csv.gz: not a text file (binary or compressed)" in capsys.readouterr().err
    no_fp8 = _run_file(tmp_path, {"kvrepro:k5v4": {2: 90.0, 1: 50.0}}, run_id="k5")
    assert summary.main(["--fp8-ratios", str(no_fp8), "--ratio-mode", "kvrepro:k5v4"]) == 1
    assert "k5.jsonl: no fp8 mode was measured in this run (allowed fp8 modes: fp8, " in capsys.readouterr().err
    with pytest.raises(SystemExit):
        summary.main(["--ratio-mode", "kvrepro:k5v4"])
    assert "--ratio-mode goes with --fp8-ratios FILE" in capsys.readouterr().err
    both = _run_file(tmp_path, {"kvrepro:k4v4": {2: 100.0}, "fp8": {2: 40.0}}, run_id="fa",
                     attention_backend_resolved=["FLASH_ATTN"])
    assert summary.main(["--fp8-ratios", str(both)]) == 0
    assert "- fp8:flash_attn (FLASH_ATTN): not run on its own (the fp8 row ran this backend)" in \
        capsys.readouterr().out
    # --ratio-mode: a bare preset name is not a sweep mode (argument error); a mode absent from the run names the option
    with pytest.raises(SystemExit) as e:
        summary.main(["--fp8-ratios", str(both), "--ratio-mode", "k4v4"])
    assert e.value.code == 2 and "--ratio-mode 'k4v4': not a sweep mode (kvrepro presets are kvrepro:<preset>); " \
        "allowed: bf16, fp8," in capsys.readouterr().err
    assert summary.main(["--fp8-ratios", str(both), "--ratio-mode", "kvrepro:k4v2"]) == 1
    assert "error: --ratio-mode kvrepro:k4v2: mode 'kvrepro:k4v2' has no rows in " in capsys.readouterr().err
    # the CLI names an fp8 engine error of another run in the same folder, as notebook 02 does
    sweep.record_engine_error(tmp_path / "w1.jsonl", "fp8:flashinfer", "w1", sweep.engine_settings("fp8:flashinfer"),
                              RuntimeError("FlashInfer backend is not available"))
    assert summary.main(["--fp8-ratios", str(both)]) == 0
    assert "not run here; its engine did not start in `w1.jsonl`: RuntimeError: FlashInfer" in capsys.readouterr().out


def _fake_vllm(monkeypatch, fail=None, backends=("TRITON_ATTN",)):
    """A ``vllm`` module whose ``LLM`` records its arguments and answers the worker's sizing questions (or raises
    ``fail``, as vLLM does for a backend it refuses)."""
    import sys
    import types
    from types import SimpleNamespace as NS

    import torch

    made = {}
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # measure_mode sets it for its own process: undone

    class LLM:
        def __init__(self, **kw):
            made.update(kw)
            if fail:
                raise fail
            cfg = NS(cache_config=NS(num_gpu_blocks=3 * 8256 + 1), scheduler_config=NS(max_num_batched_tokens=8192),
                     compilation_config=NS(cudagraph_mode=NS(name="FULL_AND_PIECEWISE")))
            self.llm_engine = NS(vllm_config=cfg)

        def collective_rpc(self, fn):
            groups = [[NS(backend=NS(get_name=lambda b=b: b)) for b in backends]]
            return [fn(NS(model_runner=NS(attn_groups=groups, model_memory_usage=1)))]

    mod = types.ModuleType("vllm")
    mod.__version__, mod.LLM = "0.20.2-sim", LLM
    monkeypatch.setitem(sys.modules, "vllm", mod)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: NS(total_memory=160 * 2**30))
    return made


def test_worker_runs_fp8_on_the_named_backend_and_records_what_resolved(tmp_path, monkeypatch):
    from kvrepro import sweep_worker

    made = _fake_vllm(monkeypatch)
    rows = sweep_worker.measure_mode("fp8:triton_attn", str(tmp_path / "r.jsonl"), "r", sizing_only=True)
    assert made["attention_backend"] == "TRITON_ATTN" and made["kv_cache_dtype"] == "fp8"
    r = rows[0]
    assert (r["mode"], r["attention_backend"], r["attention_backend_resolved"]) == \
        ("fp8:triton_attn", "TRITON_ATTN", ["TRITON_ATTN"])
    assert r["users_fit_arithmetic"] == 3 and r["measured_by"] == "sizing"


def test_worker_records_an_engine_vllm_refused(tmp_path, monkeypatch):
    from kvrepro import sweep_worker

    _fake_vllm(monkeypatch, fail=ValueError("Selected backend FLASHINFER is not valid for this configuration"))
    path = tmp_path / "r.jsonl"
    with pytest.raises(ValueError, match="FLASHINFER"):
        sweep_worker.measure_mode("fp8:flashinfer", str(path), "r", sizing_only=True)
    (err,) = sweep.engine_errors(path)
    assert err["mode"] == "fp8:flashinfer" and err["attention_backend"] == "FLASHINFER"
    assert err["error"].startswith("ValueError: Selected backend FLASHINFER") and not path.exists()
