"""kvrepro.replay on a small synthetic sweep written inside the test."""
import json
import math

import pytest

from kvrepro import replay


def row(mode, users, tok_s, clean=True, preemptions=0, **kw):
    r = {"mode": mode, "kv_cache_dtype": "auto" if mode == "bf16" else mode, "num_users": users, "clean": clean,
         "preemptions": preemptions, "aggregate_decode_tok_s": tok_s, "ttft_s_mean": 1.0, "ttft_s_max": 2.0,
         "tpot_ms_mean": 20.0, "kv_cache_tokens": 455_392, "users_fit_arithmetic": 3, "prompt_tokens": 131_072,
         "decode_tokens": 1_024, "gpu": "NVIDIA H200", "gpu_memory_gb": 80.0, "gpu_memory_utilization": 0.5128,
         "vllm_version": "0.20.2", "torch_version": "2.11.0", "kvrepro_version": "0.1.0",
         "model": "qwen3-4b-instruct-2507", "load_format": "dummy", "date": "2026-11-29", "run_id": "t1",
         "measured": True}
    r.update(kw)
    return r


def sweep_rows():
    return [row("bf16", 1, 60.0), row("bf16", 2, 110.0), row("bf16", 3, 150.0),
            row("bf16", 4, 90.0, clean=False, preemptions=3),
            row("fp8", 2, 100.0), row("fp8", 4, 180.0), row("fp8", 6, 240.0),
            row("fp8", 7, 230.0, clean=True, preemptions=1)]  # "clean" but preempted: not clean capacity


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_load_and_max_clean_capacity(tmp_path):
    write(tmp_path / "a.jsonl", sweep_rows())
    df = replay.load_results(tmp_path)
    assert len(df) == 8 and set(df["source_file"]) == {str(tmp_path / "a.jsonl")}
    cap = replay.max_clean_capacity(df).set_index("mode")
    assert cap.loc["bf16", "max_clean_users"] == 3 and cap.loc["bf16", "aggregate_decode_tok_s"] == 150.0
    assert cap.loc["fp8", "max_clean_users"] == 6 and cap.loc["fp8", "aggregate_decode_tok_s"] == 240.0
    r = replay.ratios(replay.max_clean_capacity(df)).set_index("mode")
    assert r.loc["fp8", "users_vs_bf16"] == 2.0
    assert r.loc["fp8", "tok_s_vs_bf16"] == pytest.approx(240 / 150)
    assert r.loc["bf16", "tok_s_vs_fp8"] == pytest.approx(150 / 240)
    assert replay.replay_labels(df) == [f"{m}: replayed from {tmp_path / 'a.jsonl'}, measured on NVIDIA H200 2026-11-29 "
                                        "(131072+1024 tokens per user, 80 GiB budget)" for m in ("bf16", "fp8")]


def test_no_clean_run_and_nullable_timings(tmp_path):
    write(tmp_path / "b.jsonl", [row("fp8", 9, None, clean=False, preemptions=2, ttft_s_mean=None, ttft_s_max=None,
                                     tpot_ms_mean=None)])
    cap = replay.max_clean_capacity(replay.load_results(tmp_path))
    assert cap["max_clean_users"].tolist() == [0] and math.isnan(cap["aggregate_decode_tok_s"].iloc[0])


def test_empty_dir_gives_none(tmp_path):
    assert replay.find_result_files(tmp_path) == []
    assert replay.load_results(tmp_path / "missing") is None


@pytest.mark.parametrize("mutate,needle", [
    (lambda rows: rows[1].pop("clean"), r"b\.jsonl:2: missing field\(s\) clean"),
    (lambda rows: rows[0].update(clean="yes"), r"b\.jsonl:1: field 'clean' must be bool"),
    (lambda rows: rows[2].update(num_users=2.5), "field 'num_users' must be int"),
    (lambda rows: rows[2].update(num_users=0), "num_users must be positive"),
    (lambda rows: rows[0].update(measured=False), "measured must be true"),
    (lambda rows: rows[0].update(aggregate_decode_tok_s=float("inf")), "aggregate_decode_tok_s must be finite"),
])
def test_malformed_rows_are_refused_with_file_line_field(tmp_path, mutate, needle):
    rows = sweep_rows()
    mutate(rows)
    write(tmp_path / "b.jsonl", rows)
    with pytest.raises(ValueError, match=needle):
        replay.load_results(tmp_path)


