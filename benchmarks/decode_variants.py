"""One-call H200 sweep of decode-kernel variants (v2 vs v3 and their launch options), k4v4.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/decode_variants.py --out $OUT [--budget-s 300]
        [--prefill]

First verifies every v3 mode at full size against float64 attention over the dequantized cache
(``run_h200.check_decode``), then times each configuration at 128K x 13 and 128K x 3 from a
CUDA graph (``run_h200.time_decode``: do_bench median, L2 flushed), best configs again with
2x splits and on k8v4 / k4v2, and prints registers / spills of each compiled v3 kernel.
``--prefill`` adds ``run_h200.prefill_bench`` (128K prompt: paged vs dequant+FA2 vs bf16 FA2).
Writes ``$OUT/decode_variants.json`` (with provenance) and prints a summary table last.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import benchmarks.run_h200 as rh  # noqa: E402
from benchmarks.common import copy_bandwidth, provenance, write_json  # noqa: E402
from kvrepro.ops.kernels.decode_v3 import decode_v3_kernel  # noqa: E402

SHAPES = ((131072, 13), (131072, 3))


def configs():
    yield "v2 triton bn128 w4 s1", {"variant": "v2", "dequant": "triton", "block_n": 128, "num_warps": 4, "num_stages": 1}
    yield "v2 asm bn256 w4 s1", {"variant": "v2", "dequant": "asm", "block_n": 256, "num_warps": 4, "num_stages": 1}
    for bn, w, pf, st in itertools.product((64, 128, 256), (4, 8), (True, False), (1, 2)):
        if pf and st > 1:
            continue
        yield (f"v3 triton bn{bn} w{w} s{st} pf{int(pf)}",
               {"variant": "v3", "dequant": "triton", "block_n": bn, "num_warps": w, "num_stages": st, "prefetch": pf})
    for bn, w in ((128, 4), (256, 8)):
        yield (f"v3 asm bn{bn} w{w} s1 pf1",
               {"variant": "v3", "dequant": "asm", "block_n": bn, "num_warps": w, "num_stages": 1, "prefetch": True})


def kernel_resources():
    """(constants summary, n_regs, n_spills) of every compiled v3 kernel in this process."""
    rows = []
    try:
        for cache in decode_v3_kernel.device_caches.values():
            for key, k in cache[0].items():
                c = getattr(k, "constants", None) or getattr(getattr(k, "src", None), "constants", {}) or {}
                rows.append({"key": str(key)[-160:], "n_regs": getattr(k, "n_regs", None),
                             "n_spills": getattr(k, "n_spills", None),
                             "num_warps": getattr(k.metadata, "num_warps", None), "constants": str(c)[:200]})
    except Exception as e:  # introspection only: never fail the run for it
        rows.append({"error": repr(e)[:200]})
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--budget-s", type=float, default=300)
    ap.add_argument("--prefill", action="store_true")
    args = ap.parse_args()
    t0 = time.time()
    res = {"provenance": provenance({"script": "benchmarks/decode_variants.py",
                                     "shapes": f"{rh.HQ}q/{rh.HKV}kv/d{rh.D}, block {rh.BS}"}), "rows": []}
    path = os.path.join(args.out, "decode_variants.json")
    cb = copy_bandwidth()
    res["copy_bandwidth"] = cb
    copy_bw = cb["GBps_read_plus_write"]
    print(f"copy bandwidth {copy_bw:.0f} GB/s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(1234)
    cgen = torch.Generator().manual_seed(1234)
    rh.VARIANTS.clear()
    rh.VARIANTS.update({"v2_triton": {"variant": "v2", "dequant": "triton"},
                        "v3_pf1": {"variant": "v3", "prefetch": True},
                        "v3_pf0": {"variant": "v3", "prefetch": False},
                        "v3_pf1_bn64": {"variant": "v3", "prefetch": True, "block_n": 64},
                        "v3_pf1_asm": {"variant": "v3", "prefetch": True, "dequant": "asm"}})
    rh.check_decode(cgen)
    res["correctness"] = rh.RESULTS["sections"].get("decode_correctness")
    res["correctness_errors"] = rh.RESULTS["errors"]
    print("correctness", res["correctness"], "bad", sorted(rh.BAD_VARIANTS), flush=True)
    bad_v3 = any(k.startswith("v3") for k in rh.BAD_VARIANTS)
    write_json(path, res)

    def run(name, kw, preset, ctx, batch, pool_cache, splits=None):
        key = (preset, ctx, batch)
        if key not in pool_cache:
            pool_cache.clear()
            torch.cuda.empty_cache()
            pool_cache[key] = rh.decode_setup(preset, ctx, batch, gen)
        pool, bt, sl, q = pool_cache[key]
        nbytes = batch * ctx * rh.HKV * pool.layout.bytes_per_token
        row = {"config": name, "preset": preset, "ctx": ctx, "batch": batch, **kw}
        try:
            eager, gms, s = rh.time_decode(pool, bt, sl, q, num_splits=splits, **kw)
            row.update(splits=s, ms_graph=gms, ms_eager=eager, GBps=nbytes / gms / 1e6,
                       pct_copy=100 * nbytes / gms / 1e6 / copy_bw)
        except Exception as e:
            row["error"] = repr(e)[:300]
        res["rows"].append(row)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        return row

    cache: dict = {}
    for ctx, batch in SHAPES:
        for name, kw in configs():
            if kw["variant"] == "v3" and bad_v3:
                continue
            if time.time() - t0 > args.budget_s * 0.7:
                break
            run(name, kw, "k4v4", ctx, batch, cache)
        write_json(path, res)
    ok = [r for r in res["rows"] if "ms_graph" in r and r["batch"] == 13]
    best = sorted(ok, key=lambda r: r["ms_graph"])[:3]
    res["best_128k_13"] = [r["config"] for r in best]
    for r in best:
        kw = {k: r[k] for k in ("variant", "dequant", "block_n", "num_warps", "num_stages", "prefetch") if k in r}
        if time.time() - t0 > args.budget_s * 0.85:
            break
        run(r["config"] + " 2x splits", kw, "k4v4", 131072, 13, cache, splits=2 * r["splits"])
    if best:
        kw = {k: best[0][k] for k in ("variant", "dequant", "block_n", "num_warps", "num_stages", "prefetch") if k in best[0]}
        for preset in ("k8v4", "k4v2"):
            if time.time() - t0 > args.budget_s * 0.9:
                break
            run(best[0]["config"], kw, preset, 131072, 13, cache)
    res["v3_kernel_resources"] = kernel_resources()
    write_json(path, res)
    cache.clear()
    torch.cuda.empty_cache()
    if args.prefill:
        rh.BUDGET = args.budget_s + 200
        rh.T0 = time.time()
        rh.prefill_bench(gen)
        res["prefill_128k"] = rh.RESULTS["sections"].get("prefill_128k")
        res["prefill_errors"] = {k: v for k, v in rh.RESULTS["errors"].items() if "prefill" in k}
    res["total_s"] = time.time() - t0
    write_json(path, res)
    for r in res["v3_kernel_resources"]:
        print("resources", r)
    print(f"{'config':42} {'preset':6} {'ctx':>6} {'B':>3} {'S':>3} {'ms':>7} {'GB/s':>6} {'%copy':>5}")
    for r in res["rows"]:
        if "ms_graph" in r:
            print(f"{r['config']:42} {r['preset']:6} {r['ctx']:6d} {r['batch']:3d} {r['splits']:3d} "
                  f"{r['ms_graph']:7.3f} {r['GBps']:6.0f} {r['pct_copy']:5.1f}")
        else:
            print(f"{r['config']:42} {r['preset']:6} {r['ctx']:6d} {r['batch']:3d} ERROR {r['error'][:80]}")
    if res.get("prefill_128k"):
        print("prefill", {k: v for k, v in res["prefill_128k"].items() if "per_chunk" not in k})
    print(f"total {res['total_s']:.0f} s")


if __name__ == "__main__":
    main()
