"""kvrepro.accuracy_summary: notebook 03's answer table and the README's fidelity block, checked on small synthetic
result files against values computed here in plain Python (float64): KL and perplexity change per format, the ratio
to fp8, the goal's verdict, the closest preset to fp8 at >= 12 users, the needle bound, the key-bias verdict, and
"not measured yet" wherever a file is missing."""
import json
import math

import pandas as pd
import pytest

from kvrepro import accuracy_summary as acs
from kvrepro import stats
from kvrepro.capacity import users_that_fit
from kvrepro.formats import COMPRESSED_PRESETS, DEFAULT_PRESET, FORMAT_NAMES, get_format

PARAMS = {"block_size": 16, "corpus": "pd-books", "formats": list(FORMAT_NAMES), "num_windows": 2, "score_from": 2048,
          "top_k": 20, "window_tokens": 4096}
# per format: (KL per token, NLL per token); bf16's NLL per token is 3.0
PER_TOKEN = {"bf16": (0.0, 3.0), "fp8": (0.010, 3.012), "k8v4": (0.006, 3.006), "k4v4": (0.060, 3.09),
             "k4v2": (0.230, 3.3), "k5v4": (0.021, 3.010)}


def fidelity_rows(per_token=PER_TOKEN, engine="reference-cuda", gpu="NVIDIA H200", windows=2, scored=2048,
                  when="2026-12-01T12:00:00Z", vllm=False):
    prov = json.dumps({"gpu": gpu, "hostname": "h", "cpu_count": 16, "vllm_version": "0.20.2"})
    rows = []
    for w in range(windows):
        for f, (kl, nll) in per_token.items():
            rows.append({"format": f, "window": w, "scored": scored,
                         "kl_sum": float("nan") if vllm else kl * scored, "kl_topk_sum": 0.8 * kl * scored,
                         "topk_missing": 0, "top1_sum": int(scored * (1 - 2 * kl)), "nll_sum": nll * scored,
                         "ref_nll_sum": 3.0 * scored, "engine": "vllm" if vllm else engine, "params_key": "k1",
                         "params": json.dumps(PARAMS), "top_k": 20, "measured_utc": when, "provenance": prov})
    return pd.DataFrame(rows)


def ppl_change(f, per_token=PER_TOKEN):
    return 100.0 * (math.exp(per_token[f][1]) / math.exp(3.0) - 1.0)


def needle_rows(path, lost=None, pairs=400, sanity=True):
    """A vLLM needle file: every format answers ``pairs`` single-needle prompts; bf16 right on all, a format loses
    ``lost[f]`` of them."""
    lost = lost or {}
    rows = []
    for f in FORMAT_NAMES:
        for i in range(pairs):
            rows.append({"engine": "vllm", "mode": f, "format": f, "gpu": "NVIDIA H200", "vllm_version": "0.20.2",
                         "date": "2026-12-01T09:00:00Z", "variant": "single", "context_length": 1024, "depth": 0.5,
                         "key": str(10000 + i), "prompt_sha256": f"p{i}", "correct": int(i >= lost.get(f, 0)),
                         "n_tokens": 1024})
    pd.DataFrame(rows).to_csv(path / "vllm_accuracy.csv", index=False)
    if sanity:
        toks = " ".join(str(t) for t in range(40))
        pd.DataFrame([{"format": f, "name": n, "output_ids": toks} for f in FORMAT_NAMES for n in ("a", "b")]) \
            .to_csv(path / "vllm_sanity.csv", index=False)
    return path / "vllm_accuracy.csv"


def sources(tmp_path, per_token=PER_TOKEN, needle=True, lost=None, vllm=True):
    ref = tmp_path / "ref.csv"
    fidelity_rows(per_token).to_csv(ref, index=False)
    v = tmp_path / "v.csv"
    if vllm:
        fidelity_rows(per_token, vllm=True).to_csv(v, index=False)
    n = tmp_path / "needle"
    n.mkdir(exist_ok=True)
    npath = needle_rows(n, lost) if needle else n / "none.csv"
    return {"reference": [acs.fidelity_source(str(ref))], "vllm": acs.fidelity_source(str(v), kind="vllm"),
            "needle": acs.needle_source(str(npath))}


# ---------------------------------------------------------------- the table

def test_modes_come_from_the_registry_by_bytes():
    m = acs.modes()
    assert sorted(m) == sorted(FORMAT_NAMES)
    b = [get_format(f).bytes_per_token_per_head(128) for f in m]
    assert b == sorted(b, reverse=True) and m[0] == "bf16"


