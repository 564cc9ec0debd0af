"""kvrepro's compressed KV format: randomized-Hadamard rotation + per-token integer quantization,
stored as compressed pages (``kvrepro.formats.layout``).

Method, per token and KV head, separately for K and V (bits ``b`` = key_bits / value_bits):

1. rotate: ``x_rot = x @ R`` with the fixed orthogonal ``R = diag(s) H / sqrt(head_dim)``
   (``kvrepro.formats.hadamard``; QuaRot, arXiv:2404.00456);
2. keys (asymmetric, 2/4/8 bits): ``zero = min(x_rot)``, ``scale = (max(x_rot) - zero) / (2**b - 1)``,
   both stored as float16; ``code = clamp(round((x_rot - zero) / scale), 0, 2**b - 1)``;
   values (symmetric mid-rise): ``c = (2**b - 1) / 2``, ``scale = max|x_rot| / c`` stored as
   float16, ``zero = -c * scale`` implied; ``code = clamp(round((x_rot - zero) / scale), 0, 2**b - 1)``;
   codes use the *stored* float16 scale/zero and are packed split-plane (see ``layout``);
3. read: ``x_rot_hat = code * scale + zero``; attention runs in the rotated space
   (``q @ R``, then the output ``o_rot @ R.T``), or ``x_hat = x_rot_hat @ R.T``.

``k5v4`` (``key_symmetric``, ``value_log_scale``): keys 5-bit symmetric mid-rise, ``c = 15.5``,
``scale = max|x_rot| / 15.5`` stored as float16, ``code = clamp(round(x_rot / scale + 15.5), 0, 31)``
(float32: ``x_rot / scale`` correctly rounded, then ``+ 15.5``), read ``(code - 15.5) * scale``;
stored as a 4-bit high plane and a 1-bit low plane (``layout``). Values 4-bit symmetric as above, but
the scale is one byte, a log2 code (``log_scale_code``): ``s = max|x_rot| / 7.5``,
``u = clamp(ceil(8 log2(s) + 128), 0, 255)`` (0 for ``s = 0``), stored scale
``s_hat = 2**((u - 128) / 8)`` (``log_scale_value``, float32), so ``s <= s_hat < s * 2**(1/8)`` and no
code clips; codes as above with ``s_hat``; read ``(code - 7.5) * s_hat``.

Per-token asymmetric min/max integer KV quantization follows KIVI (Liu et al., 2024,
arXiv:2402.02750) and KVQuant (Hooper et al., 2024, arXiv:2401.18079); rotation before
quantization follows QuaRot. Bytes per token per head: ``PageLayout.bytes_per_token``
(``head_dim*(kb+vb)/8 + 6``: 134 B for ``k4v4`` at head_dim 128; ``k5v4``: ``head_dim*9/8 + 3``, 147 B).
"""
from __future__ import annotations

import math

import torch

from kvrepro.formats.base import KVFormat, KVPool, check_kv
from kvrepro.formats.hadamard import check_head_dim, rotation_matrix
from kvrepro.formats.layout import PageLayout, check_bits

FP16_MAX = 65504.0
LOG_SCALE_STEPS = 8     # value_log_scale: codes per octave, s_hat = 2**((u - LOG_SCALE_BIAS) / LOG_SCALE_STEPS)
LOG_SCALE_BIAS = 128


