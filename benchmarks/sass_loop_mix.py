"""Offline instruction count of the decode kernel's main loop, no GPU needed (CPU machine is fine).

Compiles ``kvrepro.ops.kernels.attention.paged_attn_kernel`` exactly as ``decode_attention`` launches
it (v2, split output) for sm_90 with Triton's own compiler, disassembles it with the ``cuobjdump``
that ships in Triton's wheel, takes the loop body as the largest backward branch of the SASS, and
prints registers / stack bytes, loop instructions per warp, warp-instructions per token and KV head
(= loop instructions x warps / block_n) and the opcode mix. The decode kernel is issue-bound
(notes/kernels.md, run 7 and "Where the current default's instructions go"), so this count predicts
the direction of a change before any device time is spent; it is not a timing.

    python benchmarks/sass_loop_mix.py                       # the CUDA defaults, k4v4
    python benchmarks/sass_loop_mix.py --preset k8v4 --dequant triton --block-n 128 --warps 4
    python benchmarks/sass_loop_mix.py --key-mma int8          # keys through int8 tensor cores

Pointers are compiled as 16-byte aligned (``tt.divisibility`` 16), as at run time with PyTorch
allocations. Query heads 32, KV heads 8 (Qwen3-4B) unless given.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from kvrepro.formats import FORMAT_NAMES, get_format  # noqa: E402
from kvrepro.ops import decode  # noqa: E402

SIGNATURE = {"q_ptr": "*fp16", "pool_ptr": "*u8", "bt_ptr": "*i32", "seq_lens_ptr": "*i32", "qsl_ptr": "*i32",
             "fk_ptr": "*fp16", "fv_ptr": "*fp16", "o_ptr": "*fp32", "lse_ptr": "*fp32", "rot_ptr": "*fp32",
             "stride_bt": "i32", "NUM_SPLITS": "i32"}


def compile_decode(preset: str, head_dim: int, num_q_heads: int, num_kv_heads: int, block_size: int,
                   block_n: int, num_warps: int, dequant: str, arch: int = 90, key_mma: str = "f16"):
    """The compiled kernel (``triton.compile`` result) for these launch parameters."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    layout = get_format(preset).layout(head_dim, block_size)
    kernel, extra = decode.attention_kernel("v2", dequant, torch.device("cuda"))  # the launch's DEQ_ASM
    consts = dict(decode.v2_decode_constexprs(layout, num_kv_heads, num_q_heads // num_kv_heads, block_n, key_mma),
                  **extra)
    sig = dict(SIGNATURE, **{k: "constexpr" for k in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(SIGNATURE)
             if SIGNATURE[n].startswith("*") or n == "stride_bt"}
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps, num_stages=1))


def cuobjdump(cubin: bytes, *args: str) -> str:
    import triton
    exe = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([exe, *args, f.name], capture_output=True, text=True, check=True).stdout


def loop_body(sass: str) -> list[str]:
    """Instructions between the target and the source of the SASS's largest backward branch."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in
           (re.search(r"/\*([0-9a-f]{4,6})\*/\s+(.*?);", line) for line in sass.splitlines()) if m]
    best = None
    for addr, text in ins:
        m = re.search(r"BRA\s+0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr and (best is None or addr - int(m.group(1), 16) > best[1] - best[0]):
            best = (int(m.group(1), 16), addr)
    return [t for a, t in ins if best and best[0] <= a <= best[1]]


def opcode_mix(body: list[str]) -> collections.Counter:
    return collections.Counter(re.match(r"(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", t).group(1) for t in body)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="k4v4", choices=[f for f in FORMAT_NAMES if f not in ("bf16", "fp8")])
    ap.add_argument("--dequant", default="asm", choices=decode.DEQUANT_MODES, help="default: the CUDA default")
    ap.add_argument("--block-n", type=int, default=None, help="default: decode.default_launch for the preset")
    ap.add_argument("--warps", type=int, default=None, choices=(1, 2, 4, 8),
                    help="default: decode.default_launch for the preset")
    ap.add_argument("--head-dim", type=int, default=128, choices=(64, 128))
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16, choices=(16, 32, 64))
    ap.add_argument("--key-mma", default=decode.DEFAULT_KEY_MMA, choices=decode.KEY_MMAS,
                    help="key dot products: float16 (HMMA) or int8 (IMMA) tensor cores")
    ap.add_argument("--top", type=int, default=16, help="opcodes shown")
    a = ap.parse_args(argv)
    bn, w = decode.default_launch(get_format(a.preset).key_bits, a.key_mma)
    a.block_n = bn if a.block_n is None else a.block_n
    a.warps = w if a.warps is None else a.warps
    if a.block_n < 16 or a.block_n & (a.block_n - 1):
        ap.error(f"--block-n must be a power of two >= 16, got {a.block_n}")
    if a.q_heads % a.kv_heads:
        ap.error(f"--q-heads {a.q_heads} is not a multiple of --kv-heads {a.kv_heads}")
    k = compile_decode(a.preset, a.head_dim, a.q_heads, a.kv_heads, a.block_size, a.block_n, a.warps, a.dequant,
                       key_mma=a.key_mma)
    usage = cuobjdump(k.asm["cubin"], "--dump-resource-usage")
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", usage)
    body = loop_body(cuobjdump(k.asm["cubin"], "-sass"))
    if not body:
        print("no backward branch found: the loop was not recognised", file=sys.stderr)
        return 1
    per_token_head = len(body) * a.warps / a.block_n
    print(f"decode v2, {a.preset}, key_mma {a.key_mma}, dequant {a.dequant}, block_n {a.block_n}, {a.warps} warps, head_dim {a.head_dim}, "
          f"{a.q_heads}q/{a.kv_heads}kv, sm_90, triton {__import__('triton').__version__}")
    print(f"registers {m.group(1) if m else '?'}, stack {m.group(2) if m else '?'} B; loop {len(body)} instructions "
          f"per warp per {a.block_n} tokens = {per_token_head:.1f} warp-instructions per token and KV head")
    print(", ".join(f"{op} {n}" for op, n in opcode_mix(body).most_common(a.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
