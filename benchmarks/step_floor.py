"""What the parts of a decode step other than kvrepro's can reach on this GPU: the read-only bandwidth beside the copy
bandwidth of issue 23's bound, and a model's decode GEMMs through PyTorch's ``torch.nn.functional.linear`` (cuBLAS, as
vLLM's unquantized linear layers call it) at the profiled batch sizes against their weight bytes at those bandwidths.

    PYTHONPATH=. python benchmarks/step_floor.py [--rows 12 13 17] [--model qwen3-4b-instruct-2507] [--out PATH]

- copy: ``benchmarks.common.copy_bandwidth`` (4 GiB device-to-device, read + write bytes over time), as the bound;
- read: PyTorch's own reductions (:data:`READS`) over a 4 GiB float32 buffer, bytes read over time (``do_bench``
  medians, L2 flushed before each call); the read bandwidth is the fastest of them (a hand-written Triton read kernel
  was slower than all of them: git history);
- GEMMs: every decode linear layer of ``--model`` (:func:`gemm_shapes`: fused q / k / v, o, fused gate / up, down per
  layer, then the LM head), each layer's own bfloat16 weights (no weight is read twice in a step, as in vLLM), for
  ``M`` rows of activations, captured as one CUDA graph per ``M`` and timed by ``triton.testing.do_bench`` (L2 flushed
  before each replay): the time of all the step's GEMMs, beside its weight bytes at the copy and the read bandwidth.
  The profiles' ``gemm_ms`` (``results/profile/``) are the same GEMMs inside vLLM.

Writes ``--out`` (default ``benchmarks/results/step_floor.json``; provenance, the two bandwidths, one row per read
and per ``M``), atomically. About 10 s on an H200 (8 GB of weights).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.common import RESULTS, capture_graph, copy_bandwidth, provenance, write_json  # noqa: E402
from kvrepro.fileio import out_path_error  # noqa: E402

OUT = os.path.join(RESULTS, "step_floor.json")
READ_BYTES = 4 << 30
# PyTorch's own reductions over the buffer (float32 words): the read bandwidth is the fastest of them
READS = {"torch.sum": lambda x: x.sum(), "torch.amax": lambda x: x.amax(),
         "torch.sum, bfloat16 view": lambda x: x.view(torch.bfloat16).sum()}


def gemm_shapes(cfg: dict) -> list[tuple[str, int, int, int]]:
    """``(name, in_features, out_features, count)`` of a decoder's decode-step linear layers from its ``config.json``:
    q / k / v, o, gate / up and down once per layer (``count`` = ``num_hidden_layers``), then the LM head once
    (``vocab_size`` outputs; tied or not, it is read once per step).

    Raises:
        ValueError: a key the computation needs is missing (named).
    """
    need = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "num_hidden_layers",
            "vocab_size")
    missing = [k for k in need if k not in cfg]
    if missing:
        raise ValueError(f"config lacks {', '.join(missing)}")
    from kvrepro.capacity import ModelConfig

    m = ModelConfig.from_hf(cfg)          # the shapes the bound's weights_bytes counts
    h, inter, layers = m.hidden_size, m.intermediate_size, m.num_layers
    q, kv = m.num_q_heads * m.head_dim, m.num_kv_heads * m.head_dim
    return [("qkv", h, q + 2 * kv, layers), ("o", q, h, layers), ("gate_up", h, 2 * inter, layers),
            ("down", inter, h, layers), ("lm_head", h, m.vocab_size, 1)]


def gemm_weight_bytes(shapes, itemsize: int = 2) -> int:
    """Bytes of all the step's weight matrices (``itemsize`` bytes a weight: bfloat16 2)."""
    return sum(i * o * n for _, i, o, n in shapes) * itemsize


def main(argv=None) -> int:
    from kvrepro.configs import DEFAULT_MODEL, load_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[12, 13, 17],
                    help="decode batch sizes (activation rows) to time the GEMMs at (default: the profiled batches)")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="a bundled config (kvrepro/configs)")
    ap.add_argument("--out", default=OUT, help=f"result file (default {os.path.relpath(OUT)})")
    a = ap.parse_args(argv)
    bad = [m for m in a.rows if m < 1 or m > 4096]
    if bad:
        ap.error(f"--rows must be in 1..4096, got {bad}")
    try:
        shapes = gemm_shapes(load_config(a.model))
    except ValueError as e:
        ap.error(f"--model {a.model!r}: {e}")
    if out_path_error(a.out):
        ap.error(out_path_error(a.out))
    if not torch.cuda.is_available():
        raise SystemExit("step_floor.py needs a CUDA device")
    import triton.testing

    t0 = time.time()
    dev = torch.device("cuda", torch.cuda.current_device())
    res = {"provenance": provenance({"script": "benchmarks/step_floor.py", "model": a.model, "rows": a.rows}),
           "copy_bandwidth": copy_bandwidth(), "read": [], "gemm_shapes": shapes, "gemms": []}
    copy_gbps = res["copy_bandwidth"]["GBps_read_plus_write"]
    print(f"copy {copy_gbps:.0f} GB/s", flush=True)

    x = torch.randn(READ_BYTES // 4, dtype=torch.float32, device=dev)
    for name, fn in READS.items():
        ms = triton.testing.do_bench(lambda fn=fn: fn(x), warmup=50, rep=300, return_mode="median")
        res["read"].append({"op": name, "bytes": READ_BYTES, "ms": ms, "GBps_read": READ_BYTES / ms / 1e6,
                            "of_copy": READ_BYTES / ms / 1e6 / copy_gbps})
        print(res["read"][-1], flush=True)
    del x
    torch.cuda.empty_cache()
    read_gbps = max(r["GBps_read"] for r in res["read"])
    res["read_bandwidth"] = {"GBps": read_gbps, "of_copy": read_gbps / copy_gbps}

    gen = torch.Generator(device=dev).manual_seed(0)
    weights = [(name, [torch.empty(o, i, dtype=torch.bfloat16, device=dev).normal_(0, 0.02, generator=gen)
                       for _ in range(n)]) for name, i, o, n in shapes]
    wbytes = gemm_weight_bytes(shapes)
    for m in a.rows:
        ins = {i: torch.randn(m, i, dtype=torch.bfloat16, device=dev, generator=gen) for _, i, _, _ in shapes}
        step = lambda: [torch.nn.functional.linear(ins[w.shape[1]], w) for _, ws in weights for w in ws]  # noqa: E731
        g = capture_graph(step)
        ms = triton.testing.do_bench(g.replay, warmup=10, rep=100, return_mode="median")
        row = {"rows": m, "ms": ms, "weight_bytes": wbytes, "GBps": wbytes / ms / 1e6,
               "of_copy": wbytes / ms / 1e6 / copy_gbps, "of_read": wbytes / ms / 1e6 / read_gbps}
        res["gemms"].append(row)
        print(row, flush=True)
        del g
    res["total_s"] = time.time() - t0
    write_json(a.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
