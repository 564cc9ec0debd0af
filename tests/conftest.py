"""Shared pytest setup.

- OpenMP threads wait passively: on a busy 2-core machine spinning threads slowed CPU model runs
  10-30x (notes/accuracy.md). Set before torch is imported.
- On a machine without CUDA, Triton kernels run in its interpreter.
"""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
