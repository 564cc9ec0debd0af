"""H200 probe: where does ``prefill_attention(impl="paged")`` disagree with a float32 reference?

    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/check_prefill_paged.py --out $OUT

Run 5 found relerr 0.39 on the last 64 rows of the last 8K chunk of a 128K prompt (k4v4, 32q/8kv/
d128) while the CPU interpreter matches float64 up to ctx 8,000. This varies one thing at a time:
context length, chunk length, num_stages, rows, dequant mode; each case vs a float32 reference
(rotated space, context from the format's PyTorch dequantization), last <= 64 rows of the chunk.
Writes ``$OUT/check_prefill_paged.json``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.common import provenance, write_json  # noqa: E402
from kvrepro.formats import get_format  # noqa: E402
from kvrepro.ops import prefill_attention, store_kv  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16


def relerr(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = ap.parse_args()
    t0 = time.time()
    res = {"provenance": provenance({"script": "benchmarks/check_prefill_paged.py"}), "cases": []}
    L = 131072
    gen = torch.Generator(device="cuda").manual_seed(7)
    k = torch.randn(L, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(L, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    q = torch.randn(L, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    pool = get_format("k4v4").new_pool(L // BS + 8, HKV, D, BS, device="cuda")
    bt = torch.randperm(pool.num_blocks, device="cuda", generator=gen)[: L // BS][None].to(torch.int32)
    pos = torch.arange(L, device="cuda")
    slots = (bt[0, pos // BS].long() * BS + pos % BS).to(torch.int32)
    store_kv(k, v, pool.data, slots, pool.layout, pool.rotation, rotate="torch")
    r = pool.rotation
    g = HQ // HKV

    def ref_rows(ctx, ql, rows):
        k_ctx, v_ctx = pool.gather_rotated(bt[0], ctx) if ctx else (torch.zeros(0, HKV, D, device="cuda"),) * 2
        k_all = torch.cat([k_ctx, k[ctx:ctx + ql].float() @ r])
        v_all = torch.cat([v_ctx, v[ctx:ctx + ql].float() @ r])
        n = ctx + ql
        qr = q[n - rows:n].float() @ r
        lg = (qr.transpose(0, 1) @ k_all.repeat_interleave(g, 1).permute(1, 2, 0)) * D ** -0.5
        lg = lg.masked_fill(torch.arange(n, device="cuda")[None, None] > torch.arange(n - rows, n, device="cuda")[None, :, None],
                            float("-inf"))
        return (torch.softmax(lg, -1) @ v_all.repeat_interleave(g, 1).transpose(0, 1)).transpose(0, 1) @ r.T

    def case(ctx, ql, **kw):
        rows = min(64, ql)
        qsl = torch.tensor([0, ql], dtype=torch.int32, device="cuda")
        sl = torch.tensor([ctx + ql], dtype=torch.int32, device="cuda")
        row = {"ctx": ctx, "q_len": ql, **kw}
        try:
            o = prefill_attention(q[ctx:ctx + ql], k[ctx:ctx + ql], v[ctx:ctx + ql], pool.data, bt, sl, qsl,
                                  pool.layout, pool.rotation, D ** -0.5, max_query_len=ql, **kw)
            row["relerr_last_rows"] = relerr(o[ql - rows:], ref_rows(ctx, ql, rows))
            row["relerr_first_rows"] = relerr(o[:rows], ref_rows(ctx, rows, rows)) if ql > rows else None
        except Exception as e:
            row["error"] = repr(e)[:300]
        res["cases"].append(row)
        print(row, flush=True)

    for ctx, ql in ((0, 8192), (0, 256), (0, 64), (4096, 64), (4096, 8192), (32768, 64), (122880, 64), (122880, 8192)):
        case(ctx, ql)
    for kw in ({"num_stages": 1}, {"dequant": "triton", "num_stages": 1}, {"variant": "v1"}, {"rows": 16},
               {"block_n": 32}, {"num_warps": 8}):
        case(122880, 8192, **kw)
        case(0, 256, **kw)
    res["total_s"] = time.time() - t0
    write_json(os.path.join(args.out, "check_prefill_paged.json"), res)
    for row in res["cases"]:
        print(row)


if __name__ == "__main__":
    main()
