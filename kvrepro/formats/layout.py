"""Byte layout of one compressed KV-cache page (one vLLM block x one KV head).

This is the one definition of the page, the contract between the PyTorch reference
(``kvrepro.formats.compressed``) and the kernels (``kvrepro.ops``): all read and write exactly these
bytes. The Triton kernels take the offsets as constexprs (``kvrepro.ops.common.page_constexprs``);
the CUDA kernel's ``kvrepro/ops/cuda/page_layout.h`` is generated from ``PageLayout`` by
``python -m kvrepro.ops.cuda_build`` (a test checks the committed header is that output).

A pool for one attention layer is a ``uint8`` tensor of shape
``[num_blocks, num_kv_heads, page_bytes]``. The page of (block ``b``, KV head ``h``) holds
``block_size`` tokens in four contiguous regions::

    offset 0          K codes   [block_size, head_dim * key_bits / 8]    uint8
    v_code_offset     V codes   [block_size, head_dim * value_bits / 8]  uint8
    k_meta_offset     K meta    [block_size, 2]  float16  (scale, zero): k = code * scale + zero
    v_meta_offset     V meta    [block_size]     float16  (scale):       v = (code - (2**vb - 1) / 2) * scale

Keys are quantized asymmetrically (min/max), values with a symmetric mid-rise quantizer (no zero
point; levels at odd multiples of scale/2), which saves 2 bytes per token per head: ``k4v4`` is
134 B per token per head at head_dim 128, so 13 users of 131,072 + 1,024 tokens fit an emulated
A100-80GB budget where 136 B would give 12.98 (notes/kernels.md, "Page format").

Codes are "split-plane" packed: with ``n = 8 / bits`` codes per byte and ``P = head_dim / n``
bytes per token, byte ``j`` holds the code of channel ``j + i * P`` in bits
``[i * bits, (i + 1) * bits)`` for ``i = 0 .. n - 1``. A kernel thus unpacks plane ``i`` of a
whole token with one shift and mask, giving channels ``[i * P, (i + 1) * P)`` in order, with no
interleaving shuffles.

Every region size is a multiple of 16 bytes for ``block_size`` a multiple of 16, so every
region starts 16-byte aligned when the pool itself is.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvrepro.formats.hadamard import check_head_dim

SUPPORTED_BITS = (2, 4, 8)
SUPPORTED_BLOCK_SIZES = (16, 32, 64)
K_META_BYTES = 4  # float16 scale + float16 zero, per token, per head
V_META_BYTES = 2  # float16 scale, per token, per head


@dataclass(frozen=True)
class PageLayout:
    """Offsets and sizes (bytes) of one compressed page. See the module docstring.

    Raises:
        ValueError: unsupported head_dim, key_bits, value_bits or block_size.
    """

    head_dim: int
    block_size: int
    key_bits: int
    value_bits: int

    def __post_init__(self) -> None:
        check_head_dim(self.head_dim)
        for name, bits in (("key_bits", self.key_bits), ("value_bits", self.value_bits)):
            if bits not in SUPPORTED_BITS:
                raise ValueError(f"{name}={bits} is not supported; allowed: {SUPPORTED_BITS}")
        if self.block_size not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(
                f"block_size={self.block_size} is not supported by the compressed KV format; "
                f"allowed: {SUPPORTED_BLOCK_SIZES}"
            )

    @property
    def k_code_bytes(self) -> int:
        """Bytes of K codes per token per head."""
        return self.head_dim * self.key_bits // 8

    @property
    def v_code_bytes(self) -> int:
        """Bytes of V codes per token per head."""
        return self.head_dim * self.value_bits // 8

    @property
    def bytes_per_token(self) -> int:
        """K + V bytes per token per KV head, codes and metadata."""
        return self.k_code_bytes + self.v_code_bytes + K_META_BYTES + V_META_BYTES

    @property
    def k_code_offset(self) -> int:
        return 0

    @property
    def v_code_offset(self) -> int:
        return self.block_size * self.k_code_bytes

    @property
    def k_meta_offset(self) -> int:
        return self.v_code_offset + self.block_size * self.v_code_bytes

    @property
    def v_meta_offset(self) -> int:
        return self.k_meta_offset + self.block_size * K_META_BYTES

    @property
    def page_bytes(self) -> int:
        """Bytes of one page (one block, one KV head)."""
        return self.v_meta_offset + self.block_size * V_META_BYTES
