"""kvrepro.accuracy: parameter validation (fail fast, naming the parameter), the per-format
summary against hand-computed values, a tiny real run of SmolLM2 in two formats, and notebook 03's
parameters (field-faults row 12)."""
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
    """One literal-only `parameters` cell declaring exactly AccuracyParams' fields; params files valid."""
    from kvrepro import provenance

    names = provenance.parameters_cell_names(NB)
    assert sorted(names) == sorted(AccuracyParams().as_dict())
    for f in sorted((ROOT / "notebooks" / "params").glob("03_*.yaml")):
        d = yaml.safe_load(f.read_text())
        provenance.check_parameters(NB, d)
        AccuracyParams.from_dict(d)


def test_notebook_bad_parameter_fails_naming_it(tmp_path):
    papermill = pytest.importorskip("papermill")
    with pytest.raises(papermill.PapermillExecutionError, match="int3"):
        papermill.execute_notebook(str(NB), str(tmp_path / "out.ipynb"), kernel_name="python3",
                                   parameters=dict(formats=["bf16", "int3"]), cwd=str(NB.parent),
                                   progress_bar=False)
