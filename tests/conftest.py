"""Shared pytest setup. On a machine without CUDA, Triton kernels run in its interpreter."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
