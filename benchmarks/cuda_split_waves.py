"""One GPU call: where the CUDA decode kernel's time goes at 128K, and split counts that fill whole waves.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/cuda_split_waves.py --out $OUT

For batch 1 / 3 / 6 / 13 (Qwen3-4B shapes: 32 q / 8 KV heads, head_dim 128, k4v4 pages, block 16, context 131,072)
and for each split count S of a list (the current rule's count, powers of two, and the counts that give exactly one,
two or three waves of the kernel's 4 resident CTAs per SM: ``k x 4 x SMs / (B x 8)``), time from CUDA graphs
(``side_by_side_vllm.bench``: median of replays):
  - ``full``: ``decode_attention(impl="cuda", num_splits=S)`` (query rotation + attention kernel + split merge);
  - ``attn``: the attention kernel alone (``cuda_decode.launch``), ``rotate`` and ``merge``: the two Triton launches.
Each S is checked against float64 attention over the dequantized pages (``paged_attention_ref``), relative error
of the output. % of copy bandwidth = the pages' bytes (B x 131,072 x 8 heads x 134 B) / time / the copy bandwidth
measured in the same run (read + write), as in ``side_by_side_vllm``. Writes ``$OUT/cuda_split_waves.json``
(provenance included, write-then-rename after each batch). Budget ~120 s on an H200.
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
    return sorted({s for s in [rule, 16, 32, 64, 128, *waves] if 1 <= s <= 256})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 3, 6, 13])
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("cuda_split_waves.py needs a CUDA device")
    t0 = time.time()
    path = os.path.join(a.out, "cuda_split_waves.json")
    dev = torch.device("cuda")
    sms = sm_count(dev)
    res = {"provenance": provenance({"script": "benchmarks/cuda_split_waves.py", "ctx": CTX, "sms": sms,
                                     "ctas_per_sm": CTAS_PER_SM}),
           "fatbin": cuda_decode.read_manifest(), "copy_bandwidth": copy_bandwidth(), "rows": []}
    copy_bw = res["copy_bandwidth"]["GBps_read_plus_write"]
    print(f"SMs {sms}, copy {copy_bw:.0f} GB/s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(7)
    scale = D ** -0.5
    for batch in a.batches:
        pool, bt, sl, q = rh.decode_setup("k4v4", CTX, batch, gen)
        nbytes = batch * CTX * HKV * pool.layout.bytes_per_token
        ref = paged_attention_ref(q, pool, bt, sl, torch.arange(batch + 1, device=dev), scale, dtype=torch.float64)
        rule = default_num_splits(batch, HKV, bt.shape[1] * 16, dev, "cuda")
        out = torch.empty_like(q)
        for s in candidates(batch, sms, rule):
            ws = torch.empty(decode_workspace_numel(batch, HQ, D, s), device=dev, dtype=torch.float32)
            n_o = batch * HQ * s * D
            part_o, part_lse = ws[:n_o], ws[n_o:n_o + batch * HQ * s]
            q16 = ws[n_o + batch * HQ * s:].view(torch.float16)[: batch * HQ * D]
            full = lambda: decode_attention(q, pool.data, bt, sl, pool.layout, pool.rotation, scale, out=out,  # noqa: E731
                                            num_splits=s, workspace=ws, impl="cuda")
            out.fill_(float("nan"))
            full()
            err = float(((out.double() - ref).norm() / ref.norm()).item())
            attn = lambda: cuda_decode.launch(q16, pool.data, bt, sl, part_o, part_lse, s, HKV, HQ // HKV)  # noqa: E731
            rot = lambda: rotate_query_kernel[(batch * HQ,)](q, pool.rotation, q16, q.stride(0), q.stride(1),  # noqa: E731
                                                            scale * LOG2E, HQ=HQ, D=D)
            merge = lambda: merge_splits_kernel[(batch * HQ,)](  # noqa: E731
                part_o, part_lse, pool.rotation, out, out.stride(0), out.stride(1), HQ=HQ, D=D, NUM_SPLITS=s,
                SP=1 << (s - 1).bit_length())
            row = {"batch": batch, "splits": s, "ctas": batch * HKV * s,
                   "waves": batch * HKV * s / (CTAS_PER_SM * sms), "rule": s == rule, "relerr_vs_f64": err}
            for name, fn in (("full", full), ("attn", attn), ("rotate", rot), ("merge", merge)):
                _, gms, gerr = bench(fn)
                row[f"ms_{name}"] = gms
                if gerr:
                    row[f"error_{name}"] = gerr
            if row["ms_full"]:
                row["pct_copy_full"] = 100 * nbytes / row["ms_full"] / 1e6 / copy_bw
            if row["ms_attn"]:
                row["pct_copy_attn"] = 100 * nbytes / row["ms_attn"] / 1e6 / copy_bw
            res["rows"].append(row)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
        write_json(path, res)

        torch.cuda.empty_cache()
    res["total_s"] = time.time() - t0
    write_json(path, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