def _mantissas_of_octave_steps() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The 23-bit float32 mantissa fields of ``2**(j / 8)``, j = 0..7, rounded down and rounded to nearest,
    computed exactly in integers: ``floor(2**(23 + j/8)) = isqrt(isqrt(isqrt(2**(184 + j))))``."""
    down, near = [], []
    for j in range(LOG_SCALE_STEPS):
        rd = math.isqrt(math.isqrt(math.isqrt(1 << (184 + j))))
        rn = rd + 1 if (2 * rd + 1) ** 8 < 1 << (192 + j) else rd      # no ties: 2**(j/8) is irrational for j > 0
        down.append(rd - (1 << 23))
        near.append(rn - (1 << 23))
    return tuple(down), tuple(near)


# LOG_MANT_DOWN[j]: mantissa field of the largest float32 <= 2**(j/8) (encode thresholds); LOG_MANT_NEAR[j]: of the
# float32 nearest 2**(j/8) (the stored scale). Kernels use the same integers (kvrepro.ops.triton.scales).
LOG_MANT_DOWN, LOG_MANT_NEAR = _mantissas_of_octave_steps()


def log_scale_code(s: torch.Tensor) -> torch.Tensor:
    """uint8 ``u = clamp(ceil(8 log2(s) + 128), 0, 255)`` of float32 ``s >= 0`` (0 for ``s = 0``), exactly:
    the smallest ``u`` with ``s <= 2**((u - 128) / 8)``, found from the float32 bits of ``s`` (exponent ``E``,
    mantissa field ``m``) as ``8 (E + 16) + #{j : m > LOG_MANT_DOWN[j]}``, no logarithm evaluated."""
    b = s.float().contiguous().view(torch.int32)
    e = (b >> 23) & 0xFF
    mant = b & 0x7FFFFF
    u = 8 * (e - 127 + 16)
    for m in LOG_MANT_DOWN:
        u = u + (mant > m).to(torch.int32)
    return u.clamp(0, 255).to(torch.uint8)


def log_scale_value(u: torch.Tensor) -> torch.Tensor:
    """float32 ``s_hat = 2**((u - 128) / 8)`` of uint8 codes ``u`` (the float32 nearest it, built from its bits:
    exponent ``(u >> 3) - 16``, mantissa ``LOG_MANT_NEAR[u & 7]``); 2**-16 .. 2**15.875."""
    u = u.to(torch.int32)
    mant = torch.tensor(LOG_MANT_NEAR, dtype=torch.int32, device=u.device)[u & 7]
    return ((((u >> 3) - 16 + 127) << 23) | mant).view(torch.float32)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes ``[..., head_dim]`` (values < 2**bits) split-plane into uint8
    ``[..., head_dim * bits / 8]``; bits 1, 2, 4, 8, or 5: the 4-bit high plane ``code >> 1``, then the
    1-bit low plane ``code & 1`` (``kvrepro.formats.layout``)."""
    if bits == 8:
        return codes.to(torch.uint8)
    if bits == 5:
        c = codes.to(torch.int32)
        return torch.cat([pack_codes(c >> 1, 4), pack_codes(c & 1, 1)], dim=-1)
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
    if bits == 5:
        hi_bytes = p.shape[-1] * 4 // 5
        return (unpack_codes(packed[..., :hi_bytes], 4) << 1) | unpack_codes(packed[..., hi_bytes:], 1)
    mask = (1 << bits) - 1
    return torch.cat([(p >> (i * bits)) & mask for i in range(8 // bits)], dim=-1)


def quantize_rotated(x_rot: torch.Tensor, bits: int, symmetric: bool = False, log_scale: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize rotated vectors ``[..., head_dim]`` (float32) to ``bits``.

    Returns ``(packed uint8 [..., head_dim*bits/8], meta)`` where meta is float16 ``[..., 2] = (scale, zero)``
    (asymmetric: keys of 2/4/8 bits), float16 ``[..., 1] = (scale,)`` (``symmetric``: values, 5-bit keys) or uint8
    ``[..., 1] = (u,)`` (``symmetric`` and ``log_scale``: ``log_scale_code``; see the module docstring).

    Raises:
        ValueError: a vector's range does not fit float16 (|x| > 65504) or is not finite; 5 bits or ``log_scale``
            without ``symmetric``.
    """
    if (bits == 5 or log_scale) and not symmetric:
        raise ValueError(f"bits={bits}, log_scale={log_scale} need symmetric=True")
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
        if log_scale:
            u = log_scale_code(torch.maximum(hi.abs(), lo.abs()) / c)
            s = log_scale_value(u).unsqueeze(-1)
            meta = u.unsqueeze(-1)
        else:
            scale = (torch.maximum(hi.abs(), lo.abs()) / c).to(torch.float16)
            s = scale.float().unsqueeze(-1)
            meta = scale.unsqueeze(-1)
        z = -c * s
    else:
        scale = ((hi - lo) / qmax).to(torch.float16)
        zero = lo.to(torch.float16)
        s = scale.float().unsqueeze(-1)
        z = zero.float().unsqueeze(-1)
        meta = torch.stack([scale, zero], dim=-1)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    if bits == 5:       # k5v4 keys: the spec's x / scale + c
        codes = torch.clamp(torch.round(x_rot / safe + c), 0, qmax)
    else:
        codes = torch.clamp(torch.round((x_rot - z) / safe), 0, qmax)
    return pack_codes(codes, bits), meta


