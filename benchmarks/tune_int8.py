"""One-call H200 sweep of the decode launch around the int8-key default (k4v4, Qwen3-4B shapes, 128K).

    PYTHONUNBUFFERED=1 PYTHONPATH=. python benchmarks/tune_int8.py --out $OUT

Per configuration (block_n, warps, num_stages, split count relative to ``default_num_splits``, and
optionally a register cap ``max_registers``, Triton's maxnreg; 0 or absent = none): the
output's relative error against ``decode_attention``'s default launch on the same inputs, and the
CUDA-graph time (``run_h200.time_decode``) at each of ``--batches`` (default 3 and 13). The default launch is
always timed first in each batch, and ``vs_default`` is each time over that one (the baseline launch is stored
in the JSON). Writes ``tune_int8{--tag}.json`` (provenance, copy bandwidth, rows). Budget ~120 s; rows past it
are listed as skipped.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import benchmarks.run_h200 as rh  # noqa: E402
from benchmarks.common import copy_bandwidth, provenance, write_json  # noqa: E402
from kvrepro.ops import decode_attention  # noqa: E402
from kvrepro.formats import get_format  # noqa: E402
from kvrepro.ops.decode import DECODE_STAGES, default_launch, default_num_splits  # noqa: E402

CTX = 131072
BATCHES = (3, 13)
# (block_n, warps, stages, split factor vs the default split count); the default launch is prepended
CONFIGS = [(256, 2, 1, 1), (256, 2, 2, 1), (128, 2, 2, 1), (128, 2, 1, 1), (256, 4, 1, 1), (128, 4, 2, 1),
           (256, 2, 1, 0.5), (256, 2, 1, 2), (64, 2, 2, 1), (64, 1, 2, 1)]
BUDGET_S = 120.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--configs", default="", help="JSON list of [block_n, warps, stages, split factor"
                    "[, max_registers]] "
                    "(default: CONFIGS); the default launch is timed first in any case")
    ap.add_argument("--preset", default="k4v4")
    ap.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    ap.add_argument("--tag", default="", help="suffix of the output file name (tune_int8{tag}.json)")
    args = ap.parse_args()
    configs = [tuple(c) for c in json.loads(args.configs)] if args.configs else CONFIGS
    bad = [c for c in configs if len(c) not in (4, 5)]
    if bad:
        ap.error(f"--configs: each entry is [block_n, warps, stages, split factor] or [..., max_registers]; got {bad}")
    base_cfg = (*default_launch(get_format(args.preset).key_bits, "int8"), DECODE_STAGES, 1, 0)
    configs = [(*c[:4], (c[4] if len(c) == 5 else 0) or 0) for c in configs]
    configs = [base_cfg] + [c for c in configs if c != base_cfg]
    if not torch.cuda.is_available():
        sys.exit("tune_int8.py needs a CUDA device")
    t0 = time.time()
    gen = torch.Generator(device="cuda").manual_seed(11)
    res = {"provenance": provenance({"script": "benchmarks/tune_int8.py", "ctx": CTX, "preset": args.preset,
                                     "key_mma": "int8", "dequant": "asm"}),
           "copy_bandwidth": copy_bandwidth(), "rows": [], "skipped": [], "baseline_launch": list(base_cfg)}
    bw = res["copy_bandwidth"]["GBps_read_plus_write"]
    for batch in args.batches:
        pool, bt, sl, q = rh.decode_setup(args.preset, CTX, batch, gen)
        s0 = default_num_splits(batch, rh.HKV, bt.shape[1] * rh.BS, q.device)
        ref = decode_attention(q, pool.data, bt, sl, pool.layout, pool.rotation, rh.D ** -0.5, impl="triton").float()
        base = None
        for bn, w, st, f, mr in configs:
            if time.time() - t0 > BUDGET_S:
                res["skipped"].append([batch, bn, w, st, f, mr])
                continue
            kw = dict(block_n=bn, num_warps=w, num_stages=st, num_splits=max(1, int(s0 * f)), key_mma="int8",
                      max_registers=mr or None)
            row = {"batch": batch, "block_n": bn, "warps": w, "stages": st, "splits": kw["num_splits"],
                   "max_registers": mr or None}
            try:
                o = decode_attention(q, pool.data, bt, sl, pool.layout, pool.rotation, rh.D ** -0.5, **kw).float()
                row["relerr_vs_default"] = float((o - ref).norm() / ref.norm())
                _, gms, _ = rh.time_decode(pool, bt, sl, q, **kw)
                row["ms_graph"] = gms
                row["pct_copy"] = 100 * batch * CTX * rh.HKV * pool.layout.bytes_per_token / gms / 1e6 / bw
                if (bn, w, st, f, mr) == base_cfg:
                    base = gms
                row["vs_default"] = gms / base if base else None
            except Exception as e:  # recorded (e.g. out of shared memory), the sweep goes on
                row["error"] = repr(e)[:300]
            res["rows"].append(row)
            print(row, flush=True)
            write_json(os.path.join(args.out, f"tune_int8{args.tag}.json"), res)
        del pool
        torch.cuda.empty_cache()
    print(f"total {time.time() - t0:.0f} s; skipped {res['skipped']}")


if __name__ == "__main__":
    main()
