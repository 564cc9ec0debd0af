"""kvrepro.profile and scripts/step_profile.py on the CPU: kernel classes by name (names as vLLM 0.20.2's backends,
cuBLAS, inductor and kvrepro emit them), per-step attribution of a synthetic Chrome trace against hand-summed
figures, the bandwidth bound against issue 23's arithmetic, argument checks. The engine run itself is GPU-only."""
import gzip
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import scripts_module
from kvrepro import profile

ROOT = Path(__file__).resolve().parents[1]

FA3 = ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<flash::CollectiveMainloopFwdSm90"
       "<2, cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >, cute::tuple<cute::C<128>, cute::C<176>, cute::C<128> >, "
       "128, cutlass::float_e4m3_t, cutlass::bfloat16_t, cutlass::arch::Sm90, true, false> > > >(...)")


@pytest.mark.parametrize("name,cls", [
    (FA3, "attention"),
    ("void flash::FlashAttnFwdCombine<cute::tuple<cute::C<8>, cute::C<128> >, 7, 256, 1, false, true>(...)", "attention"),
    ("kernel_unified_attention_3d", "attention"), ("reduce_segments", "attention"),
    ("void flashinfer::BatchDecodeWithPagedKVCacheKernel<(flashinfer::PosEncodingMode)0, 2u, 4u, 8u>(...)", "attention"),
    ("kvrepro_decode_k4v4", "attention"), ("paged_attn_kernel", "attention"), ("merge_splits_kernel", "attention"),
    ("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, unsigned char, (vllm::Fp8KVCacheDataType)1>(...)",
     "kv_store"),
    ("store_kv_kernel", "kv_store"),
    ("nvjet_tst_128x64_64x8_1x1_v_bz_TNT", "gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x_"
     "cublas", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>(...)", "gemm"),
    ("triton_tem_fused_mm_0", "gemm"), ("void gemv2T_kernel_val<int, int, float, float, float, 128, 16, 4, 4>", "gemm"),
    ("triton_poi_fused_mul_silu_0", "other"), ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1", "other"),
    ("void vllm::rotary_embedding_kernel<c10::BFloat16, true>(...)", "other"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>>>", "other"),
])
def test_classify_kernel(name, cls):
    assert profile.classify_kernel(name) == cls


def test_classify_kernel_refuses_a_non_name():
    with pytest.raises(ValueError, match="name must be a non-empty kernel name"):
        profile.classify_kernel("")
    assert set(profile.KERNEL_CLASSES) == {"kv_store", "attention", "gemm", "other"}


def _x(cat, name, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1, "args": args}


def synthetic_trace():
    """A prefill step (1 context request + 1 decode), then three decode steps of 2 users, each one graph launch of
    kernels (attention 300 us, GEMM 500 us, KV store 20 us, norm 30 us) and a sampler kernel launched after the
    forward range closed; one kernel launched before the first step; the GPU copies of the ranges (ignored)."""
    ev = [_x("cuda_runtime", "cudaLaunchKernel", 0, 5, correlation=1),
          _x("kernel", "triton_poi_fused_0", 10, 7, correlation=1)]              # before any step: unassigned
    ev.append(_x("user_annotation", "execute_context_1(8192)_generation_1(1)", 100, 50))
    ev.append(_x("cuda_runtime", "cudaLaunchKernel", 110, 5, correlation=2))
    ev.append(_x("kernel", FA3, 120, 4000, correlation=2, grid=[1, 8, 1], block=[384, 1, 1]))
    corr = 10
    for k, t in enumerate((10_000, 12_000, 14_100)):
        ev.append(_x("user_annotation", "execute_context_0(0)_generation_2(2)", t, 100))
        ev.append(_x("gpu_user_annotation", "execute_context_0(0)_generation_2(2)", t + 20, 1000))
        ev.append(_x("cuda_runtime", "cudaGraphLaunch", t + 10, 20, correlation=corr))
        g = t + 40
        for name, dur in (("store_kv_kernel", 20), (FA3, 300), ("nvjet_tst_128x64_64x8_1x1_v_bz_TNT", 500),
                          ("void vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>", 30)):
            ev.append(_x("kernel", name, g, dur, correlation=corr, grid=[2, 8, 1] if name == FA3 else None))
            g += dur + 10                                                  # 10 us gaps between kernels
        ev.append(_x("cuda_runtime", "cudaLaunchKernel", t + 150, 5, correlation=corr + 1))   # after the range
        ev.append(_x("kernel", "argmax_kernel", g, 50, correlation=corr + 1))
        corr += 2
    ev.append(_x("kernel", "orphan", 20_000, 5, correlation=999))           # no launch event
    return ev


def test_step_breakdown_against_hand_sums():
    b = profile.step_breakdown(synthetic_trace(), users=2)
    assert len(b["steps"]) == 4 and b["decode_steps"] == 3
    assert b["unassigned_kernels"] == 2
    first = b["steps"][0]
    assert (first["context_requests"], first["decode"], first["attention"]) == (1, False, 4.0)
    s = b["steps"][1]
    assert (s["attention"], s["gemm"], s["kv_store"], s["other"]) == pytest.approx((0.3, 0.5, 0.02, 0.08))
    assert s["kernel_ms"] == pytest.approx(0.9)
    assert s["gpu_span_ms"] == pytest.approx((20 + 300 + 500 + 30 + 50 + 4 * 10) / 1e3)   # 0.94 ms
    assert s["host_ms"] == pytest.approx(2.0) and b["steps"][3]["host_ms"] is None
    m = b["mean"]
    assert m["attention_ms"] == pytest.approx(0.3) and m["attention_pct"] == pytest.approx(100 * 0.3 / 0.9)
    assert m["gemm_pct"] == pytest.approx(100 * 0.5 / 0.9)
    assert m["rest_ms"] == pytest.approx(0.1) and m["rest_pct"] == pytest.approx(100 * 0.1 / 0.9)
    assert m["gpu_idle_ms"] == pytest.approx(0.04)
    assert m["host_ms"] == pytest.approx((2.0 + 2.1) / 2)            # the last step has no next start
    top = b["top_kernels"]["attention"][0]
    assert top["name"] == FA3 and top["count_per_step"] == 1 and top["ms_per_step"] == pytest.approx(0.3)
    assert top["grid"] == [2, 8, 1]
    everything = profile.step_breakdown(synthetic_trace())          # users=None: every pure decode step
    assert everything["decode_steps"] == 3


def test_step_breakdown_says_what_it_found():
    with pytest.raises(ValueError, match=r"users=5.*\(0, 2\), \(1, 1\)"):
        profile.step_breakdown(synthetic_trace(), users=5)
    with pytest.raises(ValueError, match="no vLLM step annotation"):
        profile.step_breakdown([e for e in synthetic_trace() if e["cat"] != "user_annotation"])


def test_load_trace_reads_gzip_and_refuses_other_json(tmp_path):
    p = tmp_path / "w.pt.trace.json.gz"
    with gzip.open(p, "wt") as f:
        json.dump({"traceEvents": synthetic_trace()}, f)
    assert profile.step_breakdown(profile.load_trace(p), users=2)["decode_steps"] == 3
    (tmp_path / "bad.json").write_text('{"events": []}')
    with pytest.raises(ValueError, match="no traceEvents"):
        profile.load_trace(tmp_path / "bad.json")


def test_parse_step_name():
    assert profile.parse_step_name("execute_context_0(0)_generation_13(13)") == {
        "context_requests": 0, "context_tokens": 0, "generation_requests": 13, "generation_tokens": 13}
    assert profile.parse_step_name("gpu_model_runner: forward") is None


def test_decode_bound_is_issue_23s_arithmetic():
    """13 k4v4 users at 128K: weights 8.04 GB + KV 66 GB at 4.28 TB/s copy -> ~751 tok/s (issue 23)."""
    from kvrepro import capacity

    cfg = capacity.load_model_config()
    per_token = capacity.bytes_per_token("k4v4", cfg)
    b = profile.decode_bound(13, 131072, per_token, cfg.weights_bytes, 4280.7)
    assert b["kv_bytes"] == 13 * 131072 * 36 * 8 * 134
    assert b["bytes"] == pytest.approx(8_044_936_192 + 13 * 131072 * 38592)
    assert b["step_ms"] == pytest.approx(b["bytes"] / 4280.7e9 * 1e3)
    assert 745 < b["tok_s"] < 760
    with pytest.raises(ValueError, match="copy_gbps must be a number > 0"):
        profile.decode_bound(13, 131072, per_token, cfg.weights_bytes, 0)


def test_parse_users():
    assert profile.parse_users("13") == (13,) and profile.parse_users("4,6") == (6, 4)
    for bad in ("", "0", "a", "6,6"):
        with pytest.raises(ValueError, match="users"):
            profile.parse_users(bad)


def _script():
    return scripts_module.load("step_profile")


def test_script_settings_and_engine_arguments(tmp_path):
    sp = _script()
    cfg = sp.check_args(sp.build_parser().parse_args(["--mode", "fp8:flash_attn", "--users", "4,6"]))
    assert cfg["users"] == (6, 4) and cfg["steps"] == 8
    kw = sp.engine_kwargs(cfg, "/m", 0.51, str(tmp_path))
    assert kw["kv_cache_dtype"] == "fp8" and kw["attention_backend"] == "FLASH_ATTN"
    assert kw["profiler_config"]["profiler"] == "torch" and kw["profiler_config"]["torch_profiler_dir"] == str(tmp_path)
    assert kw["max_model_len"] == 131072 + sp.MAX_NEW_TOKENS + 64 and kw["enable_prefix_caching"] is False
    assert "attention_backend" not in sp.engine_kwargs(sp.check_args(sp.build_parser().parse_args(["--mode", "fp8"])),
                                                       "/m", 0.5, "/t")
    assert [sp.kv_format(m) for m in ("kvrepro:k4v4", "fp8", "fp8:triton_attn", "bf16")] == ["k4v4", "fp8", "fp8", "bf16"]
    assert sp.default_out("NVIDIA H200", "kvrepro:k4v4", (13, 6), "20261202_0100").name == \
        "nvidia-h200_kvrepro-k4v4_13-6u_20261202_0100.json"
    assert "attention_config" not in kw                     # vLLM's own split cap unless asked
    capped = sp.check_args(sp.build_parser().parse_args(["--mode", "fp8", "--users", "6,4", "--fa-max-splits", "2"]))
    assert sp.engine_kwargs(capped, "/m", 0.5, "/t")["attention_config"] == {
        "flash_attn_max_num_splits_for_cuda_graph": 2}
    assert sp.default_out("NVIDIA H200", "fp8", (6, 4), "20261203_0538", 2).name == \
        "nvidia-h200_fp8-fa-splits2_6-4u_20261203_0538.json"


@pytest.mark.parametrize("args,msg", [
    (["--mode", "fp16"], "mode must be one of"), (["--mode", "turboquant_k8v4"], "mode must be one of"),
    (["--users", "0"], "users must be"), (["--users", "40"], "exceeds --max-num-seqs 32"),
    (["--steps", "0"], "--steps must be an integer >= 1"), (["--settle-steps", "-1"], "--settle-steps"),
    (["--gpu-memory-gb", "0"], "--gpu-memory-gb"), (["--cudagraph-mode", "ful"], "--cudagraph-mode must be one of"),
    (["--out", "/nonexistent/x.json"], "its folder does not exist"), (["--out", "results"], "is a folder"),
    (["--mode", "fp8", "--fa-max-splits", "0"], "--fa-max-splits must be an integer >= 1"),
    (["--mode", "fp8:triton_attn", "--fa-max-splits", "2"], "mode fp8:triton_attn runs on TRITON_ATTN"),
    (["--mode", "kvrepro:k4v4", "--fa-max-splits", "2"], "--fa-max-splits applies to FlashAttention"),
    (["--mode", "fp8", "--fa-max-splits", "2", "--cudagraph-mode", "PIECEWISE"], "under full CUDA graphs only"),
    (["--gpu-memory-gb", "inf"], "--gpu-memory-gb must be a finite number"),
    (["--seed", "-1"], "--seed must be an integer >= 0, got -1"),
    (["--prompt-tokens", "999999999"], "must be <= the bundled model's max_position_embeddings (262144)"),
    (["--trace-dir", "README.md"], "--trace-dir 'README.md' is a file"),
])
def test_script_refuses_bad_arguments_naming_them(args, msg):
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "step_profile.py"), *args], capture_output=True,
                       text=True, cwd=ROOT)
    assert r.returncode == 2 and msg in r.stderr, r.stderr


