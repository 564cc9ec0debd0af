"""Fixed randomized Hadamard rotation along head_dim.

The rotation spreads outlier channels evenly over all channels before low-bit
quantization, so a per-vector min/max scale is not set by one channel.
Method: QuaRot (Ashkboos et al., 2024, arXiv:2404.00456) and QuIP# (Tseng et al., 2024,
arXiv:2402.04396) use the same randomized Hadamard transform ``H diag(s) / sqrt(d)``.

The sign vector is derived from SHA-256 of a fixed string, so it is identical on every
machine, torch version and device (no RNG state involved).
"""
from __future__ import annotations

import functools
import hashlib

import torch

SUPPORTED_HEAD_DIMS = (64, 128)


def check_head_dim(head_dim: int) -> None:
    """Raise ``ValueError`` unless ``head_dim`` is one the compressed format supports."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"head_dim={head_dim} is not supported by kvrepro's compressed KV format; "
            f"supported head_dim values: {SUPPORTED_HEAD_DIMS} (the Hadamard rotation needs a "
            "power of two and the Triton kernels are built for these sizes)"
        )


def rotation_signs(head_dim: int, seed: int = 0) -> torch.Tensor:
    """Deterministic +-1 signs, float32 tensor of shape ``[head_dim]``."""
    bits = []
    counter = 0
    while len(bits) < head_dim:
        digest = hashlib.sha256(f"kvrepro-hadamard-d{head_dim}-s{seed}-{counter}".encode()).digest()
        for byte in digest:
            for i in range(8):
                bits.append((byte >> i) & 1)
        counter += 1
    return torch.tensor([1.0 if b else -1.0 for b in bits[:head_dim]], dtype=torch.float32)


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


@functools.lru_cache(maxsize=None)
def _rotation_cpu(head_dim: int, seed: int) -> torch.Tensor:
    check_head_dim(head_dim)
    with torch.inference_mode(False):   # cached for every later caller: never an inference tensor (no version counter)
        h = _sylvester(head_dim) / head_dim**0.5
        s = rotation_signs(head_dim, seed).double()
        return (s[:, None] * h).float()


def rotation_matrix(head_dim: int, seed: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """Orthogonal rotation ``R = diag(s) H / sqrt(head_dim)``, float32 ``[head_dim, head_dim]``.

    Row vectors are rotated as ``x_rot = x @ R``; the inverse is ``x = x_rot @ R.T``.
    Because ``R`` is orthogonal, ``(q @ R) . (k @ R) == q . k``: attention can run entirely in
    the rotated space if the query is rotated and the output is rotated back.

    Raises:
        ValueError: head_dim not in ``SUPPORTED_HEAD_DIMS``.
    """
    return _rotation_cpu(head_dim, seed).to(device)
