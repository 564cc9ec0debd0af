"""kvrepro.accuracy: parameter validation (fail fast, naming the parameter), the per-format
summary against hand-computed values, a tiny real run of SmolLM2 in two formats, notebook 03's
parameters, and what its report shows first (the verdict table)."""
import math
import pathlib

import pandas as pd
import pytest
import yaml

from kvrepro import accuracy
from kvrepro.accuracy import AccuracyParams
from kvrepro.formats import get_format

ROOT = pathlib.Path(__file__).resolve().parents[1]
NB = ROOT / "notebooks" / "03_accuracy.ipynb"


@pytest.mark.parametrize("override,name", [
    (dict(formats=["bf16", "int3"]), "formats"), (dict(formats=["k4v4"]), "bf16"),
    (dict(formats=["bf16", "bf16"]), "duplicates"), (dict(formats=[]), "formats"),
    (dict(context_lengths=[-512]), "context_lengths"), (dict(context_lengths=[16384]), "context_lengths"),
    (dict(context_lengths=[512.0]), "context_lengths"), (dict(depths=[1.2]), "depths"),
    (dict(num_keys=0), "num_keys"), (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(block_size=8), "block_size"), (dict(seed="x"), "seed"), (dict(kv_mode="fp8"), "kv_mode"),
    (dict(variants=["single", "many"]), "variants"), (dict(variants=[]), "variants"),
    (dict(sanity_tokens=4), "sanity_tokens"), (dict(engine="tpu"), r"engine must be one of \('cpu', 'vllm'\)"),
    (dict(vllm_results=3), "vllm_results"),
])
def test_bad_parameters_fail_naming_them(override, name):
    with pytest.raises(ValueError, match=name):
        AccuracyParams.from_dict(AccuracyParams().as_dict() | override)


def test_run_grid_validates_before_loading_the_model(monkeypatch):
    def boom():
        raise AssertionError("model loaded before validation")
    monkeypatch.setattr(accuracy, "load_smollm2", boom)
    with pytest.raises(ValueError, match="formats"):
        accuracy.run_grid(dict(formats=["bf16", "fp4"]))


