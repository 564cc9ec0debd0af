"""Workload for an Nsight Compute profile of one decode_attention launch (CUDA; default k4v4, 128K x 13).

The cache: ``--preset`` (k4v4 default, k8v4, k4v2) with Qwen3-4B shapes (32 q / 8 KV heads, head_dim 128,
block 16, shuffled block table) at one context length and batch, the kernel's default launch. ``--impl triton``
(default) profiles the Triton kernel (``-k regex:paged_attn``; keys through int8 tensor cores, asm
dequantization), ``--impl cuda`` kvrepro's CUDA kernel (``-k regex:kvrepro_decode``)::

    ncu --set full --import-source yes -k regex:kvrepro_decode --launch-skip 2 --launch-count 1 \\
        -o $OUT/decode_b3 python3 benchmarks/ncu_decode.py --impl cuda --batch 3
    ncu --import $OUT/decode_b3.ncu-rep --page details --csv > $OUT/details_b3.csv

Runs the decode 4 times (2 warm-up launches compile and load the kernel; ncu skips those), prints the
launch (kernel, splits) and exits. Needs CUDA. Nothing is timed here: ncu reports the figures.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.common import D, HKV, HQ, decode_setup  # noqa: E402
from kvrepro.ops import decode_attention, decode_workspace_numel, default_num_splits  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=13)
    ap.add_argument("--ctx", type=int, default=131072)
    ap.add_argument("--preset", default="k4v4", choices=("k4v4", "k8v4", "k4v2"))
    ap.add_argument("--impl", default="triton", choices=("triton", "cuda"),
                    help="decode kernel to profile (ncu -k regex:paged_attn for triton, regex:kvrepro_decode for cuda)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ncu_decode.py needs a CUDA device; none found")
    gen = torch.Generator(device="cuda").manual_seed(1234)
    pool, bt, sl, q = decode_setup(args.preset, args.ctx, args.batch, gen)
    s = default_num_splits(args.batch, HKV, bt.shape[1] * pool.block_size, q.device, args.impl)
    out = torch.empty_like(q)
    ws = torch.empty(decode_workspace_numel(args.batch, HQ, D, s), device="cuda", dtype=torch.float32)
    for _ in range(4):
        decode_attention(q, pool.data, bt, sl, pool.layout, pool.rotation, D ** -0.5, out=out, workspace=ws,
                         num_splits=s, impl=args.impl)
    torch.cuda.synchronize()
    print(f"ncu_decode: {args.impl} {args.preset} ctx {args.ctx} batch {args.batch} splits {s} "
          f"({args.batch * HKV * s} programs), finite {bool(torch.isfinite(out).all())}", flush=True)


if __name__ == "__main__":
    main()
