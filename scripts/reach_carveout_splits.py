"""Split counts of the CUDA decode kernel under shared-memory budgets of other GPUs (one GPU call, H100 / H200).

    PYTHONPATH=. python scripts/reach_carveout_splits.py [--budgets none 164 100] [--presets k4v4 k8v4 k4v2]
        [--batches 1 3 6 13] [--ctx 131072] [--out results/reach/carveout_splits_<gpu>.json]

For each budget (none: the SM's own 228 KB; 164: an A100's; 100: an L40S / RTX 4090 / RTX 5090's), each preset's
kernel gets the carveout that caps an SM at that budget (``occupancy.carveout_for``), the driver's occupancy query
says how many of its CTAs an SM then holds, and for each batch (Qwen3-4B shapes: 32 q / 8 KV heads, head_dim 128,
block 16, ``--ctx`` tokens per sequence) one decode step is timed (CUDA graphs, median of replays after an L2 flush,
``benchmarks.common.bench``) at these split counts:
  - the rule's (``default_num_splits``: the fewest whole waves of the queried residency filling >= 95%);
  - one wave of 4 CTAs per SM (the count the former constant gave every GPU), when it differs;
  - two and three waves of the queried residency, and 16, 32, 64 (powers of two).
Each output is checked against float64 attention over the dequantized pages. The table printed at the end shows,
per budget, preset and batch, every count's time relative to the rule's, and whether the rule's was the fastest.
Writes ``--out`` (default ``results/reach/carveout_splits_<gpu>.json``: provenance (``kvrepro.provenance.collect``),
the fatbin's manifest SHA-256, every row), write-then-rename after each preset. Every kernel's carveout is put back
to no preference at the end. About 4-6 minutes on an H200 with the defaults.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.common import D, HKV, HQ, bench, decode_setup  # noqa: E402
from kvrepro.fileio import atomic_write_text  # noqa: E402
from kvrepro.ops import cuda_decode, decode_attention, decode_workspace_numel, default_num_splits, occupancy  # noqa: E402
from kvrepro.ops.common import sm_count  # noqa: E402
from kvrepro.provenance import collect  # noqa: E402
from kvrepro.reference import paged_attention_ref  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
KB = 1024


def candidates(rule: int, ctas: int, sms: int, batch: int, ctx: int) -> list[int]:
    """The split counts timed besides the rule's (module docstring), each in 1..min(256, ctx // 256)."""
    top = max(1, min(256, ctx // 256))
    waves = [k * ctas * sms // (batch * HKV) for k in (1, 2, 3)]
    old = cuda_decode.LAUNCH_BOUNDS_CTAS * sms // (batch * HKV)
    return sorted({min(top, max(1, s)) for s in [rule, old, *waves, 16, 32, 64]})


def table(rows: list[dict]) -> str:
    """The rows as a fixed-width table, one block per (budget, preset, batch)."""
    head = (f"{'budget':>8} {'preset':>6} {'batch':>5} {'CTAs/SM':>7} {'splits':>6} {'waves':>5} {'ms':>8} "
            f"{'vs rule':>8} {'relerr':>8}  note")
    out = [head, "-" * len(head)]
    key = lambda r: (str(r["budget_kb"]), r["preset"], r["batch"])  # noqa: E731
    for k in sorted({key(r) for r in rows}, key=lambda k: (k[0], k[1], k[2])):
        group = [r for r in rows if key(r) == k]
        rule = next(r for r in group if r["rule"])
        timed = [r for r in group if r["ms_graph"] is not None]
        best = min(timed, key=lambda r: r["ms_graph"]) if timed else None
        for r in sorted(group, key=lambda r: r["splits"]):
            vs = "" if r["ms_graph"] is None or rule["ms_graph"] is None else f"{r['ms_graph'] / rule['ms_graph']:.3f}"
            note = ("rule" if r["rule"] else "") + (" fastest" if r is best else "") + \
                   (" old constant" if r["old_constant"] and not r["rule"] else "")
            ms = "n/a" if r["ms_graph"] is None else f"{r['ms_graph']:.3f}"
            out.append(f"{str(r['budget_kb'] or 'none'):>8} {r['preset']:>6} {r['batch']:>5} {r['ctas_per_sm']:>7} "
                       f"{r['splits']:>6} {r['waves']:>5.2f} {ms:>8} {vs:>8} {r['relerr_vs_f64']:>8.1e}  {note.strip()}")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budgets", nargs="*", default=["none", "164", "100"],
                    help="shared memory per SM in KB to cap to ('none': no cap); default none 164 100")
    ap.add_argument("--presets", nargs="*", default=["k4v4", "k8v4", "k4v2"], type=str.lower)
    ap.add_argument("--batches", nargs="*", type=int, default=[1, 3, 6, 13])
    ap.add_argument("--ctx", type=int, default=131072, help="tokens per sequence (default 131072)")
    ap.add_argument("--out", default=None, help="result file (default results/reach/carveout_splits_<gpu>.json)")
    a = ap.parse_args(argv)
    bad = [p for p in a.presets if p not in cuda_decode.PRESETS.values()]
    if bad:
        ap.error(f"--presets must be among {sorted(cuda_decode.PRESETS.values())}, got {bad}")
    budgets = []
    for b in a.budgets:
        if b != "none" and not b.isdigit():
            ap.error(f"--budgets takes KB counts or 'none', got {b!r}")
        budgets.append(None if b == "none" else int(b))
    if any(n < 1 for n in a.batches) or a.ctx < 256 or a.ctx % 16:
        ap.error("--batches must be >= 1 and --ctx a multiple of 16, >= 256")
    if not torch.cuda.is_available():
        raise SystemExit("reach_carveout_splits.py needs a CUDA device")
    t0 = time.time()
    dev = torch.device("cuda", torch.cuda.current_device())
    cap = tuple(torch.cuda.get_device_capability(dev))
    sm = occupancy.limits(cap)
    budgets = [b for b in budgets if b is None or b * KB in sm.smem_configs]
    sms = sm_count(dev)
    mod = cuda_decode.load(dev)
    gpu = torch.cuda.get_device_name(dev)
    out_path = a.out or os.path.join(ROOT, "results", "reach",
                                     f"carveout_splits_{re.sub(r'[^a-z0-9]+', '_', gpu.lower()).strip('_')}.json")
    params = {"script": "scripts/reach_carveout_splits.py", "budgets_kb": budgets, "presets": a.presets,
              "batches": a.batches, "ctx": a.ctx, "sms": sms, "capability": list(cap)}
    res = {"provenance": collect(params) | {"cuda_fatbin_sha256": cuda_decode.read_manifest()["fatbin_sha256"]},
           "rows": []}
    gen = torch.Generator(device="cuda").manual_seed(22)
    scale = D ** -0.5
    try:
        for preset in a.presets:
            bits = {v: k for k, v in cuda_decode.PRESETS.items()}[preset]
            for batch in a.batches:
                pool, bt, sl, q = decode_setup(preset, a.ctx, batch, gen)
                ref = paged_attention_ref(q, pool, bt, sl, torch.arange(batch + 1, device=dev), scale,
                                          dtype=torch.float64)
                out = torch.empty_like(q)
                for budget in budgets:
                    pct = occupancy.CARVEOUT_DEFAULT if budget is None else occupancy.carveout_for(sm, budget * KB)
                    mod.set_carveout(bits, pct)
                    ctas = cuda_decode.ctas_per_sm(dev, bits)
                    model = cuda_decode.modelled_ctas(bits, cap, pct)
                    rule = default_num_splits(batch, HKV, bt.shape[1] * 16, dev, "cuda", kernel=bits)
                    old = cuda_decode.LAUNCH_BOUNDS_CTAS * sms // (batch * HKV)
                    for s in candidates(rule, ctas, sms, batch, a.ctx):
                        ws = torch.empty(decode_workspace_numel(batch, HQ, D, s), device=dev, dtype=torch.float32)

                        def step(s=s, ws=ws):
                            decode_attention(q, pool.data, bt, sl, pool.layout, pool.rotation, scale, out=out,
                                             num_splits=s, workspace=ws, impl="cuda")
                        out.fill_(float("nan"))
                        step()
                        err = float(((out.double() - ref).norm() / ref.norm()).item())
                        _, gms, gerr = bench(step)
                        row = {"budget_kb": budget, "carveout_pct": pct, "preset": preset, "batch": batch,
                               "ctas_per_sm": ctas, "ctas_per_sm_model": model, "splits": s, "ctas": batch * HKV * s,
                               "waves": batch * HKV * s / (ctas * sms), "rule": s == rule,
                               "old_constant": s == min(max(1, old), 256, a.ctx // 256), "ms_graph": gms,
                               "graph_error": gerr, "relerr_vs_f64": err}
                        res["rows"].append(row)
                        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()
                               if k != "graph_error"}, gerr or "", flush=True)
            res["total_s"] = time.time() - t0
            atomic_write_text(out_path, json.dumps(res, indent=1, default=str) + "\n")
    finally:
        for bits in cuda_decode.KERNELS:
            mod.set_carveout(bits, occupancy.CARVEOUT_DEFAULT)
    print("\n" + table(res["rows"]))
    print(f"wrote {os.path.relpath(out_path)} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
