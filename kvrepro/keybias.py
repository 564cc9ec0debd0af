"""Key-bias stress test: how a large key-projection bias, added before RoPE as models do, changes a KV format's
attention-output error.

Field fault (../shared/cases/field-faults.md, rows 1-2): Qwen2/2.5-family models carry a key-projection bias of norm
~300-1000 in a few channels of some layers. The bias is added before RoPE, so after RoPE it turns with the position
in its channel pair; a per-token quantizer then spends its range on the bias and the small per-token part of the
key, the part that decides attention, is lost.

``stress(fmt, shape, bias_norm, channels)`` builds keys ``RoPE(b + N(0, 1))`` (NeoX half-split RoPE, base 1e6 as
Qwen2.5), values N(0, 1) and queries ``RoPE(N(0, 1))`` at the last position, stores K/V through the format
(``KVFormat.roundtrip``: the page bytes every kernel reads, so the reference path stands for them) and returns the
attention output's relative error against exact attention in float64, and the share of queries whose top-1 key
matches. ``bias_table`` runs the grid and divides each error by the same format's error without the bias: the
robustness bar of issue 21 is a ratio <= 1.5.

Channel placements: ``high`` = the first 4 channels (RoPE's fastest-turning pairs; each pair turns by ~1 rad per
position), ``low`` = the last 2 channels of each half (the slowest pairs: nearly constant over the context; where
models' massive key values sit, Jin et al. 2025, arXiv:2502.01563).
"""
from __future__ import annotations

import math

import pandas as pd
import torch

from kvrepro.formats import get_format
from kvrepro.listarg import comma_list

SHAPES = ((32, 8, 128), (28, 4, 128), (16, 2, 128), (48, 2, 128), (32, 8, 64), (9, 3, 64), (32, 32, 80),
          (16, 4, 192))   # field-faults row 2: (q_heads, kv_heads, head_dim)
PLACEMENTS = ("high", "low")
BAR = 1.5


def rope(x: torch.Tensor, pos: torch.Tensor, base: float = 1e6) -> torch.Tensor:
    """NeoX-style (half-split) rotary embedding of ``x [..., n, D]`` at integer positions ``pos [n]``, float64."""
    half = x.shape[-1] // 2
    inv = base ** (-torch.arange(half, dtype=torch.float64) / half)
    ang = pos[:, None].double() * inv[None]
    c, s = ang.cos(), ang.sin()
    x1, x2 = x[..., :half].double(), x[..., half:].double()
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1)


def bias_channels(head_dim: int, placement: str) -> list[int]:
    """4 channels of ``placement`` (``PLACEMENTS``); ValueError otherwise."""
    half = head_dim // 2
    if placement == "high":
        return [0, 1, 2, 3]
    if placement == "low":
        return [half - 2, half - 1, head_dim - 2, head_dim - 1]
    raise ValueError(f"placement must be one of {PLACEMENTS}, got {placement!r}")