def test_report_lines():
    b = profile.step_breakdown(synthetic_trace(), users=2)
    result = {"mode": "kvrepro:k4v4", "batches": [
        {"users": 2, "timed": {"step_ms": 1.0, "tok_s": 2000.0}, "breakdown": b,
         "bound": profile.decode_bound(2, 1000, 100, 700_000, 1.0)},
        {"users": 1, "error": "no new trace"}]}
    lines = profile.report_lines(result)
    assert lines[0].startswith("kvrepro:k4v4 2 users: timed step 1.00 ms (2000.0 tok/s); profiled GPU span 0.94 ms: "
                               "attention 0.30 ms (33%), GEMMs 0.50 ms (56%), rest 0.10 ms (11%)")
    assert "bound 0.90 ms (2222 tok/s), reached 90.0%" in lines[0]
    assert lines[1] == "kvrepro:k4v4 1 users: not profiled: no new trace"


def _profile_file(path, mode, engine, batches):
    path.write_text(json.dumps({"mode": mode, "date": "2026-12-02T09:28:29+00:00", "engine": engine,
                                "batches": batches}))


def test_profile_table_and_section_against_hand_figures(tmp_path):
    """Two result files: the bandwidth shares are bytes / time / copy bandwidth by hand (1e9 KV bytes in 0.5 ms at
    4000 GB/s = 50%; 8e9 weight bytes in 4 ms = 50%), the share of the bound its step_ms over the timed step."""
    assert profile.section_markdown(tmp_path).startswith("Not measured yet: no step profile is committed")
    d = tmp_path / "results" / "profile"
    d.mkdir(parents=True)
    mean = {"attention_ms": 0.5, "gemm_ms": 4.0, "rest_ms": 0.25, "gpu_idle_ms": 0.1}
    bound = {"kv_bytes": 1e9, "weights_bytes": 8e9, "copy_gbps": 4000.0, "step_ms": 2.25}
    _profile_file(d / "b.json", "kvrepro:k4v4",
                  {"attention_backend": "CUSTOM", "attention_backend_resolved": ["CUSTOM"],
                   "kvrepro_settings": {"key_offset": "rope-mean"}},
                  [{"users": 13, "timed": {"step_ms": 4.5, "tok_s": 2888.9}, "breakdown": {"mean": mean},
                    "bound": bound},
                   {"users": 3, "timed": {"step_ms": 2.0, "tok_s": 1500.0}, "error": "no new trace"}])
    _profile_file(d / "a.json", "fp8", {"attention_backend": "vllm-auto", "attention_backend_resolved": ["FLASH_ATTN"]},
                  [{"users": 6, "timed": {"step_ms": 9.0, "tok_s": 666.7}, "breakdown": {"mean": mean},
                    "bound": dict(bound, step_ms=3.0)}])
    t = profile.profile_table(sorted(d.glob("*.json")))
    assert list(t["mode"]) == ["fp8", "kvrepro:k4v4", "kvrepro:k4v4"] and list(t["users"]) == [6, 13, 3]
    k = t.iloc[1]
    assert k["attention_bw"] == pytest.approx(0.5) and k["gemm_bw"] == pytest.approx(0.5)
    assert k["of_bound"] == pytest.approx(0.5) and k["key_offset"] == "rope-mean" and k["backend"] == "CUSTOM"
    assert t.iloc[0]["of_bound"] == pytest.approx(1 / 3) and t.iloc[0]["backend"] == "FLASH_ATTN"
    assert t.isna().iloc[2][["attention_ms", "attention_bw", "of_bound"]].all() and t.iloc[2]["step_ms"] == 2.0
    md = profile.section_markdown(tmp_path)
    assert "| fp8 (FLASH_ATTN) |  | 6 | 9.00 | 667 | 0.50 | 50% | 4.00 | 50% | 0.25 | 0.10 | 3.00 | 33.3% | 70.6% | none | [1] |" \
        in md
    assert "| kvrepro:k4v4 | rope-mean | 13 | 4.50 | 2889 | 0.50 | 50% | 4.00 | 50% | 0.25 | 0.10 | 2.25 | 50.0% | 52.9% | none | " \
        "[2] |" in md
    assert "| kvrepro:k4v4 | rope-mean | 3 | 2.00 | 1500 |  |  |  |  |  |  |  |  |  |  | [2] |" in md
    assert "- [2] `results/profile/b.json` (2026-12-02 09:28 UTC)" in md
    # ceiling: 1e9 KV bytes at 4000 GB/s = 0.25 ms, + 4 ms of GEMMs; bound 2.25 ms (kvrepro), 3.0 ms (fp8)
    assert k["ceiling"] == pytest.approx(2.25 / 4.25) and t.iloc[0]["ceiling"] == pytest.approx(3.0 / 4.25)
    assert "the attention reading the KV at the copy bandwidth, no other kernel and no idle time." in md
    # 95%: 2.25 / 0.95 ms less 4 ms of GEMMs is below zero: no attention time is left ("none")
    assert k["goal_attention_bw"] == math.inf
    # an engine with FlashAttention's split cap set (step_profile --fa-max-splits) is named with it
    capped = json.loads((d / "a.json").read_text())
    (d / "a2.json").write_text(json.dumps(dict(capped, params={"fa_max_splits": 2})))
    md = profile.section_markdown(tmp_path)
    assert "| fp8 (FLASH_ATTN, at most 2 KV splits) |  | 6 | 9.00 |" in md and "| fp8 (FLASH_ATTN) |  | 6 | 9.00 |" in md
    assert 'Rows "at most N KV splits" ran FlashAttention 3 with vLLM\'s split cap' in md   # said where such a row is
    (d / "a2.json").unlink()
    assert "at most N KV splits" not in profile.section_markdown(tmp_path)
    (d / "c.json").write_text("{}")
    with pytest.raises(ValueError, match="c.json: not a step-profile result"):
        profile.section_markdown(tmp_path)


