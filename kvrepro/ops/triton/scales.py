"""Per-token scales stored as codes rather than float16 (``kvrepro.formats.compressed``): the one-byte log2 value
scale of ``value_log_scale`` pages (k5v4), ``s_hat = 2**((u - 128) / 8)``. Both functions are bit for bit the
reference's ``log_scale_code`` / ``log_scale_value``: integer operations on float32 bits, no ``log2`` / ``exp2``
(whose GPU approximations would move a threshold or the stored scale by an ulp)."""
import triton
import triton.language as tl

from kvrepro.formats.compressed import LOG_MANT_DOWN, LOG_MANT_NEAR

# 23-bit mantissa fields of 2**(j/8), j = 1..7: rounded down (encode thresholds) and to nearest (the stored scale);
# j = 0 is 1.0 (field 0) in both.
_D1, _D2, _D3, _D4, _D5, _D6, _D7 = (tl.constexpr(m) for m in LOG_MANT_DOWN[1:])
_N1, _N2, _N3, _N4, _N5, _N6, _N7 = (tl.constexpr(m) for m in LOG_MANT_NEAR[1:])


@triton.jit
def log_scale_code(s):
    """float32 ``s >= 0`` -> int32 ``u = clamp(ceil(8 log2(s) + 128), 0, 255)`` (0 for ``s = 0``): with ``s``'s
    biased exponent ``e`` and mantissa field ``m``, ``u = 8 (e - 111) + #{j : m > floor32(2**(j/8))}``."""
    b = s.to(tl.int32, bitcast=True)
    e = (b >> 23) & 0xFF
    m = b & 0x7FFFFF
    u = 8 * (e - 111) + (m > 0).to(tl.int32)
    u += (m > _D1).to(tl.int32) + (m > _D2).to(tl.int32) + (m > _D3).to(tl.int32)
    u += (m > _D4).to(tl.int32) + (m > _D5).to(tl.int32) + (m > _D6).to(tl.int32) + (m > _D7).to(tl.int32)
    return tl.minimum(tl.maximum(u, 0), 255)


@triton.jit
def log_scale_value(u):
    """Integer codes ``u`` in [0, 255] -> float32 ``s_hat = 2**((u - 128) / 8)`` (the float32 nearest it): exponent
    ``(u >> 3) - 16``, mantissa field of ``2**((u & 7) / 8)``."""
    u = u.to(tl.int32)
    j = u & 7
    m = tl.where(j == 1, _N1, 0)
    m = tl.where(j == 2, _N2, m)
    m = tl.where(j == 3, _N3, m)
    m = tl.where(j == 4, _N4, m)
    m = tl.where(j == 5, _N5, m)
    m = tl.where(j == 6, _N6, m)
    m = tl.where(j == 7, _N7, m)
    return ((((u >> 3) + 111) << 23) | m).to(tl.float32, bitcast=True)
