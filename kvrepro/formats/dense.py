"""Dense KV formats: ``bf16`` (16-bit, the model's dtype; vLLM ``kv_cache_dtype="auto"``) and
``fp8`` (OCP FP8 E4M3 with one scale per layer for K and one for V; vLLM ``kv_cache_dtype="fp8"``).

Pool layout (vLLM's FlashAttention layout, one layer): ``data`` of shape
``[num_blocks, 2, block_size, num_kv_heads, head_dim]``, index 0 = K, 1 = V; dtype is the model
dtype for ``bf16`` and ``torch.float8_e4m3fn`` for ``fp8``.

FP8 source: "OCP 8-bit Floating Point Specification (OFP8)", rev. 1.0, 2023 (E4M3, max 448).
Stored value = saturate(x / scale) to +-448, as vLLM's cache write does; read value =
stored * scale.
"""
from __future__ import annotations

import torch

from kvrepro.formats.base import KVFormat, KVPool, check_finite, check_kv, is_positive_finite

FP8_E4M3_MAX = 448.0


class DensePool(KVPool):
    def __init__(self, fmt: "KVFormat", num_blocks, num_kv_heads, head_dim, block_size, device, dtype):
        super().__init__(fmt, num_blocks, num_kv_heads, head_dim, block_size)
        self.data = torch.zeros(num_blocks, 2, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)

    def _encode(self, x: torch.Tensor, which: int) -> torch.Tensor:
        return x.to(self.data.dtype)

    def _decode(self, x: torch.Tensor, which: int) -> torch.Tensor:
        return x.float()

    def write(self, key, value, slot_mapping):
        check_kv(key, value, self.num_kv_heads, self.head_dim)
        keep, blocks, offs = self._split_slots(slot_mapping, key.shape[0])
        check_finite(key[keep], value[keep])
        self.data[blocks, 0, offs] = self._encode(key[keep], 0)
        self.data[blocks, 1, offs] = self._encode(value[keep], 1)

    def gather(self, block_ids, seq_len):
        ids = self._pages_needed(block_ids, seq_len)
        pages = self.data[ids]  # [n, 2, bs, H, D]
        k = pages[:, 0].reshape(-1, self.num_kv_heads, self.head_dim)[:seq_len]
        v = pages[:, 1].reshape(-1, self.num_kv_heads, self.head_dim)[:seq_len]
        return self._decode(k, 0), self._decode(v, 1)


class BF16Format(KVFormat):
    """16-bit KV in the model's dtype (bf16 or fp16); lossless w.r.t. the model's K/V.

    2 * head_dim * 2 bytes per token per KV head (512 B at head_dim 128).
    """

    name = "bf16"

    def bytes_per_token_per_head(self, head_dim: int) -> int:
        return 2 * head_dim * 2

    def new_pool(self, num_blocks, num_kv_heads, head_dim, block_size=16, device="cpu", dtype=torch.bfloat16):
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"dtype must be bfloat16, float16 or float32, got {dtype}")
        return DensePool(self, num_blocks, num_kv_heads, head_dim, block_size, device, dtype)


class FP8Pool(DensePool):
    def __init__(self, fmt: "FP8Format", *args):
        super().__init__(fmt, *args)
        # Per-layer scales actually used; None until calibrated when scale="amax".
        self.k_scale: float | None = None if fmt.scale == "amax" else float(fmt.scale)
        self.v_scale: float | None = self.k_scale

    def _encode(self, x, which):
        if which == 0 and self.k_scale is None:
            self.k_scale = max(float(x.abs().max()) / FP8_E4M3_MAX, 1e-12)
        if which == 1 and self.v_scale is None:
            self.v_scale = max(float(x.abs().max()) / FP8_E4M3_MAX, 1e-12)
        scale = self.k_scale if which == 0 else self.v_scale
        y = (x.float() / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
        return y.to(torch.float8_e4m3fn)

    def _decode(self, x, which):
        scale = self.k_scale if which == 0 else self.v_scale
        return x.float() * (scale if scale is not None else 1.0)


class FP8Format(KVFormat):
    """FP8 E4M3 KV with one scale per layer for K and one for V.

    Args:
        scale: ``1.0`` (a float; vLLM's default when no scales are calibrated) or ``"amax"``
            (each layer's scale is set on its first write to ``max|x| / 448``, like vLLM's
            ``calculate_kv_scales``). The scale used is ``pool.k_scale`` / ``pool.v_scale``.

    2 * head_dim bytes per token per KV head (256 B at head_dim 128).

    Values beyond ``448 * scale`` saturate to +-448 codes (as vLLM's cache write does); choose
    ``scale`` or ``"amax"`` accordingly.

    Raises:
        ValueError: ``scale`` not a finite positive float nor ``"amax"``; non-finite K/V on write.
    """

    name = "fp8"

    def __init__(self, scale: float | str = 1.0) -> None:
        if scale != "amax" and not is_positive_finite(scale):
            raise ValueError(f"fp8 scale must be a finite positive float or 'amax', got {scale!r}")
        self.scale = scale

    def bytes_per_token_per_head(self, head_dim: int) -> int:
        return 2 * head_dim

    def describe(self) -> str:
        return f"fp8 (e4m3, per-layer scale={self.scale})"

    def new_pool(self, num_blocks, num_kv_heads, head_dim, block_size=16, device="cpu", dtype=torch.bfloat16):
        return FP8Pool(self, num_blocks, num_kv_heads, head_dim, block_size, device, torch.float8_e4m3fn)
