"""One-call H200 check of two kernel choices, k4v4, Qwen3-4B shapes (32q / 8kv / d128, block 16).

    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/decode_splits_prefill.py --out $OUT

1. Decode: v2 (triton, block_n 128) and v2 (asm, block_n 256, 2 and 4 warps) at 1x / 2x / 4x the
   default split count, 128K x batch 1/3/6/13, from CUDA graphs (``run_h200.time_decode``).
2. Prefill of one 131,072-token prompt in 16 chunks of 8,192 (context from compressed pages,
   chunk fresh): ``impl="dequant"`` (rotated-space dequantization + PyTorch FlashAttention-2) and
   ``impl="paged"`` vs bf16 FlashAttention-2 over the same chunks (context bf16, no compression).
Writes ``$OUT/decode_splits_prefill.json`` (with provenance); prints a table last.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import benchmarks.run_h200 as rh  # noqa: E402
from benchmarks.common import (copy_bandwidth, cuda_event_ms, prefill_chunk, prefill_prompt,  # noqa: E402
                               provenance, write_json)
from kvrepro.ops import default_num_splits  # noqa: E402
from kvrepro.ops.prefill import flash_dense_attn  # noqa: E402

CONFIGS = {"v2 triton bn128 w4": {"variant": "v2", "dequant": "triton", "block_n": 128, "num_warps": 4},
           "v2 asm bn256 w4": {"variant": "v2", "dequant": "asm", "block_n": 256, "num_warps": 4},
           "v2 asm bn128 w2": {"variant": "v2", "dequant": "asm", "block_n": 128, "num_warps": 2},
           "v2 asm bn256 w2": {"variant": "v2", "dequant": "asm", "block_n": 256, "num_warps": 2}}


def decode_part(res, gen, copy_bw, t0, budget):
    for batch in (13, 6, 3, 1):
        pool, bt, sl, q = rh.decode_setup("k4v4", 131072, batch, gen)
        nbytes = batch * 131072 * rh.HKV * pool.layout.bytes_per_token
        base = default_num_splits(batch, rh.HKV, bt.shape[1] * rh.BS, q.device)
        for name, kw in CONFIGS.items():
            for mult in (1, 2, 4):
                if time.time() - t0 > budget:
                    return
                s = min(base * mult, 256)
                if mult > 1 and s == min(base * (mult // 2), 256):
                    continue
                row = {"config": name, "ctx": 131072, "batch": batch, "split_mult": mult, **kw}
                try:
                    eager, gms, s = rh.time_decode(pool, bt, sl, q, num_splits=s, num_stages=1, **kw)
                    row.update(splits=s, ms_graph=gms, GBps=nbytes / gms / 1e6, pct_copy=100 * nbytes / gms / 1e6 / copy_bw)
                except Exception as e:
                    row["error"] = repr(e)[:300]
                res["decode"].append(row)
                print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        del pool, bt
        torch.cuda.empty_cache()


def prefill_part(res, gen):
    L, C, HQ, HKV, D, BS = 131072, 8192, rh.HQ, rh.HKV, rh.D, rh.BS
    q, k, v, pool, bt = prefill_prompt(L, HQ, HKV, D, BS, gen)

    def chunk(c0, **kw):
        return prefill_chunk(q, k, v, pool, bt, c0, C, **kw)

    # Correctness at full size on the last chunk: dequant impl vs paged impl (same function).
    a = chunk(L - C, impl="dequant", piece_tokens=L)()
    b = chunk(L - C, rows=64, block_n=64, num_warps=4, dequant="asm", variant="v2")()
    res["prefill_last_chunk_relerr_dequant_vs_paged"] = rh.relerr(a, b)
    variants = {
        "dequant_fa2_piece128k": lambda c0: chunk(c0, impl="dequant", piece_tokens=L),
        "dequant_fa2_piece32k": lambda c0: chunk(c0, impl="dequant", piece_tokens=32768),
        "paged_v2_asm": lambda c0: chunk(c0, rows=64, block_n=64, num_warps=4, dequant="asm", variant="v2"),
        "bf16_fa2_chunked": lambda c0: (lambda: flash_dense_attn(q[c0:c0 + C], k[:c0 + C], v[:c0 + C], D ** -0.5, True)),
    }
    for name, mk in variants.items():
        try:
            per = [cuda_event_ms(mk(c0)) for c0 in range(0, L, C)]
            res["prefill"][name] = {"ms": sum(per), "per_chunk_ms": per}
        except Exception as e:
            res["prefill"][name] = {"error": repr(e)[:300]}
        print(name, res["prefill"][name].get("ms"), res["prefill"][name].get("error", ""), flush=True)
    base = res["prefill"].get("bf16_fa2_chunked", {}).get("ms")
    for name, r in res["prefill"].items():
        if base and "ms" in r:
            r["ratio_vs_bf16_fa2_chunked"] = r["ms"] / base


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--budget-s", type=float, default=200)
    args = ap.parse_args()
    t0 = time.time()
    res = {"provenance": provenance({"script": "benchmarks/decode_splits_prefill.py",
                                     "shapes": f"{rh.HQ}q/{rh.HKV}kv/d{rh.D}, block {rh.BS}"}),
           "decode": [], "prefill": {}}
    path = os.path.join(args.out, "decode_splits_prefill.json")
    res["copy_bandwidth"] = copy_bandwidth()
    copy_bw = res["copy_bandwidth"]["GBps_read_plus_write"]
    gen = torch.Generator(device="cuda").manual_seed(1234)
    try:
        prefill_part(res, gen)
    except Exception as e:
        res["prefill_error"] = repr(e)[:500]
        print("prefill FAILED", e, flush=True)
    torch.cuda.empty_cache()
    write_json(path, res)
    decode_part(res, gen, copy_bw, t0, args.budget_s)
    res["total_s"] = time.time() - t0
    write_json(path, res)
    print(f"copy bandwidth {copy_bw:.0f} GB/s; prefill dequant vs paged relerr "
          f"{res.get('prefill_last_chunk_relerr_dequant_vs_paged')}")
    for name, r in res["prefill"].items():
        print(f"prefill {name:24} {r.get('ms', float('nan')):9.1f} ms  x bf16 {r.get('ratio_vs_bf16_fa2_chunked', float('nan')):.2f}")
    print(f"{'config':22} {'B':>3} {'x':>2} {'S':>4} {'ms':>7} {'GB/s':>6} {'%copy':>5}")
    for r in res["decode"]:
        if "ms_graph" in r:
            print(f"{r['config']:22} {r['batch']:3d} {r['split_mult']:2d} {r['splits']:4d} {r['ms_graph']:7.3f} "
                  f"{r['GBps']:6.0f} {r['pct_copy']:5.1f}")
        else:
            print(f"{r['config']:22} {r['batch']:3d} {r['split_mult']:2d} ERROR {r['error'][:90]}")
    print(f"total {res['total_s']:.0f} s")


if __name__ == "__main__":
    main()
