"""One GPU call: how the L2 state left by the timing harness's cache flush moves decode step times at 128K.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/l2_state.py --out $OUT [--presets k4v2 k4v4 k8v4] \
        [--batches 3 6 13] [--reps 100]

Every decode figure in benchmarks/ (``side_by_side_vllm.bench``, ``cuda_split_waves``) is a ``triton.testing.do_bench``
median of CUDA-graph replays, and do_bench zeroes a 256 MB buffer before each replay: the L2 cache (50 MB on an H200)
then holds dirty lines, which the timed kernel's reads evict, so its time includes up to an L2's worth of write-backs.
This script times the same replay (the committed CUDA kernel of each preset, the rule's split count, Qwen3-4B shapes:
32 q / 8 KV heads, head_dim 128, block 16, context 131,072) three ways:
  - ``do_bench``: do_bench itself (as the reported figures);
  - ``dirty``: its own loop, flush by writing 256 MB (do_bench's flush; should match ``do_bench``);
  - ``clean``: its own loop, flush by reading 256 MB (the L2 left holding clean lines: no write-backs in the timed
    kernel);
medians over ``--reps`` replays (CUDA events around each replay), each with its % of the copy bandwidth measured in
the same run (``common.copy_bandwidth``) and clean / dirty. The step's output is checked against float64 attention
over the dequantized pages first (RuntimeError above 5e-3 relative error). A diagnostic of the method: the project's reported figures
and targets stay do_bench's. Writes ``$OUT/l2_state.json`` (provenance, rows; write-then-rename).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import benchmarks.run_h200 as rh  # noqa: E402
from benchmarks.common import capture_graph, copy_bandwidth, provenance, write_json  # noqa: E402
from kvrepro.ops import cuda_decode, decode_attention, decode_workspace_numel, default_num_splits  # noqa: E402
from kvrepro.reference import paged_attention_ref  # noqa: E402

CTX, HQ, HKV, D = 131072, 32, 8, 128
FLUSH_BYTES = 256 << 20  # do_bench's cache-flush buffer


def event_median_ms(replay, flush, reps: int) -> float:
    """Median over ``reps`` of one ``replay()`` timed by CUDA events, each after ``flush()`` (outside the events)."""
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for _ in range(5):
        flush()
        replay()
    for e0, e1 in zip(starts, ends):
        flush()
        e0.record()
        replay()
        e1.record()
    torch.cuda.synchronize()
    return statistics.median(e0.elapsed_time(e1) for e0, e1 in zip(starts, ends))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--presets", nargs="*", type=str.lower, default=["k4v2", "k4v4", "k8v4"],
                    choices=sorted(cuda_decode.PRESETS.values()))
    ap.add_argument("--batches", type=int, nargs="*", default=[3, 6, 13])
    ap.add_argument("--reps", type=int, default=100)
    a = ap.parse_args()
    if a.reps < 5:
        ap.error(f"--reps must be >= 5, got {a.reps}")
    if not a.presets or not a.batches:
        ap.error("--presets and --batches need at least one value each")
    if any(b < 1 for b in a.batches):
        ap.error(f"--batches must be >= 1, got {a.batches}")
    if not torch.cuda.is_available():
        raise SystemExit("l2_state.py needs a CUDA device")
    import triton.testing
    t0 = time.time()
    path = os.path.join(a.out, "l2_state.json")
    dev = torch.device("cuda", torch.cuda.current_device())
    res = {"provenance": provenance({"script": "benchmarks/l2_state.py", "ctx": CTX, "reps": a.reps,
                                     "flush_bytes": FLUSH_BYTES}),
           "fatbin": cuda_decode.read_manifest(), "copy_bandwidth": copy_bandwidth(), "rows": []}
    copy_bw = res["copy_bandwidth"]["GBps_read_plus_write"]
    print(f"copy {copy_bw:.0f} GB/s", flush=True)
    buf = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device=dev)
    sink = torch.empty((), dtype=torch.int64, device=dev)
    flushes = {"dirty": buf.zero_, "clean": lambda: torch.sum(buf, dim=0, dtype=torch.int64, out=sink)}
    gen = torch.Generator(device="cuda").manual_seed(7)
    for preset in a.presets:
        for batch in a.batches:
            pool, bt, sl, q = rh.decode_setup(preset, CTX, batch, gen)
            nbytes = batch * CTX * HKV * pool.layout.bytes_per_token
            s = default_num_splits(batch, HKV, bt.shape[1] * 16, dev, "cuda")
            ws = torch.empty(decode_workspace_numel(batch, HQ, D, s), device=dev, dtype=torch.float32)
            out = torch.empty_like(q)

            def step():
                decode_attention(q, pool.data, bt, sl, pool.layout, pool.rotation, D ** -0.5, out=out, num_splits=s,
                                 workspace=ws, impl="cuda")
            out.fill_(float("nan"))
            step()
            ref = paged_attention_ref(q, pool, bt, sl, torch.arange(batch + 1, device=dev), D ** -0.5,
                                      dtype=torch.float64)
            relerr = float(((out.double() - ref).norm() / ref.norm()).item())
            if not relerr < 5e-3:  # bf16 query and output: ~1.7e-3 (notes/kernels.md)
                raise RuntimeError(f"{preset} batch {batch}: decode output relerr {relerr:.2e} vs float64 attention")
            g = capture_graph(step)
            ms = {"do_bench": triton.testing.do_bench(g.replay, warmup=10, rep=50, return_mode="median")}
            for name, flush in flushes.items():
                ms[name] = event_median_ms(g.replay, flush, a.reps)
            row = {"preset": preset, "batch": batch, "splits": s, "bytes": nbytes, "relerr_vs_f64": relerr,
                   **{f"ms_{k}": v for k, v in ms.items()},
                   **{f"pct_copy_{k}": 100 * nbytes / v / 1e6 / copy_bw for k, v in ms.items()},
                   "clean_over_dirty": ms["clean"] / ms["dirty"]}
            res["rows"].append(row)
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
            write_json(path, res)
            torch.cuda.empty_cache()
    res["total_s"] = time.time() - t0
    write_json(path, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