def test_rows_against_plain_python(tmp_path):
    rows = {r["format"]: r for r in acs.summary_rows(sources(tmp_path))}
    assert set(rows) == set(FORMAT_NAMES)
    for f, r in rows.items():
        assert r["bytes"] == get_format(f).bytes_per_token_per_head(128)
        assert r["users"] == users_that_fit(f, 131_072, 1_024)["users_fit"]
        assert r["kl"] == pytest.approx(PER_TOKEN[f][0], rel=1e-12, abs=1e-15)
        assert r["ppl_change_pct"] == pytest.approx(ppl_change(f), rel=1e-9, abs=1e-12)
        assert r["kl_topk_vllm"] == pytest.approx(0.8 * PER_TOKEN[f][0], rel=1e-12, abs=1e-15)
        if f not in ("bf16", "fp8"):
            assert r["kl_vs_fp8"] == pytest.approx(PER_TOKEN[f][0] / PER_TOKEN["fp8"][0], rel=1e-12)
            want = PER_TOKEN[f][0] <= PER_TOKEN["fp8"][0] and ppl_change(f) <= ppl_change("fp8")
            assert r["meets_fp8"] is want
    assert rows[DEFAULT_PRESET]["name"] == f"{DEFAULT_PRESET} (default)"
    assert rows["bf16"]["verdict"] == "baseline" and rows["fp8"]["verdict"] == "the bar"
    # k8v4 meets fp8's fidelity but serves fewer than 12 users; k4v4 misses both KL and perplexity
    assert rows["k8v4"]["meets_fp8"] and rows["k8v4"]["verdict"] == "NOT MET"
    assert rows["k8v4"]["verdict_why"] == f"{rows['k8v4']['users']} users < 12"
    assert rows["k4v4"]["verdict"] == "NOT MET"
    assert rows["k4v4"]["verdict_why"] == (f"KL {0.060 / 0.010:.2f}x fp8's; perplexity {ppl_change('k4v4'):+.2f}% > "
                                           f"fp8's {ppl_change('fp8'):+.2f}%")


def test_needle_bound_is_the_exact_mcnemar_bound(tmp_path):
    lost = {"k4v4": 3, "k4v2": 40}
    rows = {r["format"]: r for r in acs.summary_rows(sources(tmp_path, lost=lost))}
    for f in ("fp8", "k4v4", "k4v2"):
        want = stats.mcnemar_noninferiority(lost.get(f, 0), 0, 400)
        assert rows[f]["single_bound"] == pytest.approx(want["bound_pp"], rel=1e-12)
        assert rows[f]["needle"] == ("NON-INFERIOR" if want["non_inferior"] else "INFERIOR")
        assert rows[f]["sanity"] == "pass"
    assert rows["k4v2"]["verdict"] == "NOT MET" and "needle INFERIOR" in rows["k4v2"]["verdict_why"]


def test_a_preset_that_meets_fp8_at_12_users_meets_the_goal(tmp_path):
    per = dict(PER_TOKEN, k5v4=(0.009, 3.008))          # below fp8's KL (0.010) and perplexity change
    assert users_that_fit("k5v4", 131_072, 1_024)["users_fit"] >= acs.GOAL_USERS
    src = sources(tmp_path, per)
    rows = acs.summary_rows(src)
    by = {r["format"]: r for r in rows}
    assert by["k5v4"]["meets_fp8"] and by["k5v4"]["needle"] == "NON-INFERIOR" and by["k5v4"]["verdict"] == "MET"
    text = acs.closest_to_fp8(rows)
    assert text.startswith("**Closest to fp8's fidelity at >= 12 users: k5v4 (default) (12 users): KL 0.009 = "
                           "0.90x fp8's")
    assert "it **meets** the goal" in text


