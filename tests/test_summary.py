"""kvrepro.summary: the README's results block is what the committed results give, and the selection of one
current run per mode, its max clean capacity and its ratios, checked on small synthetic rows against values
computed here in plain Python (float64)."""
import json
from pathlib import Path

import pandas as pd
import pytest

from kvrepro import replay, summary

ROOT = Path(__file__).resolve().parents[1]


def row(mode, users, tok_s, *, date, run_id="r1", clean=True, preemptions=0, **kw):
    r = {"mode": mode, "kv_cache_dtype": "auto", "num_users": users, "clean": clean, "preemptions": preemptions,
         "aggregate_decode_tok_s": tok_s, "ttft_s_mean": 1.0, "ttft_s_max": 2.0, "tpot_ms_mean": 20.0,
         "kv_cache_tokens": 1_000_000, "users_fit_arithmetic": 8, "prompt_tokens": 131_072, "decode_tokens": 1_024,
         "gpu": "NVIDIA H200", "gpu_memory_gb": 80.0, "gpu_memory_utilization": 0.515, "vllm_version": "0.20.2",
         "torch_version": "2.11.0", "kvrepro_version": "0.1.0", "model": "Qwen/Qwen3-4B-Instruct-2507",
         "load_format": "dummy", "date": date, "run_id": run_id, "measured": True}
    r.update(kw)
    return r


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sweep(mode, points, date, **kw):
    """Rows of one engine run: points = [(users, tok/s or None, clean)], dated one second apart from ``date``."""
    base = pd.Timestamp(date)
    return [row(mode, u, t, clean=c, date=(base + pd.Timedelta(seconds=i)).isoformat(), **kw)
            for i, (u, t, c) in enumerate(points)]


FP8 = [(6, 160.0, True), (5, 250.0, True), (4, 240.0, True), (3, 210.0, True), (7, None, False)]
BF16 = [(3, 170.0, True), (2, 150.0, True), (1, 120.0, True)]


def load(tmp_path):
    return replay.load_results(tmp_path)


# ---------------------------------------------------------------- the README agrees with the results

def test_readme_block_is_generated_from_the_committed_results():
    """README.md's results block is exactly what the committed result files give (run `make summary` /
    `python -m kvrepro.summary --write` after changing results)."""
    text = (ROOT / summary.README).read_text(encoding="utf-8")
    assert summary.current_block(text) == summary.readme_block(), \
        "README.md's results block differs from the results: run python -m kvrepro.summary --write"


def test_readme_settings_table_is_generated_from_the_declarations():
    """README.md's settings table is exactly kvrepro.settings' declarations (one source for names and defaults)."""
    text = (ROOT / summary.README).read_text(encoding="utf-8")
    block = summary.current_block(text, summary.README, summary.SETTINGS_BEGIN, summary.SETTINGS_END)
    assert block == summary.settings_block(), "README.md's settings table differs: run python -m kvrepro.summary --write"
    from kvrepro import settings
    for d in settings.SETTINGS:
        assert f"| `{d.env}` |" in block


def test_capacity_index_is_generated_from_the_committed_results():
    assert (ROOT / summary.CAPACITY_INDEX).read_text(encoding="utf-8") == summary.capacity_index(summary.load_capacity())


def test_committed_block_names_every_mode_once_and_the_seed():
    block = summary.readme_block()
    table = [ln for ln in block.splitlines() if ln.startswith("| ")][1:]
    names = [ln.split("|")[1].strip().strip("*") for ln in table[1:]]
    assert names == [d for _, d, _ in summary.MODES]
    row = {ln.split("|")[1].strip().strip("*"): ln for ln in table[1:]}
    assert "2 (66.6 tok/s)" in row["bf16"] and "5 (105.0)" in row["fp8"]
    assert "6 (140.9)" in row[summary.DISPLAY[summary.CAPACITY_PRESET]]
    assert "![" in block and summary.CHART in block and "not kvrepro's" in block


# ---------------------------------------------------------------- selection on synthetic rows

def test_newest_engine_run_per_mode_wins_across_files(tmp_path):
    write(tmp_path / "a.jsonl", sweep("fp8", FP8, "2026-11-30T09:00:00+00:00", run_id="a")
          + sweep("kvrepro:k4v4", [(13, 500.0, True), (12, 490.0, True)], "2026-11-30T09:10:00+00:00", run_id="a"))
    write(tmp_path / "b.jsonl", sweep("kvrepro:k4v4", [(13, 540.0, True), (14, None, False)],
                                      "2026-11-30T18:00:00+00:00", run_id="b"))
    write(tmp_path / "c.jsonl", sweep("kvrepro:k4v4", [(13, 999.0, True)], "2026-11-30T12:00:00+00:00", run_id="c"))
    runs = summary.select_current(load(tmp_path), ["fp8", "kvrepro:k4v4"])
    assert Path(runs["kvrepro:k4v4"]["source_file"].iloc[0]).name == "b.jsonl"      # 18:00 beats 09:10 and 12:00
    assert Path(runs["fp8"]["source_file"].iloc[0]).name == "a.jsonl"
    assert sorted(runs["kvrepro:k4v4"]["num_users"]) == [13, 14]                    # only that run's rows


def test_accept_takes_the_newest_run_it_accepts(tmp_path):
    """select_current(accept=...): runs newest first, the first one the predicate accepts; none accepted, no entry."""
    write(tmp_path / "a.jsonl", sweep("fp8", FP8, "2026-11-30T09:00:00+00:00", run_id="a")
          + sweep("fp8", [(6, 150.0, True)], "2026-11-30T10:00:00+00:00", run_id="b")
          + sweep("fp8", [(6, 170.0, True)], "2026-11-30T11:00:00+00:00", run_id="c"))
    df = load(tmp_path)
    assert summary.select_current(df, ["fp8"])["fp8"]["run_id"].iloc[0] == "c"
    cheap = summary.select_current(df, ["fp8"], accept=lambda r: float(r["aggregate_decode_tok_s"].max()) < 165)
    assert cheap["fp8"]["run_id"].iloc[0] == "b"                                    # c refused, b is the next newest
    many = summary.select_current(df, ["fp8"], accept=lambda r: len(r) > 1)
    assert list(many["fp8"]["num_users"]) == [3, 4, 5, 6, 7]                       # sorted rows of run a
    assert summary.select_current(df, ["fp8"], accept=lambda r: False) == {}