def test_malformed_json_and_empty_file(tmp_path):
    p = tmp_path / "c.jsonl"
    p.write_text(json.dumps(row("bf16", 1, 1.0)) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"c\.jsonl:2: not valid JSON"):
        replay.load_jsonl(p)
    p.write_text("\n")
    with pytest.raises(ValueError, match="no result records"):
        replay.load_jsonl(p)


def test_reference_points_carry_sources():
    ref = replay.reference_points()
    seed = ref[ref["source"] == replay.SEED_SOURCE].set_index("mode")
    assert seed.loc["fp16", "num_users"] == 2 and seed.loc["fp16", "aggregate_decode_tok_s"] == 66.6
    assert seed.loc["fp8", "num_users"] == 5 and seed.loc["compressed (seed)", "aggregate_decode_tok_s"] == 140.9
    assert set(ref["source"]) == {replay.SEED_SOURCE, replay.CARD_SOURCE}


def test_measure_without_gpu_or_vllm_fails_clearly():
    import importlib.util

    import torch
    if torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None:
        pytest.skip("GPU and vLLM present: the refusal cannot be exercised here")
    with pytest.raises(RuntimeError, match="measure=True needs"):
        replay.require_gpu_and_vllm()


def test_sizing_rows_are_kept_out_of_capacity(tmp_path):
    import pandas as pd
    rows = sweep_rows() + [row("k4v4", 0, None, measured_by="sizing", kv_cache_tokens=1_740_032,
                               users_fit_arithmetic=13, ttft_s_mean=None, ttft_s_max=None, tpot_ms_mean=None)]
    write(tmp_path / "s.jsonl", rows)
    df = replay.load_results(tmp_path)
    cap = replay.max_clean_capacity(df).set_index("mode")
    assert cap.loc["k4v4", "max_clean_users"] is pd.NA and cap.loc["bf16", "max_clean_users"] == 3  # not run, not 0
    r = replay.ratios(replay.max_clean_capacity(df)).set_index("mode")
    assert math.isnan(r.loc["k4v4", "users_vs_bf16"]) and r.loc["fp8", "users_vs_bf16"] == 2.0
    sizes = replay.kv_sizes(df).set_index("mode")
    assert sizes.loc["k4v4", "kv_cache_tokens"] == 1_740_032 and sizes.loc["k4v4", "users_fit_arithmetic"] == 13