def test_closest_sentence_follows_the_data(tmp_path):
    rows = acs.summary_rows(sources(tmp_path))
    text = acs.closest_to_fp8(rows)
    # at >= 12 users: k5v4 (0.021), k4v4 (0.060), k4v2 (0.230); k5v4 is the lowest KL relative to fp8
    assert text.startswith(f"**Closest to fp8's fidelity at >= 12 users: k5v4 (default) (12 users): KL 0.021 = "
                           f"{0.021 / 0.010:.2f}x fp8's, perplexity {ppl_change('k5v4'):+.2f}%**")
    assert "does **not** meet the goal" in text
    assert f"k4v4 (13 users): KL 0.06 = {0.060 / 0.010:.2f}x fp8's" in text
    assert "k4v2 (17 users)" in text and "Below 12 users: k8v4 (8 users)" in text
    # another data set, another answer: k4v4 closer than k5v4
    tmp2 = tmp_path / "b"
    tmp2.mkdir()
    rows2 = acs.summary_rows(sources(tmp2, dict(PER_TOKEN, k4v4=(0.015, 3.008))))
    assert acs.closest_to_fp8(rows2).startswith("**Closest to fp8's fidelity at >= 12 users: k4v4 (13 users)")


def test_missing_files_say_not_measured_yet(tmp_path):
    src = {"reference": [acs.fidelity_source(str(tmp_path / "none.csv"))],
           "vllm": acs.fidelity_source(str(tmp_path / "none2.csv"), kind="vllm"),
           "needle": acs.needle_source(str(tmp_path / "none3.csv"))}
    rows = acs.summary_rows(src)
    t = acs.display_table(rows)
    assert len(t) == len(FORMAT_NAMES)
    assert (t["KL vs bf16, full vocab (nats/token)"] == acs.NOT_MEASURED).all()
    assert (t["KL top-20, vLLM"] == acs.NOT_MEASURED).all()
    assert "not measured yet: no" in acs.legend(src)
    assert "is not known" in acs.closest_to_fp8(rows)
    text = acs.readme_text(src)
    assert text.count(acs.NOT_MEASURED) >= 3 * len(COMPRESSED_PRESETS)
    assert "| bf16 |" not in text                                  # fp8 and the presets only


def test_each_row_uses_a_source_that_measured_it_with_fp8(tmp_path):
    """A format missing from the preferred source comes from the next one (its tag says so), never mixed with
    another source's fp8."""
    no_k5 = {f: v for f, v in PER_TOKEN.items() if f != "k5v4"}
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    fidelity_rows(no_k5).to_csv(a, index=False)
    other = dict(PER_TOKEN, fp8=(0.020, 3.02))
    fidelity_rows(other, engine="reference-cpu", gpu="none").to_csv(b, index=False)
    src = {"reference": [acs.fidelity_source(str(a)), acs.fidelity_source(str(b))]}
    rows = {r["format"]: r for r in acs.summary_rows(src)}
    assert rows["k4v4"]["ref_tag"] == 1 and rows["k5v4"]["ref_tag"] == 2
    assert rows["k5v4"]["kl_vs_fp8"] == pytest.approx(0.021 / 0.020)
    assert "CPU (h, 16 cores)" in src["reference"][1].label()
    assert "NVIDIA H200" in src["reference"][0].short() and "replayed" in src["reference"][0].short()


def test_source_label_names_engine_machine_date_and_size(tmp_path):
    p = tmp_path / "r.csv"
    fidelity_rows().to_csv(p, index=False)
    s = acs.fidelity_source(str(p))
    assert s.label().startswith("replayed: reference path (float32), NVIDIA H200, 2026-12-01 12:00 UTC; 2 windows x "
                                "2,048 scored tokens (4,096 tokens)")
    live = acs.fidelity_source("", rows=fidelity_rows(engine="reference-cpu", gpu="none"), measured_now=True)
    assert live.short().startswith("measured now: reference path, CPU (h, 16 cores)")
    v = tmp_path / "v.csv"
    fidelity_rows(vllm=True).to_csv(v, index=False)
    assert acs.fidelity_source(str(v)).engine == "vLLM 0.20.2, top-20 log-probs"


# ---------------------------------------------------------------- chart, key bias, parameters

