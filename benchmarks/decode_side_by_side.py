"""Decode attention side by side on one GPU: kvrepro (each preset) vs vLLM 0.20.2's FA3 (bf16 and
fp8 paged KV) and vLLM's in-tree TurboQuant decode kernel, at Qwen3-4B shapes (32 q / 8 KV heads,
head_dim 128, block_size 16, shuffled block tables), plus the copy bandwidth of the same run.

Needs a CUDA GPU and vLLM 0.20.2 (the ``vllm`` extra or the conda environment of environment.yml):

    PYTHONPATH=. python benchmarks/decode_side_by_side.py [--ctxs 131072] [--out PATH]

Writes ``--out`` (default ``benchmarks/results/decode_side_by_side.json``: provenance, copy bandwidth, one row per
kernel, context and batch), write-then-rename after each context length.

Time per step = median of ``triton.testing.do_bench`` (L2 flushed before every call), one
attention layer, kvrepro with its defaults. Every kernel is timed twice in the same process: eager
launches (``ms``) and one call captured in a CUDA graph and replayed (``ms_graph``; as vLLM serves
decode; ``graph_error`` if a kernel cannot be captured), so ratios can be taken within one method.
``--rope``: the cost of the key offset rope-mean's score correction instead (no vLLM needed): kvrepro's default kernel
for every preset (the CUDA kernel on sm_80+) without and with ``rope_bias`` (rows
``kvrepro_<preset>`` and ``kvrepro_<preset>_rope``) and, for the CUDA presets, the Triton kernel without and with it
(``kvrepro_<preset>_triton``, ``kvrepro_<preset>_triton_rope``); ``--launch 64,2 ...`` adds each preset's Triton kernel
at other launches (``kvrepro_k5v4_triton_b64w2``, ``..._rope``), batches 3 / 6 / 13 by
default, into ``benchmarks/results/decode_rope_mean.json``; the lines printed at the end give each rope row's time
over its preset's row without the correction (eager and graph).
"KV bytes" = the bytes of KV (codes + scales) the step must read once. Each row records ``impl``: the kernel that ran
(``cuda`` / ``triton`` for kvrepro, as ``decode.resolve_impl`` picks it for the row's arguments; ``vLLM`` otherwise).
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.common import (BS, D, HKV, HQ, RESULTS, bench, copy_bandwidth, parse_launch,  # noqa: E402
                               provenance, random_pool, write_json)
from kvrepro.ops import decode, decode_attention  # noqa: E402

CTXS = (32768, 131072)
BATCHES = (1, 3, 6, 13)
OUT = os.path.join(RESULTS, "decode_side_by_side.json")
OUT_ROPE = os.path.join(RESULTS, "decode_rope_mean.json")
ROPE_BATCHES = (3, 6, 13)


def block_table(batch, ctx, num_blocks, gen):
    nb = ctx // BS
    return torch.randperm(num_blocks, device="cuda", generator=gen)[: batch * nb].reshape(batch, nb).to(torch.int32)


def fa3_case(dtype_name, batch, ctx, gen):
    from vllm.vllm_flash_attn import flash_attn_varlen_func
    nb = batch * ctx // BS + 8
    kc = torch.randn(nb, BS, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    vc = torch.randn(nb, BS, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    kw = {}
    if dtype_name == "fp8":
        kc, vc, q = kc.to(torch.float8_e4m3fn), vc.to(torch.float8_e4m3fn), q.to(torch.float8_e4m3fn)
        one = torch.ones(batch, HKV, device="cuda", dtype=torch.float32)
        kw = {"q_descale": one, "k_descale": one, "v_descale": one}
    bt = block_table(batch, ctx, nb, gen)
    cu = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    sl = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    out = torch.empty(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    fn = lambda: flash_attn_varlen_func(q=q, k=kc, v=vc, out=out, cu_seqlens_q=cu, max_seqlen_q=1,  # noqa: E731
                                        seqused_k=sl, max_seqlen_k=ctx, softmax_scale=D ** -0.5, causal=True,
                                        block_table=bt, fa_version=3, **kw)
    return bench(fn), batch * ctx * HKV * D * 2 * kc.element_size(), "vLLM"


def turboquant_case(preset, batch, ctx, gen):
    from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
    from vllm.model_executor.layers.quantization.turboquant.config import TurboQuantConfig
    from vllm.v1.attention.ops.triton_turboquant_decode import triton_turboquant_decode_attention
    cfg = TurboQuantConfig.from_cache_dtype(preset, D)
    nb = batch * ctx // BS + 8
    cache = torch.randint(0, 256, (nb, BS, HKV, cfg.slot_size_aligned), device="cuda", dtype=torch.uint8, generator=gen)
    h = torch.ones(1, 1, device="cuda")
    while h.shape[0] < D:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    pi = (h / D ** 0.5).contiguous()
    cent = get_centroids(D, cfg.centroid_bits).to("cuda")
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    bt = block_table(batch, ctx, nb, gen)
    sl = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    fn = lambda: triton_turboquant_decode_attention(  # noqa: E731
        query=q, kv_cache=cache, block_table=bt, seq_lens=sl, Pi=pi, centroids=cent, scale=D ** -0.5,
        mse_bits=cfg.key_mse_bits, key_packed_size=cfg.key_packed_size,
        value_quant_bits=cfg.effective_value_quant_bits, key_fp8=cfg.key_fp8,
        norm_correction=cfg.norm_correction, PiT=pi.T.contiguous(), max_num_kv_splits=32)
    return bench(fn), batch * ctx * HKV * cfg.slot_size_aligned, "vLLM"


def rope_bias_args(batch, gen):
    """A rope-mean ``rope_bias`` of the runtime's form: terms float32 [batch, HQ, 16] (A, B of ~|q| x |b_hat| with a
    bias of norm 1000) and 8 pairs per KV head among RoPE's frequencies at theta 1e6 (the fastest, 1 rad per position,
    in each)."""
    from kvrepro.formats.offset import MAX_PAIRS, rope_inv_freq
    terms = 300 * torch.randn(batch, HQ, 2 * MAX_PAIRS, device="cuda", generator=gen)
    inv = rope_inv_freq(D, 1e6).to("cuda")
    pick = torch.stack([torch.cat([torch.zeros(1, dtype=torch.long, device="cuda"),
                                   1 + torch.randperm(D // 2 - 1, device="cuda", generator=gen)[:MAX_PAIRS - 1]])
                        for _ in range(HKV)])
    return terms.contiguous(), inv[pick].contiguous()


def kvrepro_case(preset, batch, ctx, gen, rope=False, **kw):
    nb = batch * ctx // BS + 8
    pool = random_pool(preset, nb, HKV, D, BS, "cuda", gen)
    bt = block_table(batch, ctx, nb, gen)
    sl = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = torch.empty_like(q)
    if rope:
        kw["rope_bias"] = rope_bias_args(batch, gen)
    fn = lambda: decode_attention(q, pool.data, bt, sl, pool.layout, pool.rotation, D ** -0.5, out=out, **kw)  # noqa: E731
    # the kernel decode_attention picks for these arguments (its own rule), recorded with the row
    impl = decode.resolve_impl(kw.get("impl"), pool.layout, HQ // HKV, q.device,
                               tuple(k for k in decode.TRITON_OPTIONS if kw.get(k) is not None))
    return bench(fn), batch * ctx * HKV * pool.layout.bytes_per_token, impl


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=OUT, help=f"result file (default {os.path.relpath(OUT)})")
    ap.add_argument("--ctxs", type=int, nargs="+", default=list(CTXS), help="context lengths (tokens)")
    ap.add_argument("--key-mma", nargs="+", default=[decode.DEFAULT_KEY_MMA], choices=decode.KEY_MMAS,
                    help="key paths of the Triton kernel to time (rows kvrepro_<preset> for each preset's default "
                         "kernel: the CUDA kernel for k4v4, k8v4 and k4v2 (the presets this mode times); kvrepro_<preset>_triton; "
                         "kvrepro_<preset>_triton_<key_mma> for other key paths)")
    ap.add_argument("--rope", action="store_true",
                    help="time the rope-mean correction (kvrepro kernels without / with rope_bias) instead; no vLLM")
    ap.add_argument("--launch", nargs="*", default=[],
                    help="with --rope: each preset's Triton kernel also at these block_n,num_warps launches, "
                         "without / with the correction (rows kvrepro_<preset>_triton_b<block_n>w<warps>[_rope]), e.g. 64,2")
    ap.add_argument("--batches", type=int, nargs="+", default=None,
                    help=f"batches (default {list(BATCHES)}; {list(ROPE_BATCHES)} with --rope)")
    args = ap.parse_args()
    try:
        args.launch = [parse_launch(x) for x in args.launch]
    except ValueError as e:
        ap.error(str(e))
    if args.launch and not args.rope:
        ap.error("--launch goes with --rope")
    for name, vals in (("--ctxs", args.ctxs), ("--batches", args.batches or [])):
        if any(v < 1 for v in vals):
            ap.error(f"{name} takes positive integers, got {vals}")
    if not torch.cuda.is_available():
        raise SystemExit("decode_side_by_side.py needs a CUDA device (it times GPU kernels); none found")
    if args.rope:
        return main_rope(args)
    try:
        import vllm
    except ImportError as e:
        raise SystemExit(f"decode_side_by_side.py needs vLLM (0.20.2) for FA3 and TurboQuant: {e}") from None
    gen = torch.Generator(device="cuda").manual_seed(7)
    res = {"provenance": provenance({"script": "benchmarks/decode_side_by_side.py", "vllm": vllm.__version__,
                                     "kvrepro_default_key_mma": decode.DEFAULT_KEY_MMA, "key_mma": args.key_mma}),
           "copy_bandwidth": copy_bandwidth(), "rows": []}
    bw = res["copy_bandwidth"]["GBps_read_plus_write"]
    cases = {"bf16_fa3": lambda b, c: fa3_case("bf16", b, c, gen),
             "fp8_fa3": lambda b, c: fa3_case("fp8", b, c, gen),
             "turboquant_4bit_nc": lambda b, c: turboquant_case("turboquant_4bit_nc", b, c, gen),
             "turboquant_k8v4": lambda b, c: turboquant_case("turboquant_k8v4", b, c, gen),
             }
    for preset in ("k4v4", "k8v4", "k4v2"):       # the default kernel of each preset (the CUDA kernel on sm_80+)
        cases[f"kvrepro_{preset}"] = lambda b, c, preset=preset: kvrepro_case(preset, b, c, gen)
    for mma in args.key_mma:                       # the Triton kernel with each key path
        for preset in ("k4v4", "k8v4", "k4v2"):
            name = f"kvrepro_{preset}_triton" + ("" if mma == decode.DEFAULT_KEY_MMA else f"_{mma}")
            cases[name] = lambda b, c, preset=preset, mma=mma: kvrepro_case(preset, b, c, gen, key_mma=mma)
    run_cases(cases, args.ctxs, args.batches or BATCHES, res, bw, args.out)


def run_cases(cases, ctxs, batches, res, bw, out):
    """Time every case at every context and batch into ``res["rows"]``, writing ``out`` after each context."""
    for ctx in ctxs:
        for batch in batches:
            for name, fn in cases.items():
                try:
                    (ms, gms, gerr), nbytes, impl = fn(batch, ctx)
                    row = {"kernel": name, "impl": impl, "ctx": ctx, "batch": batch, "ms": ms, "kv_bytes": nbytes,
                           "GBps": nbytes / ms / 1e6, "pct_copy": 100 * nbytes / ms / 1e6 / bw, "ms_graph": gms}
                    if gms:
                        row["pct_copy_graph"] = 100 * nbytes / gms / 1e6 / bw
                    if gerr:
                        row["graph_error"] = gerr
                except Exception as e:
                    row = {"kernel": name, "ctx": ctx, "batch": batch, "error": "".join(traceback.format_exception(e))[-800:]}
                res["rows"].append(row)
                torch.cuda.empty_cache()
            write_json(out, res)
    for r in res["rows"]:
        print(r["kernel"], r["ctx"], r["batch"], "eager", round(r.get("ms", -1), 4), "graph",
              round(r.get("ms_graph") or -1, 4), round(r.get("pct_copy_graph") or -1, 1),
              (r.get("error", "") or r.get("graph_error", ""))[-120:])


def main_rope(args):
    """``--rope``: kvrepro's default kernel without / with rope_bias and the Triton kernel with it."""
    from kvrepro.ops import cuda_decode
    gen = torch.Generator(device="cuda").manual_seed(7)
    out = OUT_ROPE if args.out == OUT else args.out
    res = {"provenance": provenance({"script": "benchmarks/decode_side_by_side.py --rope",
                                     "rope_kernels": list(cuda_decode.ROPE_KERNELS.values())}),
           "copy_bandwidth": copy_bandwidth(), "rows": []}
    cases = {}
    for preset in ("k4v4", "k8v4", "k4v2", "k5v4"):
        cases[f"kvrepro_{preset}"] = lambda b, c, preset=preset: kvrepro_case(preset, b, c, gen)
        cases[f"kvrepro_{preset}_rope"] = lambda b, c, preset=preset: kvrepro_case(preset, b, c, gen, rope=True)
        for bn, w in args.launch:                         # the Triton kernel at other launches
            name = f"kvrepro_{preset}_triton_b{bn}w{w}"
            cases[name] = lambda b, c, preset=preset, bn=bn, w=w: kvrepro_case(preset, b, c, gen, impl="triton",
                                                                             block_n=bn, num_warps=w)
            cases[f"{name}_rope"] = lambda b, c, preset=preset, bn=bn, w=w: kvrepro_case(
                preset, b, c, gen, rope=True, impl="triton", block_n=bn, num_warps=w)
        cases[f"kvrepro_{preset}_triton"] = lambda b, c, preset=preset: kvrepro_case(preset, b, c, gen, impl="triton")
        cases[f"kvrepro_{preset}_triton_rope"] = lambda b, c, preset=preset: kvrepro_case(preset, b, c, gen, rope=True,
                                                                                          impl="triton")
    run_cases(cases, args.ctxs if args.ctxs != list(CTXS) else [131072], args.batches or ROPE_BATCHES, res,
              res["copy_bandwidth"]["GBps_read_plus_write"], out)
    base = {(r["kernel"], r["ctx"], r["batch"]): r for r in res["rows"] if "ms" in r}
    for (name, ctx, batch), r in base.items():
        ref = base.get((name.replace("_triton_rope", "").replace("_triton", "").replace("_rope", ""), ctx, batch))
        if (name.endswith("rope") or name.endswith("_triton")) and ref:
            print(f"{name} ({r['impl']}) ctx {ctx} batch {batch}: {r['ms']:.4f} ms eager, x{r['ms'] / ref['ms']:.3f} "
                  f"of {ref['kernel']} ({ref['impl']}); graph "
                  + (f"x{r['ms_graph'] / ref['ms_graph']:.3f}" if r.get("ms_graph") and ref.get("ms_graph") else "-"))


if __name__ == "__main__":
    main()