def test_kernel_bandwidth_table_and_section_against_hand_figures(tmp_path):
    """decode_side_by_side.py --rope rows paired per (preset, batch): the bandwidth fraction is KV bytes over the graph
    time against the copy bandwidth of the file, the ratio rope over plain, a preset without a rope row blank; the
    section names the file's GPU and which points reach the 92% goal; a file of another kind is refused by name."""
    rows = [dict(kernel="kvrepro_k4v4", impl="cuda", ctx=131072, batch=3, ms_graph=0.125, kv_bytes=500_000_000),
            dict(kernel="kvrepro_k4v4_rope", impl="cuda", ctx=131072, batch=3, ms_graph=0.25, kv_bytes=500_000_000),
            dict(kernel="kvrepro_k4v4_triton_rope", impl="triton", ctx=131072, batch=3, ms_graph=1.0,
                 kv_bytes=500_000_000),
            dict(kernel="kvrepro_k5v4", impl="triton", ctx=131072, batch=13, ms_graph=1.0, kv_bytes=3_000_000_000)]
    path = tmp_path / "decode_rope_mean.json"
    path.write_text(json.dumps({"provenance": {"gpu": "NVIDIA H200", "date_utc": "2026-12-02T12:10:16+00:00",
                                               "script": "benchmarks/decode_side_by_side.py --rope"},
                                "copy_bandwidth": {"GBps_read_plus_write": 4000.0}, "rows": rows}))
    t = profile.kernel_bandwidth_table(path)
    assert list(t["preset"]) == ["k4v4", "k5v4"] and list(t["batch"]) == [3, 13]
    k4 = t.iloc[0]
    assert k4["bw"] == pytest.approx(500e6 / 0.125e-3 / 4000e9) == pytest.approx(1.0)      # 4 TB/s: the copy rate
    assert k4["bw_rope"] == pytest.approx(0.5) and k4["rope_ratio"] == pytest.approx(2.0) and k4["impl"] == "cuda"
    k5 = t.iloc[1]
    assert k5["bw"] == pytest.approx(0.75)
    assert all(v is None or v != v for v in (k5["ms_rope"], k5["bw_rope"], k5["rope_ratio"]))   # None or NaN: blank
    root = tmp_path / "repo"
    (root / "benchmarks" / "results").mkdir(parents=True)
    assert "Not measured yet" in profile.kernel_section_markdown(root)
    (root / profile.KERNEL_BENCH).write_text(path.read_text())
    md = profile.kernel_section_markdown(root)
    assert "(NVIDIA H200, 2026-12-02 12:10 UTC" in md and "| k4v4 | cuda | 3 | 0.125 | 100.0% | 0.250 | 50.0% | 2.00x |" in md
    assert "| k5v4 | triton | 13 | 1.000 | 75.0% |  |  |  |" in md
    assert "Reached here without the correction: k4v4 at batch 3; with it: none." in md
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"batches": []}))
    with pytest.raises(ValueError, match="bad.json: not a decode_side_by_side.py --rope result"):
        profile.kernel_bandwidth_table(bad)
    bad.write_text("| a markdown table |")
    with pytest.raises(ValueError, match="bad.json: not a decode_side_by_side.py --rope result .not JSON"):
        profile.kernel_bandwidth_table(bad)
    with pytest.raises(ValueError, match="bad.json: not a step-profile result .not JSON"):
        profile.profile_table([bad])


