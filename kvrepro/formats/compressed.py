"""kvrepro's compressed KV format: randomized-Hadamard rotation + per-token asymmetric
integer quantization, stored as compressed pages (``kvrepro.formats.layout``).

Method, per token and KV head, separately for K and V (bits ``b`` = key_bits / value_bits):

1. rotate: ``x_rot = x @ R`` with the fixed orthogonal ``R = diag(s) H / sqrt(head_dim)``
   (``kvrepro.formats.hadamard``; QuaRot, arXiv:2404.00456);
2. keys (asymmetric): ``zero = min(x_rot)``, ``scale = (max(x_rot) - zero) / (2**b - 1)``, both
   stored as float16; ``code = clamp(round((x_rot - zero) / scale), 0, 2**b - 1)``;
   values (symmetric mid-rise): ``c = (2**b - 1) / 2``, ``scale = max|x_rot| / c`` stored as
   float16, ``zero = -c * scale`` implied; ``code = clamp(round(x_rot / scale + c), 0, 2**b - 1)``;
   codes use the *stored* float16 scale/zero and are packed split-plane (see ``layout``);
3. read: ``x_rot_hat = code * scale + zero``; attention runs in the rotated space
   (``q @ R``, then the output ``o_rot @ R.T``), or ``x_hat = x_rot_hat @ R.T``.

Per-token asymmetric min/max integer KV quantization follows KIVI (Liu et al., 2024,
arXiv:2402.02750) and KVQuant (Hooper et al., 2024, arXiv:2401.18079); rotation before
quantization follows QuaRot. Bytes per token per head: ``head_dim*(kb+vb)/8 + 6``
(134 B for ``k4v4`` at head_dim 128).
"""
from __future__ import annotations

import torch

from kvrepro.formats.base import KVFormat, KVPool, check_kv
from kvrepro.formats.hadamard import check_head_dim, rotation_matrix
from kvrepro.formats.layout import K_META_BYTES, SUPPORTED_BITS, V_META_BYTES, PageLayout

