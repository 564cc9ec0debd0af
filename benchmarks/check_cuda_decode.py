"""One GPU call: check and time kvrepro's CUDA decode kernel (``decode_attention(impl="cuda")``, the committed
fatbin) against the Triton kernel (``impl="triton"``).

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/check_cuda_decode.py --out $OUT [--splits 32 64 128 256]

(a) The fatbin's manifest (nvcc version, ptxas report) into the JSON.
(b) Correctness vs float64 attention over the dequantized cache (``paged_attention_ref``) and vs the Triton
    ``decode_attention`` default: k4v4, 32 q / 8 KV heads (group 4) and 24 q / 8 KV (group 3), head_dim 128,
    lens 8193 / 97 / 1 / 0 / 5 (0 = padding row: zeros), float16 and bfloat16 queries, 1, 3 and default splits;
    one 131,072-token sequence with 1 split and with the default split count; a NaN in one query head.
(c) Time from CUDA graphs (``side_by_side_vllm.bench``: triton do_bench median of replays), 128K context,
    batch 1 / 3 / 6 / 13, CUDA vs Triton alternating twice, each at its default split count (``default_num_splits``
    of its ``impl``), copy bandwidth in the same run and % of it; then the CUDA kernel at each ``--splits`` count
    (run 19 fitted the CUDA split rule this way).
Writes ``$OUT/cuda_decode.json`` after each part (provenance included). Budget ~150 s; exits 1 if a check fails.
First run: H200 run 18 (2026-11-30, then as ``prototypes/cuda_decode/check_cuda_decode.py`` with the kernel built
on the device); notes/kernels.md.
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
from kvrepro.formats import get_format  # noqa: E402
from kvrepro.ops import cuda_decode, decode_attention, decode_workspace_numel, default_num_splits  # noqa: E402
from kvrepro.reference import paged_attention_ref  # noqa: E402

DEV = "cuda"
LENS = [8193, 97, 1, 0, 5]
CTX = 131072
MAX_RELERR = {"float16": 5e-4, "bfloat16": 4e-3, "128K": 8e-4, "vs_triton_f16": 5e-4, "vs_triton_bf16": 4e-3}


def ref64(q, pool, bt, sl, d=128):
    return paged_attention_ref(q, pool, bt, sl, torch.arange(q.shape[0] + 1, device=DEV), d ** -0.5,
                               dtype=torch.float64)


def correctness(gen, quick: bool = False) -> tuple[dict, list]:
    res, bad = {}, []
    for hq in ((32,) if quick else (32, 24)):
        pool = get_format("k4v4").new_pool(len(LENS) * 520, 8, 128, 16, device=DEV)
        bt = rh.fill_seqs(pool, LENS, gen, torch.bfloat16, max_blocks=520)
        sl = torch.tensor(LENS, dtype=torch.int32, device=DEV)
        for dtype in (torch.float16, torch.bfloat16):
            q = torch.randn(len(LENS), hq, 128, device=DEV, dtype=dtype)
            ref = ref64(q, pool, bt, sl)
            tri = decode_attention(q, pool.data, bt, sl, pool.layout, pool.rotation, 128 ** -0.5, impl="triton")
            for splits in (1, 3, None):
                o = torch.full_like(q, float("nan"))
                decode_attention(q, pool.data, bt, sl, pool.layout, pool.rotation, 128 ** -0.5, out=o,
                                 num_splits=splits, impl="cuda")
                name = f"{hq}q {str(dtype)[6:]} splits {splits or 'default'}"
                r = {"relerr_vs_f64": rh.relerr(o[[0, 1, 2, 4]], ref[[0, 1, 2, 4]]),
                     "relerr_vs_triton": rh.relerr(o, tri), "pad_row_zero": bool((o[3] == 0).all()),
                     "finite": bool(torch.isfinite(o).all())}
                res[name] = r
                kind = str(dtype)[6:]
                if not (r["finite"] and r["pad_row_zero"] and r["relerr_vs_f64"] < MAX_RELERR[kind]
                        and r["relerr_vs_triton"] < MAX_RELERR["vs_triton_" + ("f16" if kind == "float16" else "bf16")]):
                    bad.append(name)
            if hq == 32 and dtype == torch.float16:          # NaN in one head
                qn = q.clone()
                qn[1, 5, 7] = float("nan")
                o = decode_attention(qn, pool.data, bt, sl, pool.layout, pool.rotation, 128 ** -0.5, impl="cuda")
                keep = torch.ones(q.shape[:2], dtype=torch.bool, device=DEV)
                keep[1, 5] = False
                keep[3] = False
                r = {"nan_head_all_nan": bool(torch.isnan(o[1, 5]).all()),
                     "others_relerr_vs_f64": rh.relerr(o[keep], ref[keep])}
                res["nan query"] = r
                if not (r["nan_head_all_nan"] and r["others_relerr_vs_f64"] < MAX_RELERR["float16"]):
                    bad.append("nan query")
        del pool, bt
        torch.cuda.empty_cache()
    if quick:
        return res, bad
    pool = get_format("k4v4").new_pool(CTX // 16 + 8, 8, 128, 16, device=DEV)
    bt = rh.fill_seqs(pool, [CTX], gen, torch.bfloat16)
    sl = torch.tensor([CTX], dtype=torch.int32, device=DEV)
    q = torch.randn(1, 32, 128, device=DEV, dtype=torch.float16)
    ref = ref64(q, pool, bt, sl)
    for splits in (1, None):
        o = decode_attention(q, pool.data, bt, sl, pool.layout, pool.rotation, 128 ** -0.5, num_splits=splits,
                             impl="cuda")
        name = f"128K splits {splits or 'default'}"
        res[name] = {"relerr_vs_f64": rh.relerr(o, ref)}
        if not res[name]["relerr_vs_f64"] < MAX_RELERR["128K"]:
            bad.append(name)
    return res, bad


def timing(gen, copy_bw, split_counts=()) -> list:
    rows = []
    for batch in (1, 3, 6, 13):
        pool, bt, sl, q = rh.decode_setup("k4v4", CTX, batch, gen)
        splits = {k: default_num_splits(batch, 8, bt.shape[1] * 16, q.device, k) for k in ("cuda", "triton")}
        ws = torch.empty(max(decode_workspace_numel(batch, 32, 128, n) for n in splits.values()), device=DEV,
                         dtype=torch.float32)
        out = torch.empty_like(q)
        fns = {k: (lambda k=k: decode_attention(q, pool.data, bt, sl, pool.layout, pool.rotation, 128 ** -0.5,
                                                 out=out, num_splits=splits[k], workspace=ws, impl=k))
               for k in ("cuda", "triton")}
        ms = {k: [] for k in fns}
        errors = {}
        for _ in range(2):
            for k, fn in fns.items():
                _, gms, err = bench(fn)          # graph capture failure: recorded, no figure
                if gms is None:
                    errors[k] = err
                else:
                    ms[k].append(gms)
        nbytes = batch * CTX * 8 * pool.layout.bytes_per_token
        if errors or not all(ms.values()):
            rows.append({"batch": batch, "graph_error": errors})
            print(rows[-1], flush=True)
            continue
        for k in fns:
            best = min(ms[k])
            rows.append({"kernel": k, "batch": batch, "splits": splits[k], "ms_graph": best, "ms_all": ms[k],
                         "pct_copy": 100 * nbytes / best / 1e6 / copy_bw})
        rows.append({"batch": batch, "cuda_over_triton": min(ms["cuda"]) / min(ms["triton"])})
        print(rows[-3], rows[-2], rows[-1], flush=True)
        for n in split_counts:          # the CUDA kernel at other split counts
            ws_n = torch.empty(decode_workspace_numel(batch, 32, 128, n), device=DEV, dtype=torch.float32)
            _, gms, err = bench(lambda n=n, ws_n=ws_n: decode_attention(
                q, pool.data, bt, sl, pool.layout, pool.rotation, 128 ** -0.5, out=out, num_splits=n,
                workspace=ws_n, impl="cuda"))
            rows.append({"kernel": "cuda", "batch": batch, "splits": n, "ms_graph": gms, "graph_error": err,
                         "pct_copy": None if gms is None else 100 * nbytes / gms / 1e6 / copy_bw})
            print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--splits", type=int, nargs="*", default=[16, 32, 64, 128, 256],
                    help="extra split counts to time the CUDA kernel at (after the default)")
    ap.add_argument("--quick", action="store_true",
                    help="the small correctness cases only (for compute-sanitizer: memcheck / racecheck / synccheck)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("check_cuda_decode.py needs a CUDA device (H200)")
    t0 = time.time()
    path = os.path.join(a.out, "cuda_decode.json")
    res = {"provenance": provenance({"script": "benchmarks/check_cuda_decode.py", "ctx": CTX})}
    res["fatbin"] = cuda_decode.read_manifest()
    print(res["fatbin"]["nvcc_version"], res["fatbin"]["ptxas_report"][-1], flush=True)
    res["copy_bandwidth"] = copy_bandwidth()
    res["correctness"], bad = correctness(torch.Generator().manual_seed(5), a.quick)   # CPU generator: rh.fill_seqs
    res["correctness_failed"] = bad
    print(f"correctness done {time.time() - t0:.0f} s; failed: {bad}", flush=True)
    for k, r in res["correctness"].items():
        print(f"{k:36} " + " ".join(f"{n}={v:.2e}" if isinstance(v, float) else f"{n}={v}" for n, v in r.items()))
    write_json(path, res)
    if a.quick:
        res["timing_skipped"] = "--quick"
    elif time.time() - t0 < 110:
        res["timing"] = timing(torch.Generator(device=DEV).manual_seed(7), res["copy_bandwidth"]["GBps_read_plus_write"],
                               a.splits)
    else:
        res["timing_skipped"] = f"correctness took {time.time() - t0:.0f} s (> 110 s budget)"
        print(res["timing_skipped"], flush=True)
    res["total_s"] = time.time() - t0
    write_json(path, res)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
