"""Prototype (not run on a GPU yet): load ``decode_k4v4.cu`` and run it in place of the Triton attention kernel.

``decode_cuda`` has the arguments of ``kvrepro.ops.decode_attention`` for a k4v4 pool with head_dim 128, block 16
and a GQA group of at most 8 (anything else raises ValueError). It runs the same three steps: Triton
``rotate_query_kernel`` (q @ R * scale * log2 e -> float16), the CUDA attention kernel (split-K partials into the
same workspace), Triton ``merge_splits_kernel``. The CUDA kernel is compiled with nvcc for sm_90 into a cubin and
launched through the CUDA driver API (ctypes, ``cuLaunchKernel`` on PyTorch's current stream, so CUDA graphs capture
it); no PyTorch extension build is needed.
"""
from __future__ import annotations

import ctypes
import glob
import os
import shutil
import subprocess
import tempfile

import torch

from kvrepro.ops.decode import LOG2E, decode_workspace_numel, default_num_splits
from kvrepro.ops.common import check_float, check_int, check_pool, next_pow2, pool_tensor
from kvrepro.ops.kernels.rotate import merge_splits_kernel, rotate_query_kernel

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "decode_k4v4.cu")
WARPS = 4


def find_nvcc(nvcc: str | None = None) -> str:
    """``nvcc`` if given, else the one on PATH, else the newest ``/usr/local/cuda*/bin/nvcc``. Raises
    FileNotFoundError naming the places looked at."""
    cands = [nvcc] if nvcc else [shutil.which("nvcc"), *sorted(glob.glob("/usr/local/cuda*/bin/nvcc"), reverse=True)]
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise FileNotFoundError(f"nvcc not found (looked at {nvcc or 'PATH and /usr/local/cuda*/bin'})")


def build(nvcc: str | None = None, arch: str = "sm_90", out_dir: str | None = None) -> tuple[str, str]:
    """Compile ``decode_k4v4.cu`` to a cubin: ``(path, ptxas report)`` (registers, spills, shared memory).
    Raises RuntimeError with nvcc's output, FileNotFoundError without an nvcc."""
    exe = find_nvcc(nvcc)
    out_dir = out_dir or tempfile.mkdtemp(prefix="kvrepro_cuda_")
    path = os.path.join(out_dir, f"decode_k4v4_{arch}.cubin")
    r = subprocess.run([exe, f"-arch={arch}", "-O3", "-cubin", "-Xptxas", "-v", "-o", path, SOURCE],
                       capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"nvcc failed:\n{r.stdout}\n{r.stderr}")
    return path, (r.stdout + r.stderr).strip()


class _Driver:
    def __init__(self, cubin: str, name: str = "kvrepro_decode_k4v4"):
        self.lib = ctypes.CDLL("libcuda.so.1")
        torch.zeros(1, device="cuda")                        # make the primary context current
        self.image = open(cubin, "rb").read()                 # kept alive: the module points into it
        self.module, self.fn = ctypes.c_void_p(), ctypes.c_void_p()
        self._check(self.lib.cuModuleLoadData(ctypes.byref(self.module), ctypes.c_char_p(self.image)), "load")
        self._check(self.lib.cuModuleGetFunction(ctypes.byref(self.fn), self.module, name.encode()), "function")

    def _check(self, rc, what):
        if rc:
            raise RuntimeError(f"CUDA driver error {rc} in {what}")

    def launch(self, grid, block, args):
        vals = [ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else ctypes.c_int(int(a)) for a in args]
        ptrs = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in vals])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self._check(self.lib.cuLaunchKernel(self.fn, *grid, *block, 0, stream, ptrs, None), "launch")


_DRIVER: _Driver | None = None


def load(cubin: str) -> None:
    """Load a cubin made by ``build`` (once per process, before any CUDA-graph capture)."""
    global _DRIVER
    _DRIVER = _Driver(cubin)


def decode_cuda(query, pool, block_tables, seq_lens, layout, rotation, scale, out=None, num_splits=None,
                workspace=None):
    """``decode_attention`` (k4v4, head_dim 128, block 16, group <= 8) with the CUDA attention kernel.
    Returns ``out`` [B, Hq, D] in the query dtype. Raises ValueError for other shapes, RuntimeError if
    ``load`` was not called."""
    if _DRIVER is None:
        raise RuntimeError("call cuda_decode.load(build()[0]) first")
    data = pool_tensor(pool)
    _, hkv = check_pool(data, layout)                     # the checks decode_attention makes
    if data.device.type != "cuda":
        raise ValueError(f"pool must be on a CUDA device, got {data.device}")
    b, hq, d = query.shape
    check_float("query", query, (b, hq, d), data.device)
    check_int("block_tables", block_tables, 2, data.device)
    check_int("seq_lens", seq_lens, 1, data.device)
    if (layout.key_bits, layout.value_bits, layout.head_dim, layout.block_size) != (4, 4, 128, 16):
        raise ValueError(f"decode_cuda supports k4v4, head_dim 128, block 16; got {layout}")
    if hq % hkv or hq // hkv > 8:
        raise ValueError(f"decode_cuda needs a GQA group <= 8, got {hq} q / {hkv} kv heads")
    group = hq // hkv
    if num_splits is None:
        num_splits = default_num_splits(b, hkv, block_tables.shape[1] * layout.block_size, data.device)
    out = torch.empty_like(query) if out is None else out
    if b == 0:
        return out
    need = decode_workspace_numel(b, hq, d, num_splits)
    workspace = torch.empty(need, dtype=torch.float32, device=data.device) if workspace is None else workspace
    n_o = b * hq * num_splits * d
    part_o, part_lse = workspace[:n_o], workspace[n_o:n_o + b * hq * num_splits]
    q16 = workspace[n_o + b * hq * num_splits:need].view(torch.float16)[: b * hq * d]
    rotate_query_kernel[(b * hq,)](query, rotation, q16, query.stride(0), query.stride(1), float(scale) * LOG2E,
                                   HQ=hq, D=d)
    _DRIVER.launch((b, hkv * num_splits, 1), (WARPS * 32, 1, 1),
                   [q16, data, block_tables, seq_lens, part_o, part_lse, block_tables.stride(0), num_splits, hkv,
                    group])
    merge_splits_kernel[(b * hq,)](part_o, part_lse, rotation, out, out.stride(0), out.stride(1), HQ=hq, D=d,
                                   NUM_SPLITS=num_splits, SP=next_pow2(num_splits))
    return out