def stress(fmt: str, shape: tuple, bias_norm: float, placement: str = "high", tokens: int = 2048,
           seed: int = 0, key_offset: str | None = None) -> dict:
    """One case: ``shape = (q_heads, kv_heads, head_dim)``; bias of norm ``bias_norm`` spread evenly over the 4
    channels of ``placement``. The keys are stored as the engines store them: with the format's default key offset
    (``key_offset=None``; ``kvrepro.formats.offset``, calibrated on these keys as one prefill, slow pairs taken for
    base 1e6 over ``tokens`` positions), or as ``key_offset`` says (``"off"``, ``"first-prefill"``, ``"slow-pairs"``,
    ``"rope-mean"``: the per-position pre-RoPE mean, ``offset.RopeMean``, half-split pairs at positions 0..tokens-1). Returns ``{"rel_err", "top1"}`` (attention output relative error vs exact float64
    attention, all heads; share of queries whose top-1 key is unchanged).

    Raises:
        ValueError: an unknown format or placement; a head_dim the format does not support (the format's own
            message names head_dim and the supported values).
    """
    hq, hkv, d = shape
    f = get_format(fmt)
    g = torch.Generator().manual_seed(seed)
    b = torch.zeros(d, dtype=torch.float64)
    b[bias_channels(d, placement)] = bias_norm / 2.0       # 4 channels: norm = 2 x per-channel value
    pos = torch.arange(tokens)
    k = rope(b + torch.randn(hkv, tokens, d, generator=g, dtype=torch.float64), pos).transpose(0, 1)  # [n, Hkv, D]
    v = torch.randn(tokens, hkv, d, generator=g, dtype=torch.float64)
    q = rope(torch.randn(hq, 1, d, generator=g, dtype=torch.float64), pos[-1:])[:, 0]                  # [Hq, D]
    k16, v16 = k.to(torch.bfloat16), v.to(torch.bfloat16)
    from kvrepro.formats.offset import slow_channels

    kh, vh = f.roundtrip(k16.float(), v16.float(), key_offset=f.default_key_offset if key_offset is None else key_offset,
                         channels=slow_channels(d, 1e6, tokens),     # this test's RoPE: base 1e6, `tokens` positions
                         rope={"rope_theta": 1e6, "rotary_dim": d, "neox": True})
    grp = hq // hkv
    kk, kq = k16.double().repeat_interleave(grp, 1), kh.double().repeat_interleave(grp, 1)
    vv, vq = v16.double().repeat_interleave(grp, 1), vh.double().repeat_interleave(grp, 1)
    scale = d ** -0.5
    ref_logits = torch.einsum("hd,nhd->hn", q, kk) * scale
    logits = torch.einsum("hd,nhd->hn", q, kq) * scale
    ref = torch.einsum("hn,nhd->hd", torch.softmax(ref_logits, -1), vv)
    out = torch.einsum("hn,nhd->hd", torch.softmax(logits, -1), vq)
    return {"rel_err": float((out - ref).norm() / ref.norm()),
            "top1": float((logits.argmax(-1) == ref_logits.argmax(-1)).double().mean())}


def bias_table(formats=("fp8", "k8v4", "k5v4", "k4v4", "k4v2"), shapes=SHAPES, bias_norms=(300.0, 600.0, 1000.0),
               placements=PLACEMENTS, tokens: int = 2048, seed: int = 0, key_offset: str | None = None
               ) -> pd.DataFrame:
    """The grid: one row per (format, shape, placement, bias norm) with the error, the error without the bias, their
    ratio and ``meets`` (ratio <= ``BAR``), the top-1 agreement with and without the bias (``top1``,
    ``top1_no_bias``: whether a low agreement is the bias's or the format's own), keys stored with ``key_offset``
    (``stress``; None = each format's default, recorded in the ``key_offset`` column). A shape the format does not support gets ``supported=False``
    and the refusal message in ``note`` (the bar counts it as not met)."""
    rows = []
    for fmt in formats:
        ko = get_format(fmt).default_key_offset if key_offset is None else key_offset
        for shape in shapes:
            try:
                base = stress(fmt, shape, 0.0, "high", tokens, seed, ko)
            except ValueError as e:
                rows.append({"format": fmt, "shape": str(shape), "supported": False, "key_offset": ko,
                             "note": str(e).split(";")[0]})
                continue
            for placement in placements:
                for bn in bias_norms:
                    r = base if bn == 0 else stress(fmt, shape, bn, placement, tokens, seed, ko)   # no bias: base
                    ratio = r["rel_err"] / base["rel_err"]
                    rows.append({"format": fmt, "shape": str(shape), "supported": True, "placement": placement,
                                 "bias_norm": bn, "rel_err": r["rel_err"], "rel_err_no_bias": base["rel_err"],
                                 "ratio": ratio, "top1": r["top1"], "top1_no_bias": base["top1"],
                                 "meets": ratio <= BAR, "key_offset": ko, "note": ""})
    return pd.DataFrame(rows)


