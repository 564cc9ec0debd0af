"""The KV store with the rotation inside the store kernel against the rotation in PyTorch (``KVREPRO_STORE_ROTATE``
kernel / torch) on one GPU: one layer's ``store_kv`` at Qwen3-4B shapes (8 KV heads, head_dim 128, block 16), K and V
as vLLM passes them (strided views of the fused QKV projection's output, bfloat16), for a decode step's tokens (13,
and 16: vLLM's padded graph size above it) and one prefill chunk (8,192 tokens).

    PYTHONPATH=. python benchmarks/store_rotate.py [--presets k4v4,k5v4] [--tokens 13,16,8192] [--out PATH]

Writes ``--out`` (default ``benchmarks/results/store_rotate.json``; provenance, one row per preset and token count),
atomically. Per row: eager and CUDA-graph medians of ``triton.testing.do_bench`` (``benchmarks.common.bench``) for
both modes and their ratio, and how far the kernel's bytes are from the PyTorch path's (the largest code difference
and the share of codes that differ: float32 summation order may move a code by one at a tie). Per preset: the
kernel's registers and spill bytes per thread as Triton compiled it, and the device memory that left the free pool
but not PyTorch's allocator at its first launch (the driver's local-memory reservation for a spill stack, which
vLLM's memory profiling counts against the KV cache: notes/vllm.md, "Memory accounting").
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.common import BS, D, HKV, HQ, RESULTS, bench, provenance, write_json  # noqa: E402
from kvrepro.formats import COMPRESSED_PRESETS, get_format  # noqa: E402
from kvrepro.formats.compressed import unpack_codes  # noqa: E402
from kvrepro.listarg import comma_list  # noqa: E402
from kvrepro.ops import store  # noqa: E402

OUT = os.path.join(RESULTS, "store_rotate.json")
TOKENS = (13, 16, 8192)


def kv_views(tokens: int, gen: torch.Generator):
    """K and V ``[tokens, HKV, D]`` bfloat16 as vLLM hands them to the backend: views into one QKV output row."""
    qkv = torch.randn(tokens, (HQ + 2 * HKV) * D, device="cuda", generator=gen).bfloat16()
    k = qkv[:, HQ * D:(HQ + HKV) * D].view(tokens, HKV, D)
    v = qkv[:, (HQ + HKV) * D:].view(tokens, HKV, D)
    return k, v


def non_torch_bytes() -> int:
    """Device memory in use that PyTorch's caching allocator does not hold (driver, context, local memory)."""
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


def measure(preset: str, tokens_list, gen) -> tuple[dict, list[dict]]:
    fmt = get_format(preset)
    layout = fmt.layout(D, BS)
    blocks = max(tokens_list) // BS + 64
    pool = fmt.new_pool(blocks, HKV, D, BS, device="cuda")
    other = fmt.new_pool(blocks, HKV, D, BS, device="cuda")
    rot = pool.rotation
    pm = store.hadamard_operand(rot)              # the host check, outside any capture
    k, v = kv_views(16, gen)
    slots = torch.arange(16, device="cuda")
    torch.cuda.synchronize()
    before = non_torch_bytes()
    compiled = store._launch(k, v, pool.data, slots, pm, layout, HKV)   # this preset's first in-kernel rotation
    torch.cuda.synchronize()
    info = {"preset": preset, "registers": compiled.n_regs, "spills": compiled.n_spills,
            "num_warps": store.STORE_WARPS[True],
            "first_launch_non_torch_mib": round((non_torch_bytes() - before) / 2**20, 1)}
    rows = []
    for t in tokens_list:
        k, v = kv_views(t, gen)
        slots = torch.randperm(blocks * BS, device="cuda", generator=gen)[:t]
        res = {}
        for mode, target in (("torch", other), ("kernel", pool)):
            def fn(mode=mode, target=target):
                store.store_kv(k, v, target.data, slots, layout, rot, rotate=mode)
            res[mode] = bench(fn)
        pool.data.zero_()
        other.data.zero_()
        store.store_kv(k, v, pool.data, slots, layout, rot, rotate="kernel")
        store.store_kv(k, v, other.data, slots, layout, rot, rotate="torch")
        worst, share = 0, 0.0
        for a, b, bits in zip(pool.regions()[:2], other.regions()[:2], (layout.key_bits, layout.value_bits)):
            diff = (unpack_codes(a, bits).int() - unpack_codes(b, bits).int()).abs()
            worst = max(worst, int(diff.max()))
            share = max(share, float((diff > 0).float().sum()) / (t * HKV * D))
        (te, tg, terr), (ke, kg, kerr) = res["torch"], res["kernel"]
        errors = "; ".join(f"{m}: {e}" for m, e in (("torch", terr), ("kernel", kerr)) if e)
        row = {"preset": preset, "tokens": t, "torch_ms": te, "kernel_ms": ke, "torch_ms_graph": tg,
               "kernel_ms_graph": kg, "graph_error": errors, "kernel_over_torch": ke / te,
               "kernel_over_torch_graph": kg / tg if kg and tg else None,
               "max_code_diff_vs_torch": worst, "codes_differing_vs_torch": share}
        rows.append(row)
        print(f"{preset} {t:>5} tokens: torch {te * 1e3:8.1f} us (graph {tg * 1e3 if tg else float('nan'):7.1f}), "
              f"kernel {ke * 1e3:8.1f} us (graph {kg * 1e3 if kg else float('nan'):7.1f}), kernel / torch "
              f"{row['kernel_over_torch']:.2f} (graph {row['kernel_over_torch_graph'] or float('nan'):.2f}); codes vs "
              f"torch: max diff {worst}, {share:.1e} differ", flush=True)
    print(f"{preset}: kernel {info['registers']} registers, {info['spills']} spills at {info['num_warps']} warps, "
          f"first launch +{info['first_launch_non_torch_mib']} MiB outside PyTorch", flush=True)
    return info, rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--presets", default=",".join(COMPRESSED_PRESETS),
                    help="comma-separated presets (default: %(default)s)")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)),
                    help="comma-separated token counts per call (default: %(default)s)")
    ap.add_argument("--out", default=OUT, help=f"result file (default {os.path.relpath(OUT)})")
    a = ap.parse_args(argv)
    try:
        presets = list(dict.fromkeys(comma_list(a.presets, "--presets")))       # each once
        bad = [p for p in presets if p not in COMPRESSED_PRESETS]
        if bad:
            raise ValueError(f"--presets: {bad} unknown; allowed: {', '.join(COMPRESSED_PRESETS)}")
        try:
            tokens = list(dict.fromkeys(int(x) for x in comma_list(a.tokens, "--tokens")))
        except ValueError:
            tokens = []
        if not tokens or min(tokens) < 1:
            raise ValueError(f"--tokens takes comma-separated positive integers, got {a.tokens!r}")
    except ValueError as e:
        ap.error(str(e))
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the CPU path runs the kernels under Triton's interpreter, not timed here)")
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = {"provenance": provenance({"script": "benchmarks/store_rotate.py", "shapes": f"{HKV} KV heads, head_dim {D}, "
                                     f"block {BS}, K/V strided views of a bfloat16 QKV row of {HQ} + 2 x {HKV} heads"}),
           "kernels": [], "rows": []}
    for preset in presets:
        info, rows = measure(preset, tokens, gen)
        res["kernels"].append(info)
        res["rows"] += rows
        write_json(a.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