def test_engine_run_id_splits_runs_within_one_file(tmp_path):
    old = sweep("kvrepro:k4v4", [(13, 500.0, True)], "2026-11-30T09:00:00+00:00", engine_run_id="e1")
    new = sweep("kvrepro:k4v4", [(12, 520.0, True), (13, None, False)], "2026-11-30T10:00:00+00:00",
                engine_run_id="e2")
    write(tmp_path / "a.jsonl", old + new)
    runs = summary.select_current(load(tmp_path), ["kvrepro:k4v4"])
    assert set(runs["kvrepro:k4v4"]["engine_run_id"]) == {"e2"}
    assert summary.max_clean(runs["kvrepro:k4v4"]) == (12, 520.0)                   # 13 was not clean in e2
    keys = replay.run_keys(load(tmp_path))
    assert len(set(keys)) == 2


def test_rows_without_engine_run_id_group_by_file_run_and_mode(tmp_path):
    write(tmp_path / "a.jsonl", sweep("fp8", FP8, "2026-11-30T09:00:00+00:00", run_id="x")
          + sweep("bf16", BF16, "2026-11-30T09:05:00+00:00", run_id="x"))
    runs = summary.engine_runs(load(tmp_path))
    assert sorted(runs["mode"]) == ["bf16", "fp8"] and list(runs["rows"].sort_values()) == [3, 5]


def test_sizing_only_runs_and_other_workloads_are_not_current(tmp_path):
    write(tmp_path / "a.jsonl", sweep("fp8", FP8, "2026-11-30T09:00:00+00:00"))
    write(tmp_path / "b.jsonl", [row("fp8", 0, None, date="2026-12-01T00:00:00+00:00", measured_by="sizing",
                                     run_id="s")]
          + sweep("fp8", [(2, 99.0, True)], "2026-12-02T00:00:00+00:00", run_id="w", gpu_memory_gb=40.0))
    runs = summary.select_current(load(tmp_path), ["fp8"])
    assert Path(runs["fp8"]["source_file"].iloc[0]).name == "a.jsonl"
    anywhere = summary.select_current(load(tmp_path), ["fp8"], workload=None)
    assert float(anywhere["fp8"]["gpu_memory_gb"].iloc[0]) == 40.0                    # newest of any workload


def test_max_clean_and_best_clean_against_plain_python(tmp_path):
    write(tmp_path / "a.jsonl", sweep("fp8", FP8 + [(8, 300.0, True)], "2026-11-30T09:00:00+00:00"))
    rows = load(tmp_path)
    rows.loc[rows["num_users"] == 8, "preemptions"] = 2                              # "clean" but preempted
    pts = [(u, t) for u, t, c in FP8 if c and t is not None]
    want_max = max(pts, key=lambda p: p[0])
    want_best = max(pts, key=lambda p: (p[1], -p[0]))
    assert summary.max_clean(rows) == want_max == (6, 160.0)
    assert summary.best_clean(rows) == want_best == (5, 250.0)
    assert summary.max_clean(rows.iloc[:0]) is None


def test_ratios_and_cross_file_note_against_plain_python(tmp_path):
    write(tmp_path / "a.jsonl", sweep("fp8", FP8, "2026-11-30T09:00:00+00:00", run_id="a")
          + sweep("bf16", BF16, "2026-11-30T08:00:00+00:00", run_id="a"))
    write(tmp_path / "b.jsonl", sweep("kvrepro:k4v4", [(13, 540.0, True), (12, 530.0, True)],
                                      "2026-11-30T18:00:00+00:00", run_id="b"))
    write(tmp_path / "c.jsonl", sweep("kvrepro:k4v2", [(17, 700.0, True)], "2026-12-01T06:00:00+00:00", run_id="c",
                                      vllm_version="0.21.0"))
    rows = {r["mode"]: r for r in summary.summary_rows(load(tmp_path), modes=summary.MODE_NAMES)}
    fp8_max, fp8_best = 160.0, 250.0                                                 # FP8: 6 users / 5 users
    k = rows["kvrepro:k4v4"]
    assert (k["users"], k["tok_s"]) == (13, 540.0)
    assert k["vs_fp8_max"] == pytest.approx(540.0 / fp8_max, rel=1e-15)
    assert k["vs_fp8_best"] == pytest.approx(540.0 / fp8_best, rel=1e-15)
    assert Path(k["fp8_source_file"]).name == "a.jsonl" and k["fp8_when"] == "2026-11-30 09:00 UTC"
    assert rows["bf16"]["vs_fp8_max"] == pytest.approx(170.0 / fp8_max) and rows["bf16"]["fp8_source_file"] is None
    assert rows["fp8"]["vs_fp8_max"] == 1.0 and rows["fp8"]["vs_fp8_best"] == pytest.approx(fp8_max / fp8_best)
    k2 = rows["kvrepro:k4v2"]                                                        # another vLLM: no ratio
    assert k2["users"] == 17 and k2["vs_fp8_max"] is None and k2["setup_differs"] == ["vllm_version"]
    assert rows["kvrepro:k8v4"]["users"] is None and rows["kvrepro:k8v4"]["source_file"] is None
    table = summary.markdown_table(list(rows.values()))
    lines = table.splitlines()
    line = {m: next(ln for ln in lines if summary.DISPLAY[m] in ln) for m in ("kvrepro:k8v4", "kvrepro:k4v4",
                                                                            "kvrepro:k4v2")}
    assert "fp8 from another run: a.jsonl" in line["kvrepro:k4v4"]
    assert "setup differs from fp8's run (vllm_version)" in line["kvrepro:k4v2"]
    assert f"{540.0 / fp8_max:.2f}x" in line["kvrepro:k4v4"] and "no run for this workload" in line["kvrepro:k8v4"]
    assert "(6 users, 160.0 tok/s)" in lines[0] and "(5 users, 250.0 tok/s)" in lines[0]


def test_bytes_column_and_seed_points():
    rows = {r["mode"]: r for r in summary.summary_rows(None)}
    # head_dim 128: bf16 = 2 x 128 x 2 B, fp8 = 2 x 128 x 1 B; k4v4 = 64 B K codes + 64 B V codes + 2 x 2 B K
    # scale/zero + 2 B V scale
    assert rows["bf16"]["bytes_per_token_head"] == 2 * 128 * 2
    assert rows["fp8"]["bytes_per_token_head"] == 2 * 128
    assert rows["kvrepro:k4v4"]["bytes_per_token_head"] == 64 + 64 + 4 + 2
    assert (rows["bf16"]["seed_users"], rows["fp8"]["seed_users"], rows["kvrepro:k4v4"]["seed_users"]) == (2, 5, 6)
    assert rows["kvrepro:k8v4"]["seed_users"] is None and rows["kvrepro:k4v2"]["seed_users"] is None


