"""Helpers for the kvrepro.ops tests: random paged sequences and float64 references."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():   # before triton is imported: the interpreter on CPU, compiled kernels on a GPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvrepro.formats import get_format  # noqa: E402
from kvrepro.ops import store_kv  # noqa: E402
from kvrepro.reference import attention_ref  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


# SHA-256 (first 16 hex digits) of the page bytes k4v4, k8v4 and k4v2 stored for ``fixed_kv(d)`` in a 3-block pool of
# 2 KV heads (slots 0..36), recorded before k5v4 was added: the existing presets must stay byte-identical, through
# the reference write (test_formats) and the store kernel (test_ops_store) alike.
EXISTING_PRESET_SHA256 = {
    ("k4v4", 64): "6bf7173f8a9b4e06", ("k4v4", 128): "1372d941ece601b2",
    ("k8v4", 64): "c7c086a80763f241", ("k8v4", 128): "78a76e62436f5221",
    ("k4v2", 64): "7a36b0a82f9e9721", ("k4v2", 128): "e27ee34f3151bf19",
}


def fixed_kv(d: int, n: int = 37, h: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed bfloat16 K/V ``[n, h, d]`` (CPU) that ``EXISTING_PRESET_SHA256`` was recorded with."""
    g = torch.Generator().manual_seed(1234 + d)
    k = (torch.randn(n, h, d, generator=g) * 2).to(torch.bfloat16)
    v = torch.randn(n, h, d, generator=g).to(torch.bfloat16)
    return k, v


def sha256_16(data: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(data.cpu().numpy().tobytes()).hexdigest()[:16]


def relerr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def make_pool(preset, hkv, d, block_size, num_blocks, gen):
    """A pool poisoned with random bytes (never zeros), so unwritten pages cannot pass."""
    pool = get_format(preset).new_pool(num_blocks, hkv, d, block_size, device=DEV)
    pool.data.copy_(torch.randint(0, 256, pool.data.shape, generator=gen, dtype=torch.uint8))
    return pool


def block_tables(num_seqs, max_blocks, num_blocks, gen, high=False):
    """Distinct random block ids per row (``high``: taken from the top of the pool)."""
    ids = torch.randperm(num_blocks, generator=gen)[: num_seqs * max_blocks]
    if high:
        ids = num_blocks - 1 - torch.arange(num_seqs * max_blocks)
    return ids.reshape(num_seqs, max_blocks).to(torch.int32).to(DEV)


def fill(pool, bt_row, n_tokens, gen, dtype, scale=1.0):
    """Random K/V ``[n_tokens, H, D]`` stored with ``store_kv`` at positions 0..n-1 of a row."""
    h, d, bs = pool.num_kv_heads, pool.head_dim, pool.block_size
    k = (torch.randn(n_tokens, h, d, generator=gen) * scale).to(DEV, dtype)
    v = torch.randn(n_tokens, h, d, generator=gen).to(DEV, dtype)
    pos = torch.arange(n_tokens, device=DEV)
    slots = (bt_row[pos // bs].long() * bs + pos % bs).to(torch.int32)
    store_kv(k, v, pool.data, slots, pool.layout, pool.rotation)
    return k, v


def chunk_reference(query, pool, bt_row, ctx, k_fresh, v_fresh, scale):
    """float64 attention of a chunk: context 0..ctx-1 dequantized from the pool, chunk fresh."""
    q_len = query.shape[0]
    kc, vc = pool.gather(bt_row, ctx) if ctx else (torch.zeros(0, pool.num_kv_heads, pool.head_dim, device=DEV),) * 2
    k = torch.cat([kc.double(), k_fresh.double()])
    v = torch.cat([vc.double(), v_fresh.double()])
    assert k.shape[0] == ctx + q_len
    return attention_ref(query, k, v, scale, torch.float64)