def test_side_by_side_converts_card_tokens_to_users():
    import pandas as pd
    table = pd.DataFrame({"format": ["bf16", "fp8", "k4v4"], "users_fit": [3, 6, 13]})
    s = replay.side_by_side(table, 131_072, 1_024, 16).set_index("mode")
    # 8,256 blocks per user; card KV tokens / 16 - 1 null block
    assert s.loc["bf16", "card_users_fit"] == (455_392 // 16 - 1) // 8_256 == 3
    assert s.loc["turboquant_4bit_nc", "card_users_fit"] == 82_732 // 8_256 == 10
    assert s.loc["turboquant_k8v4", "card_users_fit"] == 63_125 // 8_256 == 7
    assert (s.loc["bf16", "seed_users"], s.loc["bf16", "seed_tok_s"]) == (2, 66.6)
    assert s.loc["k4v4", "users_arithmetic"] == 13 and pd.isna(s.loc["k4v4", "seed_users"])
    assert s.loc["compressed (seed)", "seed_users"] == 6


def test_workload_mismatch_is_said_not_hidden(tmp_path):
    """02 replays rows measured for another workload than its parameters: it must say so."""
    write(tmp_path / "a.jsonl", sweep_rows())
    df = replay.load_results(tmp_path)
    assert replay.workload_mismatch(df, 131_072, 1_024, 80.0) is None
    msg = replay.workload_mismatch(df, 65_536, 1_024, 40.0)
    assert "131072+1024 tokens per user at 80 GiB" in msg and "65536+1024" in msg and "40 GiB" in msg
    # one mode run with another split of the same footprint is named, the matching ones are not
    write(tmp_path / "a.jsonl", sweep_rows() + [row("tq", 4, 30.0, prompt_tokens=132_032, decode_tokens=64)])
    msg = replay.workload_mismatch(replay.load_results(tmp_path), 131_072, 1_024, 80.0)
    assert "(tq: 132032+64 tokens per user at 80 GiB)" in msg and "bf16" not in msg


def test_two_result_files_are_never_merged(tmp_path):
    """Each result file is its own source: a second run's rows do not mix into the first's capacity,
    ratios are taken within a file, and a file written now is labelled as measured now."""
    write(tmp_path / "a.jsonl", sweep_rows())
    b = [dict(r, aggregate_decode_tok_s=r["aggregate_decode_tok_s"] * 2, run_id="t2") for r in sweep_rows()]
    write(tmp_path / "b.jsonl", b)
    df = replay.load_results(tmp_path)
    cap = replay.ratios(replay.max_clean_capacity(df))
    assert len(cap) == 4 and set(cap["source_file"]) == {str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")}
    got = cap.set_index(["source_file", "mode"])["aggregate_decode_tok_s"]
    assert got[(str(tmp_path / "a.jsonl"), "bf16")] == 150.0 and got[(str(tmp_path / "b.jsonl"), "bf16")] == 300.0
    assert cap.set_index("mode").loc["fp8", "tok_s_vs_bf16"].tolist() == pytest.approx([240 / 150] * 2)  # within a file
    labels = replay.replay_labels(df, measured_now=[tmp_path / "b.jsonl"])
    assert labels[0].startswith(f"bf16: replayed from {tmp_path / 'a.jsonl'}, measured on")
    assert labels[2].startswith(f"bf16: measured now, written to {tmp_path / 'b.jsonl'}, measured on")


def test_each_label_shows_its_own_runs_time_span(tmp_path):
    """A label gives the first-last time of its own engine run's rows, not the earliest date of all rows."""
    write(tmp_path / "a.jsonl", [row("bf16", 1, 60.0, date="2026-11-30T09:43:04+00:00"),
                                 row("bf16", 2, 90.0, date="2026-11-30T09:44:59+00:00"),
                                 row("fp8", 1, 70.0, date="2026-12-01T06:49:35+00:00")])
    labels = replay.replay_labels(replay.load_results(tmp_path))
    assert "measured on NVIDIA H200 2026-11-30 09:43-09:44 UTC" in labels[0] and labels[0].startswith("bf16:")
    assert "measured on NVIDIA H200 2026-12-01 06:49 UTC" in labels[1] and labels[1].startswith("fp8:")


def test_empty_and_reference_capacity():
    import pandas as pd
    empty = replay.max_clean_capacity(pd.DataFrame(columns=["mode", "num_users", "aggregate_decode_tok_s",
                                                            "clean", "preemptions"]))
    assert list(empty.columns) == ["mode", "max_clean_users", "aggregate_decode_tok_s"] and len(empty) == 0
    assert len(replay.ratios(empty)) == 0
    ref = replay.max_clean_capacity(replay.reference_points()).set_index("mode")
    # the card ran TurboQuant at 3 users without finding its capacity: not measured, not "0 clean"
    assert ref.loc["turboquant_4bit_nc", "max_clean_users"] is pd.NA
    assert ref.loc["fp8", "max_clean_users"].max() >= 5


def test_baseline_borrowed_only_from_a_matching_workload_and_labelled(tmp_path):
    """A re-measure file with one kvrepro mode takes bf16 / fp8 from another file of the same GPU, budget and
    workload (latest by name), says so in ``baseline_from``, and borrows nothing from a different budget."""
    write(tmp_path / "a.jsonl", sweep_rows())                                   # bf16 150 tok/s @3, fp8 240 @6
    write(tmp_path / "b-fix.jsonl", [row("kvrepro:k4v4", 13, 480.0, run_id="t2")])
    write(tmp_path / "c-40g.jsonl", [row("kvrepro:k4v4", 6, 200.0, run_id="t3", gpu_memory_gb=40.0)])
    cap = replay.ratios(replay.max_clean_capacity(replay.load_results(tmp_path))).set_index("source_file")
    fix = cap.loc[str(tmp_path / "b-fix.jsonl")]
    assert fix["tok_s_vs_fp8"] == pytest.approx(480 / 240) and fix["users_vs_bf16"] == pytest.approx(13 / 3)
    assert fix["baseline_from"] == "other run: a.jsonl"
    other = cap.loc[str(tmp_path / "c-40g.jsonl")]
    assert math.isnan(other["tok_s_vs_fp8"]) and other["baseline_from"] == "none"
    same = cap[cap["mode"] == "fp8"].iloc[0]
    assert same["baseline_from"] == "same file" and same["tok_s_vs_bf16"] == pytest.approx(240 / 150)


def test_borrowing_needs_the_same_model_and_vllm_and_unlike_rows_are_labelled(tmp_path):
    """No baseline is borrowed from a run of another model or vLLM version; a same-file baseline that ran
    another workload is named as such in ``baseline_from``."""
    write(tmp_path / "a.jsonl", sweep_rows() + [row("tq", 2, 30.0, prompt_tokens=132_032, decode_tokens=64)])
    write(tmp_path / "b.jsonl", [row("kvrepro:k4v4", 13, 480.0, run_id="t2", model="other-70b")])
    write(tmp_path / "c.jsonl", [row("kvrepro:k4v4", 13, 480.0, run_id="t3", vllm_version="0.9.0")])
    cap = replay.ratios(replay.max_clean_capacity(replay.load_results(tmp_path)))
    for f in ("b.jsonl", "c.jsonl"):
        r = cap[cap["source_file"] == str(tmp_path / f)].iloc[0]
        assert math.isnan(r["tok_s_vs_fp8"]) and r["baseline_from"] == "none"
    tq = cap[cap["mode"] == "tq"].iloc[0]
    assert tq["tok_s_vs_fp8"] == pytest.approx(30 / 240)
    assert tq["baseline_from"] == "same file (workload differs: prompt_tokens, decode_tokens)"


def test_row_without_ratio_names_no_baseline(tmp_path):
    """A sizing-only row (no users run) gets NaN ratios and ``baseline_from`` "none", also when a
    matching baseline exists in its own file or in another one."""
    sized = row("tq8", 0, None, run_id="t2")
    sized.update(measured_by="sizing", aggregate_decode_tok_s=None)
    write(tmp_path / "a.jsonl", sweep_rows() + [dict(sized, run_id="t1")])
    write(tmp_path / "b.jsonl", [sized])
    cap = replay.ratios(replay.max_clean_capacity(replay.load_results(tmp_path)))
    for r in cap[cap["mode"] == "tq8"].itertuples():
        assert math.isnan(r.tok_s_vs_fp8) and math.isnan(r.users_vs_bf16) and r.baseline_from == "none"


def test_decode_kernel_column_says_which_kernel_ran(tmp_path):
    """kvrepro rows name the decode kernel their kvrepro_settings recorded; rows from before the field existed say
    so; vLLM modes say vLLM."""
    rows = sweep_rows() + [
        row("kvrepro:k4v4", 13, 506.2, kvrepro_settings={"decode_impl": {"k4v4 32q/8kv d128 bs16": "cuda"}}),
        row("kvrepro:k8v4", 8, 246.8, kvrepro_settings={"decode_variant": "v2"}),
        row("kvrepro:k4v2", 0, None, measured_by="sizing"),                          # older sizing row: no settings
        row("kvrepro:k4v2", 17, 294.4, kvrepro_settings={"decode_impl": "auto (no layer resolved it yet)"})]
    write(tmp_path / "a.jsonl", rows)
    cap = replay.max_clean_capacity(replay.load_results(tmp_path)).set_index("mode")
    assert cap.loc["kvrepro:k4v4", "decode_kernel"] == "cuda"
    assert cap.loc["kvrepro:k8v4", "decode_kernel"] == "triton (not recorded)"
    assert cap.loc["bf16", "decode_kernel"] == "vLLM"
    assert cap.loc["kvrepro:k4v2", "decode_kernel"] == "auto (no layer resolved it yet)"   # said as recorded


def test_notebook_run_parameters_are_checked(tmp_path):
    """Notebook 02's ``measure`` must be a bool (papermill's ``-p measure no`` passes the string "no", which is truthy
    and would start a sweep), and a replay's ``results_dir`` must exist (a typo would render an empty report)."""
    replay.check_replay_params(False, "results/capacity")
    replay.check_replay_params(False, str(tmp_path))
    replay.check_replay_params(True, str(tmp_path / "new"))          # a measurement creates its folder
    for bad in ("no", "yes", 0, 1, None):
        with pytest.raises(ValueError, match="measure must be True or False"):
            replay.check_replay_params(bad, "results/capacity")
    with pytest.raises(ValueError, match="results_dir='/nonexist': no such folder"):
        replay.check_replay_params(False, "/nonexist")
    for bad in ("", "  ", 3, None):
        with pytest.raises(ValueError, match="results_dir must be a folder path"):
            replay.check_replay_params(False, bad)