def default_out(key_offset: str | None, norms) -> str:
    """The committed table a run of ``main`` replaces by default: ``results/keybias/keybias[_no_bias][_<offset>]_cpu.csv``
    for the compressed presets' key offset (``key_offset``, None = the default preset's; none in the name for
    slow-pairs, whose table came first) and ``_no_bias`` when every norm is 0."""
    from kvrepro.formats import DEFAULT_PRESET

    ko = key_offset or get_format(DEFAULT_PRESET).default_key_offset
    tag = ("_no_bias" if norms and all(n == 0 for n in norms) else "") + \
        ("" if ko == "slow-pairs" else "_" + ko.replace("-", "_"))
    return f"results/keybias/keybias{tag}_cpu.csv"


def main(argv=None) -> int:
    """``python -m kvrepro.keybias [--out CSV] [--tokens N] [--key-offset MODE] [--bias-norms N,..] [--placements P,..]``:
    the grid (default: the full one) with provenance columns, written atomically (``--key-offset``: one mode for every
    format, ``offset.MODES``; default each format's own)."""
    import argparse
    import json
    import os
    import time

    from kvrepro.fileio import atomic_write
    from kvrepro.formats import FORMAT_NAMES
    from kvrepro.formats.offset import MODES
    from kvrepro.provenance import collect

    ap = argparse.ArgumentParser(prog="python -m kvrepro.keybias",
                                 description="Key-bias stress grid: each KV format's attention-output error under a key bias "
                                 "of norm 300-1000 added before RoPE (as Qwen2-family key projections have), over the "
                                 "usual (q_heads, kv_heads, head_dim) shapes, divided by its error without it "
                                 "(bar: 1.5x).")
    ap.add_argument("--out", default=None,
                    help="CSV to write (atomically; default: the committed table of the key offset and norms asked "
                    "for, results/keybias/keybias[_no_bias][_<offset>]_cpu.csv, which this replaces)")
    ap.add_argument("--tokens", type=int, default=2048, help="positions (keys) per case, >= 2 (default 2048)")
    ap.add_argument("--key-offset", default=None, choices=MODES,
                    help="store every format's keys with this key offset (default: each format's own default)")
    ap.add_argument("--bias-norms", default="300,600,1000",
                    help="comma-separated bias norms >= 0 (default 300,600,1000; 0: the format without a bias, e.g. "
                    "its own top-1 agreement)")
    ap.add_argument("--placements", default=",".join(PLACEMENTS), help=f"comma-separated, from {PLACEMENTS}")
    a = ap.parse_args(argv)
    if a.tokens < 2:
        ap.error(f"--tokens must be an integer >= 2, got {a.tokens}")
    try:
        norms = tuple(float(x) for x in comma_list(a.bias_norms, "--bias-norms"))
    except ValueError:
        ap.error(f"--bias-norms must be comma-separated numbers >= 0, got {a.bias_norms!r}")
    if not norms or not all(math.isfinite(x) and x >= 0 for x in norms):
        ap.error(f"--bias-norms must be comma-separated finite numbers >= 0, got {a.bias_norms!r}")
    if len(set(norms)) != len(norms):
        ap.error(f"--bias-norms has duplicates: {a.bias_norms!r}")
    try:
        places = tuple(comma_list(a.placements, "--placements"))
    except ValueError as e:
        ap.error(str(e))
    if not places or any(x not in PLACEMENTS for x in places):
        ap.error(f"--placements must be comma-separated from {PLACEMENTS}, got {a.placements!r}")
    if len(set(places)) != len(places):
        ap.error(f"--placements has duplicates: {a.placements!r}")
    formats = [f for f in FORMAT_NAMES if f != "bf16"]
    out = a.out or default_out(a.key_offset, norms)
    if os.path.isdir(out):       # checked before the grid runs, not when it is written
        ap.error(f"--out {out!r} is a folder; give a CSV file path")
    t = bias_table(formats=formats, bias_norms=norms, placements=places, tokens=a.tokens, key_offset=a.key_offset)
    t["tokens"] = a.tokens
    t["measured_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    t["provenance"] = json.dumps(collect(), sort_keys=True, default=str)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    atomic_write(out, lambda f: t.to_csv(f, index=False))
    print(f"wrote {out}")
    s = t[t["supported"]].groupby("format")["ratio"].agg(["min", "max"])
    print(s.to_string())
    return 0


if __name__ == "__main__":
    from kvrepro import cli

    raise SystemExit(cli.run(main))