def test_needle_counts_single_variant(tmp_path):
    d = pd.DataFrame({"format": ["bf16"] * 4 + ["k4v4"] * 4, "variant": ["single", "single", "single", "multi"] * 2,
                      "correct": [1, 1, 0, 0, 1, 0, 0, 1], "gpu": "NVIDIA H200", "vllm_version": "0.20.2",
                      "date": "2026-11-30T02:42:41Z", "context_length": [1024, 2048, 8184, 1024] * 2})
    d.to_csv(tmp_path / "v.csv", index=False)
    n = summary.needle_counts(tmp_path / "v.csv")
    assert n["bf16"] == (2, 3) and n["k4v4"] == (1, 3) and n["_bf16"]["k4v4"] == (2, 3)
    assert [m["context_lengths"] for m in n["_meta"]] == [[1024, 2048, 8184]]
    assert summary.needle_counts(tmp_path / "none.csv") == {}


def test_needle_counts_prefers_the_default_key_offsets_run_per_format(tmp_path, monkeypatch):
    """Two committed runs: each format's counts come from the run whose compressed presets used the default key
    offset if it has the format, else from the other; bf16 beside each from the same run."""
    import json

    from kvrepro.formats import DEFAULT_PRESET, get_format

    want = get_format(DEFAULT_PRESET).default_key_offset
    other = "slow-pairs" if want != "slow-pairs" else "off"

    def run(path, ko, rows):
        d = pd.DataFrame([{"format": f, "variant": "single", "correct": c, "gpu": "NVIDIA H200",
                           "vllm_version": "0.20.2", "date": "2026-12-02T02:47:06Z", "context_length": 1024,
                           "kvrepro_settings": json.dumps({"key_offset": ko}) if f not in ("bf16", "fp8") else None}
                          for f, cs in rows.items() for c in cs])
        d.to_csv(path, index=False)

    run(tmp_path / "a.csv", other, {"bf16": [1, 1, 1, 0], "k5v4": [1, 0, 0, 0], "k8v4": [1, 1, 1, 1]})
    run(tmp_path / "b.csv", want, {"bf16": [1, 1], "k5v4": [1, 1]})
    monkeypatch.setattr(summary, "VLLM_ACCURACY", str(tmp_path / "a.csv"))     # listed first, preferred second
    monkeypatch.setattr(summary, "VLLM_ACCURACY_REPLICA", str(tmp_path / "b.csv"))
    n = summary.needle_counts()
    assert n["k5v4"] == (2, 2) and n["_bf16"]["k5v4"] == (2, 2)               # the default offset's run
    assert n["k8v4"] == (4, 4) and n["_bf16"]["k8v4"] == (3, 4)               # only the other run has it
    assert [(m["key_offset"], m["formats"]) for m in n["_meta"]] == [(want, ["bf16", "k5v4"]), (other, ["k8v4"])]


def test_time_span():
    assert replay.time_span(["2026-11-30T09:41:13+00:00", "2026-11-30T09:46:12+00:00"]) == "2026-11-30 09:41-09:46 UTC"
    assert replay.time_span(["2026-11-30T09:41:13+00:00"]) == "2026-11-30 09:41 UTC"
    assert replay.time_span(["2026-11-30T23:59:00Z", "2026-12-01T00:01:00Z"]) == "2026-11-30 23:59 - 2026-12-01 00:01 UTC"
    assert replay.time_span(["2026-11-29", "2026-11-29"]) == "2026-11-29"


# ---------------------------------------------------------------- the chart