@pytest.mark.gpu
@pytest.mark.vllm
def test_step_profile_on_the_gpu(tmp_path):
    """The script end to end at a small size (2 users x 4,096 tokens, k4v4): the file holds a breakdown per batch whose
    parts add up and a bound below the timed step."""
    out = tmp_path / "p.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "step_profile.py"), "--mode", "kvrepro:k4v4",
                        "--users", "2,1", "--prompt-tokens", "4096", "--steps", "4", "--out", str(out)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600, env=dict(os.environ))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    for b in res["batches"]:
        m = b["breakdown"]["mean"]
        assert m["attention_ms"] > 0 and m["gemm_ms"] > 0
        assert m["attention_ms"] + m["gemm_ms"] + m["rest_ms"] == pytest.approx(m["kernel_ms"])
        assert b["bound"]["step_ms"] < b["timed"]["step_ms"]
        assert b["breakdown"]["top_kernels"]["attention"][0]["name"].startswith("kvrepro_decode_")


class _FakeEngine:
    """vLLM's in-process engine as the script drives it: one token per live request per step; the profiler writes a
    Chrome trace of the steps it saw (one graph launch per step: attention 0.2 ms x users, GEMM 1 ms)."""

    def __init__(self, trace_dir):
        import types

        self.live, self.trace_dir, self.profiling, self.seen = {}, Path(trace_dir), False, []
        self.vllm_config = types.SimpleNamespace(cache_config=types.SimpleNamespace(num_gpu_blocks=1000))

    def add_request(self, rid, prompt, params):
        self.live[rid] = 0

    def abort_request(self, rids):
        for r in rids:
            self.live.pop(r, None)

    def step(self):
        import types

        outs = []
        for rid in list(self.live):
            self.live[rid] += 1
            outs.append(types.SimpleNamespace(request_id=rid, outputs=[types.SimpleNamespace(token_ids=[7])],
                                              finished=False))
        if self.profiling:
            self.seen.append(len(self.live))
        return outs

    def write_trace(self):
        ev, t, corr = [], 1000, 1
        for n in self.seen:
            ev.append(_x("user_annotation", f"execute_context_0(0)_generation_{n}({n})", t, 50))
            ev.append(_x("cuda_runtime", "cudaGraphLaunch", t + 5, 5, correlation=corr))
            ev.append(_x("kernel", "kvrepro_decode_k4v4", t + 20, 200 * n, correlation=corr, grid=[n, 8, 1]))
            ev.append(_x("kernel", "nvjet_tst_gemm", t + 30 + 200 * n, 1000, correlation=corr))
            t, corr = t + 5000, corr + 1
        path = self.trace_dir / f"rank0.{len(list(self.trace_dir.iterdir()))}.pt.trace.json.gz"
        with gzip.open(path, "wt") as f:
            json.dump({"traceEvents": ev}, f)
        self.seen = []


