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
    k_meta_offset     K meta    [block_size, k_meta_bytes]
    v_meta_offset     V meta    [block_size, v_meta_bytes]

Metadata per token, by scheme (``k4v4``, ``k8v4``, ``k4v2``: asymmetric keys, float16 V scale;
``k5v4``: ``key_symmetric`` and ``value_log_scale``)::

    keys, asymmetric (2/4/8 bits)   float16 (scale, zero)  4 B   k = code * scale + zero
    keys, key_symmetric (5 bits)    float16 scale          2 B   k = (code - 15.5) * scale
    values, float16 scale           float16 scale          2 B   v = (code - (2**vb - 1) / 2) * scale
    values, value_log_scale         uint8 u                1 B   v = (code - (2**vb - 1) / 2) * 2**((u - 128) / 8)

Keys are quantized asymmetrically (min/max), values with a symmetric mid-rise quantizer (no zero
point; levels at odd multiples of scale/2), which saves 2 bytes per token per head: ``k4v4`` is
134 B per token per head at head_dim 128, so 13 users of 131,072 + 1,024 tokens fit an emulated
A100-80GB budget where 136 B would give 12.98 (notes/kernels.md, "Page format"). ``k5v4`` is
147 B (80 + 64 codes, 2 + 1 meta).

Codes are "split-plane" packed: with ``n = 8 / bits`` codes per byte and ``P = head_dim / n``
bytes per token, byte ``j`` holds the code of channel ``j + i * P`` in bits
``[i * bits, (i + 1) * bits)`` for ``i = 0 .. n - 1``. A kernel thus unpacks plane ``i`` of a
whole token with one shift and mask, giving channels ``[i * P, (i + 1) * P)`` in order, with no
interleaving shuffles. 5-bit key codes (``head_dim * 5 / 8`` bytes per token) are two bit planes,
one after the other: the high plane ``code >> 1`` packed as 4-bit codes (``head_dim / 2`` bytes),
then the low plane ``code & 1`` packed as 1-bit codes (``head_dim / 8`` bytes: byte ``j`` bit ``i``
is channel ``j + i * head_dim / 8``); ``code = (hi << 1) | lo``.

Every region size is a multiple of 16 bytes for ``block_size`` a multiple of 16, so every
region starts 16-byte aligned when the pool itself is.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvrepro.formats.hadamard import check_head_dim

SUPPORTED_BITS = (2, 4, 8)          # asymmetric keys; values
SYMMETRIC_KEY_BITS = (5,)           # keys with key_symmetric=True (k5v4)
LOG_SCALE_VALUE_BITS = (4,)         # values with value_log_scale=True (k5v4)
SUPPORTED_BLOCK_SIZES = (16, 32, 64)
K_META_BYTES = 4  # asymmetric keys: float16 scale + float16 zero, per token, per head
V_META_BYTES = 2  # values: float16 scale, per token, per head
K_META_BYTES_SYMMETRIC = 2  # key_symmetric: float16 scale
V_META_BYTES_LOG = 1        # value_log_scale: uint8 log2 code


def check_bits(key_bits: int, value_bits: int, key_symmetric: bool = False, value_log_scale: bool = False) -> None:
    """Raise ``ValueError`` naming the parameter unless the combination is one the format implements: asymmetric
    keys of 2, 4 or 8 bits, or symmetric (``key_symmetric``) keys of 5 bits; values of 2, 4 or 8 bits with a float16
    scale, or of 4 bits with the uint8 log2 scale (``value_log_scale``)."""
    for name, flag in (("key_symmetric", key_symmetric), ("value_log_scale", value_log_scale)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be True or False, got {flag!r}")
    if key_symmetric and key_bits not in SYMMETRIC_KEY_BITS:
        raise ValueError(f"key_bits={key_bits} is not supported with key_symmetric=True; allowed: {SYMMETRIC_KEY_BITS}")
    if not key_symmetric and key_bits not in SUPPORTED_BITS:
        hint = " (5-bit keys are symmetric only: key_symmetric=True)" if key_bits in SYMMETRIC_KEY_BITS else ""
        raise ValueError(f"key_bits={key_bits} is not supported; allowed: {SUPPORTED_BITS}, "
                         f"or {SYMMETRIC_KEY_BITS} with key_symmetric=True{hint}")
    if value_bits not in SUPPORTED_BITS:
        raise ValueError(f"value_bits={value_bits} is not supported; allowed: {SUPPORTED_BITS}")
    if value_log_scale and value_bits not in LOG_SCALE_VALUE_BITS:
        raise ValueError(f"value_bits={value_bits} is not supported with value_log_scale=True; "
                         f"allowed: {LOG_SCALE_VALUE_BITS}")


@dataclass(frozen=True)
class PageLayout:
    """Offsets and sizes (bytes) of one compressed page. See the module docstring.

    ``key_symmetric`` (5-bit keys, float16 scale only) and ``value_log_scale`` (uint8 log2 value
    scale) default to False: the layouts of ``k4v4``, ``k8v4`` and ``k4v2``.

    Raises:
        ValueError: unsupported head_dim, block_size or bit/scheme combination (``check_bits``).
    """

    head_dim: int
    block_size: int
    key_bits: int
    value_bits: int
    key_symmetric: bool = False
    value_log_scale: bool = False

    def __post_init__(self) -> None:
        check_head_dim(self.head_dim)
        check_bits(self.key_bits, self.value_bits, self.key_symmetric, self.value_log_scale)
        if self.block_size not in SUPPORTED_BLOCK_SIZES:
            raise ValueError(
                f"block_size={self.block_size} is not supported by the compressed KV format; "
                f"allowed: {SUPPORTED_BLOCK_SIZES}"
            )

    def __repr__(self) -> str:
        extra = "".join(f", {n}=True" for n in ("key_symmetric", "value_log_scale") if getattr(self, n))
        return (f"PageLayout(head_dim={self.head_dim}, block_size={self.block_size}, key_bits={self.key_bits}, "
                f"value_bits={self.value_bits}{extra})")

    @property
    def k_code_bytes(self) -> int:
        """Bytes of K codes per token per head."""
        return self.head_dim * self.key_bits // 8

    @property
    def v_code_bytes(self) -> int:
        """Bytes of V codes per token per head."""
        return self.head_dim * self.value_bits // 8

    @property
    def k_meta_bytes(self) -> int:
        """Bytes of K metadata per token per head: 4 (float16 scale, zero), 2 if ``key_symmetric`` (scale)."""
        return K_META_BYTES_SYMMETRIC if self.key_symmetric else K_META_BYTES

    @property
    def v_meta_bytes(self) -> int:
        """Bytes of V metadata per token per head: 2 (float16 scale), 1 if ``value_log_scale`` (uint8 code)."""
        return V_META_BYTES_LOG if self.value_log_scale else V_META_BYTES

    @property
    def bytes_per_token(self) -> int:
        """K + V bytes per token per KV head, codes and metadata."""
        return self.k_code_bytes + self.v_code_bytes + self.k_meta_bytes + self.v_meta_bytes

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
        return self.k_meta_offset + self.block_size * self.k_meta_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes of one page (one block, one KV head)."""
        return self.v_meta_offset + self.block_size * self.v_meta_bytes