def dequantize_rotated(packed: torch.Tensor, meta: torch.Tensor, bits: int) -> torch.Tensor:
    """The rotated vectors, float32 ``[..., head_dim]``, from ``quantize_rotated``'s output: ``code * scale + zero``
    for float16 ``meta [..., 2]`` (scale, zero); for ``[..., 1]`` (symmetric, ``c = (2**bits - 1) / 2``):
    ``code * scale - scale * c`` (2/4/8 bits), ``(code - c) * scale`` (5 bits), and ``(code - c) * s_hat`` for a
    uint8 log2 code (``log_scale_value``)."""
    codes = unpack_codes(packed, bits).float()
    c = ((1 << bits) - 1) / 2
    if meta.dtype == torch.uint8:
        return (codes - c) * log_scale_value(meta[..., 0]).unsqueeze(-1)
    m = meta.float()
    s = m[..., 0:1]
    if m.shape[-1] == 2:
        return codes * s + m[..., 1:2]
    if bits == 5:
        return (codes - c) * s
    return codes * s + (-s * c)


class CompressedPool(KVPool):
    """Pool ``data``: uint8 ``[num_blocks, num_kv_heads, layout.page_bytes]``."""

    def __init__(self, fmt: "CompressedFormat", num_blocks, num_kv_heads, head_dim, block_size, device):
        super().__init__(fmt, num_blocks, num_kv_heads, head_dim, block_size)
        self.layout = fmt.layout(head_dim, block_size)
        self.rotation = rotation_matrix(head_dim, fmt.seed, device)
        self.data = torch.zeros(num_blocks, num_kv_heads, self.layout.page_bytes, dtype=torch.uint8, device=device)

    def regions(self, data: torch.Tensor | None = None):
        """Byte views ``(k_codes [nb,H,bs,kcb], v_codes [nb,H,bs,vcb], k_meta [nb,H,bs,kmb],
        v_meta [nb,H,bs,vmb])`` of ``data`` (default: the pool), meta bytes per token ``layout.k_meta_bytes`` /
        ``v_meta_bytes``; view float16 meta as float16 to read it (a uint8 log2 V scale is read as it is)."""
        d = self.data if data is None else data
        L, nb, h, bs = self.layout, d.shape[0], d.shape[1], self.block_size
        kc = d[:, :, L.k_code_offset:L.v_code_offset].view(nb, h, bs, L.k_code_bytes)
        vc = d[:, :, L.v_code_offset:L.k_meta_offset].view(nb, h, bs, L.v_code_bytes)
        km = d[:, :, L.k_meta_offset:L.v_meta_offset].view(nb, h, bs, L.k_meta_bytes)
        vm = d[:, :, L.v_meta_offset:L.page_bytes].view(nb, h, bs, L.v_meta_bytes)
        return kc, vc, km, vm

    def write(self, key, value, slot_mapping):
        """``KVPool.write``."""
        check_kv(key, value, self.num_kv_heads, self.head_dim)
        keep, blocks, offs = self._split_slots(slot_mapping, key.shape[0])
        L = self.layout
        kp, km = quantize_rotated(key[keep].float() @ self.rotation, L.key_bits, symmetric=L.key_symmetric)
        vp, vm = quantize_rotated(value[keep].float() @ self.rotation, L.value_bits, symmetric=True,
                                  log_scale=L.value_log_scale)
        kc_r, vc_r, km_r, vm_r = self.regions()
        # Advanced indices on dims 0 and 2 -> the assigned value is [tokens, heads, bytes].
        kc_r[blocks, :, offs] = kp
        vc_r[blocks, :, offs] = vp
        km_r[blocks, :, offs] = km.view(torch.uint8).reshape(km.shape[0], km.shape[1], L.k_meta_bytes)
        vm_r[blocks, :, offs] = vm.view(torch.uint8).reshape(vm.shape[0], vm.shape[1], L.v_meta_bytes)

    def gather_rotated(self, block_ids, seq_len):
        """Dequantized K/V in the rotated space, float32 ``[seq_len, H, D]``."""
        ids = self._pages_needed(block_ids, seq_len)
        kc, vc, km, vm = self.regions(self.data[ids])

        def tokens(x):  # [n, H, bs, X] -> [n*bs, H, X]
            return x.permute(0, 2, 1, 3).reshape(-1, x.shape[1], x.shape[3])[:seq_len]

        vmeta = tokens(vm) if self.layout.value_log_scale else tokens(vm).contiguous().view(torch.float16)
        k = dequantize_rotated(tokens(kc), tokens(km).contiguous().view(torch.float16), self.layout.key_bits)
        v = dequantize_rotated(tokens(vc), vmeta, self.layout.value_bits)
        return k, v

    def gather(self, block_ids, seq_len):
        k, v = self.gather_rotated(block_ids, seq_len)
        rt = self.rotation.T
        return k @ rt, v @ rt