def test_step_profile_drives_the_engine_and_writes_its_file(tmp_path, monkeypatch, capsys):
    """The script's measure/main on the CPU against a stand-in engine (vLLM's API as the script calls it): batches
    largest first, one trace per batch read back, bound from kvrepro.capacity and the copy bandwidth, file written."""
    import types

    import torch

    sp = _script()
    made = {}

    class LLM:
        def __init__(self, **kw):
            made["kw"] = kw
            self.llm_engine = _FakeEngine(kw["profiler_config"]["torch_profiler_dir"])

        def start_profile(self, prefix=None):
            self.llm_engine.profiling = True

        def stop_profile(self):
            self.llm_engine.profiling = False
            self.llm_engine.write_trace()

        def get_metrics(self):
            return []

        def collective_rpc(self, fn):
            return [["CUSTOM"]]

    fake = types.ModuleType("vllm")
    fake.__version__, fake.LLM = "0.20.2", LLM
    fake.SamplingParams = lambda **kw: kw
    sp_mod = types.ModuleType("vllm.sampling_params")
    sp_mod.RequestOutputKind = types.SimpleNamespace(DELTA="delta")
    monkeypatch.setitem(sys.modules, "vllm", fake)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sp_mod)
    props = types.SimpleNamespace(name="Fake GPU", total_memory=143771 * 2**20)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i=0: props)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    import benchmarks.common as bc

    monkeypatch.setattr(bc, "copy_bandwidth", lambda nbytes=4 << 30: {"bytes": nbytes, "ms": 1.0,
                                                                      "GBps_read_plus_write": 4000.0})
    monkeypatch.setattr(sp.sweep, "measurement_blockers", lambda info=None: [])
    from kvrepro.vllm_backend import runtime

    monkeypatch.setattr(runtime, "settings_record", lambda: {"preset": "k4v4"})
    out = tmp_path / "p.json"
    assert sp.main(["--mode", "kvrepro:k4v4", "--users", "3,1", "--prompt-tokens", "64", "--steps", "4",
                    "--out", str(out)]) == 0
    assert made["kw"]["attention_backend"] == "CUSTOM" and made["kw"]["max_model_len"] == 64 + sp.MAX_NEW_TOKENS + 64
    res = json.loads(out.read_text())
    assert [b["users"] for b in res["batches"]] == [3, 1] and res["engine"]["attention_backend_resolved"] == ["CUSTOM"]
    b3, b1 = res["batches"]
    assert b3["breakdown"]["decode_steps"] == 4 and b3["breakdown"]["users"] == 3
    assert b3["breakdown"]["mean"]["attention_ms"] == pytest.approx(0.6)     # 0.2 ms x 3 users, as the trace says
    assert b1["breakdown"]["mean"]["attention_ms"] == pytest.approx(0.2)
    assert b3["breakdown"]["top_kernels"]["attention"][0]["grid"] == [3, 8, 1]
    from kvrepro import capacity

    cfg = capacity.load_model_config()
    want = profile.decode_bound(3, b3["context_tokens_mean"], capacity.bytes_per_token("k4v4", cfg),
                                cfg.weights_bytes, 4000.0)
    assert b3["bound"] == pytest.approx(want)
    assert b3["timed"]["steps"] == 4 and b3["timed"]["tokens"] == 3 * 4
    assert res["provenance"]["kvrepro_src_sha256"] and res["kv_bytes_per_token"] == 36 * 8 * 134
    printed = capsys.readouterr().out
    assert "kvrepro:k4v4 3 users: timed step" in printed and f"wrote {out}" in printed