@pytest.mark.filterwarnings("ignore:FigureCanvasAgg is non-interactive")
def test_chart_marks_max_clean_seed_points_and_integer_ticks(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    write(tmp_path / "a.jsonl", sweep("fp8", FP8, "2026-11-30T09:00:00+00:00")
          + sweep("bf16", BF16, "2026-11-30T08:00:00+00:00"))
    runs = summary.select_current(load(tmp_path), summary.MODE_NAMES)
    fig = summary.plot_capacity(runs)
    ax = fig.axes[0]
    stars = {tuple(c.get_offsets()[0]) for c in ax.collections if len(c.get_offsets()) == 1}
    assert (6.0, 160.0) in stars and (3.0, 170.0) in stars
    seed = {c.get_label(): tuple(c.get_offsets()[0]) for c in ax.collections
            if c.get_label().startswith("seed A100 (published)")}
    assert sorted(seed.values()) == [(2.0, 66.6), (5.0, 105.0), (6.0, 140.9)]
    assert {lb.split(", ", 1)[1].split(",")[0] for lb in seed} == {"fp16: 2 users", "fp8: 5 users",
                                                                    "compressed: 6 users"}
    assert not ax.texts  # seed points are named in the legend, not by labels that could sit on a measured star
    assert all(float(t).is_integer() for t in ax.get_xticks())
    lines = [ln for ln in ax.get_lines() if not ln.get_label().startswith("_")]
    assert len({ln.get_color() for ln in lines}) == len({ln.get_marker() for ln in lines}) == len(lines) == 2
    assert "\n" not in ax.get_title()
    assert "NVIDIA H200" in fig.texts[0].get_text() and "a.jsonl" in fig.texts[0].get_text()
    plt.close(fig)


# ---------------------------------------------------------------- CLI

@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A tiny repository: results/capacity with one run per mode of a synthetic sweep, a README with markers."""
    cap = tmp_path / "results" / "capacity"
    cap.mkdir(parents=True)
    write(cap / "r.jsonl", sweep("fp8", FP8, "2026-11-30T09:00:00+00:00") + sweep("bf16", BF16, "2026-11-30T08:00:00Z"))
    (tmp_path / "README.md").write_text(f"# x\n\n{summary.ANSWER_BEGIN}\n{summary.ANSWER_END}\n\n"
                                        f"{summary.BEGIN}\nold\n{summary.END}\n\n"
                                        f"{summary.FIDELITY_BEGIN}\n{summary.FIDELITY_END}\n\nafter\n"
                                        f"{summary.SERVE_BEGIN}\n{summary.SERVE_END}\n"
                                        f"{summary.SETTINGS_BEGIN}\n{summary.SETTINGS_END}\n")
    monkeypatch.setattr(replay, "repo_root", lambda: tmp_path)
    monkeypatch.setattr(summary, "repo_root", lambda: tmp_path)
    return tmp_path


@pytest.mark.filterwarnings("ignore:FigureCanvasAgg is non-interactive")
def test_cli_write_then_check(repo, capsys):
    assert summary.main(["--check"]) == 1
    out = capsys.readouterr()
    assert "-old" in out.out and "run `python -m kvrepro.summary --write`" in out.err
    assert summary.main(["--write"]) == 0
    text = (repo / "README.md").read_text()
    assert text.startswith("# x\n\n" + summary.ANSWER_BEGIN) and text.endswith(summary.SETTINGS_END + "\n")
    assert "The capacity preset k4v4 has no measured run" in text.split(summary.ANSWER_END)[0]  # fp8 and bf16 only
    from kvrepro.formats import COMPRESSED_PRESETS, DEFAULT_PRESET
    assert f"| `KVREPRO_PRESET` | {', '.join(COMPRESSED_PRESETS)} | {DEFAULT_PRESET} |" in text   # settings too
    assert "| bf16 | 512 | 2 (66.6 tok/s) | 3 | 170.0 |" in text
    assert "Under serving load: not measured yet" in text.split(summary.SERVE_BEGIN)[1]   # no results/serve here
    from kvrepro.capacity import users_that_fit
    from kvrepro.formats import get_format

    users = users_that_fit(DEFAULT_PRESET, 131_072, 1_024)["users_fit"]
    nbytes = get_format(DEFAULT_PRESET).bytes_per_token_per_head(128)
    assert "not measured yet: no `" in text
    assert f"| **{DEFAULT_PRESET} (default)** | {nbytes} | {users} | not measured yet |" in text
    assert (repo / summary.CHART).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "`r.jsonl`" in (repo / summary.CAPACITY_INDEX).read_text()
    assert not list(repo.rglob("*.tmp"))                                             # atomic: no temp left
    assert summary.main(["--check"]) == 0
    (repo / "README.md").write_text(text.replace("| 170.0 |", "| 171.0 |"))         # README and results disagree
    assert summary.main(["--check"]) == 1
    assert "+| bf16 | 512 | 2 (66.6 tok/s) | 3 | 170.0 |" in capsys.readouterr().out


@pytest.mark.filterwarnings("ignore:FigureCanvasAgg is non-interactive")
def test_cli_check_sees_a_new_fidelity_result(repo, capsys):
    """Committing a fidelity result without regenerating the README fails --check, with the new rows in the diff."""
    from test_accuracy_summary import fidelity_rows

    assert summary.main(["--write"]) == 0
    assert summary.main(["--check"]) == 0
    (repo / "results" / "fidelity").mkdir(parents=True)
    fidelity_rows().to_csv(repo / "results" / "fidelity" / "reference_h200_smollm2.csv", index=False)
    capsys.readouterr()
    assert summary.main(["--check"]) == 1
    assert "+| fp8 | 256 | 6 | 0.01 |" in capsys.readouterr().out


def test_cli_write_without_markers_fails_clearly(repo, capsys):
    (repo / "README.md").write_text("# no markers\n")
    assert summary.main(["--write"]) == 1
    assert "README.md: expected one '<!-- results:begin -->' line" in capsys.readouterr().err
    assert (repo / "README.md").read_text() == "# no markers\n" and not (repo / summary.CHART).exists()
    with pytest.raises(ValueError, match="found 2 and 1"):
        summary.replace_block(f"{summary.BEGIN}\n{summary.BEGIN}\n{summary.END}\n", "x")


def test_verdict_line(tmp_path):
    write(tmp_path / "a.jsonl", sweep("fp8", FP8, "2026-11-30T09:00:00+00:00")
          + sweep("kvrepro:k4v4", [(13, 480.0, True)], "2026-11-30T10:00:00+00:00"))
    rows = summary.summary_rows(load(tmp_path))
    line = summary.verdict(rows, "kvrepro:k4v4")
    assert "**13 users**" in line and "fp8 serves 6 here" in line and f"**{480 / 160:.2f}x fp8**" in line
    assert "No measured run" in summary.verdict(summary.summary_rows(None))
    from kvrepro.formats import DEFAULT_PRESET

    if DEFAULT_PRESET != "k4v4":      # the default without a run: said, then the capacity preset's line
        line = summary.verdict(rows)
        assert line.startswith(f"No measured run of kvrepro {DEFAULT_PRESET} (default)")
        assert "The capacity preset: **kvrepro k4v4** serves **13 users**" in line


def test_one_palette_for_formats_and_modes():
    for fmt in ("bf16", "fp8", "k4v4", "k8v4", "k4v2"):
        mode = fmt if fmt in ("bf16", "fp8") else f"kvrepro:{fmt}"
        assert summary.style_of(fmt) == summary.style_of(mode) == summary.STYLE[mode]
    pal = summary.palette(["bf16", "fp8", "k4v4", "k8v4", "k4v2"])
    assert len(set(pal.values())) == 5 and pal["k4v4"] == summary.STYLE["kvrepro:k4v4"][0]


def test_styled_tables_hide_index_and_show_integers_and_one_missing_marker():
    import pandas as pd

    assert [summary.cell_text(v) for v in (12.0, 23051.3, float("nan"), pd.NA, None, "a\nb", 0.12345)] == [
        "12", "23051.3", summary.MISSING, summary.MISSING, summary.MISSING, "a ⏎ b", "0.123"]
    from kvrepro.style import formatted      # the generated markdown tables' cells: blank where missing

    assert [formatted(v, "{:.1f}") for v in (0.25, float("nan"), pd.NA, None)] == ["0.2", "", "", ""]
    assert formatted(0.836, "{:.0f}%", 100) == "84%" and formatted(12345, "{:,}") == "12,345"
    assert formatted("rope-mean", " ({})") == " (rope-mean)"
    html = summary.styled(pd.DataFrame({"mode": ["fp8"], "users": [6.0]})).to_html()
    assert ">6<" in html and "text-align: left" in html and "row_heading" not in html


# ---------------------------------------------------------------- the fidelity block

def test_readme_fidelity_block_is_generated_from_the_committed_results():
    """README.md's fidelity block is exactly what the committed fidelity and needle files give."""
    text = (ROOT / summary.README).read_text(encoding="utf-8")
    block = summary.current_block(text, summary.README, summary.FIDELITY_BEGIN, summary.FIDELITY_END)
    assert block == summary.fidelity_block(), \
        "README.md's fidelity block differs from the results: run python -m kvrepro.summary --write"


def _fidelity_repo(root, per_token, lost):
    from test_accuracy_summary import fidelity_rows, needle_rows

    (root / "results" / "fidelity").mkdir(parents=True)
    fidelity_rows(per_token).to_csv(root / "results" / "fidelity" / "reference_h200_smollm2.csv", index=False)
    fidelity_rows(per_token, vllm=True).to_csv(root / "results" / "fidelity" / "vllm_h200_smollm2.csv", index=False)
    (root / "results" / "accuracy" / "vllm_h200").mkdir(parents=True)
    needle_rows(root / "results" / "accuracy" / "vllm_h200", lost)
    return summary.fidelity_sources(root)


def test_fidelity_block_from_synthetic_files(tmp_path):
    """Every figure of the block from small synthetic result files, checked against plain Python."""
    import math

    from kvrepro import stats
    from kvrepro.capacity import users_that_fit
    from kvrepro.formats import COMPRESSED_PRESETS
    from test_accuracy_summary import PER_TOKEN

    lost = {"fp8": 1, "k5v4": 2, "k4v4": 3, "k4v2": 9}
    block = summary.fidelity_block(_fidelity_repo(tmp_path, PER_TOKEN, lost))
    assert block.startswith(summary.FIDELITY_BEGIN) and block.endswith(summary.FIDELITY_END)
    table = {ln.split("|")[1].strip().strip("*"): [c.strip() for c in ln.split("|")[2:-1]]
             for ln in block.splitlines() if ln.startswith("| ") and "---" not in ln}
    from kvrepro.formats import DEFAULT_PRESET

    assert set(table) - {"mode"} == {"fp8", *(f"{f} (default)" if f == DEFAULT_PRESET else f
                                              for f in COMPRESSED_PRESETS)}
    fp8_kl, fp8_ppl = PER_TOKEN["fp8"][0], 100 * (math.exp(PER_TOKEN["fp8"][1] - 3.0) - 1)
    for name, cells in table.items():
        if name == "mode":
            continue
        f = name.split(" ")[0]
        kl, nll = PER_TOKEN[f]
        ppl = 100 * (math.exp(nll - 3.0) - 1)
        bound = stats.mcnemar_noninferiority(lost.get(f, 0), 0, 400)["bound_pp"]
        assert cells[0] == str(get_bytes(f)) and cells[1] == str(users_that_fit(f, 131_072, 1_024)["users_fit"])
        assert cells[2] == (f"{kl:.3g}" if f == "fp8" else f"{kl:.3g} ({kl / fp8_kl:.2f}x fp8)")
        assert cells[3] == f"{0.8 * kl:.3g}" and cells[4] == f"{ppl:+.2f}%"
        assert cells[5].startswith(f"{bound:.2f} / ")
        assert cells[6] == ("NON-INFERIOR" if bound <= 1.0 else "INFERIOR")
    k5_ppl = 100 * (math.exp(PER_TOKEN['k5v4'][1] - 3.0) - 1)
    assert "**Closest to fp8's fidelity at >= 12 users: k5v4 (default) (12 users): KL 0.021 = " \
           f"{0.021 / fp8_kl:.2f}x fp8's, perplexity {k5_ppl:+.2f}%**" in block
    assert f"fp8 (6 users): KL {fp8_kl:.3g}, perplexity {fp8_ppl:+.2f}%" in block
    assert "replayed: reference path (float32), NVIDIA H200, 2026-12-01 12:00 UTC" in block
    assert "replayed: vLLM 0.20.2, top-20 log-probs, NVIDIA H200" in block
    assert "400 single-needle prompts per mode" in block


def get_bytes(f):
    from kvrepro.formats import get_format

    return get_format(f).bytes_per_token_per_head(summary.HEAD_DIM)


def test_fidelity_block_marks_each_needle_figure_with_its_run(tmp_path):
    """The README's two needle runs: the replication grid (default key offset, single-needle prompts only) gives
    every row's single-needle bound and verdict, the first grid (another offset) its multi-needle bound; the bound
    cell names each figure's run, so the multi-needle one is not read as the other run's (or both)."""
    from kvrepro import accuracy_summary as acs
    from kvrepro import stats
    from kvrepro.formats import COMPRESSED_PRESETS, get_format
    from test_accuracy_summary import PER_TOKEN, needle_rows

    want = get_format(summary.DEFAULT_PRESET).default_key_offset
    _fidelity_repo(tmp_path, PER_TOKEN, {})         # the reference and vLLM fidelity files; needle runs below
    replica = tmp_path / Path(acs.NEEDLE_REPLICA).parent
    replica.mkdir(parents=True)
    first = tmp_path / Path(acs.NEEDLE).parent        # written by _fidelity_repo, rewritten here
    for path, ko in ((replica, want), (first, "slow-pairs" if want != "slow-pairs" else "off")):
        d = pd.read_csv(needle_rows(path, {"k4v2": 9} if path == replica else {"k4v2": 20}))
        if path == first:
            multi = d.assign(variant="multi", prompt_sha256="m" + d["prompt_sha256"])
            multi.loc[multi["format"] == "k4v4", "correct"] = [int(i >= 12) for i in range(400)]
            d = pd.concat([d, multi], ignore_index=True)
        d["kvrepro_settings"] = [json.dumps({"key_offset": ko}) if f in COMPRESSED_PRESETS else None
                                 for f in d["format"]]
        d.to_csv(path / "vllm_accuracy.csv", index=False)
    src = summary.fidelity_sources(tmp_path)
    block = summary.fidelity_block(src)
    rep, fst = src["needle"]
    assert rep.key_offset == want and (rep.tag, fst.tag) == (3, 4)      # [1] reference, [2] vLLM top-20
    cells = {ln.split("|")[1].strip().strip("*").split(" ")[0]: [c.strip() for c in ln.split("|")[2:-1]]
             for ln in block.splitlines() if ln.startswith("| ") and "---" not in ln}
    for f in ("fp8", *COMPRESSED_PRESETS):
        single = stats.mcnemar_noninferiority(9 if f == "k4v2" else 0, 0, 400)["bound_pp"]
        multi = stats.mcnemar_noninferiority({"k4v4": 12, "k4v2": 20}.get(f, 0), 0, 400)["bound_pp"]
        assert cells[f][5] == f"{single:.2f} [3] / {multi:.2f} [4]", f
        assert cells[f][6] == ("INFERIOR" if f == "k4v2" else "NON-INFERIOR")     # the replication grid's verdict
    assert ("- [4] needle bounds and verdicts, output sanity of the formats or needle variants (single, multi) the "
            "needle runs above lack") in block


def test_fidelity_block_says_which_files_are_missing(tmp_path):
    block = summary.fidelity_block(summary.fidelity_sources(tmp_path))
    for p in ("results/fidelity/reference_h200_smollm2.csv", "results/fidelity/vllm_h200_smollm2.csv",
              "results/accuracy/vllm_h200/vllm_accuracy.csv"):
        assert f"not measured yet: no `{tmp_path / p}`" in block
    assert "which one is closest to fp8 is not known" in block


def test_answer_states_capacity_and_fidelity_from_the_rows(tmp_path):
    """The README's opening answer: first the default preset (users against fp8's, fidelity, decode rate against
    fp8's: "at fp8's fidelity or better" only when its verdict is MET), then the capacity preset's users, ratios and
    fidelity cost, all from the rows; a preset without a fidelity row or a run says so."""
    from kvrepro.formats import DEFAULT_PRESET

    write(tmp_path / "a.jsonl", sweep("fp8", FP8, "2026-11-30T09:00:00+00:00")
          + sweep("kvrepro:k4v4", [(13, 480.0, True)], "2026-11-30T10:00:00+00:00"))
    rows = summary.summary_rows(load(tmp_path))
    fid = [dict(format="k4v4", kl=0.06, kl_vs_fp8=2.5, ppl_change_pct=6.0, fp8_ppl_change_pct=2.0,
                needle="INFERIOR", single_bound=1.36, users=13, verdict="NOT MET"),
           dict(format=DEFAULT_PRESET, kl=0.02, kl_vs_fp8=0.9, ppl_change_pct=1.5, fp8_ppl_change_pct=2.0,
                needle="NON-INFERIOR", single_bound=0.8, users=12, verdict="MET")]
    text = summary.answer(rows, fid)
    k4 = next(r for r in rows if r["mode"] == "kvrepro:k4v4")
    assert "For throughput, the capacity preset k4v4 serves 13 users; its aggregate decode rate (480.0 tok/s" in text
    # the fairest comparison first (the best clean point of any fp8), the seed's protocol after it
    best_u, best_t = k4["fp8_best"]
    assert (f"is {k4['vs_fp8_best']:.2f}x the best clean point of any fp8 backend (vLLM's default: {best_u} users, "
            f"{best_t:.1f} tok/s); {480 / 160:.2f}x fp8 on vLLM's default backend at its max clean capacity (6 users, "
            "160.0 tok/s: the seed's protocol);") in text
    assert "it costs KL 2.50x fp8's, perplexity +6.00% (fp8 +2.00%), needle retrieval INFERIOR (loss bound 1.36 pp" in text
    if DEFAULT_PRESET != "k4v4":
        assert text.startswith(f"kvrepro's default preset {DEFAULT_PRESET}: KL 0.90x fp8's, perplexity +1.50% (fp8 "
                               "+2.00%), needle retrieval NON-INFERIOR (loss bound 0.80 pp, bar 1 pp); 12 users by the "
                               "capacity arithmetic (no 128K run yet).")
        assert "fidelity not measured" in summary.answer(rows, fid[:1])
        # with a 128K run of the default preset: its users against fp8's and its decode rate against fp8's
        write(tmp_path / "b.jsonl", sweep(f"kvrepro:{DEFAULT_PRESET}", [(12, 120.0, True)],
                                          "2026-11-30T11:00:00+00:00"))
        text = summary.answer(summary.summary_rows(load(tmp_path)), fid)
        assert text.startswith(f"**On one NVIDIA H200 at an emulated 80 GiB, kvrepro's default preset {DEFAULT_PRESET} "
                               "serves 12 users of 128K tokens where fp8 serves 6, at fp8's fidelity or better**: KL "
                               "0.90x fp8's")
        assert "its aggregate decode rate (120.0 tok/s" in text
        assert f"{120 / 160:.2f}x fp8 on vLLM's default backend at its max clean capacity (6 users, 160.0 tok/s" in text
        fid[1]["verdict"] = "NOT MET"
        assert "at a fidelity cost**" in summary.answer(summary.summary_rows(load(tmp_path)), fid)
    assert "no measured run" in summary.answer(summary.summary_rows(None), fid)


def test_ratios_use_the_fp8_of_the_modes_own_run_where_it_has_one(tmp_path):
    """A mode whose sweep also measured fp8 is compared with that fp8 (one run), not with a newer fp8 run of another
    file; the header keeps fp8's current run and the row says which fp8 its ratios use. A mode whose run has no fp8
    falls back to fp8's current run, as before."""
    write(tmp_path / "a.jsonl", sweep("kvrepro:k4v4", [(13, 540.0, True)], "2026-12-01T08:00:00+00:00", run_id="a")
          + sweep("fp8", [(6, 150.0, True), (4, 230.0, True)], "2026-12-01T08:10:00+00:00", run_id="a"))
    write(tmp_path / "b.jsonl", sweep("fp8", FP8, "2026-12-02T09:00:00+00:00", run_id="b")
          + sweep("kvrepro:k4v2", [(17, 590.0, True)], "2026-12-02T08:00:00+00:00", run_id="b"))
    write(tmp_path / "c.jsonl", sweep("bf16", BF16, "2026-12-01T07:00:00+00:00", run_id="c"))
    rows = {r["mode"]: r for r in summary.summary_rows(load(tmp_path), modes=summary.MODE_NAMES)}
    k = rows["kvrepro:k4v4"]
    assert k["fp8_same_run"] and (k["fp8_max"], k["fp8_best"]) == ((6, 150.0), (4, 230.0))
    assert k["vs_fp8_max"] == pytest.approx(540.0 / 150.0, rel=1e-15)
    assert k["vs_fp8_best"] == pytest.approx(540.0 / 230.0, rel=1e-15) and k["fp8_source_file"] is None
    k2 = rows["kvrepro:k4v2"]                                                 # its run is fp8's current run
    assert not k2["fp8_same_run"] and k2["vs_fp8_max"] == pytest.approx(590.0 / 160.0, rel=1e-15)
    b = rows["bf16"]                                                          # no fp8 in its run: the current one
    assert not b["fp8_same_run"] and Path(b["fp8_source_file"]).name == "b.jsonl"
    assert b["vs_fp8_best"] == pytest.approx(170.0 / 250.0, rel=1e-15)
    assert rows["fp8"]["fp8_max"] == (6, 160.0) and rows["fp8"]["vs_fp8_max"] == 1.0
    lines = summary.markdown_table(list(rows.values())).splitlines()
    assert "(6 users, 160.0 tok/s)" in lines[0] and "(5 users, 250.0 tok/s)" in lines[0]
    line = next(ln for ln in lines if summary.DISPLAY["kvrepro:k4v4"] in ln)
    assert "vs its run's fp8: 6 users 150.0 tok/s, best 4 users 230.0" in line
    assert f"{540.0 / 150.0:.2f}x" in line and "fp8 from another run" not in line
    assert "fp8 from another run: b.jsonl" in next(ln for ln in lines if ln.startswith("| bf16"))


def test_strongest_fp8_over_backends_and_the_answer_names_it(tmp_path):
    """Each fp8 backend from its own newest run; the strongest at max clean capacity and at any clean point by plain
    max; a capped backend has no capacity point; another setup is left out; the README line lists every backend and
    the answer adds the ratio against a stronger fp8 than the row's own, only where one is stronger."""
    write(tmp_path / "a.jsonl", sweep("fp8", FP8, "2026-12-01T09:00:00+00:00", run_id="a")
          + sweep("kvrepro:k4v4", [(13, 480.0, True)], "2026-12-01T08:00:00+00:00", run_id="a"))
    write(tmp_path / "b.jsonl", sweep("fp8:flashinfer", [(6, 230.0, True), (5, 220.0, True), (4, 200.0, True)],
                                      "2026-12-02T09:00:00+00:00", run_id="b",
                                      attention_backend_resolved=["FLASHINFER"]))
    write(tmp_path / "c.jsonl", sweep("fp8:triton_attn", [(3, 300.0, True)], "2026-12-02T10:00:00+00:00",
                                      run_id="c", measured_by="full", users_fit_arithmetic=6))   # capped at 3 of 6
    write(tmp_path / "d.jsonl", sweep("fp8:flash_attn", [(6, 900.0, True)], "2026-12-03T10:00:00+00:00",
                                      run_id="d", vllm_version="0.21.0"))             # another setup: left out
    df = load(tmp_path)
    s = summary.strongest_fp8(df)
    assert (s["at_capacity"]["mode"], s["at_capacity"]["users"], s["at_capacity"]["tok_s"]) == ("fp8:flashinfer", 6,
                                                                                             230.0)
    assert (s["best_point"]["mode"], s["best_point"]["users"], s["best_point"]["tok_s"]) == ("fp8:triton_attn", 3,
                                                                                           300.0)
    line = summary.fp8_backends_line(df)
    assert "fp8:triton_attn (TRITON_ATTN) capacity not measured (capped at 3 users)" in line
    assert "fp8:flashinfer (FLASHINFER) 6 users at 230.0 tok/s, best clean point 6 users at 230.0" in line
    assert "d.jsonl), not compared: setup differs from vLLM's choice fp8's run (vllm_version)" in line
    assert "Strongest at its max clean capacity: fp8:flashinfer (FLASHINFER, 6 users, 230.0" in line
    rows = summary.summary_rows(df)
    k4 = next(r for r in rows if r["mode"] == "kvrepro:k4v4")
    assert k4["vs_strongest_max"] == pytest.approx(480 / 230, rel=1e-15)
    assert k4["vs_strongest_best"] == pytest.approx(480 / 300, rel=1e-15)
    text = summary.answer(rows, [])
    assert (f"{480 / 230:.2f}x the strongest fp8 at its max clean capacity (FLASHINFER: 6 users, 230.0 tok/s, "
            "another run: `b.jsonl`)") in text
    assert f"is {480 / 300:.2f}x the best clean point of any fp8 backend (TRITON_ATTN: 3 users, 300.0 tok/s" in text
    assert f"; {480 / 160:.2f}x fp8 on vLLM's default backend at its max clean capacity" in text
    assert summary.verdict(rows, "kvrepro:k4v4").endswith(
        f"{480 / 230:.2f}x the strongest fp8 at its max clean capacity (FLASHINFER: 6 users, 230.0 tok/s, another run: "
        f"`b.jsonl`), {480 / 300:.2f}x the strongest fp8 at its best clean point (TRITON_ATTN: 3 users, 300.0 tok/s, "
        "another run: `c.jsonl`).")
    # nothing stronger than the row's own fp8: no clause
    only = load(tmp_path)
    only = only[only["source_file"].str.endswith("a.jsonl")]
    alone = summary.answer(summary.summary_rows(only), [])
    assert "another run" not in alone and "FLASHINFER" not in alone and "TRITON_ATTN" not in alone
    assert "(vLLM's default: " in alone
    assert summary.fp8_backends_line(only) is None


def test_own_run_fp8_is_chosen_by_engine_run_and_a_stronger_fp8_only_from_another_backend_of_the_setup(tmp_path):
    """Two runs in one file: a mode takes the fp8 of its own run, not the newer run's; the newest run of vLLM's choice
    fp8 does not count as a stronger fp8 than the row's own (run-to-run noise of one backend); a backend of another
    setup than the row's is not its strongest, one of the row's setup is even when fp8's newest run has another setup;
    an own-run fp8 of another setup falls back to fp8's newest run when that one matches."""
    write(tmp_path / "a.jsonl", sweep("kvrepro:k4v4", [(13, 540.0, True)], "2026-12-01T08:00:00+00:00", run_id="r1")
          + sweep("fp8", [(6, 150.0, True), (4, 230.0, True)], "2026-12-01T08:10:00+00:00", run_id="r1")
          + sweep("fp8", [(6, 180.0, True), (4, 260.0, True)], "2026-12-02T08:10:00+00:00", run_id="r2"))
    k = next(r for r in summary.summary_rows(load(tmp_path)) if r["mode"] == "kvrepro:k4v4")
    assert k["fp8_same_run"] and k["vs_fp8_max"] == pytest.approx(540 / 150, rel=1e-15)
    assert k["strongest_max"] is None and "the strongest fp8" not in summary.answer(summary.summary_rows(load(tmp_path)), [])

    d2 = tmp_path / "b"
    d2.mkdir()
    write(d2 / "a.jsonl", sweep("kvrepro:k4v4", [(13, 500.0, True)], "2026-12-01T08:00:00+00:00", run_id="a")
          + sweep("fp8:flashinfer", [(6, 300.0, True)], "2026-12-01T09:00:00+00:00", run_id="a",
                  attention_backend_resolved=["FLASHINFER"]))
    write(d2 / "b.jsonl", sweep("fp8", FP8, "2026-12-02T09:00:00+00:00", run_id="b", vllm_version="0.21.0"))
    k = next(r for r in summary.summary_rows(load(d2)) if r["mode"] == "kvrepro:k4v4")
    assert k["vs_fp8_max"] is None and k["setup_differs"] == ["vllm_version"]            # fp8 only on another vLLM
    assert k["strongest_max"]["mode"] == "fp8:flashinfer" and k["vs_strongest_max"] == pytest.approx(500 / 300)

    d3 = tmp_path / "c"
    d3.mkdir()
    write(d3 / "a.jsonl", sweep("kvrepro:k4v4", [(13, 500.0, True)], "2026-12-01T08:00:00+00:00", run_id="a")
          + sweep("fp8", [(6, 100.0, True)], "2026-12-01T09:00:00+00:00", run_id="a", vllm_version="0.21.0"))
    write(d3 / "b.jsonl", sweep("fp8", FP8, "2026-11-30T09:00:00+00:00", run_id="b"))
    write(d3 / "c.jsonl", sweep("fp8:flashinfer", [(6, 900.0, True)], "2026-12-02T09:00:00+00:00", run_id="c",
                                vllm_version="0.21.0"))
    k = next(r for r in summary.summary_rows(load(d3)) if r["mode"] == "kvrepro:k4v4")
    assert not k["setup_differs"] and k["vs_fp8_max"] == pytest.approx(500 / 160)     # b's fp8: the same setup
    assert Path(k["fp8_source_file"]).name == "b.jsonl" and k["strongest_max"] is None   # 900: another vLLM


def test_fp8_measured_elsewhere_reads_each_run_of_a_file_with_two(tmp_path):
    """A results file holding two runs (two run_ids) is read run by run, not refused as a whole."""
    cur = tmp_path / "cur.jsonl"
    write(cur, sweep("kvrepro:k4v4", [(13, 500.0, True)], "2026-12-02T08:00:00+00:00", run_id="cur")
          + sweep("fp8", FP8, "2026-12-02T09:00:00+00:00", run_id="cur"))
    write(tmp_path / "x.jsonl", sweep("kvrepro:k4v2", [(17, 600.0, True)], "2026-12-03T08:00:00+00:00", run_id="x1")
          + sweep("fp8", [(6, 150.0, True)], "2026-12-03T08:30:00+00:00", run_id="x2")
          + sweep("fp8:flashinfer", [(6, 300.0, True)], "2026-12-03T09:00:00+00:00", run_id="x2"))
    other = summary.fp8_measured_elsewhere(cur)
    assert set(other) == {"fp8:flashinfer"} and other["fp8:flashinfer"][2:] == ((6, 150.0), "fp8")
    assert "fp8:flashinfer (FLASHINFER): not run beside kvrepro k4v4; measured in `x.jsonl`" in \
        summary.strongest_fp8_markdown([]) + summary.fp8_ratios_markdown(summary.fp8_ratios(cur), {}, other)


def test_strongest_fp8_section_of_the_committed_run():
    """Notebook 02's fp8-backend section on the committed capacity run: its ratios are those of the capacity preset's
    own run (fp8 of that run, every backend it holds), equal to the results table's where that run is also fp8's
    current one, and the fp8 backends that run lacks are listed as not run."""
    rows = summary.summary_rows(summary.load_capacity(), summary.needle_counts())
    cap = next(r for r in rows if r["mode"] == summary.CAPACITY_PRESET)
    md = summary.strongest_fp8_markdown(rows)
    r = summary.fp8_ratios(str(summary.repo_root() / cap["source_file"]))
    vs_max, vs_best = r["at_capacity"]["ratio"], r["best_point"]["ratio"]
    assert f"**{vs_max:.2f}x**" in md and f"**{vs_best:.2f}x**" in md
    if cap["fp8_source_file"] is None:                      # the table's fp8 is the same run's: vLLM's choice
        choice = next(f for f in r["fp8"] if f["mode"] == summary.BASELINE)
        assert (round(choice["vs_max"], 2), round(vs_best, 2)) == (round(cap["vs_fp8_max"], 2),
                                                                   round(cap["vs_fp8_best"], 2))
        assert vs_max <= choice["vs_max"]                   # the strongest fp8 at capacity: none is slower there
    for m in r["missing"]:
        assert f"- {m} ({summary.sweep_backend(m)}): " in md
    assert "nothing to compare" in summary.strongest_fp8_markdown(summary.summary_rows(None))
    # a stronger fp8 of another run gets its own line, with the ratio of the row's tok/s to it
    p = cap["strongest_max"]
    if p and p["tok_s"] > r["at_capacity"]["tok_s"]:
        assert (f"Against the strongest fp8 of any run at its max clean capacity ({p['mode']}, {p['users']} users, "
                f"{p['tok_s']:.1f} tok/s, `{Path(p['source_file']).name}`: another run): "
                f"**{cap['tok_s'] / p['tok_s']:.2f}x**.") in md
    else:
        assert "of any run at its max clean capacity" not in md


def test_the_capacity_preset_without_the_rope_mean_correction_is_its_newest_other_run(tmp_path):
    """The line under the README table: the newest k4v4 run whose keys were stored without rope-mean (off or
    slow-pairs), at its max clean capacity, named with its file; runs with rope-mean do not count however new, and
    without such a run there is no line."""
    k4 = "kvrepro:k4v4"
    rows = (sweep(k4, [(13, 600.0, True), (12, 580.0, True)], "2026-12-01T15:00:00+00:00", run_id="old",
                  engine_run_id="a", kvrepro_settings={"preset": "k4v4"})                   # before the setting: off
            + sweep(k4, [(13, 610.0, True), (14, None, False)], "2026-12-01T16:00:00+00:00", run_id="sp",
                    engine_run_id="b", kvrepro_settings={"key_offset": "slow-pairs"})
            + sweep(k4, [(13, 420.0, True)], "2026-12-02T11:00:00+00:00", run_id="rm", engine_run_id="c",
                    kvrepro_settings={"key_offset": "rope-mean"}))
    df = replay.load_jsonl(write(tmp_path / "runs.jsonl", rows))
    u = summary.uncorrected_point(df)
    assert (u["key_offset"], u["users"], u["tok_s"]) == ("slow-pairs", 13, 610.0) and u["file"].endswith("runs.jsonl")
    line = [x for x in summary.notes_lines(df, {}, chart=False) if "without the rope-mean correction" in x]
    assert line and "13 users, 610.0 tok/s (2026-12-01 16:00 UTC, [runs.jsonl](" in line[0]
    only_rm = replay.load_jsonl(write(tmp_path / "rm.jsonl", rows[-1:]))
    assert summary.uncorrected_point(only_rm) is None
    assert not [x for x in summary.notes_lines(only_rm, {}, chart=False) if "without the rope-mean" in x]