class CompressedFormat(KVFormat):
    """Compressed KV pages: ``key_bits``-bit keys, ``value_bits``-bit values (see module doc).

    Args:
        name: preset name.
        key_bits, value_bits: in ``(2, 4, 8)``; ``key_bits`` 5 with ``key_symmetric``.
        seed: rotation seed (the kernels and the reference must agree; default 0).
        key_symmetric: symmetric keys with a float16 scale only (5-bit keys, ``k5v4``).
        value_log_scale: values with a one-byte log2 scale (4-bit values, ``k5v4``).

    The engines store keys minus a per-layer constant by default (``default_key_offset``,
    ``kvrepro.formats.offset``); the pool itself stores what it is given.

    Raises:
        ValueError: an unsupported bit / scheme combination (``layout.check_bits``, naming the parameter);
            unsupported head_dim/block_size when a pool is made.
    """

    default_key_offset = "rope-mean"

    def __init__(self, name: str, key_bits: int, value_bits: int, seed: int = 0, *, key_symmetric: bool = False,
                 value_log_scale: bool = False) -> None:
        check_bits(key_bits, value_bits, key_symmetric, value_log_scale)
        self.name = name
        self.key_bits = key_bits
        self.value_bits = value_bits
        self.seed = seed
        self.key_symmetric = key_symmetric
        self.value_log_scale = value_log_scale

    def layout(self, head_dim: int, block_size: int = 16) -> PageLayout:
        return PageLayout(head_dim, block_size, self.key_bits, self.value_bits, self.key_symmetric,
                          self.value_log_scale)

    def bytes_per_token_per_head(self, head_dim: int) -> int:
        check_head_dim(head_dim)
        return self.layout(head_dim).bytes_per_token

    def describe(self) -> str:
        if self.key_symmetric or self.value_log_scale:
            k = (f"{self.key_bits}-bit symmetric K" if self.key_symmetric else f"{self.key_bits}-bit K")
            km = "fp16 K scale" if self.key_symmetric else "fp16 K scale+zero"
            vm = "uint8 log2 V scale" if self.value_log_scale else "fp16 V scale"
            return f"{self.name} (Hadamard-rotated {k} / {self.value_bits}-bit V, per-token {km}, {vm})"
        return f"{self.name} (Hadamard-rotated {self.key_bits}-bit K / {self.value_bits}-bit V, per-token fp16 K scale+zero, V scale)"

    def new_pool(self, num_blocks, num_kv_heads, head_dim, block_size=16, device="cpu", dtype=torch.bfloat16):
        return CompressedPool(self, num_blocks, num_kv_heads, head_dim, block_size, device)
