"""Registers and spills of kvrepro's Triton decode kernel per preset, compiled offline for a GPU architecture (no GPU
needed): what ptxas reports for ``paged_attn_kernel`` with the constexprs and launch ``decode_attention`` uses at
Qwen3-4B shapes (32 q / 8 KV heads, head_dim 128, block 16), with and without the key offset rope-mean's score
correction (``NPAIRS`` 0 / 8), plus any extra ``(block_n, num_warps)`` launches asked for.

    PYTHONPATH=. python benchmarks/triton_spills.py [--arch 90] [--launch 64,2 256,4] [--out PATH]

Writes ``--out`` (default ``benchmarks/results/triton_decode_spills.json``; provenance, one row per preset x NPAIRS x
launch: registers per thread, stack frame, spill store / load bytes per thread, the PTX's float64 instructions),
atomically. Method: ``triton.compile`` for ``GPUTarget("cuda", arch, 32)`` into an empty Triton cache, with Triton's own ptxas
log printed (``knobs.nvidia.dump_ptxas_log``: the ptxas it ships, the command it builds every cubin with), read for
the entry function's figures.
A spill is a per-thread round trip through local memory (L1, else L2 / HBM) inside the key loop: the figure says
where a kernel's time may go; the time itself is measured on a GPU (``decode_side_by_side.py``).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.common import RESULTS, parse_launch, provenance, write_json  # noqa: E402
from kvrepro.formats import COMPRESSED_PRESETS, get_format  # noqa: E402
from kvrepro.listarg import comma_list  # noqa: E402

OUT = os.path.join(RESULTS, "triton_decode_spills.json")
HKV, GROUP, D, BS = 8, 4, 128, 16      # Qwen3-4B: 8 KV heads, GQA group 4, head_dim 128; block 16
NPAIRS = 8                              # kvrepro.formats.offset.MAX_PAIRS
_INFO = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def ptxas_path() -> str:
    """The ptxas bundled with Triton (FileNotFoundError if this Triton has none)."""
    import triton

    p = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.isfile(p):
        raise FileNotFoundError(f"no ptxas in this Triton install ({p}); triton_spills.py needs Triton's NVIDIA backend")
    return p


def compile_decode(preset: str, npairs: int, arch: int, launch: tuple[int, int] | None = None) -> dict:
    """One row: ``paged_attn_kernel`` as ``decode_attention`` launches it for ``preset`` (its default key path and
    launch, or ``launch`` = ``(block_n, num_warps)``), ``npairs`` rope-mean pairs, compiled for sm_``arch``."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    from kvrepro.ops import decode
    from kvrepro.ops.triton.attention import paged_attn_kernel

    layout = get_format(preset).layout(D, BS)
    mma = decode.resolve_key_mma(None, layout.key_bits)
    block_n, warps = launch or decode.default_launch(layout.key_bits, mma)
    cx = dict(decode.decode_constexprs(layout, HKV, GROUP, block_n, mma), DEQ_ASM=True, NPAIRS=npairs)
    sig = {"q_ptr": "*fp16", "pool_ptr": "*u8", "bt_ptr": "*i32", "seq_lens_ptr": "*i32", "qsl_ptr": "*i32",
           "fk_ptr": "*fp16", "fv_ptr": "*fp16", "o_ptr": "*fp32", "lse_ptr": "*fp32", "rot_ptr": "*fp32",
           "stride_bt": "i32", "NUM_SPLITS": "i32", **{k: "constexpr" for k in cx}}
    if npairs:
        sig.update(rb_ptr="*fp32", rf_ptr="*fp32", rb_scale="fp32")
    else:
        sig.update(rb_ptr="constexpr", rf_ptr="constexpr", rb_scale="constexpr")
        cx.update(rb_ptr=None, rf_ptr=None, rb_scale=1.0)
    src = triton.compiler.ASTSource(fn=paged_attn_kernel, signature=sig, constexprs=cx)
    target = GPUTarget("cuda", arch, 32)
    log = io.StringIO()
    with knobs.nvidia.scope(), contextlib.redirect_stdout(log):    # Triton prints its own ptxas -v log
        knobs.nvidia.dump_ptxas_log = True
        k = triton.compile(src, target=target, options={"num_warps": warps, "num_stages": decode.DECODE_STAGES})
    ptx, text = k.asm["ptx"], log.getvalue()
    sm = re.search(r"^\.target (\S+)", ptx, re.M).group(1)
    if not _INFO.search(text):
        raise RuntimeError(f"no ptxas -v figures in Triton's log for {preset} NPAIRS={npairs} (cached compile? set "
                           f"TRITON_CACHE_DIR to an empty folder): {text[-400:]!r}")
    stack, st, ld = (int(x) for x in _INFO.search(text).groups())
    return {"preset": preset, "npairs": npairs, "key_mma": mma, "block_n": block_n, "num_warps": warps, "arch": sm,
            "registers": int(_REGS.search(text).group(1)), "stack_bytes": stack, "spill_store_bytes": st,
            "spill_load_bytes": ld, "ptx_f64_instructions": len(re.findall(r"\.f64\b", ptx))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 to compile for (default 90: H100 / "
                    "H200; 80 A100, 89 Ada, 100 B200, 120 RTX 50)")
    ap.add_argument("--presets", default=",".join(COMPRESSED_PRESETS), help="comma-separated presets")
    ap.add_argument("--launch", nargs="*", default=[], help="extra (block_n,num_warps) launches, e.g. 64,2 256,4")
    ap.add_argument("--out", default=OUT, help=f"result file (default {os.path.relpath(OUT)})")
    a = ap.parse_args(argv)
    try:
        presets = comma_list(a.presets, "--presets")
        bad = [p for p in presets if p not in COMPRESSED_PRESETS]
        if bad:
            raise ValueError(f"--presets: {bad} unknown; allowed: {', '.join(COMPRESSED_PRESETS)}")
        launches = [None] + [parse_launch(x) for x in a.launch]
    except ValueError as e:
        ap.error(str(e))
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvrepro-spills-")   # compile, never reuse a cubin
    import triton

    ver = next((x.strip() for x in subprocess.run([ptxas_path(), "--version"], capture_output=True, text=True)
                .stdout.splitlines() if "release" in x), "?")
    res = {"provenance": provenance({"script": "benchmarks/triton_spills.py", "ptxas": ver,
                                     "target": f"cuda sm_{a.arch}", "shapes": f"{HKV * GROUP} q / {HKV} KV heads, "
                                     f"head_dim {D}, block {BS}", "triton_compile_only": True,
                                     "measured": f"compiled (triton {triton.__version__}), no GPU run"}),
           "rows": []}
    for preset in presets:
        for launch in launches:
            for npairs in (0, NPAIRS):
                row = compile_decode(preset, npairs, a.arch, launch)
                row["launch"] = "default" if launch is None else "extra"
                res["rows"].append(row)
                print(f"{preset} NPAIRS={npairs} block_n={row['block_n']} warps={row['num_warps']} ({row['launch']}): "
                      f"{row['registers']} registers, stack {row['stack_bytes']} B, spill stores "
                      f"{row['spill_store_bytes']} B / loads {row['spill_load_bytes']} B, f64 {row['ptx_f64_instructions']}",
                      flush=True)
    write_json(a.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
