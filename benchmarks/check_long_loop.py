"""H200 probe: is the long-context disagreement of the paged prefill (run 5, check_prefill_paged) a
property of long loops in one program? Decode at 128K with 1 / 4 / 64 splits (each split = one loop
over ctx / splits tokens; triton and asm dequant) and paged prefill at ctx 120K (v2 triton, v2 asm, v1 triton;
64 query rows; fp16 and bf16 inputs), each vs
a float32 reference in the rotated space (context from the format's PyTorch dequantization).

    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/check_long_loop.py --out $OUT
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.common import provenance, write_json  # noqa: E402
from kvrepro.formats import get_format  # noqa: E402
from kvrepro.ops import decode_attention, prefill_attention, store_kv  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16


def relerr(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = ap.parse_args()
    res = {"provenance": provenance({"script": "benchmarks/check_long_loop.py"}), "cases": []}
    L = 131072
    gen = torch.Generator(device="cuda").manual_seed(11)
    pool = get_format("k4v4").new_pool(L // BS + 8, HKV, D, BS, device="cuda")
    bt = torch.randperm(pool.num_blocks, device="cuda", generator=gen)[: L // BS][None].to(torch.int32)
    pos = torch.arange(L, device="cuda")
    slots = (bt[0, pos // BS].long() * BS + pos % BS).to(torch.int32)
    k = torch.randn(L, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(L, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    store_kv(k, v, pool.data, slots, pool.layout, pool.rotation)
    r, g = pool.rotation, HQ // HKV

    def ref(qrows, ctx, k_new=None, v_new=None):
        """qrows [R, HQ, D] at positions ctx - R + (k_new rows) ..; causal within the fresh part."""
        kc, vc = pool.gather_rotated(bt[0], ctx)
        if k_new is not None:
            kc = torch.cat([kc, k_new.float() @ r])
            vc = torch.cat([vc, v_new.float() @ r])
        n = kc.shape[0]
        rr = qrows.shape[0]
        qr = qrows.float() @ r
        lg = (qr.transpose(0, 1) @ kc.repeat_interleave(g, 1).permute(1, 2, 0)) * D ** -0.5
        lg = lg.masked_fill(torch.arange(n, device="cuda")[None, None] > torch.arange(n - rr, n, device="cuda")[None, :, None],
                            float("-inf"))
        return (torch.softmax(lg, -1) @ vc.repeat_interleave(g, 1).transpose(0, 1)).transpose(0, 1) @ r.T

    for dt in (torch.float16, torch.bfloat16):
        q = torch.randn(1, HQ, D, device="cuda", dtype=dt, generator=gen)
        want = ref(q, L)
        for s, dq in ((1, "triton"), (1, "asm"), (4, "triton"), (4, "asm"), (64, "triton")):
            o = decode_attention(q, pool.data, bt, torch.tensor([L], dtype=torch.int32, device="cuda"),
                                 pool.layout, pool.rotation, D ** -0.5, num_splits=s, dequant=dq)
            row = {"kind": "decode", "dtype": str(dt), "ctx": L, "splits": s, "dequant": dq,
                   "relerr": relerr(o, want)}
            res["cases"].append(row)
            print(row, flush=True)
    ctx, ql = 122880, 64
    for dt in (torch.float16, torch.bfloat16):
        q = torch.randn(ql, HQ, D, device="cuda", dtype=dt, generator=gen)
        kn, vn = k[ctx:ctx + ql].to(dt), v[ctx:ctx + ql].to(dt)
        want = ref(q, ctx, kn, vn)
        for kw in ({}, {"dequant": "asm"}, {"variant": "v1", "dequant": "triton"}):
            o = prefill_attention(q, kn, vn, pool.data, bt, torch.tensor([ctx + ql], dtype=torch.int32, device="cuda"),
                                  torch.tensor([0, ql], dtype=torch.int32, device="cuda"), pool.layout, pool.rotation,
                                  D ** -0.5, max_query_len=ql, **kw)
            row = {"kind": "prefill", "dtype": str(dt), "ctx": ctx, "q_len": ql, **kw, "relerr": relerr(o, want)}
            res["cases"].append(row)
            print(row, flush=True)
    write_json(os.path.join(args.out, "check_long_loop.json"), res)


if __name__ == "__main__":
    main()