def _synthetic():
    rows = []
    for fmt, correct, lp in (("bf16", [1, 1, 1, 0], [-0.1, -0.2, -0.3, -2.0]),
                             ("k4v2", [1, 0, 1, 0], [-0.5, -1.2, -0.4, -3.0])):
        for i in range(4):
            rows.append(dict(format=fmt, context_length=512 * (1 + i // 2), depth=0.5 * (i % 2), key="11111",
                             n_tokens=500, prompt_sha256=f"h{i}", correct=correct[i], key_logprob_mean=lp[i],
                             prefill_s=1.0, decode_s=0.5, kv_bytes=1000 * (4 if fmt == "bf16" else 1)))
    df = pd.DataFrame(rows)
    df["format"] = pd.Categorical(df["format"], ["bf16", "k4v2"], ordered=True)
    return df


def test_summary_and_deltas_against_hand_values():
    s = accuracy.summarize(_synthetic())
    assert s.loc["bf16", "accuracy"] == 0.75 and s.loc["k4v2", "correct"] == 2
    assert s.loc["k4v2", "delta_accuracy_vs_bf16"] == pytest.approx(-0.25)
    assert s.loc["k4v2", "delta_logprob_vs_bf16"] == pytest.approx((-0.4 - 1.0 - 0.1 - 1.0) / 4)
    assert s.loc["k4v2", "worst_delta_logprob"] == pytest.approx(-1.0)
    assert s.loc["bf16", "kv_bytes_per_token"] == 8.0 and s.loc["k4v2", "kv_bytes_per_token"] == 2.0
    assert s.loc["k4v2", "bytes_per_token_per_head"] == get_format("k4v2").bytes_per_token_per_head(64)
    v = accuracy.verdict(s)
    assert v.startswith("bf16 retrieved 3/4 (75%); BELOW 90%") and "k4v2: 2/4" in v
    t = accuracy.cell_table(_synthetic(), "correct")["k4v2"]
    assert t.loc[512, 0.0] == 1 and t.loc[512, 0.5] == 0


def test_check_same_prompts_catches_differing_hashes():
    df = _synthetic()
    accuracy.check_same_prompts(df)
    bad = df.copy()
    bad.loc[(bad["format"] == "k4v2") & (bad["prompt_sha256"] == "h2"), "prompt_sha256"] = "other"
    with pytest.raises(ValueError, match="prompts differ"):
        accuracy.check_same_prompts(bad)


def test_tiny_real_run(tmp_path):
    """SmolLM2 at ~256 tokens, bf16 vs k4v4: same prompt bytes, real page bytes, bf16 retrieves."""
    p = AccuracyParams(formats=("bf16", "k4v4"), context_lengths=(256,), depths=(0.5,), num_keys=1)
    df = accuracy.run_grid(p, progress=False)
    assert len(df) == 2 and df["prompt_sha256"].nunique() == 1
    b, k = df.set_index("format").loc["bf16"], df.set_index("format").loc["k4v4"]
    assert b["correct"] == 1 and b["key_logprob_mean"] > -0.5  # measured: ~-0.02 at 256 tokens
    # stored bytes are the formats' real page bytes (same whole pages for both)
    assert b["kv_bytes"] / k["kv_bytes"] == pytest.approx(256 / get_format("k4v4").bytes_per_token_per_head(64))
    assert b["kv_bytes"] == 30 * 3 * 256 * 16 * -(-b["n_tokens"] // 16)
    assert k["key_logprob_mean"] != b["key_logprob_mean"]
    out = accuracy.save_results(df, p, str(tmp_path / "r.csv"), {"date_utc": "x"})
    assert pd.read_csv(out).shape == df.shape and (tmp_path / "r.csv.json").exists()


def test_notebook_parameters_match_the_runner():
    """One literal-only `parameters` cell declaring exactly AccuracyParams' fields and notebook 03's own (the live
    fidelity measurement and the key-bias grid, kvrepro.accuracy_summary.NOTEBOOK_PARAMETERS); params files valid."""
    from kvrepro import accuracy_summary, provenance

    names = provenance.parameters_cell_names(NB)
    assert sorted(names) == sorted([*AccuracyParams().as_dict(), *accuracy_summary.NOTEBOOK_PARAMETERS])
    for f in sorted((ROOT / "notebooks" / "params").glob("03_*.yaml")):
        d = yaml.safe_load(f.read_text())
        provenance.check_parameters(NB, d)
        accuracy_summary.notebook_params(d)


def test_notebook_bad_parameter_fails_naming_it(tmp_path):
    import papermill
    with pytest.raises(papermill.PapermillExecutionError, match="int3"):
        papermill.execute_notebook(str(NB), str(tmp_path / "out.ipynb"), kernel_name="python3",
                                   parameters=dict(formats=["bf16", "int3"]), cwd=str(NB.parent),
                                   progress_bar=False)


# ---------------------------------------------------------------- sanity, target, engine agreement (hand values)

def test_sanity_metrics_against_hand_values():
    m = accuracy.sanity_metrics([1, 2, 3, 4], "1 2 9 4 4")
    assert m == dict(first_divergence=2, prefix_agreement=0.5, token_agreement=0.75, dup_rate=0.25, rep3_rate=0.0)
    loop = [5, 6, 7] * 5  # 13 3-grams, the first 3 new, the other 10 repeats
    assert accuracy.sanity_metrics(loop, loop)["rep3_rate"] == pytest.approx(10 / 13)
    assert accuracy.sanity_metrics([1, 2], [])["token_agreement"] == 0.0
    with pytest.raises(ValueError, match="ref"):
        accuracy.sanity_metrics([], [1])


def _sanity_rows():
    texts = {"a": list(range(10, 42)), "b": list(range(50, 82)), "c": list(range(100, 132))}
    rows = []
    for name, ref in texts.items():
        outs = {"bf16": ref, "good": ref[:20] + list(range(200, 212)),
                "loop": ref[:6] + [5, 6, 7] * 8 + [5, 6],
                "stutter": ref[:6] + [9, 9, 8, 8] * 6 + [1, 2],
                "offtrack": [999] + ref[1:]}
        for fmt, out in outs.items():
            rows.append(dict(format=fmt, name=name, output_ids=" ".join(map(str, out))))
    return pd.DataFrame(rows)


def test_sanity_table_flags_corrupt_output():
    t = accuracy.sanity_table(_sanity_rows())
    assert t.loc["bf16", "sanity_pass"] and t.loc["bf16", "token_agreement"] == 1.0
    assert t.loc["good", "sanity_pass"] and t.loc["good", "first_divergence_median"] == 20
    assert t.loc["good", "token_agreement"] == pytest.approx(20 / 32)
    assert not t.loc["loop", "sanity_pass"] and t.loc["loop", "worst_extra_rep3"] > 0.5  # loops, no adjacent dups
    assert t.loc["loop", "worst_extra_dup"] == 0
    assert not t.loc["stutter", "sanity_pass"] and t.loc["stutter", "worst_extra_dup"] > 0.10
    assert not t.loc["offtrack", "sanity_pass"] and t.loc["offtrack", "first_divergence_median"] == 0
    assert t.loc["offtrack", "token_agreement"] == pytest.approx(31 / 32)  # same text after token 0, still fails
    with pytest.raises(ValueError, match="baseline"):
        accuracy.sanity_table(_sanity_rows().query("format != 'bf16'"))


def test_a_loop_an_exact_kv_control_shows_too_is_the_models():
    """On prompt 'a' the bf16 control (another attention kernel over the exact cache) loops like 'loop' does: there
    the loop is the model's, so 'loop' is judged against the control's rate on 'a'; on 'b' and 'c' the control
    does not loop and 'loop' still fails there (its reason names those prompts and the bf16 engines)."""
    rows = _sanity_rows()
    ctl = rows[rows["format"] == "bf16"].assign(format="bf16-triton_attn")
    loop_a = rows[(rows["format"] == "loop") & (rows["name"] == "a")]["output_ids"].iloc[0]
    ctl.loc[ctl["name"] == "a", "output_ids"] = loop_a
    assert accuracy.exact_kv_formats(["bf16", "fp8", "bf16-triton_attn", "k4v4"]) == ["bf16", "bf16-triton_attn"]
    m = accuracy.sanity_rows(pd.concat([rows, ctl]))
    rep_loop = accuracy.sanity_metrics(loop_a, loop_a)["rep3_rate"]
    a = m[(m["format"] == "loop") & (m["name"] == "a")].iloc[0]
    assert a["base_rep3_rate"] == pytest.approx(rep_loop) and a["rep3_rate"] == pytest.approx(rep_loop)
    assert (m[m["name"] != "a"]["base_rep3_rate"] == 0).all()
    v = accuracy.sanity_verdicts(pd.concat([rows, ctl]))
    assert not v.loc["loop", "sanity_pass"] and "vs bf16 engines 0% on 'b'" in v.loc["loop", "sanity_reason"]
    only_a = pd.concat([rows, ctl])
    only_a = only_a[(only_a["name"] == "a") & only_a["format"].isin(["bf16", "bf16-triton_attn", "loop"])]
    assert accuracy.sanity_table(only_a).loc["loop", "worst_extra_rep3"] == pytest.approx(0.0)


def test_one_chance_loop_is_not_a_corrupt_format_two_are():
    """A format that loops on one of three prompts only (what the exact-KV control itself does on some prompt) passes;
    looping on two fails, and the reason lists both prompts. With a single prompt, its loop fails."""
    rows = _sanity_rows()
    loop_out = rows[(rows["format"] == "loop")].set_index("name")["output_ids"]
    good = rows[rows["format"] == "good"].copy()
    once = good.assign(format="once")
    once.loc[once["name"] == "a", "output_ids"] = loop_out["a"]
    twice = good.assign(format="twice")
    twice.loc[twice["name"].isin(["a", "c"]), "output_ids"] = loop_out[["a", "c"]].values
    v = accuracy.sanity_verdicts(pd.concat([rows, once, twice]))
    assert v.loc["once", "loop_prompts"] == 1 and v.loc["once", "sanity_pass"]
    assert v.loc["once", "worst_extra_rep3"] > accuracy.SANITY_MAX_EXTRA_REP
    assert v.loc["twice", "loop_prompts"] == 2 and not v.loc["twice", "sanity_pass"]
    assert v.loc["twice", "sanity_reason"].startswith("loops on 2 of 3 prompts ('a', 'c'): up to ")
    single = pd.concat([rows, once])
    single = single[single["name"] == "a"]
    assert not accuracy.sanity_table(single).loc["once", "sanity_pass"]


def _cells(fmt, values, variant="single", engine="cpu"):
    """values: {(length, depth): [correct per key]} -> rows with distinct hashes per (variant, cell, key)."""
    return [dict(format=fmt, variant=variant, engine=engine, context_length=n, depth=d, key=str(10000 + i),
                 correct=c, prompt_sha256=f"{variant}-{n}-{d}-{i}")
            for (n, d), cs in values.items() for i, c in enumerate(cs)]


def test_target_check_judges_only_cells_where_bf16_is_at_least_95_percent():
    rows = (_cells("bf16", {(1024, 0.0): [1, 1], (1024, 1.0): [1, 0]})
            + _cells("k4v4", {(1024, 0.0): [1, 1], (1024, 1.0): [0, 0]})
            + _cells("k4v2", {(1024, 0.0): [1, 0], (1024, 1.0): [1, 1]})
            + _cells("bf16", {(1024, 0.0): [0, 0]}, "multi") + _cells("k4v4", {(1024, 0.0): [0, 0]}, "multi"))
    t = accuracy.target_check(pd.DataFrame(rows), min_variant_baseline=0.0)  # cell rule only
    assert t.loc[("k4v4", "single"), "meets"] and t.loc[("k4v4", "single"), "cells_judged"] == 1
    assert t.loc[("k4v4", "single"), "verdict"] == "MET"
    assert t.loc[("k4v2", "single"), "meets"] is False and t.loc[("k4v2", "single"), "cells_worse"] == ["1024/0.0"]
    assert t.loc[("k4v2", "single"), "verdict"] == "NOT MET" and t.loc[("k4v2", "single"), "accuracy"] == 0.75
    # nothing to judge: NOT JUDGED, never NOT MET (0/0)
    k = t.loc[("k4v4", "multi")]
    assert k["verdict"] == "NOT JUDGED" and k["meets"] is None and k["cells_judged"] == 0 and "no cell" in k["reason"]
    # the baseline is never judged against itself
    assert (t.loc["bf16", "verdict"] == "NOT JUDGED").all() and t.loc["bf16", "meets"].isna().all()
    assert accuracy.target_line(t) == ("multi: NOT JUDGED (no cell with bf16 >= 95%); single: MET (1/1 judged cells; "
                                       "prompts lost / gained vs bf16: 0 / 0)")
    assert accuracy.target_line(t, "k4v2") == ("single: NOT MET (0/1 judged cells, below bf16 at 1024/0.0; "
                                               "prompts lost / gained vs bf16: 1 / 0)")
    # default: bf16 at 75% over the single variant (< 90%): the comparison is noise, so not judged
    d = accuracy.target_check(pd.DataFrame(rows))
    assert d.loc[("k4v4", "single"), "verdict"] == "NOT JUDGED" and d.loc[("k4v4", "single"), "meets"] is None
    assert "bf16 75% < 90%" in d.loc[("k4v4", "single"), "reason"]
    assert "NOT MET" not in accuracy.target_line(d) and " MET" not in accuracy.target_line(d).replace("NOT JUDGED", "")


def test_engine_agreement_against_hand_values():
    cells = {(1024, 0.0): [1, 1, 1, 1], (2048, 0.0): [1, 1, 1, 1], (4096, 0.0): [0, 1, 0, 0]}
    cpu = pd.DataFrame(_cells("bf16", cells) + _cells("k4v4", cells))
    v_bf = {(1024, 0.0): [1, 1, 1, 1], (2048, 0.0): [1, 1, 1, 1], (4096, 0.0): [1, 0, 0, 1]}
    v_k4 = {(1024, 0.0): [1, 1, 1, 1], (2048, 0.0): [1, 1, 1, 0], (4096, 0.0): [0, 0, 1, 1]}  # one decided miss
    vllm = pd.DataFrame(_cells("bf16", v_bf, engine="vllm") + _cells("k4v4", v_k4, engine="vllm")
                        + _cells("k4v4", {(8184, 0.0): [0, 0]}, engine="vllm"))  # not shared: ignored
    t = accuracy.engine_agreement(vllm, cpu, min_variant_baseline=0.0)
    k = t.loc[("k4v4", "single")]
    assert k["shared_runs"] == 12 and k["accuracy_vllm"] == 9 / 12 and k["accuracy_cpu"] == 9 / 12
    assert k["run_agreement"] == 8 / 12  # 2048: 1 run differs; 4096: 3 differ
    assert k["judged_runs"] == 8 and k["judged_agreement"] == 7 / 8  # only 1K and 2K are decided (bf16 100%)
    assert not k["agree"] and (k["target_cpu"], k["target_vllm"]) == ("MET", "NOT MET")
    b = t.loc[("bf16", "single")]
    assert b["agree"] and b["judged_agreement"] == 1.0 and b["run_agreement"] == 9 / 12  # 4096 undecided
    assert b["target_cpu"] == b["target_vllm"] == "NOT JUDGED"  # the baseline itself
    # default: bf16 at 75% on both engines (< 90%): the target is not judged on either
    assert set(accuracy.engine_agreement(vllm, cpu).loc[("k4v4", "single"), ["target_cpu", "target_vllm"]]) \
        == {"NOT JUDGED"}
    with pytest.raises(ValueError, match="share no"):
        accuracy.engine_agreement(vllm.assign(prompt_sha256="x"), cpu)


def test_load_vllm_results_labels_replay(tmp_path):
    rows = pd.DataFrame(_cells("bf16", {(1024, 0.0): [1]}, engine="vllm")).assign(
        mode="bf16", gpu="NVIDIA H200", date="2026-11-30T01:02:03Z", vllm_version="0.20.2")
    rows.to_csv(tmp_path / "vllm_accuracy.csv", index=False)
    r = accuracy.load_vllm_results(str(tmp_path / "vllm_accuracy.csv"))
    assert r["label"] == f"replayed from {tmp_path / 'vllm_accuracy.csv'}, measured on NVIDIA H200 2026-11-30 01:02 UTC"
    assert r["sanity"] is None and len(r["rows"]) == 1
    rows.drop(columns=["gpu"]).to_csv(tmp_path / "bad.csv", index=False)
    with pytest.raises(ValueError, match="gpu"):
        accuracy.load_vllm_results(str(tmp_path / "bad.csv"))
    with pytest.raises(FileNotFoundError):
        accuracy.load_vllm_results(str(tmp_path / "none.csv"))


def test_notebook_replays_vllm_results_labelled_when_vllm_is_not_runnable(tmp_path):
    """engine="vllm" on a machine without GPU/vLLM: the committed vLLM results (here: a synthetic file in
    the committed format) and the committed CPU results are replayed, labelled, and compared."""
    import papermill
    from kvrepro.sweep import measurement_blockers

    if not measurement_blockers():
        pytest.skip("GPU and vLLM present: engine='vllm' would measure")
    cpu = pd.read_csv(ROOT / "results" / "accuracy" / "03_default.csv", dtype={"key": str})
    v = cpu[cpu["format"].isin(["bf16", "k4v4"])].assign(
        engine="vllm", mode=lambda d: d["format"].map({"bf16": "bf16", "k4v4": "kvrepro:k4v4"}), variant="single",
        gpu="NVIDIA H200", date="2026-11-30T01:00:00Z", vllm_version="0.20.2", torch_version="2.11.0",
        weights="gguf", compile="decode-graphs", answer_kind="target")
    miss = v.index[(v["format"] == "k4v4") & (v["context_length"] == 4096)][0]
    v.loc[miss, "correct"] = 0  # one k4v4 miss on vLLM: the target fails at that cell, engines disagree
    path = tmp_path / "vllm_accuracy.csv"
    v.to_csv(path, index=False)
    params = yaml.safe_load((ROOT / "notebooks" / "params" / "03_ci.yaml").read_text()) | dict(
        engine="vllm", vllm_results=str(path), sanity_tokens=0)
    out = tmp_path / "out.ipynb"
    papermill.execute_notebook(str(NB), str(out), kernel_name="python3", parameters=params, cwd=str(NB.parent),
                               progress_bar=False)
    text = out.read_text()
    assert "engine=&#x27;vllm&#x27; is not runnable here" in text or "engine='vllm' is not runnable here" in text
    assert f"replayed from {path}, measured on NVIDIA H200 2026-11-30 01:00 UTC" in text
    assert "replayed from results/accuracy/03_default.csv, measured on CPU" in text
    from kvrepro.formats import DEFAULT_PRESET

    assert "run_agreement" in text and "NOT MET" in text
    assert ("k4v4 target" in text) == (DEFAULT_PRESET == "k4v4")      # the target line is the default preset's
    # the provenance table lists the requested grid (512 tokens); the replayed rows' own grid is tabled too
    text = _outputs(out)
    assert "requested, not used" in text and "Grid of the replayed CPU rows" in text
    assert "Grid of the replayed vLLM rows" in text and "1024, 2048, 4096" in text
    assert "0/0 judged" not in text


def _run_ci_notebook(tmp_path, **over):
    import papermill
    params = yaml.safe_load((ROOT / "notebooks" / "params" / "03_ci.yaml").read_text()) | over
    out = tmp_path / "out.ipynb"
    papermill.execute_notebook(str(NB), str(out), kernel_name="python3", parameters=params, cwd=str(NB.parent),
                               progress_bar=False)
    return _outputs(out)


def _outputs(path):
    """What the executed notebook displayed (outputs only, not its source)."""
    import json

    parts = []
    for c in json.loads(path.read_text())["cells"]:
        for o in c.get("outputs", []):
            parts.append("".join(o.get("text", "")))
            for v in o.get("data", {}).values():
                parts.append("".join(v) if isinstance(v, (list, str)) else "")
    return "\n".join(parts)


def test_notebook_without_committed_vllm_results_says_so_once(tmp_path):
    from kvrepro.sweep import measurement_blockers

    if not measurement_blockers():
        pytest.skip("GPU and vLLM present: engine='vllm' would measure")
    text = _run_ci_notebook(tmp_path, engine="vllm", vllm_results=str(tmp_path / "none.csv"), sanity_tokens=0)
    assert "replayed** from committed results" not in text and "Every vLLM figure" not in text
    assert text.count("No vLLM results") == 1 and text.count(f"committed at `{tmp_path / 'none.csv'}`") == 1
    assert "Grid of the replayed CPU rows" in text


def test_notebook_refuses_to_overwrite_a_committed_result_before_running(tmp_path):
    import papermill
    before = (ROOT / "results" / "accuracy" / "03_default.csv").read_bytes()
    with pytest.raises(papermill.PapermillExecutionError, match="results_path 'results/accuracy/03_default.csv'"):
        _run_ci_notebook(tmp_path, results_path="results/accuracy/03_default.csv")
    assert (ROOT / "results" / "accuracy" / "03_default.csv").read_bytes() == before


def test_save_results_refuses_to_overwrite_another_grid(tmp_path):
    """A tiny run must not replace a committed measured result of another grid (its .json sidecar records
    the grid); the same grid (``make report`` run twice) or ``overwrite=True`` may replace it."""
    df = pd.DataFrame(_cells("bf16", {(1024, 0.0): [1]}))
    big = AccuracyParams(context_lengths=(1024, 2048), num_keys=2)
    path = str(tmp_path / "03_default.csv")
    accuracy.save_results(df, big, path, {"date_utc": "d1"})
    accuracy.save_results(df, big, path, {"date_utc": "d2"})  # same grid: a rerun replaces it
    tiny = AccuracyParams.from_dict(big.as_dict() | dict(formats=["bf16", "k4v4"], context_lengths=[512], num_keys=1))
    with pytest.raises(ValueError, match=r"results_path .*03_default.csv.* another grid .*context_lengths: "
                                         r"recorded \[1024, 2048\], this run \[512\].*overwrite: true"):
        accuracy.save_results(df.iloc[:0], tiny, path, {"date_utc": "d3"})
    with pytest.raises(ValueError, match="formats"):
        accuracy.check_overwrite(tiny, path)
    assert len(pd.read_csv(path)) == 1 and '"d2"' in open(path + ".json").read()  # untouched
    accuracy.save_results(df.iloc[:0], AccuracyParams.from_dict(tiny.as_dict() | dict(overwrite=True)), path, {})
    assert len(pd.read_csv(path)) == 0
    (tmp_path / "bare.csv").write_text("x\n1\n")  # no .json sidecar: provenance unknown, refused
    with pytest.raises(ValueError, match="bare.csv.*no readable"):
        accuracy.save_results(df, big, str(tmp_path / "bare.csv"), {})
    with pytest.raises(ValueError, match="overwrite"):
        AccuracyParams.from_dict(big.as_dict() | dict(overwrite="yes"))


def test_make_report_output_may_be_rewritten_after_a_grid_change(tmp_path, monkeypatch):
    """reports/ (make report's gitignored output, results_path of 03_default.yaml) is rewritten by every
    run, even when 03_default.yaml's grid changed since the last one; results/ stays protected."""
    monkeypatch.setattr(accuracy, "resolve_path", lambda p: str(tmp_path / p))
    default = yaml.safe_load((ROOT / "notebooks" / "params" / "03_default.yaml").read_text())
    assert default["results_path"].startswith("reports/")
    df = pd.DataFrame(_cells("bf16", {(1024, 0.0): [1]}))
    from kvrepro.accuracy_summary import notebook_params

    old = notebook_params(default | dict(num_keys=2))[0]
    new = notebook_params(default)[0]
    for p in (old, new, new):
        accuracy.save_results(df, p, default["results_path"], {})
    accuracy.save_results(df, old, "results/x.csv", {})
    with pytest.raises(ValueError, match="num_keys: recorded 2, this run 1"):
        accuracy.save_results(df, new, "results/x.csv", {})


def test_committed_default_results_are_protected_from_the_ci_grid():
    """The review's case: 03_ci.yaml with results_path = the committed results/accuracy/03_default.csv."""
    ci = yaml.safe_load((ROOT / "notebooks" / "params" / "03_ci.yaml").read_text())
    from kvrepro.accuracy_summary import notebook_params

    p = notebook_params(ci | dict(results_path="results/accuracy/03_default.csv"))[0]
    with pytest.raises(ValueError, match="results_path 'results/accuracy/03_default.csv'"):
        accuracy.check_overwrite(p, p.results_path)


def test_target_check_counts_paired_prompts_lost_and_gained_on_judged_cells():
    rows = (_cells("bf16", {(1024, 0.0): [1, 1, 1, 1], (2048, 0.0): [1, 1, 1, 1], (4096, 0.0): [0, 1, 0, 0]})
            + _cells("k4v4", {(1024, 0.0): [1, 0, 1, 1], (2048, 0.0): [1, 1, 1, 1], (4096, 0.0): [1, 1, 1, 1]}))
    t = accuracy.target_check(pd.DataFrame(rows), min_variant_baseline=0.0)
    k = t.loc[("k4v4", "single")]
    assert k["verdict"] == "NOT MET" and k["cells_judged"] == 2          # 4096 is not judged (bf16 25%)
    assert (k["prompts_lost"], k["prompts_gained"]) == (1, 0)            # 4096's gains are outside judged cells
    no_hash = accuracy.target_check(pd.DataFrame(rows).drop(columns="prompt_sha256"), min_variant_baseline=0.0)
    assert math.isnan(no_hash.loc[("k4v4", "single"), "prompts_lost"])


def test_format_order_and_replayed_grid_keep_formats_outside_format_names():
    """A vLLM control format (not a kvrepro KV format) sorts after the known ones and survives the replayed-grid
    summary and the categorical order 03 applies (it used to become NaN there)."""
    assert accuracy.format_order(["k4v4", "bf16-triton_attn", "bf16", "fp8", "a-control"]) == \
        ["bf16", "fp8", "k4v4", "a-control", "bf16-triton_attn"]
    df = pd.DataFrame(dict(variant="single", format=["bf16", "bf16-triton_attn", "k4v4"], context_length=1024,
                           depth=0.0, key=[1, 1, 1], correct=[1, 0, 1]))
    df["format"] = pd.Categorical(df["format"], categories=accuracy.format_order(df["format"]), ordered=True)
    assert not df["format"].isna().any()
    assert accuracy.replayed_grid(df).loc["single", "formats"] == "bf16, k4v4, bf16-triton_attn"
    t = accuracy.target_check(df)
    assert t.loc[("bf16-triton_attn", "single"), "verdict"] == "NOT MET"


def _pairs(fmt, n, lost=0, gained=0, base_right=None, variant="single", engine="vllm", prefix=""):
    """``n`` paired rows of ``fmt`` and their bf16 partners (rows of bf16 only once per prompt, by the caller):
    bf16 is right on the first ``base_right`` prompts (default all but ``gained``); the format loses the first
    ``lost`` of those and gains the last ``gained`` prompts (where bf16 is wrong)."""
    base_right = n - gained if base_right is None else base_right
    base = [1] * base_right + [0] * (n - base_right)
    mine = list(base)
    for i in range(lost):
        mine[i] = 0
    for i in range(n - gained, n):
        mine[i] = 1
    rows = [dict(format=fmt, variant=variant, engine=engine, correct=c, prompt_sha256=f"{prefix}{variant}-{i}",
                 context_length=1024, depth=0.0, key=str(10000 + i)) for i, c in enumerate(mine)]
    return rows, [dict(r, format="bf16", correct=c) for r, c in zip(rows, base)]


def _verdict_rows():
    """vLLM-like rows: 1,000 single-needle pairs (bf16 right on 990) and 400 multi-needle pairs (bf16 right on 200)."""
    rows = []
    k4v4, base = _pairs("k4v4", 1000, lost=1, base_right=990)
    rows += k4v4 + base
    rows += _pairs("k4v2", 1000, lost=12, gained=2, base_right=990)[0]
    rows += _pairs("fp8", 1000, base_right=990)[0]
    rows += _pairs("bf16-triton_attn", 1000, lost=2, gained=2, base_right=990)[0]
    for f in ("k4v4", "k4v2", "fp8", "bf16-triton_attn"):
        m, mb = _pairs(f, 400, lost=20, gained=20, base_right=200, variant="multi")
        rows += m + (mb if f == "k4v4" else [])
    df = pd.DataFrame(rows).sample(frac=1.0, random_state=0)        # order must not matter: pairs by prompt_sha256
    san = _sanity_rows().replace({"format": {"good": "k4v4", "loop": "k4v2", "stutter": "fp8"}})
    return df, san[san["format"].isin(["bf16", "k4v4", "k4v2", "fp8"])]   # no sanity rows for the control


def test_mode_verdicts_against_hand_counts():
    from kvrepro import stats

    df, san = _verdict_rows()
    t = accuracy.mode_verdicts(df, san)
    assert list(dict.fromkeys(t.index.get_level_values(0))) == ["bf16", "fp8", "k4v4", "k4v2", "bf16-triton_attn"]
    k = t.loc[("k4v4", "single")]
    assert (k["pairs"], k["lost"], k["gained"]) == (1000, 1, 0) and k["accuracy"] == 989 / 1000
    assert k["bound_pp"] == pytest.approx(100 * stats.noninferiority_bound(1, 0, 1000))
    # all discordant pairs are losses: the bound is the one on the discordant rate
    assert k["bound_pp"] == pytest.approx(100 * stats.clopper_pearson_upper(1, 1000, 0.025))
    assert k["loss_pp"] == pytest.approx(0.1) and k["retrieval"] == "NON-INFERIOR" and k["verdict"] == "NON-INFERIOR"
    assert k["text"] == f"NON-INFERIOR (bound {k['bound_pp']:.2f} pp <= 1 pp)"
    m = t.loc[("k4v4", "multi")]     # bf16 50%: near-chance answers flip, the data cannot decide
    assert (m["pairs"], m["lost"], m["gained"], m["verdict"]) == (400, 20, 20, "NOT JUDGED")
    assert m["reason"] == "bf16 50% < 90%: near-chance answers flip on any numerical difference"
    o = t.loc[("k4v4", "overall")]
    assert (o["pairs"], o["lost"], o["gained"], o["verdict"], o["sanity"]) == (1400, 21, 20, "NON-INFERIOR", "pass")
    assert o["bound_pp"] == k["bound_pp"] and o["reason"].startswith("single: lost 1, gained 0 of 1000: loss +0.10 pp")
    assert o["text"] == (f"NON-INFERIOR (single: bound {k['bound_pp']:.2f} pp <= 1 pp; multi: NOT JUDGED, bf16 50% "
                         "< 90%: near-chance answers flip on any numerical difference)")
    # k4v2: 12 lost, 2 gained -> INFERIOR by its bound; it also loops (sanity FAIL): FAIL decides, visibly
    r = t.loc[("k4v2", "single")]
    assert r["retrieval"] == "INFERIOR"
    assert r["bound_pp"] == pytest.approx(100 * stats.noninferiority_bound(12, 2, 1000))
    assert r["bound_pp"] > 1.0 and (t.loc["k4v2", "verdict"] == "FAIL").all()
    assert t.loc[("k4v2", "overall"), "text"] == ("FAIL: output sanity (loops on 3 of 3 prompts ('a', 'b', 'c'): up to "
                                                 "70% repeated 3-grams vs bf16 0% on 'a')")
    # fp8: retrieves as bf16 does (NON-INFERIOR) but stutters: FAIL with the rates that failed
    f = t.loc[("fp8", "overall")]
    assert f["retrieval"] == "NON-INFERIOR" and f["verdict"] == "FAIL" and f["sanity"] == "FAIL"
    assert f["text"] == (f"FAIL: output sanity ({12 / 31:.0%} adjacent duplicates vs bf16 0% on 'a'; "
                         f"loops on 3 of 3 prompts ('a', 'b', 'c'): up to {18 / 30:.0%} repeated 3-grams vs bf16 0% "
                         "on 'a')")
    # the control: balanced flips, NON-INFERIOR on retrieval, but no sanity rows -> NOT JUDGED overall, saying why
    c = t.loc[("bf16-triton_attn", "overall")]
    assert t.loc[("bf16-triton_attn", "single"), "verdict"] == "NON-INFERIOR"
    assert c["verdict"] == "NOT JUDGED" and c["reason"].startswith("no output-sanity rows; retrieval NON-INFERIOR")
    assert (t.loc["bf16", "verdict"] == "baseline").all()
    # few pairs: NOT JUDGED with the number needed; a prompt answered twice is refused
    few = accuracy.mode_verdicts(df[df["prompt_sha256"].isin([f"single-{i}" for i in range(100)])], san)
    assert few.loc[("k4v4", "single"), "reason"] == "100 pairs < 368 needed for a 1 pp margin"
    assert few.loc[("k4v4", "overall"), "verdict"] == "NOT JUDGED"
    with pytest.raises(ValueError, match="format k4v4: 1 prompts answered more than once"):
        accuracy.mode_verdicts(pd.concat([df, df[df["format"] == "k4v4"].iloc[:1]]))
    with pytest.raises(ValueError, match="no 'bf16' baseline"):
        accuracy.mode_verdicts(df[df["format"] != "bf16"])


def test_verdict_table_against_hand_values():
    """Per mode: bytes at head_dim 64, correct / runs per engine and variant, sanity, and each engine's overall
    verdict from mode_verdicts (the same function for both engines)."""
    vllm, san = _verdict_rows()
    cells = {(1024, 0.0): [1, 1], (2048, 0.0): [1, 1]}
    cpu = pd.DataFrame(_cells("bf16", cells) + _cells("k4v4", cells) + _cells("k4v2", {(1024, 0.0): [1, 1],
                                                                                       (2048, 0.0): [0, 1]}))
    t = accuracy.verdict_table(cpu, vllm, san, san)
    assert list(t.index) == ["bf16", "fp8", "k4v4", "k4v2", "bf16-triton_attn"]   # KV formats, then the control
    # 64-dim heads: bf16 2 x 64 x 2 B; k4v4 32 + 32 B of 4-bit codes + 4 B K scale/zero + 2 B V scale
    col = "B/token/head (head_dim 64)"
    assert t.loc["bf16", col] == 2 * 64 * 2 and t.loc["k4v4", col] == 32 + 32 + 4 + 2
    assert t.loc["bf16-triton_attn", col] == 2 * 64 * 2              # the control keeps bf16 KV
    assert t.loc["k4v2", "CPU single"] == f"{1 + 1 + 0 + 1}/4" and t.loc["k4v4", "vLLM single"] == "989/1000"
    assert t.loc["fp8", "CPU single"] == "" and t.loc["k4v4", "vLLM multi"] == "200/400"
    assert (t.loc["k4v4", "CPU sanity"], t.loc["k4v2", "CPU sanity"], t.loc["fp8", "vLLM sanity"]) == \
        ("pass", "FAIL", "FAIL")
    assert t.loc["bf16", "verdict"] == "baseline"
    mv = accuracy.mode_verdicts(vllm, san)
    assert t.loc["k4v4", "verdict"] == ("CPU: NOT JUDGED (single: NOT JUDGED, 4 pairs < 368 needed for a 1 pp "
                                        f"margin) · vLLM: {mv.loc[('k4v4', 'overall'), 'text']}")
    loops = "loops on 3 of 3 prompts ('a', 'b', 'c'): up to 70% repeated 3-grams vs bf16 0% on 'a'"
    assert t.loc["k4v2", "verdict"] == f"CPU: FAIL: output sanity ({loops}) · vLLM: FAIL: output sanity ({loops})"
    assert t.loc["fp8", "verdict"].startswith("vLLM: FAIL: output sanity (39% adjacent duplicates")


def test_save_results_writes_the_verdict(tmp_path):
    """With the run's sanity rows the CPU result files carry the verdict: a mode_verdict column and .verdict.csv."""
    df, san = _verdict_rows()
    p = AccuracyParams(formats=("bf16", "fp8", "k4v4", "k4v2"))
    out = accuracy.save_results(df[df["format"] != "bf16-triton_attn"], p, str(tmp_path / "r.csv"), {}, sanity=san)
    rows = pd.read_csv(out)
    v = pd.read_csv(out + ".verdict.csv")
    assert set(rows[rows["format"] == "k4v2"]["mode_verdict"]) == {"FAIL"}
    k4v2 = v.set_index(["format", "variant"]).loc[("k4v2", "overall")]
    assert k4v2["text"] == ("FAIL: output sanity (loops on 3 of 3 prompts ('a', 'b', 'c'): up to 70% repeated 3-grams "
                            "vs bf16 0% on 'a')")
    assert set(rows[rows["format"] == "bf16"]["mode_verdict"]) == {"baseline"}
    assert v.set_index(["format", "variant"]).loc[("k4v4", "overall"), "verdict"] == "NON-INFERIOR"
    assert len(pd.read_csv(out + ".sanity.csv")) == len(san)
    out2 = accuracy.save_results(df, p, str(tmp_path / "plain.csv"), {})     # no sanity: rows only, as before
    assert "mode_verdict" not in pd.read_csv(out2) and not (tmp_path / "plain.csv.verdict.csv").exists()


# ---------------------------------------------------------------- kvrepro.stats against independent references

def _tail_le(x, n, p):
    """P(X <= x), X ~ Binomial(n, p), exactly: rational arithmetic on math.comb (p taken as the exact float)."""
    from fractions import Fraction
    from math import comb

    P = Fraction(p)
    return sum(comb(n, k) * P ** k * (1 - P) ** (n - k) for k in range(x + 1))


@pytest.mark.parametrize("x,n", [(0, 1), (1, 1), (0, 10), (3, 10), (9, 10), (10, 10), (1, 368), (5, 1000),
                                 (20, 40), (37, 40), (2, 3)])
def test_clopper_pearson_against_exact_tail_sums(x, n):
    from kvrepro import stats

    for a in (0.05, 0.025):
        up, lo = stats.clopper_pearson_upper(x, n, a), stats.clopper_pearson_lower(x, n, a)
        if x == n:
            assert up == 1.0
        else:   # the smallest p whose lower tail is alpha: at the bound exactly alpha, just below it more
            assert float(_tail_le(x, n, up)) == pytest.approx(a, rel=1e-9)
            assert _tail_le(x, n, up - 1e-7) > a
        if x == 0:
            assert lo == 0.0
        else:   # the upper tail P(X >= x) at the lower bound
            assert float(1 - _tail_le(x - 1, n, lo)) == pytest.approx(a, rel=1e-9)
            assert 1 - _tail_le(x - 1, n, lo + 1e-7) > a
        assert lo <= x / n <= up
    for p in (0.001, 0.3, 0.97):
        assert stats.binom_cdf(x, n, p) == pytest.approx(float(_tail_le(x, n, p)), rel=1e-11, abs=1e-300)


def test_noninferiority_bound_covers_the_true_loss():
    """Exact coverage, by enumerating every outcome (b, c) of N = 40 pairs: the bound is >= the true loss
    p_b - p_c with probability >= 95% for each (p_b, p_c) tried, among them the case the plug-in bound
    (2 pi_U - 1) n / N misses (a mode that only loses)."""
    from fractions import Fraction
    from math import comb, factorial

    from kvrepro import stats

    N = 40
    bound = {(b, c): stats.noninferiority_bound(b, c, N) for b in range(N + 1) for c in range(N + 1 - b)}
    plug = {(b, c): (2 * stats.clopper_pearson_upper(b, b + c) - 1) * (b + c) / N if b + c else 0.0
            for b, c in bound}

    def coverage(pb, pc, bounds):
        pb, pc = Fraction(pb), Fraction(pc)
        total = Fraction(0)
        for (b, c), v in bounds.items():
            if v >= float(pb - pc) - 1e-12:
                total += (Fraction(factorial(N), factorial(b) * factorial(c) * factorial(N - b - c))
                          * pb ** b * pc ** c * (1 - pb - pc) ** (N - b - c))
        return float(total)

    for pb, pc in [("0.05", "0"), ("0.02", "0"), ("0.1", "0.02"), ("0.1", "0.1"), ("0.2", "0.05"), ("0", "0.1"),
                   ("0.3", "0.3")]:
        assert coverage(pb, pc, bound) >= 0.95, (pb, pc)
    assert coverage("0.05", "0", plug) < 0.9        # why the discordant rate is bounded, not plugged in
    assert sum(comb(N, k) for k in range(N + 1)) == 2 ** N   # the enumeration's own sanity


def test_mcnemar_noninferiority_hand_values():
    from math import comb

    from kvrepro import stats

    s = stats.mcnemar_noninferiority(0, 0, 1000)
    assert s["bound_pp"] == pytest.approx(100 * (1 - 0.025 ** (1 / 1000))) and s["non_inferior"] and s["p_worse"] == 1.0
    assert stats.min_pairs() == 368
    assert stats.mcnemar_noninferiority(0, 0, 368)["non_inferior"]
    assert not stats.mcnemar_noninferiority(0, 0, 367)["non_inferior"]
    assert stats.min_pairs(2.0, 0.1) == min(n for n in range(1, 1000) if 1 - 0.05 ** (1 / n) <= 0.02)
    s = stats.mcnemar_noninferiority(3, 1, 1000)
    assert (s["lost"], s["gained"], s["discordant"], s["loss_pp"]) == (3, 1, 4, pytest.approx(0.2))
    assert s["p_worse"] == pytest.approx(sum(comb(4, k) for k in (3, 4)) / 16)      # 5/16
    k = 2 * stats.clopper_pearson_upper(3, 4, 0.025) - 1
    assert s["bound_pp"] == pytest.approx(100 * k * stats.clopper_pearson_upper(4, 1000, 0.025))
    g = stats.mcnemar_noninferiority(0, 10, 1000)   # only gains: a negative bound, from the lower bound on d
    k = 2 * (1 - 0.025 ** (1 / 10)) - 1
    assert k < 0 and g["bound_pp"] == pytest.approx(100 * k * stats.clopper_pearson_lower(10, 1000, 0.025))
    assert stats.mcnemar_noninferiority(12, 2, 1000, margin_pp=5.0)["non_inferior"]
    for args, match in [((3, 1, 3), "pairs must be >= 1 and >= b \\+ c"), ((0, 0, 0), "pairs"), ((-1, 0, 5), "b must"),
                        ((1, 0, 5, 0), "margin_pp"), ((1, 0, 5, 1.0, 1.5), "alpha")]:
        with pytest.raises(ValueError, match=match):
            stats.mcnemar_noninferiority(*args)


@pytest.mark.filterwarnings("ignore:FigureCanvasAgg is non-interactive")
def test_heatmap_labels_do_not_overlap_on_the_vllm_grid():
    """5 context lengths x 7 depths x 6 formats (the committed vLLM grid): tick labels keep apart."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths, depths = [1024, 2048, 4096, 6144, 8184], [0.0, 0.17, 0.33, 0.5, 0.67, 0.83, 1.0]
    rows = [dict(format=f, context_length=n, depth=d, correct=1.0) for f in ("bf16", "fp8", "k4v4", "k8v4", "k4v2", "ctl")
            for n in lengths for d in depths]
    fig = accuracy.plot_heatmaps(pd.DataFrame(rows), "correct", "t", vmin=0, vmax=1)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    for ax in [a for a in fig.axes if a.get_visible()]:
        for labels in (ax.get_yticklabels(), ax.get_xticklabels()):
            boxes = [t.get_window_extent(renderer) for t in labels if t.get_text()]
            assert len(boxes) in (len(lengths), len(depths))
            assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    assert fig.get_figwidth() <= 14                                      # fits a 1400 px page at 100 dpi
    plt.close(fig)


def test_committed_vllm_results_are_found_compressed_from_any_working_directory(tmp_path, monkeypatch):
    """The vLLM needle run is committed as vllm_accuracy.csv.gz; the .csv path names it, from the repo root or from
    notebooks/ (papermill's cwd), and the rows equal the decompressed file's."""
    import gzip

    from kvrepro import accuracy_summary

    monkeypatch.chdir(ROOT / "notebooks")
    assert not (ROOT / accuracy.VLLM_RESULTS).exists() and (ROOT / (accuracy.VLLM_RESULTS + ".gz")).exists()
    r = accuracy.load_vllm_results(accuracy.VLLM_RESULTS)
    with gzip.open(ROOT / (accuracy.VLLM_RESULTS + ".gz"), "rt") as f:
        raw = pd.read_csv(f, dtype=str)
    assert len(r["rows"]) == len(raw) and list(r["rows"]["prompt_sha256"]) == list(raw["prompt_sha256"])
    assert r["label"].startswith(f"replayed from {accuracy.VLLM_RESULTS}.gz")
    src = accuracy_summary.needle_source(accuracy.VLLM_RESULTS)
    assert src.ok and src.path.endswith("vllm_accuracy.csv.gz")
    assert accuracy.existing(str(tmp_path / "none.csv")) == str(tmp_path / "none.csv")


@pytest.mark.filterwarnings("ignore:FigureCanvasAgg is non-interactive")
def test_a_centred_heatmap_keeps_tiny_differences_pale():
    """A centred scale fitted to a -0.003 nats difference would paint it at full saturation; the scale's half-range is
    at least min_range (the colour limits are +-0.1 nats, not +-0.003)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [dict(format=f, context_length=512, depth=0.5, d=v) for f, v in (("bf16", 0.0), ("k4v4", -0.003))]
    fig = accuracy.plot_heatmaps(pd.DataFrame(rows), "d", "t", cmap="RdBu", center=0.0)
    mesh = [c for ax in fig.axes for c in ax.collections if hasattr(c, "get_clim")][0]
    assert mesh.get_clim() == pytest.approx((-0.1, 0.1))
    plt.close(fig)
    fig = accuracy.plot_heatmaps(pd.DataFrame(rows), "d", "t", cmap="RdBu", center=0.0, min_range=1e-3)
    mesh = [c for ax in fig.axes for c in ax.collections if hasattr(c, "get_clim")][0]
    assert mesh.get_clim() == pytest.approx((-0.003, 0.003))
    plt.close(fig)