FP16_MAX = 65504.0


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes ``[..., head_dim]`` (values < 2**bits) split-plane into uint8
    ``[..., head_dim * bits / 8]``."""
    if bits == 8:
        return codes.to(torch.uint8)
    n = 8 // bits
    planes = codes.to(torch.int32).reshape(*codes.shape[:-1], n, codes.shape[-1] // n)
    out = torch.zeros(planes.shape[:-2] + planes.shape[-1:], dtype=torch.int32, device=codes.device)
    for i in range(n):
        out |= planes[..., i, :] << (i * bits)
    return out.to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``pack_codes``: uint8 ``[..., P]`` -> int32 codes ``[..., P * 8 / bits]``."""
    p = packed.to(torch.int32)
    if bits == 8:
        return p
    mask = (1 << bits) - 1
    return torch.cat([(p >> (i * bits)) & mask for i in range(8 // bits)], dim=-1)


def quantize_rotated(x_rot: torch.Tensor, bits: int, symmetric: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize rotated vectors ``[..., head_dim]`` (float32) to ``bits``.

    Returns ``(packed uint8 [..., head_dim*bits/8], meta float16)`` where meta is
    ``[..., 2] = (scale, zero)`` (asymmetric, keys) or ``[..., 1] = (scale,)`` (``symmetric``,
    values; see the module docstring).

    Raises:
        ValueError: a vector's range does not fit float16 (|x| > 65504) or is not finite.
    """
    x_rot = x_rot.float()
    lo = x_rot.amin(dim=-1)
    hi = x_rot.amax(dim=-1)
    if not (torch.isfinite(lo).all() and torch.isfinite(hi).all()):
        raise ValueError("K/V contain non-finite values; cannot quantize")
    if x_rot.numel() and float(torch.maximum(hi.abs(), lo.abs()).max()) > FP16_MAX:
        raise ValueError(f"K/V magnitude exceeds float16 range ({FP16_MAX}) of the stored scale/zero")
    qmax = (1 << bits) - 1
    if symmetric:
        c = qmax / 2
        scale = (torch.maximum(hi.abs(), lo.abs()) / c).to(torch.float16)
        s = scale.float().unsqueeze(-1)
        z = -c * s
        meta = scale.unsqueeze(-1)
    else:
        scale = ((hi - lo) / qmax).to(torch.float16)
        zero = lo.to(torch.float16)
        s = scale.float().unsqueeze(-1)
        z = zero.float().unsqueeze(-1)
        meta = torch.stack([scale, zero], dim=-1)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    codes = torch.clamp(torch.round((x_rot - z) / safe), 0, qmax)
    return pack_codes(codes, bits), meta


def dequantize_rotated(packed: torch.Tensor, meta: torch.Tensor, bits: int) -> torch.Tensor:
    """``code * scale + zero`` in the rotated space, float32 ``[..., head_dim]``; ``meta`` is
    ``[..., 2]`` (scale, zero) or ``[..., 1]`` (scale; symmetric, zero = -scale * (2**bits - 1) / 2)."""
    codes = unpack_codes(packed, bits).float()
    m = meta.float()
    s = m[..., 0:1]
    z = m[..., 1:2] if m.shape[-1] == 2 else -s * (((1 << bits) - 1) / 2)
    return codes * s + z


class CompressedPool(KVPool):
    """Pool ``data``: uint8 ``[num_blocks, num_kv_heads, layout.page_bytes]``."""

    def __init__(self, fmt: "CompressedFormat", num_blocks, num_kv_heads, head_dim, block_size, device):
        super().__init__(fmt, num_blocks, num_kv_heads, head_dim, block_size)
        self.layout = fmt.layout(head_dim, block_size)
        self.rotation = rotation_matrix(head_dim, fmt.seed, device)
        self.data = torch.zeros(num_blocks, num_kv_heads, self.layout.page_bytes, dtype=torch.uint8, device=device)

    def regions(self, data: torch.Tensor | None = None):
        """Byte views ``(k_codes [nb,H,bs,kcb], v_codes [nb,H,bs,vcb], k_meta [nb,H,bs,4],
        v_meta [nb,H,bs,2])`` of ``data`` (default: the pool); view meta as float16 to read it."""
        d = self.data if data is None else data
        L, nb, h, bs = self.layout, d.shape[0], d.shape[1], self.block_size
        kc = d[:, :, L.k_code_offset:L.v_code_offset].view(nb, h, bs, L.k_code_bytes)
        vc = d[:, :, L.v_code_offset:L.k_meta_offset].view(nb, h, bs, L.v_code_bytes)
        km = d[:, :, L.k_meta_offset:L.v_meta_offset].view(nb, h, bs, K_META_BYTES)
        vm = d[:, :, L.v_meta_offset:L.page_bytes].view(nb, h, bs, V_META_BYTES)
        return kc, vc, km, vm

    def write(self, key, value, slot_mapping):
        """``KVPool.write``."""
        check_kv(key, value, self.num_kv_heads, self.head_dim)
        keep, blocks, offs = self._split_slots(slot_mapping, key.shape[0])
        kp, km = quantize_rotated(key[keep].float() @ self.rotation, self.layout.key_bits)
        vp, vm = quantize_rotated(value[keep].float() @ self.rotation, self.layout.value_bits, symmetric=True)
        kc_r, vc_r, km_r, vm_r = self.regions()
        # Advanced indices on dims 0 and 2 -> the assigned value is [tokens, heads, bytes].
        kc_r[blocks, :, offs] = kp
        vc_r[blocks, :, offs] = vp
        km_r[blocks, :, offs] = km.view(torch.uint8).reshape(km.shape[0], km.shape[1], K_META_BYTES)
        vm_r[blocks, :, offs] = vm.view(torch.uint8).reshape(vm.shape[0], vm.shape[1], V_META_BYTES)

    def gather_rotated(self, block_ids, seq_len):
        """Dequantized K/V in the rotated space, float32 ``[seq_len, H, D]``."""
        ids = self._pages_needed(block_ids, seq_len)
        kc, vc, km, vm = self.regions(self.data[ids])

        def tokens(x):  # [n, H, bs, X] -> [n*bs, H, X]
            return x.permute(0, 2, 1, 3).reshape(-1, x.shape[1], x.shape[3])[:seq_len]

        k = dequantize_rotated(tokens(kc), tokens(km).contiguous().view(torch.float16), self.layout.key_bits)
        v = dequantize_rotated(tokens(vc), tokens(vm).contiguous().view(torch.float16), self.layout.value_bits)
        return k, v

    def gather(self, block_ids, seq_len):
        k, v = self.gather_rotated(block_ids, seq_len)
        rt = self.rotation.T
        return k @ rt, v @ rt


class CompressedFormat(KVFormat):
    """Compressed KV pages: ``key_bits``-bit keys, ``value_bits``-bit values (see module doc).

    Args:
        name: preset name.
        key_bits, value_bits: in ``(2, 4, 8)``.
        seed: rotation seed (the kernels and the reference must agree; default 0).

    Raises:
        ValueError: unsupported bits; unsupported head_dim/block_size when a pool is made.
    """

    def __init__(self, name: str, key_bits: int, value_bits: int, seed: int = 0) -> None:
        for pname, bits in (("key_bits", key_bits), ("value_bits", value_bits)):
            if bits not in SUPPORTED_BITS:
                raise ValueError(f"{pname}={bits} is not supported; allowed: {SUPPORTED_BITS}")
        self.name = name
        self.key_bits = key_bits
        self.value_bits = value_bits
        self.seed = seed

    def layout(self, head_dim: int, block_size: int = 16) -> PageLayout:
        return PageLayout(head_dim, block_size, self.key_bits, self.value_bits)

    def bytes_per_token_per_head(self, head_dim: int) -> int:
        check_head_dim(head_dim)
        return head_dim * (self.key_bits + self.value_bits) // 8 + K_META_BYTES + V_META_BYTES

    def describe(self) -> str:
        return f"{self.name} (Hadamard-rotated {self.key_bits}-bit K / {self.value_bits}-bit V, per-token fp16 K scale+zero, V scale)"

    def new_pool(self, num_blocks, num_kv_heads, head_dim, block_size=16, device="cpu", dtype=torch.bfloat16):
        return CompressedPool(self, num_blocks, num_kv_heads, head_dim, block_size, device)
