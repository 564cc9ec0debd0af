"""One GPU call: the CUDA decode kernel at 128K per split count, and variants of it, side by side.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/cuda_split_waves.py --out $OUT [--preset k4v4|k8v4|k4v2] \
        [--variant NAME=PATH.fatbin ...] [--three-launch PATH.fatbin] [--trace PATH.fatbin] [--rule-only]

For batch 1 / 3 / 6 / 13 (Qwen3-4B shapes: 32 q / 8 KV heads, head_dim 128, ``--preset`` pages (default k4v4), block
16, context 131,072)
and for each split count S of a list (the rule's count, powers of two, and the counts that give exactly one, two or
three waves of the kernel's 4 resident CTAs per SM: ``k x 4 x SMs / (B x 8)``), time from CUDA graphs
(``side_by_side_vllm.bench``: median of replays) one decode step, ``decode_attention(impl="cuda", num_splits=S)``:
  - ``committed``: the committed fatbin (one launch: query rotation, attention, split merge);
  - ``--variant NAME=PATH``: another build of the same source (e.g. ``-DKVREPRO_STAGES_K4V2=8``), same launch (only the
    preset's kernel is looked up, so builds older than that preset's kernel cannot be variants of it);
  - ``--three-launch PATH``: a fatbin of the earlier kernel (rotated float16 query in, partials out) with the Triton
    ``rotate_query_kernel`` before it and ``merge_splits_kernel`` after it, as before the fusion.
``--trace PATH``: a build with ``-DKVREPRO_TRACE=4096`` (``%globaltimer`` stamps per CTA: start, query ready, own
loop end, all warps' loop end, counted in, merge end; and the SM id), launched once per batch at the rule's split
count after an L2 flush; the stamps' spread says where a step's time goes (``trace`` in the JSON).
``--rule-only``: time only the rule's split count (and ``--extra-splits``).
Each timed output is checked against float64 attention over the dequantized pages (``paged_attention_ref``).
``--three-launch`` takes a k4v4 build (``--preset k4v4``); ``--trace`` a build holding the preset's kernel.
% of copy bandwidth = the pages' bytes (B x 131,072 x 8 heads x bytes per token: 134 B for k4v4) / time / the copy bandwidth measured in the
same run (read + write), as in ``side_by_side_vllm``. Writes ``$OUT/cuda_split_waves.json`` (provenance, every row;
write-then-rename after each batch). Budget ~150 s on an H200. First run (three-launch kernel only): H200 run 25.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import benchmarks.run_h200 as rh  # noqa: E402
from benchmarks.common import copy_bandwidth, provenance, write_json  # noqa: E402
from benchmarks.side_by_side_vllm import bench  # noqa: E402
from kvrepro.ops import cuda_decode, decode_attention, decode_workspace_numel, default_num_splits  # noqa: E402
from kvrepro.ops.decode import LOG2E, sm_count  # noqa: E402
from kvrepro.ops.kernels.rotate import merge_splits_kernel, rotate_query_kernel  # noqa: E402
from kvrepro.reference import paged_attention_ref  # noqa: E402

CTX, HQ, HKV, D = 131072, 32, 8, 128
CTAS_PER_SM = 4        # the kernel's __launch_bounds__(128, 4); run 24: 4 resident CTAs per SM


def candidates(batch: int, sms: int, rule: int) -> list[int]:
    waves = [k * CTAS_PER_SM * sms // (batch * HKV) for k in (1, 2, 3)]
    return sorted({s for s in [rule, 16, 32, 64, *waves] if 1 <= s <= 256})


def three_launch(mod, q, pool, bt, sl, out, ws, s, scale):
    """The kernel as it was before the fusion: Triton query rotation, the attention kernel, Triton split merge."""
    b = q.shape[0]
    n_o = b * HQ * s * D
    part_o, part_lse = ws[:n_o], ws[n_o:n_o + b * HQ * s]
    q16 = ws[n_o + b * HQ * s:].view(torch.float16)[: b * HQ * D]
    rotate_query_kernel[(b * HQ,)](q, pool.rotation, q16, q.stride(0), q.stride(1), scale * LOG2E, HQ=HQ, D=D)
    mod.launch((b, HKV * s, 1), [q16, pool.data, bt, sl, part_o, part_lse, bt.stride(0), s, HKV, HQ // HKV],
               torch.cuda.current_stream().cuda_stream, (4, 4))
    merge_splits_kernel[(b * HQ,)](part_o, part_lse, pool.rotation, out, out.stride(0), out.stride(1), HQ=HQ, D=D,
                                   NUM_SPLITS=s, SP=1 << (s - 1).bit_length())


TRACE_SLOTS = ("start", "query_ready", "loop_end_warp0", "loop_end_all", "counted_in", "merge_end")


def trace_step(mod, fn, n_ctas: int) -> dict:
    """One launch of ``fn`` through the trace build ``mod`` after an L2 flush; the stamps (ns from the first CTA's
    start): per slot the minimum, median and maximum over the CTAs (the merge end over the merging CTAs), the SM
    count used and the raw stamps of every CTA."""
    import ctypes
    ptr, size = ctypes.c_uint64(), ctypes.c_size_t()
    rc = mod.lib.cuModuleGetGlobal_v2(ctypes.byref(ptr), ctypes.byref(size), mod.module, b"kvrepro_trace")
    if rc:
        raise RuntimeError(f"kvrepro_trace not in the trace build: {mod.error(rc)}")
    n_slots = size.value // 8 // 8
    if n_ctas > n_slots:
        raise ValueError(f"{n_ctas} CTAs, the trace build holds {n_slots}")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    mod.lib.cuMemsetD8_v2(ptr, 0, size.value)
    flush.zero_()
    fn()
    torch.cuda.synchronize()
    host = (ctypes.c_uint64 * (n_slots * 8))()
    rc = mod.lib.cuMemcpyDtoH_v2(host, ptr, ctypes.c_size_t(size.value))
    if rc:
        raise RuntimeError(f"reading kvrepro_trace: {mod.error(rc)}")
    t = torch.tensor(list(host), dtype=torch.float64).view(n_slots, 8)[:n_ctas]
    t0 = t[:, 0].min()
    out = {"n_ctas": n_ctas, "sms_used": int(t[:, 7].unique().numel()), "slots_us": {}}
    for k, name in enumerate(TRACE_SLOTS):
        col = t[:, k]
        col = col[col > 0]
        if col.numel():
            us = (col - t0) / 1e3
            out["slots_us"][name] = {"min": us.min().item(), "median": us.median().item(), "max": us.max().item(),
                                     "n": int(col.numel())}
    out["raw_ns_from_start"] = [[int(x - t0) if x > 0 and k < 7 else int(x) for k, x in enumerate(row.tolist())]
                                for row in t]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 3, 6, 13])
    ap.add_argument("--preset", default="k4v4", type=str.lower, choices=sorted(cuda_decode.PRESETS.values()),
                    help="compressed preset whose CUDA kernel is timed (default k4v4)")
    ap.add_argument("--variant", nargs="*", default=[], help="NAME=PATH of another fatbin of decode_k4v4.cu")
    ap.add_argument("--three-launch", default=None, help="fatbin of the earlier three-launch kernel")
    ap.add_argument("--trace", default=None, help="fatbin built with -DKVREPRO_TRACE=4096 (stamps per CTA)")
    ap.add_argument("--skews", type=int, nargs="*", default=[],
                    help="also time the committed build at these cuda_decode.RANK_SKEW values (and trace each)")
    ap.add_argument("--rule-only", action="store_true", help="time only the rule's split count and --extra-splits")
    ap.add_argument("--extra-splits", type=int, nargs="*", default=[], help="more split counts to time")
    a = ap.parse_args()
    # arguments first (they do not need a GPU), then the device
    if a.preset != "k4v4" and a.three_launch:
        ap.error(f"--three-launch takes a k4v4 build; got --preset {a.preset}")
    for v in a.variant:
        name, sep, p = v.partition("=")
        if not sep or not name or not p:
            ap.error(f"--variant takes NAME=PATH.fatbin, got {v!r}")
    for p in [v.partition("=")[2] for v in a.variant] + [a.three_launch, a.trace]:
        if p and not os.path.isfile(p):
            ap.error(f"no such fatbin: {p}")
    bad = [k for k in a.skews if not 0 <= k <= 255]
    if bad:
        ap.error(f"--skews must be in 0..255 (cuda_decode.RANK_SKEW's range), got {bad}")
    if not torch.cuda.is_available():
        raise SystemExit("cuda_split_waves.py needs a CUDA device")
    t0 = time.time()
    path = os.path.join(a.out, "cuda_split_waves.json")
    dev = torch.device("cuda", torch.cuda.current_device())
    sms = sm_count(dev)
    committed = cuda_decode.load(dev)
    mods = {"committed": committed}
    bits = {v: k for k, v in cuda_decode.PRESETS.items()}[a.preset]
    one = {bits: cuda_decode.KERNELS[bits]}            # the preset's kernel only: older builds hold fewer kernels
    k4 = {(4, 4): cuda_decode.KERNELS[(4, 4)]}
    for v in a.variant:
        name, p = v.split("=", 1)
        mods[name] = cuda_decode._Module(dev, p, one)
    old = cuda_decode._Module(dev, a.three_launch, k4) if a.three_launch else None
    tracer = cuda_decode._Module(dev, a.trace, one) if a.trace else None
    res = {"provenance": provenance({"script": "benchmarks/cuda_split_waves.py", "preset": a.preset, "ctx": CTX,
                                     "sms": sms,
                                     "ctas_per_sm": CTAS_PER_SM, "variants": a.variant,
                                     "three_launch": a.three_launch, "trace": a.trace,
                                     "fatbin_sha256": {f: cuda_decode._sha256(f) for f in
                                                       [v.split("=", 1)[1] for v in a.variant]
                                                       + [a.three_launch, a.trace] if f}}),
           "fatbin": cuda_decode.read_manifest(), "copy_bandwidth": copy_bandwidth(), "rows": []}
    copy_bw = res["copy_bandwidth"]["GBps_read_plus_write"]
    print(f"SMs {sms}, copy {copy_bw:.0f} GB/s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(7)
    scale = D ** -0.5
    default_skew = cuda_decode.RANK_SKEW

    def step(mod, q, pool, bt, sl, out, s, ws, skew=default_skew):
        """One decode step through the build ``mod`` with ``cuda_decode.RANK_SKEW = skew`` (restored after)."""
        cuda_decode._MODULES[dev.index] = mod          # the launch goes through this build
        cuda_decode.RANK_SKEW = skew
        try:
            decode_attention(q, pool.data, bt, sl, pool.layout, pool.rotation, scale, out=out, num_splits=s,
                             workspace=ws, impl="cuda")
        finally:
            cuda_decode.RANK_SKEW = default_skew

    for batch in a.batches:
        pool, bt, sl, q = rh.decode_setup(a.preset, CTX, batch, gen)
        nbytes = batch * CTX * HKV * pool.layout.bytes_per_token
        ref = paged_attention_ref(q, pool, bt, sl, torch.arange(batch + 1, device=dev), scale, dtype=torch.float64)
        rule = default_num_splits(batch, HKV, bt.shape[1] * 16, dev, "cuda")
        out = torch.empty_like(q)
        for skew in ([default_skew] + [k for k in a.skews if k != default_skew]) if tracer is not None else []:
            ws = torch.empty(decode_workspace_numel(batch, HQ, D, rule), device=dev, dtype=torch.float32)
            traced = lambda ws=ws, skew=skew: step(tracer, q, pool, bt, sl, out, rule, ws, skew)  # noqa: E731
            traced()                                            # warm-up (module, counters, signs)
            tr = trace_step(tracer, traced, batch * HKV * rule)
            cuda_decode._MODULES[dev.index] = committed
            tr.update({"batch": batch, "splits": rule, "rank_skew": skew,
                       "relerr_vs_f64": float(((out.double() - ref).norm() / ref.norm()).item())})
            res.setdefault("trace", []).append(tr)
            print("trace", batch, rule, "skew", skew, {k: {kk: round(vv, 2) for kk, vv in v.items()}
                                                        for k, v in tr["slots_us"].items()}, "SMs", tr["sms_used"],
                  flush=True)
        split_list = {rule} if a.rule_only else set(candidates(batch, sms, rule))
        for s in sorted(split_list | set(a.extra_splits)):
            ws = torch.empty(decode_workspace_numel(batch, HQ, D, s), device=dev, dtype=torch.float32)
            fns = {name: (lambda mod=mod, s=s, ws=ws: step(mod, q, pool, bt, sl, out, s, ws))
                   for name, mod in mods.items()}
            for skew in a.skews:
                fns[f"committed_skew{skew}"] = (lambda s=s, ws=ws, skew=skew:
                                                step(committed, q, pool, bt, sl, out, s, ws, skew))
            if old is not None:
                fns["three_launch"] = lambda s=s, ws=ws: three_launch(old, q, pool, bt, sl, out, ws, s, scale)
            for name, fn in fns.items():
                out.fill_(float("nan"))
                fn()
                err = float(((out.double() - ref).norm() / ref.norm()).item())
                _, gms, gerr = bench(fn)
                row = {"kernel": name, "batch": batch, "splits": s, "ctas": batch * HKV * s,
                       "waves": batch * HKV * s / (CTAS_PER_SM * sms), "rule": s == rule, "relerr_vs_f64": err,
                       "ms_graph": gms, "graph_error": gerr,
                       "pct_copy": None if gms is None else 100 * nbytes / gms / 1e6 / copy_bw}
                res["rows"].append(row)
                print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if k != "graph_error"},
                      gerr or "", flush=True)
        cuda_decode._MODULES[dev.index] = committed
        write_json(path, res)
        torch.cuda.empty_cache()
    res["total_s"] = time.time() - t0
    write_json(path, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
