"""The CUDA decode kernel at 128K per split count (one GPU call), and other builds of it side by side.

    PYTHONPATH=. python benchmarks/decode_splits.py [--preset k4v4|k8v4|k4v2|k5v4] [--batches 1 3 6 13] [--rule-only]
        [--extra-splits S ...] [--variant NAME=PATH.fatbin ...] [--trace PATH.fatbin] [--skews K ...] [--rope]
        [--out PATH]

For each batch (Qwen3-4B shapes: 32 q / 8 KV heads, head_dim 128, ``--preset`` pages (default k4v4), block 16,
context 131,072) and each split count S of a list (the rule's count, powers of two, and the counts that give exactly
one, two or three waves of the kernel's ``CTAS_PER_SM`` resident CTAs per SM: ``k x 4 x SMs / (B x 8)``), times
from CUDA graphs (``common.bench``: median of replays) one decode step, ``decode_attention(impl="cuda",
num_splits=S)``:
  - ``committed``: the committed fatbin (one launch: query rotation, attention, split merge);
  - ``--variant NAME=PATH``: another build of ``kvrepro/ops/cuda/decode.cu`` (e.g. ``-DKVREPRO_STAGES_K4V2=8``),
    same launch (only the preset's kernel is looked up, so builds without that preset's kernel cannot be variants);
  - ``--skews K ...``: the committed build at other ``cuda_decode.RANK_SKEW`` values.
``--trace PATH``: a build with ``-DKVREPRO_TRACE=4096`` (``%globaltimer`` stamps per CTA: start, query ready, own
loop end, all warps' loop end, counted in, merge end; and the SM id), launched once per batch at the rule's split
count after an L2 flush; the stamps' spread says where a step's time goes (``trace`` in the JSON).
``--rule-only``: time only the rule's split count (and ``--extra-splits``).
``--rope``: the preset's rope-mean kernel (``ROPE_KERNELS``) in every build, each step with the same ``rope_bias``
(``decode_side_by_side.rope_bias_args``: the runtime's form, 8 pairs per KV head); not with ``--trace`` / ``--skews``.
Each timed output is checked against float64 attention over the dequantized pages (``paged_attention_ref``), with
``--rope`` against the Triton kernel with the same ``rope_bias`` (``relerr_vs_triton``: ``paged_attention_ref`` has
no correction), and every row records the largest difference from the committed build's output at the same split
count (``max_abs_vs_committed``; 0: the same bits).
% of copy bandwidth = the pages' bytes (B x 131,072 x 8 heads x bytes per token: 134 B for k4v4) / time / the copy
bandwidth measured in the same run (read + write), as in ``decode_side_by_side.py``. Writes ``--out`` (default
``benchmarks/results/decode_splits.json``: provenance, the fatbin's manifest, every row) once, at the end,
write-then-rename: an interrupted run leaves the file as it was. About 150 s on an H200.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.common import (D, HKV, HQ, RESULTS, bench, copy_bandwidth, decode_setup,  # noqa: E402
                               provenance, write_json)
from kvrepro.ops import cuda_decode, decode_attention, decode_workspace_numel, default_num_splits  # noqa: E402
from kvrepro.fileio import file_sha256, out_path_error  # noqa: E402
from kvrepro.ops.common import sm_count  # noqa: E402
from kvrepro.reference import paged_attention_ref  # noqa: E402
from benchmarks.decode_side_by_side import rope_bias_args  # noqa: E402

CTX = 131072
CTAS_PER_SM = cuda_decode.CTAS_PER_SM
OUT = os.path.join(RESULTS, "decode_splits.json")


def candidates(batch: int, sms: int, rule: int) -> list[int]:
    waves = [k * CTAS_PER_SM * sms // (batch * HKV) for k in (1, 2, 3)]
    return sorted({s for s in [rule, 16, 32, 64, *waves] if 1 <= s <= 256})


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
    ap.add_argument("--out", default=OUT, help=f"result file (default {os.path.relpath(OUT)})")
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 3, 6, 13])
    ap.add_argument("--preset", default="k4v4", type=str.lower, choices=sorted(cuda_decode.PRESETS.values()),
                    help="compressed preset whose CUDA kernel is timed (default k4v4)")
    ap.add_argument("--variant", nargs="*", default=[], help="NAME=PATH of another fatbin of cuda/decode.cu")
    ap.add_argument("--trace", default=None, help="fatbin built with -DKVREPRO_TRACE=4096 (stamps per CTA)")
    ap.add_argument("--skews", type=int, nargs="*", default=[],
                    help="also time the committed build at these cuda_decode.RANK_SKEW values (and trace each)")
    ap.add_argument("--rule-only", action="store_true", help="time only the rule's split count and --extra-splits")
    ap.add_argument("--extra-splits", type=int, nargs="*", default=[], help="more split counts to time")
    ap.add_argument("--rope", action="store_true",
                    help="time the preset's rope-mean kernel (rope_bias of the runtime's form) in every build")
    a = ap.parse_args()
    if a.rope and (a.trace or a.skews):
        ap.error("--rope times the builds' rope-mean kernels; --trace and --skews take the kernel without it")
    # arguments first (they do not need a GPU), then the device
    for v in a.variant:
        name, sep, p = v.partition("=")
        if not sep or not name or not p:
            ap.error(f"--variant takes NAME=PATH.fatbin, got {v!r}")
    names = [v.partition("=")[0] for v in a.variant]
    if "committed" in names or len(set(names)) < len(names):
        ap.error(f"--variant names must be distinct and not 'committed' (the committed build's row), got {names}")
    if out_path_error(a.out):
        ap.error(out_path_error(a.out))
    for p in [v.partition("=")[2] for v in a.variant] + [a.trace]:
        if p and not os.path.isfile(p):
            ap.error(f"no such fatbin: {p}")
    bad = [k for k in a.skews if not 0 <= k <= 255]
    if bad:
        ap.error(f"--skews must be in 0..255 (cuda_decode.RANK_SKEW's range), got {bad}")
    if not torch.cuda.is_available():
        raise SystemExit("decode_splits.py needs a CUDA device")
    t0 = time.time()
    path = a.out
    dev = torch.device("cuda", torch.cuda.current_device())
    sms = sm_count(dev)
    committed = cuda_decode.load(dev)
    mods = {"committed": committed}
    bits = {v: k for k, v in cuda_decode.PRESETS.items()}[a.preset]
    one = {bits: cuda_decode.KERNELS[bits]}            # the preset's kernel only: older builds hold fewer kernels
    one_rope = {bits: cuda_decode.ROPE_KERNELS[bits]} if a.rope else {}
    for v in a.variant:
        name, p = v.split("=", 1)
        mods[name] = cuda_decode._Module(dev, p, one, one_rope)
    tracer = cuda_decode._Module(dev, a.trace, one) if a.trace else None
    res = {"provenance": provenance({"script": "benchmarks/decode_splits.py", "preset": a.preset, "ctx": CTX,
                                     "sms": sms, "ctas_per_sm": CTAS_PER_SM, "variants": a.variant, "rope": a.rope,
                                     "trace": a.trace,
                                     "fatbin_sha256": {f: file_sha256(f) for f in
                                                       [v.split("=", 1)[1] for v in a.variant] + [a.trace] if f}}),
           "fatbin": cuda_decode.read_manifest(), "copy_bandwidth": copy_bandwidth(), "rows": []}
    copy_bw = res["copy_bandwidth"]["GBps_read_plus_write"]
    print(f"SMs {sms}, copy {copy_bw:.0f} GB/s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(7)
    scale = D ** -0.5
    default_skew = cuda_decode.RANK_SKEW

    def step(mod, q, pool, bt, sl, out, s, ws, skew=default_skew, rb=None):
        """One decode step through the build ``mod`` with ``cuda_decode.RANK_SKEW = skew`` (restored after) and
        ``rope_bias=rb``."""
        cuda_decode._MODULES[dev.index] = mod          # the launch goes through this build
        cuda_decode.RANK_SKEW = skew
        try:
            decode_attention(q, pool.data, bt, sl, pool.layout, pool.rotation, scale, out=out, num_splits=s,
                             workspace=ws, impl="cuda", rope_bias=rb)
        finally:
            cuda_decode.RANK_SKEW = default_skew

    for batch in a.batches:
        pool, bt, sl, q = decode_setup(a.preset, CTX, batch, gen)
        nbytes = batch * CTX * HKV * pool.layout.bytes_per_token
        rb = rope_bias_args(batch, gen) if a.rope else None
        if a.rope:
            ref = decode_attention(q, pool.data, bt, sl, pool.layout, pool.rotation, scale, impl="triton",
                                   rope_bias=rb).double()
        else:
            ref = paged_attention_ref(q, pool, bt, sl, torch.arange(batch + 1, device=dev), scale,
                                      dtype=torch.float64)
        err_key = "relerr_vs_triton" if a.rope else "relerr_vs_f64"
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
            fns = {name: (lambda mod=mod, s=s, ws=ws: step(mod, q, pool, bt, sl, out, s, ws, rb=rb))
                   for name, mod in mods.items()}
            for skew in a.skews:
                fns[f"committed_skew{skew}"] = (lambda s=s, ws=ws, skew=skew:
                                                step(committed, q, pool, bt, sl, out, s, ws, skew))
            base = None
            for name, fn in fns.items():
                out.fill_(float("nan"))
                fn()
                err = float(((out.double() - ref).norm() / ref.norm()).item())
                if base is None:                           # the committed build comes first
                    base = out.clone()
                vs_committed = float((out.float() - base.float()).abs().max().item())
                _, gms, gerr = bench(fn)
                row = {"kernel": name, "batch": batch, "splits": s, "ctas": batch * HKV * s,
                       "waves": batch * HKV * s / (CTAS_PER_SM * sms), "rule": s == rule, err_key: err,
                       "max_abs_vs_committed": vs_committed,
                       "ms_graph": gms, "graph_error": gerr,
                       "pct_copy": None if gms is None else 100 * nbytes / gms / 1e6 / copy_bw}
                res["rows"].append(row)
                print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if k != "graph_error"},
                      gerr or "", flush=True)
        cuda_decode._MODULES[dev.index] = committed
        torch.cuda.empty_cache()
    res["total_s"] = time.time() - t0
    write_json(path, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