@pytest.mark.filterwarnings("ignore:FigureCanvasAgg is non-interactive")
def test_users_vs_kl_chart(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    src = sources(tmp_path)
    fig = acs.plot_users_vs_kl([("ref", src["reference"][0], "kl"), ("vllm", src["vllm"], "kl_topk")])
    assert len(fig.axes) == 2
    ax = fig.axes[0]
    from matplotlib.collections import PathCollection

    dots = [c for c in ax.collections if isinstance(c, PathCollection)]
    pts = {c.get_label(): tuple(c.get_offsets()[0]) for c in dots}
    assert set(pts) == {acs.display_name(f) for f in FORMAT_NAMES if f != "bf16"}
    assert pts["fp8"] == (users_that_fit("fp8", 131_072, 1_024)["users_fit"], pytest.approx(0.010))
    assert "users that fit" in ax.get_xlabel() and "KL" in ax.get_ylabel()
    assert any(ln.get_xdata()[0] == acs.GOAL_USERS for ln in ax.get_lines())      # the 12-user line
    assert len({c.get_paths()[0].vertices.tobytes() for c in dots}) == len(dots)     # one marker per format
    assert len({tuple(c.get_facecolor()[0]) for c in dots}) == len(dots)             # one colour per format
    plt.close(fig)


def test_keybias_verdicts():
    def case(fmt, shape, placement, norm, ratio):
        return {"format": fmt, "shape": shape, "supported": True, "placement": placement, "bias_norm": norm,
                "ratio": ratio}

    t = pd.DataFrame([case("a", "(1, 1, 128)", "high", 300.0, 1.2), case("a", "(2, 1, 128)", "high", 300.0, 1.4),
                      case("b", "(1, 1, 128)", "low", 600.0, 6.0),
                      {"format": "b", "shape": "(1, 1, 80)", "supported": False, "note": "head_dim=80 is not supported"}])
    v = acs.keybias_verdicts(t).set_index("format")
    assert v.loc["a", "verdict"] == "met" and v.loc["a", "worst ratio"] == 1.4
    assert v.loc["b", "verdict"] == "NOT MET" and v.loc["b", "times the bar"] == pytest.approx(4.0)
    assert "1 shape(s) refused" in v.loc["b", "detail"]
    s = acs.keybias_summary(t)
    assert s.loc[s["format"] == "a", "shapes meeting"].item() == "2/2"
    assert s.loc[s["format"] == "b", "refused shapes"].item() == "(1, 1, 80)"


def test_notebook_parameters_checked():
    assert acs.resolve_formats("all") == list(FORMAT_NAMES)
    with pytest.raises(ValueError, match="formats must be 'all' or a list"):
        acs.resolve_formats("bf16")
    assert acs.live_fidelity_params(["bf16"], 0, 1024, 512) is None
    p = acs.live_fidelity_params(list(FORMAT_NAMES), 2, 1024, 512)
    assert p.scored_tokens == 1024
    with pytest.raises(ValueError, match="fidelity_windows must be a non-negative integer"):
        acs.live_fidelity_params(["bf16"], -1, 1024, 512)
    with pytest.raises(ValueError, match=r"fidelity_score_from must be an integer in \[1, fidelity_window_tokens"):
        acs.live_fidelity_params(["bf16"], 1, 1024, 1024)
    with pytest.raises(ValueError, match="keybias_tokens must be an integer"):
        acs.check_keybias_tokens(8)


def test_cpu_sanity_shown_beside_the_needle_runs(tmp_path):
    ok = " ".join(str(t) for t in range(40))
    loop = " ".join(["5", "6", "7"] * 13)
    cpu = pd.DataFrame([{"format": f, "name": n, "output_ids": loop if f == "k4v4" else ok}
                        for f in ("bf16", "fp8", "k4v4") for n in ("a", "b")])
    rows = {r["format"]: r for r in acs.summary_rows(sources(tmp_path), cpu_sanity=cpu)}
    assert rows["k4v4"]["cpu_sanity"] == "FAIL" and rows["fp8"]["cpu_sanity"] == "pass"
    assert rows["k4v2"]["cpu_sanity"] == "" and rows["k4v4"]["sanity"] == "pass"      # the verdict's: the needle run's
    t = acs.display_table(list(rows.values())).set_index("mode")
    assert t.loc[acs.display_name("k4v4"), "output sanity"] == "pass; CPU FAIL"


def test_notebook_params_split_and_default():
    grid = {"formats": "all", "context_lengths": [1024], "depths": [0.5], "variants": ["single"]}
    p, fid, kb = acs.notebook_params(grid)
    assert p.formats == tuple(FORMAT_NAMES) and fid.formats == tuple(FORMAT_NAMES)
    assert (fid.num_windows, fid.window_tokens, fid.score_from) == (2, 1024, 512)
    assert kb == {"results": acs.KEYBIAS, "tokens": 2048}
    assert acs.notebook_params(grid | {"fidelity_windows": 0})[1] is None
    with pytest.raises(ValueError, match="unknown parameter"):
        acs.notebook_params(grid | {"fidelity_window": 3})
    with pytest.raises(ValueError, match="keybias_results must be a path"):
        acs.notebook_params(grid | {"keybias_results": 3})


def test_ratio_to_fp8_on_the_windows_both_measured(tmp_path):
    """A file with more windows of some formats: each format is compared with fp8 on the windows bf16, fp8 and it
    all measured; a near tie is printed with the decimals that tell it apart."""
    rows = fidelity_rows(windows=3)
    extra = fidelity_rows({"bf16": (0.0, 3.0), "fp8": (0.050, 3.05)}, windows=5)   # fp8 worse on windows 3-4
    extra = extra[extra["window"] >= 3]
    p = tmp_path / "r.csv"
    pd.concat([rows, extra]).to_csv(p, index=False)
    src = acs.fidelity_source(str(p))
    assert "3-5 windows" in src.label()
    x = acs.vs_fp8(src, "k4v4")
    assert x["windows"] == 3 and x["fp8_kl"] == pytest.approx(0.010) and x["kl_vs_fp8"] == pytest.approx(6.0)
    tie = {"kl": 0.0100001, "fp8_kl": 0.01, "kl_vs_fp8": 1.00001, "ppl_change_pct": 2.2831, "fp8_ppl_change_pct": 2.2829}
    assert acs._short_of(tie) == ["KL 1.00001x fp8's", "perplexity +2.2831% > fp8's +2.2829%"]


def test_the_default_offsets_reference_is_preferred_and_other_sources_are_named(tmp_path):
    """Two reference files: an older one with another key offset measuring every preset, and one with the default
    offset lacking k4v2. The default's comes first (tag 1) whatever the given order; the table takes each row from
    it where it measured the row, k4v2's KL cell names its other source, and the closest-to-fp8 sentence uses the
    default's source only (k4v2 'not measured in [1]')."""
    from kvrepro.formats import get_format

    default_offset = get_format(DEFAULT_PRESET).default_key_offset
    other = tmp_path / "other.csv"
    fidelity_rows().assign(params=json.dumps(dict(PARAMS, key_offset="first-prefill"))).to_csv(other, index=False)
    mine = tmp_path / "mine.csv"
    per = {f: v for f, v in PER_TOKEN.items() if f != "k4v2"}
    per["k5v4"] = (0.012, PER_TOKEN["k5v4"][1])
    fidelity_rows(per).assign(params=json.dumps(dict(PARAMS, key_offset=default_offset))).to_csv(mine, index=False)
    refs = acs.by_default_offset([acs.fidelity_source(str(other)), acs.fidelity_source(str(mine))])
    assert [acs.key_offset_of(s) for s in refs] == [default_offset, "first-prefill"]
    rows = {r["format"]: r for r in acs.summary_rows({"reference": refs})}
    assert rows["k5v4"]["kl"] == pytest.approx(0.012) and rows["k5v4"]["ref_tag"] == 1
    assert rows["k4v2"]["kl"] == pytest.approx(PER_TOKEN["k4v2"][0]) and rows["k4v2"]["ref_tag"] == 2
    assert acs._kl_cell(rows["k4v2"]).endswith("[2]") and "[" not in acs._kl_cell(rows["k5v4"])
    text = acs.closest_to_fp8(list(rows.values()))
    assert "KL 0.012 = 1.20x fp8's" in text and "k4v2 (17 users): not measured in [1]" in text
    assert text.endswith("(All figures of this sentence from source [1].)")


def test_a_bound_of_a_variant_not_judged_says_so():
    r = dict(format="k4v4", single_bound=1.1, multi_bound=5.94, single_judged=True, multi_judged=False,
             needle="INFERIOR")
    assert acs._bounds(r) == "1.10 / 5.94 (not judged)"
    assert acs._bounds(dict(r, multi_judged=True)) == "1.10 / 5.94"
    # figures from two runs: each names its own, the judgement note before the mark
    assert acs._bounds(dict(r, needle_tag=4, multi_tag=5)) == "1.10 [4] / 5.94 (not judged) [5]"
    # one run for both, that is not most rows' one: both marked, as neither figure is from the common run
    assert acs._bounds(dict(r, needle_tag=5, needle_tag_shown=True)) == "1.10 [5] / 5.94 (not judged) [5]"
    assert acs._bounds(dict(r, needle_tag=4, multi_bound=None)) == "1.10 / –"


def test_needle_figures_come_from_the_default_offsets_run_first(tmp_path):
    """Two needle runs: the one whose compressed presets ran with the default key offset decides each format it
    has (k5v4 loses 30 of 400 there, NOT NON-INFERIOR); the other (losing nothing) only fills in formats the first
    lacks, and the rows name that run in their bound cell."""
    want = get_format(DEFAULT_PRESET).default_key_offset
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    for path, ko, lost in ((first, "slow-pairs" if want != "slow-pairs" else "off", {}),
                           (second, want, {"k5v4": 30})):
        p = needle_rows(path, lost)
        d = pd.read_csv(p)
        d["kvrepro_settings"] = [json.dumps({"key_offset": ko}) if f in COMPRESSED_PRESETS else None
                                 for f in d["format"]]
        if path == second:
            d = d[d["format"] != "k8v4"]
        d.to_csv(p, index=False)
    src = sources(tmp_path)
    src["needle"] = acs.needle_sources(str(first / "vllm_accuracy.csv"), str(second / "vllm_accuracy.csv"))
    assert [s.key_offset for s in src["needle"]][0] == want                  # preferred first, whatever the order
    rows = {r["format"]: r for r in acs.summary_rows(src)}
    pref, other = src["needle"][0].tag, src["needle"][1].tag
    assert rows["k5v4"]["needle"] == "INFERIOR" and rows["k5v4"]["needle_tag"] == pref
    assert rows["k8v4"]["needle"] == "NON-INFERIOR" and rows["k8v4"]["needle_tag"] == other
    assert rows["k8v4"]["needle_tag_shown"] and not rows["k5v4"]["needle_tag_shown"]
    none_lost = stats.mcnemar_noninferiority(0, 0, 400)["bound_pp"]
    assert acs._bounds(rows["k8v4"]) == f"{none_lost:.2f} [{other}] / –"     # its figure names its run
    assert acs._bounds(rows["k5v4"]) == f"{stats.mcnemar_noninferiority(30, 0, 400)['bound_pp']:.2f} / –"
    assert f"[{other}] needle bounds and verdicts, output sanity of the formats" in acs.legend(src)


def test_multi_needle_bound_comes_from_the_run_that_has_multi_needle_prompts(tmp_path):
    """The preferred run (default key offset) has single-needle prompts only; the other run adds multi-needle ones
    (k4v4 loses 12 of 400 there, bf16 right on all): each row takes its single-needle figures from the first and
    its multi-needle bound from the second, the cell and the sources column name the second run."""
    want = get_format(DEFAULT_PRESET).default_key_offset
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    for path, ko in ((first, want), (second, "slow-pairs" if want != "slow-pairs" else "off")):
        p = needle_rows(path)
        d = pd.read_csv(p)
        if path == second:
            multi = d.assign(variant="multi", prompt_sha256="m" + d["prompt_sha256"])
            multi.loc[multi["format"] == "k4v4", "correct"] = [int(i >= 12) for i in range(400)]
            d = pd.concat([d, multi], ignore_index=True)
        d["kvrepro_settings"] = [json.dumps({"key_offset": ko}) if f in COMPRESSED_PRESETS else None
                                 for f in d["format"]]
        d.to_csv(p, index=False)
    src = sources(tmp_path)
    src["needle"] = acs.needle_sources(str(second / "vllm_accuracy.csv"), str(first / "vllm_accuracy.csv"))
    rows = {r["format"]: r for r in acs.summary_rows(src)}
    pref, other = src["needle"][0].tag, src["needle"][1].tag
    assert src["needle"][0].key_offset == want
    k4 = rows["k4v4"]
    assert k4["needle_tag"] == pref and k4["multi_tag"] == other
    assert k4["single_bound"] == pytest.approx(stats.mcnemar_noninferiority(0, 0, 400)["bound_pp"], rel=1e-12)
    assert k4["multi_bound"] == pytest.approx(stats.mcnemar_noninferiority(12, 0, 400)["bound_pp"], rel=1e-12)
    # each figure carries its own run's mark: a single mark at the end could belong to either
    single, multi = k4["single_bound"], k4["multi_bound"]
    assert acs._bounds(k4) == f"{single:.2f} [{pref}] / {multi:.2f} [{other}]"
    assert f"[{pref}]" in k4["sources"].split() and f"[{other}]" in k4["sources"].split()
    assert rows["k8v4"]["multi_bound"] == pytest.approx(stats.mcnemar_noninferiority(0, 0, 400)["bound_pp"])
    assert f"[{other}] needle bounds and verdicts, output sanity of the formats or needle variants" in acs.legend(src)