@pytest.mark.parametrize("args,msg", [(["--rope", "--batches", "-3"], "--batches takes positive integers, got [-3]"),
                                      (["--ctxs", "0"], "--ctxs takes positive integers, got [0]"),
                                      (["--launch", "64,2"], "--launch goes with --rope")])
def test_decode_benchmark_refuses_bad_arguments_before_it_needs_a_gpu(args, msg):
    """benchmarks/decode_side_by_side.py (the kernel table's source) names a bad argument and exits 2, on any machine."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_side_by_side.py"), *args],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and msg in r.stderr, (r.returncode, r.stderr[-500:])


def test_step_section_footnote_names_the_fatbin_and_flags_an_earlier_build():
    """The step table's footnote gives each kvrepro profile's CUDA fatbin and says when it is not the committed one
    (the committed profiles of rope-mean ran kernels since replaced); files without one (vLLM's own modes) get none."""
    from kvrepro.ops.cuda_decode import read_manifest
    now = read_manifest()["fatbin_sha256"]
    assert profile._fatbin_note(now, now) == f"; CUDA fatbin {now[:8]}"
    old = "7787629efbb8764f558e42f6a7fc0fc6c57426d856721b9e793d14e7b1d9650f"
    assert profile._fatbin_note(old, now) == (f"; CUDA fatbin 7787629e, not the committed {now[:8]}: measured_fatbins.json "
                                         "says which kernels differ")
    assert profile._fatbin_note(None, now) == "" and profile._fatbin_note(float("nan"), now) == ""
    text = profile.section_markdown(ROOT)
    fatbins = {json.loads(f.read_text())["engine"].get("kvrepro_settings", {}).get("cuda_fatbin_sha256")
               for f in (ROOT / "results/profile").glob("*.json")} - {None}
    assert fatbins, "the committed profiles include kvrepro's"
    for sha in fatbins:                     # each kvrepro profile's fatbin, flagged exactly when it is an earlier one
        assert f"CUDA fatbin {sha[:8]}" in text
        assert (f"CUDA fatbin {sha[:8]}, not the committed" in text) == (sha != now)


def _goal_case(tmp_path, read_gbps, gpu="NVIDIA H200", fatbin=None, mean=None):
    """A root with one kvrepro profile (decoded with the committed fatbin unless ``fatbin``) and a step_floor.json
    whose fastest read is ``read_gbps`` against a copy bandwidth of 4000 GB/s. By hand: the bound's 19 ms over 0.95
    is a 20 ms step; GEMMs 3, rest 1 (kvrepro's store 0.4, rope_offset 0.2 and rope_terms 0.1, vLLM's 0.3), idle
    0.5 ms; so 64e9 KV bytes must be read in 20 - 3 - 1 - 0.5 = 15.5 ms (4129.0 GB/s, 103.2% of the profile's 4000
    GB/s), or in 16.2 ms (3950.6 GB/s) with kvrepro's 0.7 ms free."""
    from kvrepro.ops.cuda_decode import read_manifest

    d = tmp_path / "results" / "profile"
    d.mkdir(parents=True)
    mean = mean or {"attention_ms": 16.5, "gemm_ms": 3.0, "rest_ms": 1.0, "gpu_idle_ms": 0.5}
    top = {"kv_store": [{"name": "store_kv_kernel", "ms_per_step": 0.4}],
           "other": [{"name": "rope_offset_kernel", "ms_per_step": 0.2},
                     {"name": "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "ms_per_step": 0.3},
                     {"name": "rope_terms_kernel", "ms_per_step": 0.1}],
           "attention": [{"name": "kvrepro_decode_k4v4_rope", "ms_per_step": 16.5}]}
    bound = {"kv_bytes": 64e9, "weights_bytes": 8e9, "copy_gbps": 4000.0, "step_ms": 19.0}
    path = d / "k.json"
    path.write_text(json.dumps({
        "mode": "kvrepro:k4v4", "date": "2026-12-04T08:00:00+00:00", "provenance": {"gpu": gpu},
        "engine": {"attention_backend": "CUSTOM", "kvrepro_settings": {
            "key_offset": "rope-mean", "cuda_fatbin_sha256": fatbin or read_manifest()["fatbin_sha256"]}},
        "batches": [{"users": 13, "timed": {"step_ms": 21.0, "tok_s": 619.0},
                     "breakdown": {"mean": mean, "top_kernels": top}, "bound": bound}]}))
    floor = tmp_path / profile.STEP_FLOOR
    floor.parent.mkdir(parents=True)
    floor.write_text(json.dumps({"provenance": {"gpu": "NVIDIA H200", "date_utc": "2026-12-04T14:32:26+00:00"},
                                 "copy_bandwidth": {"GBps_read_plus_write": 4000.0},
                                 "read": [{"op": "torch.amax", "GBps_read": read_gbps - 10},
                                          {"op": "torch.sum", "GBps_read": read_gbps}]}))
    return path


def test_goal_columns_and_text_against_hand_figures(tmp_path):
    path = _goal_case(tmp_path, 3900.0)
    r = profile.profile_table([path]).iloc[0]
    assert r["kvrepro_rest_ms"] == pytest.approx(0.7) and r["copy_gbps"] == 4000.0
    assert r["goal_attention_gbps"] == pytest.approx(64e9 / 15.5e-3 / 1e9)
    assert r["goal_attention_bw"] == pytest.approx(64e9 / 15.5e-3 / 1e9 / 4000)
    assert r["goal_attention_gbps_free"] == pytest.approx(64e9 / 16.2e-3 / 1e9)
    assert profile.read_bandwidth(tmp_path) == {"gpu": "NVIDIA H200", "GBps": 3900.0, "of_copy": 0.975,
                                                "op": "torch.sum", "ops": 2, "date": "2026-12-04"}
    md = profile.section_markdown(tmp_path)
    assert "| 103% | [1] |" in md
    assert "the fastest of 2 PyTorch reductions over 4 GiB, torch.sum) reaches 3,900 GB/s, 97.5% of the copy" in md
    assert ("- kvrepro:k4v4, 13 users: 4,129 GB/s; 3,951 GB/s without kvrepro's 0.70 ms of store and offset "
            "kernels") in md
    assert ("So each of these needs a faster read than the bare read's 3,900 GB/s, even with kvrepro's own kernels "
            "outside the attention free") in md


@pytest.mark.parametrize("read, verdict", [
    (4000.0, "So each of these needs a faster read than the bare read's 4,000 GB/s with the rest of its step as it "
             "is; kvrepro:k4v4 at 13 users would need less than that only with kvrepro's store and offset kernels free"),
    (4200.0, "So kvrepro:k4v4 at 13 users could reach 95% with an attention reading at the rate given, below the "
             "bare read's 4,200 GB/s")])
def test_goal_verdict_follows_the_read_bandwidth(tmp_path, read, verdict):
    _goal_case(tmp_path, read)
    assert verdict in profile.section_markdown(tmp_path)


def test_goal_lines_only_for_the_committed_kernel_and_the_read_bandwidths_gpu(tmp_path):
    for root, kw in (("gpu", {"gpu": "NVIDIA A100-SXM4-80GB"}), ("fatbin", {"fatbin": "0" * 64})):
        _goal_case(tmp_path / root, 3900.0, **kw)
        md = profile.section_markdown(tmp_path / root)
        assert "reaches 3,900 GB/s" in md and "The read rate 95% needs" not in md and "So " not in md.split(
            "reaches 3,900 GB/s")[1].split("\n\n- [1]")[0]
    floor = tmp_path / "gpu" / profile.STEP_FLOOR
    floor.unlink()
    md = profile.section_markdown(tmp_path / "gpu")
    assert "Attention for 95%: the share of the copy bandwidth" in md and "bare read" not in md
    for bad in ("{}", json.dumps({"read": [{"op": "torch.sum", "GBps_read": "fast"}],
                                  "copy_bandwidth": {"GBps_read_plus_write": 4000.0}}),
                json.dumps({"read": [{"op": "torch.sum", "GBps_read": 4000.0}], "copy_bandwidth": {}})):
        floor.write_text(bad)
        with pytest.raises(ValueError, match="step_floor.json: no read rows with a positive GBps_read"):
            profile.section_markdown(tmp_path / "gpu")


@pytest.mark.parametrize("mean", [
    {"attention_ms": 16.5, "gemm_ms": 3.0, "rest_ms": float("nan"), "gpu_idle_ms": 0.5},
    {"attention_ms": 16.5, "gemm_ms": 3.0, "rest_ms": 1.0},                      # no idle time recorded
    {"attention_ms": 16.5, "gemm_ms": None, "rest_ms": 1.0, "gpu_idle_ms": 0.5}])
def test_goal_is_blank_when_an_input_is_missing_or_not_finite(tmp_path, mean):
    """A NaN or missing part leaves the goal blank (not "none", not a verdict), instead of a guess."""
    path = _goal_case(tmp_path, 3900.0, mean=mean)
    r = profile.profile_table([path]).iloc[0]
    assert r["goal_attention_gbps"] is None or r["goal_attention_gbps"] != r["goal_attention_gbps"]
    md = profile.section_markdown(tmp_path)
    assert "The read rate 95% needs" not in md and "| none |" not in md


def test_goal_is_none_when_the_rest_fills_the_step(tmp_path):
    path = _goal_case(tmp_path, 3900.0, mean={"attention_ms": 16.5, "gemm_ms": 19.0, "rest_ms": 1.0,
                                               "gpu_idle_ms": 0.5})
    r = profile.profile_table([path]).iloc[0]
    assert r["goal_attention_gbps"] == math.inf and r["goal_attention_bw"] == math.inf
    assert "| none | [1] |" in profile.section_markdown(tmp_path)


def test_committed_profiles_need_more_than_a_bare_read():
    """The figures notes/vllm.md states, from the committed files: every kvrepro profile of the committed kernel needs
    the attention to read faster than the committed bare read, with the rest as measured and with kvrepro's own
    kernels outside the attention free; vLLM's GEMMs read at 71-74% of the copy bandwidth in step_floor.json."""
    from kvrepro.ops.cuda_decode import read_manifest

    root = Path(__file__).resolve().parents[1]
    read = profile.read_bandwidth(root)
    assert read["gpu"] == "NVIDIA H200" and 1.0 < read["of_copy"] < 1.06
    t = profile.profile_table(sorted((root / profile.PROFILE_DIR).glob("*.json")))
    kv = t[t["mode"].str.startswith("kvrepro") & (t["fatbin"] == read_manifest()["fatbin_sha256"])]
    assert len(kv) >= 3
    assert (kv["goal_attention_gbps_free"] > read["GBps"]).all() and (kv["goal_attention_bw"] > 1.05).all()
    floor = json.loads((root / profile.STEP_FLOOR).read_text())
    assert all(0.70 <= g["of_copy"] <= 0.74 for g in floor["gemms"])
