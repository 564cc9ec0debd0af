"""kvrepro.fidelity: the metrics against independent float64 computations, the parameters, and the CPU path on
the real SmolLM2 (tiny windows)."""
import math
import time

import pandas as pd
import pytest
import torch

from kvrepro import fidelity
from kvrepro.fidelity import FidelityParams, engine_agreement, goal_check, summarize, topk_kl, window_row


def _dists(n, v, seed, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    p = torch.log_softmax(torch.randn(n, v, generator=g, dtype=torch.float64) * 3, -1)
    q = torch.log_softmax(p + spread * torch.randn(n, v, generator=g, dtype=torch.float64), -1)
    return p, q


def test_topk_kl_with_the_whole_vocabulary_is_the_kl():
    p, q = _dists(7, 50, 0)
    rv, ri = p.topk(50, -1)
    mv, mi = q.topk(50, -1)
    kl, missing = topk_kl(ri, rv, mi, mv)
    want = torch.nn.functional.kl_div(q, p, log_target=True, reduction="none").sum(-1)
    assert torch.allclose(kl, want, atol=1e-12) and (missing == 0).all()


def test_topk_kl_is_the_coarse_kl_when_q_returns_p_top_k():
    p, q = _dists(5, 40, 1, spread=0.01)   # nearly equal: Q's top-10 contains P's top-5
    rv, ri = p.topk(5, -1)
    mv, mi = q.topk(10, -1)
    kl, missing = topk_kl(ri, rv, mi, mv)
    assert (missing == 0).all()
    for i in range(5):   # partition {top-5 of P} + {rest}, computed from the full distributions
        top = ri[i]
        pt, qt = p[i, top].exp(), q[i, top].exp()
        want = (pt * (pt.log() - qt.log())).sum() + (1 - pt.sum()) * math.log((1 - pt.sum()) / (1 - qt.sum()))
        assert abs(kl[i].item() - want.item()) < 1e-12
        full = (p[i].exp() * (p[i] - q[i])).sum()
        assert kl[i] <= full + 1e-12   # data processing: a coarser partition never adds divergence


def test_topk_kl_counts_missing_tokens_at_the_floor():
    ri = torch.tensor([[3, 4]])
    rv = torch.tensor([[math.log(0.5), math.log(0.3)]], dtype=torch.float64)
    mi = torch.tensor([[3, 7]])
    mv = torch.tensor([[math.log(0.6), math.log(0.1)]], dtype=torch.float64)
    kl, missing = topk_kl(ri, rv, mi, mv)
    want = 0.5 * math.log(0.5 / 0.6) + 0.3 * math.log(0.3 / 0.1) + 0.2 * math.log(0.2 / (1 - 0.6 - 0.1))
    assert missing.tolist() == [1] and abs(kl.item() - want) < 1e-12
    with pytest.raises(ValueError, match=r"\[N, k\]"):
        topk_kl(ri[0], rv[0], mi, mv)


def test_window_row_and_summary_against_direct_sums():
    p, q = _dists(30, 64, 2)
    tgt = torch.randint(0, 64, (30,), generator=torch.Generator().manual_seed(3))
    r = window_row("k4v4", 0, p, q, tgt, 8)
    assert abs(r["kl_sum"] - torch.nn.functional.kl_div(q, p, log_target=True, reduction="sum").item()) < 1e-9
    assert r["top1_sum"] == int((p.argmax(-1) == q.argmax(-1)).sum())
    assert abs(r["nll_sum"] + q[torch.arange(30), tgt].sum().item()) < 1e-9
    base = window_row("bf16", 0, p, p, tgt, 8)
    assert base["kl_sum"] == 0 and base["top1_sum"] == 30
    s = summarize(pd.DataFrame([base, r, {**r, "window": 1, "nll_sum": 0.0}])).set_index("format")
    assert list(s.index) == ["bf16", "k4v4"] and s.loc["k4v4", "windows"] == 1  # window 1 lacks bf16: left out
    assert abs(s.loc["k4v4", "ppl"] - math.exp(r["nll_sum"] / 30)) < 1e-9
    assert abs(s.loc["k4v4", "ppl_change_pct"] - 100 * (math.exp((r["nll_sum"] - base["nll_sum"]) / 30) - 1)) < 1e-9
    g = goal_check(pd.DataFrame([{"format": "fp8", "kl": 0.02, "ppl_change_pct": 2.0},
                                 {"format": "k5v4", "kl": 0.019, "ppl_change_pct": 2.1},
                                 {"format": "k8v4", "kl": 0.006, "ppl_change_pct": 0.8}])).set_index("format")
    assert g["meets_fp8"].to_dict() == {"fp8": True, "k5v4": False, "k8v4": True}
    with pytest.raises(ValueError, match="reference format 'fp8'"):
        goal_check(pd.DataFrame([{"format": "bf16", "kl": 0.0, "ppl_change_pct": 0.0}]))
    a = engine_agreement(pd.DataFrame({"format": ["bf16", "k4v4", "fp8"], "kl_topk": [0, 0.04, 0.01]}),
                         pd.DataFrame({"format": ["bf16", "k4v4", "fp8"], "kl_topk": [0, 0.05, 0.03]}))
    assert a.set_index("format")["agree"].to_dict() == {"k4v4": True, "fp8": False}


@pytest.mark.parametrize("kw, match", [
    (dict(formats=("fp8", "k4v4")), "must include the baseline 'bf16'"),
    (dict(formats=("bf16", "fp16")), r"formats: unknown \['fp16'\]; allowed: bf16, fp8"),
    (dict(corpus="nope"), "corpus 'nope' is not known; allowed: pd-books"),
    (dict(window_tokens=10_000), r"window_tokens must be an integer in \[64, 8192\]"),
    (dict(score_from=4096), r"score_from must be an integer in \[1, window_tokens - 1 = 4095\]"),
    (dict(num_windows=0), "num_windows must be a positive integer"),
    (dict(top_k=0), r"top_k must be an integer in \[1, 100\]"),
])
def test_bad_parameters_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        FidelityParams(**kw).validate()
    with pytest.raises(ValueError, match="unknown fidelity parameter"):
        FidelityParams.from_dict({"windows": 3})


def test_vllm_rows_from_worker_outputs():
    p, q = _dists(12, 30, 4)
    pv, pi = p.topk(5, -1)
    qv, qi = q.topk(5, -1)
    tgt = torch.arange(12) % 30
    ref = {"windows": [{"ids": pi.int(), "lps": pv.float(), "actual": p[torch.arange(12), tgt].float()}]}
    res = {"windows": [{"ids": qi.int(), "lps": qv.float(), "actual": q[torch.arange(12), tgt].float()}]}
    (row,) = fidelity.vllm_rows(ref, res, "k4v4", 5)
    kl, missing = topk_kl(pi, pv.float(), qi, qv.float())
    assert abs(row["kl_topk_sum"] - kl.sum().item()) < 1e-9 and row["topk_missing"] == int(missing.sum())
    assert math.isnan(row["kl_sum"]) and row["top1_sum"] == int((pi[:, 0] == qi[:, 0]).sum())


def test_cpu_path_on_smollm2_measures_and_resumes(tmp_path, monkeypatch):
    params = FidelityParams(formats=("bf16", "k4v4"), window_tokens=96, score_from=64, num_windows=1, top_k=5)
    path = str(tmp_path / "fid.csv")
    rows = fidelity.run_cpu(params, path)
    s = summarize(rows).set_index("format")
    assert s.loc["bf16", "kl"] == 0 and s.loc["bf16", "top1_pct"] == 100
    assert 0 < s.loc["k4v4", "kl"] < 1 and s.loc["k4v4", "scored_tokens"] == 32
    assert set(rows["engine"]) == {"reference-cpu"} and rows["provenance"].str.contains("kvrepro_src_sha256").all()
    calls = []
    monkeypatch.setattr(fidelity, "_cpu_logprobs", lambda *a: calls.append(a))
    again = fidelity.run_cpu(params, path)      # everything measured: nothing runs, same rows
    assert calls == [] and again.equals(rows)
    with pytest.raises(ValueError, match="num_windows"):
        fidelity.run_cpu(FidelityParams(formats=("bf16",), window_tokens=8192, score_from=64, num_windows=10_000),
                         str(tmp_path / "x.csv"))
    assert not (tmp_path / "x.csv").exists()


FAKE_WORKER = '''
import sys, time, torch
a = sys.argv
if a[1:4] != ["-m", "kvrepro.fidelity", "vllm-worker"]:
    raise SystemExit("unexpected command " + " ".join(a))
arg = lambda k: a[a.index(k) + 1]
mode, out, k = arg("--mode"), arg("--out"), int(arg("--top-k"))
windows = torch.load(arg("--windows"))
n = len(windows[0]) - int(arg("--score-from"))
import os
open(out + ".env", "w").write(os.environ.get("KVREPRO_KEY_OFFSET", "-") + " " + arg("--gpu-memory-utilization"))
if mode == "kvrepro:k4v2":
    raise SystemExit(3)                                   # a mode that fails keeps the others
g = torch.Generator().manual_seed(sum(map(ord, mode)))
res = []
for w in windows:
    lp = torch.log_softmax(torch.randn(n, 50, generator=g) * (1 if mode == "bf16" else 1.05), -1)
    v, i = lp.topk(k, -1)
    res.append({"ids": i.int(), "lps": v, "actual": lp[:, 0]})
time.sleep(0.5)
torch.save({"windows": res, "info": {"mode": mode}}, out)
'''


def test_vllm_runner_runs_modes_at_once_and_writes_rows_per_mode(tmp_path, monkeypatch):
    """run_vllm's orchestration with a stand-in worker (the real one needs vLLM and a GPU): modes run
    ``parallel`` at a time, each kvrepro mode gets the key-offset setting, rows equal vllm_rows of the worker
    outputs, a failing mode is left out and the others are kept."""
    import subprocess
    import sys

    fake = tmp_path / "fake_python"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} {tmp_path / 'worker.py'} \"$@\"\n")
    fake.chmod(0o755)
    (tmp_path / "worker.py").write_text(FAKE_WORKER)
    monkeypatch.setattr(sys, "executable", str(fake))
    starts = []
    real_popen = subprocess.Popen
    monkeypatch.setattr(fidelity.subprocess, "Popen",
                        lambda *a, **k: starts.append(time.monotonic()) or real_popen(*a, **k))
    params = FidelityParams(formats=("bf16", "fp8", "k4v4", "k4v2"), window_tokens=96, score_from=64,
                            num_windows=2, top_k=5)
    path, work = str(tmp_path / "v.csv"), str(tmp_path / "w")
    rows = fidelity.run_vllm(params, path, "model-dir", work, parallel=2)
    assert sorted(set(rows["format"])) == ["bf16", "fp8", "k4v4"] and len(rows) == 6
    out = {m: torch.load(f"{work}/{m.replace(':', '_')}.pt") for m in ("bf16", "fp8", "kvrepro:k4v4")}
    for fmt, mode in (("fp8", "fp8"), ("k4v4", "kvrepro:k4v4")):
        want = fidelity.vllm_rows(out["bf16"], out[mode], fmt, 5)
        got = rows[rows["format"] == fmt].sort_values("window")
        assert list(got["kl_topk_sum"]) == pytest.approx([r["kl_topk_sum"] for r in want], rel=1e-12)
    env = {m: open(f"{work}/{m}.pt.env").read().split() for m in ("bf16", "kvrepro_k4v4")}
    assert env["kvrepro_k4v4"] == ["rope-mean", "0.3"] and env["bf16"][0] == "-"
    assert starts[1] - starts[0] < 0.4                 # the first two started together
    with pytest.raises(ValueError, match="parallel must be a positive integer"):
        fidelity.run_vllm(params, path, "m", work, parallel=0)
