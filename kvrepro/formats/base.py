"""Common interface of KV-cache formats and their paged pools (PyTorch reference).

A *format* says how one token's K and V vectors of one KV head become bytes. A *pool* is the
paged KV cache of one attention layer in that format, addressed the way vLLM addresses it:
``slot = block_id * block_size + offset``; slot ``-1`` marks padding and is skipped.
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch


def check_positive_int(name: str, value: int) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is an int > 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def is_positive_finite(value) -> bool:
    """True for an int/float (not bool) that is finite and > 0."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0)


def check_finite(key: torch.Tensor, value: torch.Tensor) -> None:
    """Raise ``ValueError`` if K or V holds a NaN or an infinity (pass the rows to be stored)."""
    if not (torch.isfinite(key).all() and torch.isfinite(value).all()):
        raise ValueError("K/V contain non-finite values; refusing to store them")


def check_kv(key: torch.Tensor, value: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
    """Check K/V of shape ``[num_tokens, num_kv_heads, head_dim]``; raise ``ValueError``."""
    for name, x in (("key", key), ("value", value)):
        if x.dim() != 3 or tuple(x.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(
                f"{name} must have shape [num_tokens, {num_kv_heads}, {head_dim}], got {tuple(x.shape)}"
            )
    if key.shape != value.shape:
        raise ValueError(f"key shape {tuple(key.shape)} != value shape {tuple(value.shape)}")


class KVPool(ABC):
    """Paged KV cache of one layer. ``data`` is the tensor a kernel would read.

    Attributes:
        num_blocks, num_kv_heads, head_dim, block_size: pool geometry.
        data: the stored bytes; shape and dtype depend on the format.
    """

    def __init__(self, fmt: "KVFormat", num_blocks: int, num_kv_heads: int, head_dim: int,
                 block_size: int) -> None:
        check_positive_int("num_blocks", num_blocks)
        check_positive_int("num_kv_heads", num_kv_heads)
        check_positive_int("head_dim", head_dim)
        check_positive_int("block_size", block_size)
        self.fmt = fmt
        self.num_blocks = num_blocks
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.data: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def _split_slots(self, slot_mapping: torch.Tensor, num_tokens: int):
        if slot_mapping.dim() != 1 or slot_mapping.numel() != num_tokens:
            raise ValueError(
                f"slot_mapping must have shape [num_tokens={num_tokens}], got {tuple(slot_mapping.shape)}"
            )
        if slot_mapping.dtype.is_floating_point or slot_mapping.dtype == torch.bool:
            raise ValueError(f"slot_mapping must be an integer tensor, got {slot_mapping.dtype}")
        slot_mapping = slot_mapping.to(torch.int64)
        if slot_mapping.numel() and int(slot_mapping.min()) < -1:
            raise ValueError(f"slot_mapping holds {int(slot_mapping.min())}; slots are >= 0, or -1 for padding")
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        if slots.numel() and int(slots.max()) >= self.num_blocks * self.block_size:
            raise ValueError(
                f"slot_mapping holds slot {int(slots.max())} >= num_blocks * block_size = "
                f"{self.num_blocks * self.block_size}"
            )
        return keep, slots // self.block_size, slots % self.block_size

    @abstractmethod
    def write(self, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` (bf16/fp16/fp32)
        into the slots ``slot_mapping`` (int ``[num_tokens]``, -1 = padding, skipped)."""

    @abstractmethod
    def gather(self, block_ids: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K and V of one sequence, float32 ``[seq_len, num_kv_heads, head_dim]``.

        ``block_ids``: int ``[>= ceil(seq_len / block_size)]``, the sequence's block-table row.
        """

    def _pages_needed(self, block_ids: torch.Tensor, seq_len: int) -> torch.Tensor:
        check_positive_int("seq_len", seq_len)
        n = -(-seq_len // self.block_size)
        if block_ids.numel() < n:
            raise ValueError(f"block table row has {block_ids.numel()} blocks, seq_len={seq_len} needs {n}")
        return block_ids[:n].to(torch.int64)


class KVFormat(ABC):
    """A KV-cache storage format. Subclasses document method, shapes, dtypes and source."""

    name: str
    default_key_offset: str = "off"   # kvrepro.formats.offset.MODES: what the engines do unless told otherwise

    @abstractmethod
    def bytes_per_token_per_head(self, head_dim: int) -> int:
        """Bytes stored per token per KV head, K and V together, scales included."""

    @abstractmethod
    def new_pool(self, num_blocks: int, num_kv_heads: int, head_dim: int, block_size: int = 16,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16) -> KVPool:
        """Allocate an empty pool. ``dtype`` is the model dtype (used by 16-bit formats)."""

    def describe(self) -> str:
        return self.name

    def roundtrip(self, key: torch.Tensor, value: torch.Tensor, block_size: int = 16, key_offset: str = "off",
                  channels: torch.Tensor | None = None, rope: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Store then read back ``[num_tokens, num_kv_heads, head_dim]`` K/V through a fresh
        pool; returns float32 K/V of the same shape (what attention would see).

        ``key_offset="first-prefill"`` / ``"slow-pairs"``: the keys are one prefill; store ``key - c`` with ``c`` their
        mean in every channel / in ``channels`` (bool ``[head_dim]``, ``offset.slow_channels``), and return the
        read-back keys plus ``c`` (attention over them equals attention over the stored keys exactly: the shift is
        softmax-invariant). ``"rope-mean"``: the keys are one prefill at positions ``0 .. num_tokens - 1``; store
        ``key - R(p) b_hat`` (``offset.RopeMean`` calibrated on them with ``rope``: theta, rotary_dim, neox) and return
        the read-back keys plus ``R(p) b_hat`` (what the kernels' score correction restores). ``"off"``: the format
        alone.

        Raises:
            ValueError: a bad ``key_offset``; ``"slow-pairs"`` without ``channels``; ``"rope-mean"`` without ``rope``.
        """
        from kvrepro.formats.offset import KeyOffset, RopeMean, check_mode

        check_mode(key_offset)
        n, h, d = key.shape
        off = rm = None
        pos = torch.arange(n, device=key.device)
        if key_offset == "slow-pairs" and channels is None:
            raise ValueError("key_offset='slow-pairs' needs channels (kvrepro.formats.offset.slow_channels)")
        if key_offset == "rope-mean":
            if rope is None:
                raise ValueError("key_offset='rope-mean' needs rope (rope_theta, rotary_dim, neox)")
            rm = RopeMean(h, d, rope, key.device)
            rm.calibrate(key, pos)
            key = rm.remove(key, pos)
        elif key_offset != "off":
            off = KeyOffset(h, d, key.device, channels if key_offset == "slow-pairs" else None)
            off.calibrate(key)
            key = off.apply(key)
        num_blocks = -(-n // block_size)
        pool = self.new_pool(num_blocks, h, d, block_size, device=key.device, dtype=key.dtype)
        pool.write(key, value, torch.arange(n, device=key.device))
        k, v = pool.gather(torch.arange(num_blocks, device=key.device), n)
        if rm is not None:
            return rm.restore(k, pos), v
        return (k if off is None else k + off.offset), v
