"""Lane-level CPU emulation of the CUDA decode kernel's register data flow for one page (numpy, no GPU).

What ``kvrepro/ops/cuda/decode.cu`` does with one page in shared memory, lane by lane: the swizzled ``cp.async``
copy, ``ldmatrix.x4`` (+ ``.trans``) and ``movmatrix.trans`` per the PTX ISA fragment layouts, the int8 / float16
unpacking by bit operations (``lop3``, ``sub.f16x2``), and ``mma.m16n8k32.s8`` / ``mma.m16n8k16.f16`` on their
documented A / B / C fragments. ``tests/test_ops_cuda_decode.py`` compares the results with a direct decode of the
page bytes. It emulates the kernel's design, not its binary: a transcription slip between the two, and the hardware's
own behaviour, are covered by the GPU tests only.

Page offsets come from ``kvrepro.formats`` (the layouts the kernel's ``page_layout.h`` is generated from).
"""
from __future__ import annotations

import numpy as np

from kvrepro.formats import get_format

D, BS = 128, 16
K4V4 = get_format("k4v4").layout(D, BS)
K4V2 = get_format("k4v2").layout(D, BS)
K5V4 = get_format("k5v4").layout(D, BS)


def ldmatrix_x4(smem: np.ndarray, row_addr: list[int], trans: bool) -> np.ndarray:
    """[32 lanes, 4 regs] uint32: lane t gave the address of row t % 8 of matrix t // 8 (16 bytes = 8 b16)."""
    mats = [np.stack([smem[row_addr[8 * i + r]: row_addr[8 * i + r] + 16].view(np.uint16) for r in range(8)])
            for i in range(4)]                                   # 4 x [8 rows, 8 b16]
    out = np.zeros((32, 4), np.uint32)
    for t in range(32):
        for i, m in enumerate(mats):
            if trans:
                lo, hi = m[2 * (t % 4), t // 4], m[2 * (t % 4) + 1, t // 4]
            else:
                lo, hi = m[t // 4, 2 * (t % 4)], m[t // 4, 2 * (t % 4) + 1]
            out[t, i] = np.uint32(lo) | (np.uint32(hi) << np.uint32(16))
    return out


def s8x4(x: np.uint32) -> np.ndarray:
    return np.frombuffer(np.uint32(x).tobytes(), dtype=np.int8).astype(np.int64)


def f16x2(x: np.uint32) -> np.ndarray:
    return np.frombuffer(np.uint32(x).tobytes(), dtype=np.float16).astype(np.float64)


def pack_f16x2(lo: float, hi: float) -> np.uint32:
    return np.frombuffer(np.array([lo, hi], np.float16).tobytes(), dtype=np.uint32)[0]


def _c_fragments(C: np.ndarray) -> np.ndarray:
    return np.array([[C[t // 4, 2 * (t % 4)], C[t // 4, 2 * (t % 4) + 1], C[t // 4 + 8, 2 * (t % 4)],
                      C[t // 4 + 8, 2 * (t % 4) + 1]] for t in range(32)])


def mma_s8(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """m16n8k32 row.col s8: a [32, 4] and b [32, 2] uint32 fragments -> C [32, 4] int64 fragments."""
    A = np.zeros((16, 32), np.int64)
    B = np.zeros((32, 8), np.int64)
    for t in range(32):
        g, q = t // 4, t % 4
        for i in range(4):
            A[g + 8 * (i % 2), q * 4 + 16 * (i // 2): q * 4 + 16 * (i // 2) + 4] = s8x4(a[t, i])
        for i in range(2):
            B[q * 4 + 16 * i: q * 4 + 16 * i + 4, g] = s8x4(b[t, i])
    return _c_fragments(A @ B)


def mma_f16(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """m16n8k16 row.col f16 -> f32: a [32, 4], b [32, 2] uint32 (f16x2) -> C [32, 4] float64."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for t in range(32):
        g, q = t // 4, t % 4
        for i in range(4):
            A[g + 8 * (i % 2), 2 * q + 8 * (i // 2): 2 * q + 8 * (i // 2) + 2] = f16x2(a[t, i])
        for i in range(2):
            B[2 * q + 8 * i: 2 * q + 8 * i + 2, g] = f16x2(b[t, i])
    return _c_fragments(A @ B)


def movmatrix_t(x: np.ndarray) -> np.ndarray:
    """movmatrix.m8n8.trans.b16 on [32] uint32 fragments."""
    M = np.zeros((8, 8), np.uint16)
    for t in range(32):
        M[t // 4, 2 * (t % 4)], M[t // 4, 2 * (t % 4) + 1] = x[t] & 0xFFFF, x[t] >> 16
    return np.array([np.uint32(M[2 * (t % 4), t // 4]) | (np.uint32(M[2 * (t % 4) + 1, t // 4]) << np.uint32(16))
                     for t in range(32)], np.uint32)


def lop(x, mask, v, xor):
    """The kernel's lop3: ``(x & mask) ^ v`` (``xor``) or ``(x & mask) | v``."""
    x, mask, v = np.uint32(x), np.uint32(mask), np.uint32(v)
    return (x & mask) ^ v if xor else (x & mask) | v


def hsub2(x, c):
    """sub.f16x2."""
    a = np.frombuffer(np.uint32(x).tobytes(), np.float16)
    b = np.frombuffer(np.uint32(c).tobytes(), np.float16)
    return np.frombuffer((a - b).astype(np.float16).tobytes(), np.uint32)[0]


def to_smem(page: np.ndarray) -> np.ndarray:
    """A k4v4 page as the kernel's cp.async copy lays it out in shared memory: 16-byte chunk ``c`` of the K and V code
    rows (4 chunks per token) at chunk ``c ^ ((c >> 3) & 3)``, the metadata chunks in place."""
    out = np.zeros_like(page)
    code_chunks = K4V4.k_meta_offset // 16
    for lane in range(32):                      # the kernel's copy_page(): one lane base per 512-byte run
        for k in range(code_chunks // 32):
            d, c = (lane ^ ((lane >> 3) & 3)) + 32 * k, lane + 32 * k
            out[16 * d: 16 * d + 16] = page[16 * c: 16 * c + 16]
        if lane < len(page) // 16 - code_chunks:
            m = code_chunks + lane
            out[16 * m: 16 * m + 16] = page[16 * m: 16 * m + 16]
    return out


def bank_ways(addrs: list[int]) -> int:
    """Worst bank conflict of one ldmatrix.x4: per matrix (8 lanes' 16-byte rows), the most rows hitting a bank."""
    worst = 1
    for m in range(4):
        hits = np.zeros(32, int)
        for a in addrs[8 * m: 8 * m + 8]:
            for w in range(4):
                hits[(a // 4 + w) % 32] += 1
        worst = max(worst, int(hits.max()))
    return worst


def row_addr(base: int, half: int) -> list[int]:
    """Per lane, the byte address ldmatrix reads (the kernel's ``swz_row_chunk``): matrix ``lane >> 3`` = tokens
    0-7 / 8-15 x bytes +0 / +16 of 32-byte half ``half``, row ``lane & 7``."""
    out = []
    for t in range(32):
        tok, j = (t >> 3 & 1) * 8 + (t & 7), half * 2 + (t >> 4)
        out.append(base + 16 * (tok * 4 + (j ^ ((tok >> 1) & 3))))
    return out


def plain_row_addr(base: int, half: int) -> list[int]:
    """``row_addr`` without the swizzle (64-byte rows in token order)."""
    return [base + ((t >> 3 & 1) * 8 + (t & 7)) * 64 + half * 32 + (t >> 4) * 16 for t in range(32)]


def key_dot(smem: np.ndarray, bh: np.ndarray, bl: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's S^T = K Q^T for one k4v4 page in shared memory (``to_smem``): int32 C fragments [32, 4] of the
    high- and low-digit chains (``bh`` / ``bl``: [4 chunks, 32, 2] B fragments of the query digits)."""
    chi = np.zeros((32, 4), np.int64)
    clo = np.zeros((32, 4), np.int64)
    for half in range(2):
        r = ldmatrix_x4(smem, row_addr(0, half), trans=False)
        a_lo = np.array([[lop(np.uint32(r[t, i]) << np.uint32(4), 0xF0F0F0F0, 0x80808080, True) for i in range(4)]
                         for t in range(32)], np.uint32)
        a_hi = np.array([[lop(r[t, i], 0xF0F0F0F0, 0x80808080, True) for i in range(4)] for t in range(32)], np.uint32)
        chi += mma_s8(a_lo, bh[half]) + mma_s8(a_hi, bh[2 + half])
        clo += mma_s8(a_lo, bl[half]) + mma_s8(a_hi, bl[2 + half])
    return chi, clo


def k5_row_addr(half: int) -> list[int]:
    """Per lane, the byte address of k5v4's high-plane ldmatrix (the kernel's ``lk5 + 32 half``): its key region keeps
    the page's 80-byte token rows, unswizzled; matrix ``lane >> 3`` = tokens 0-7 / 8-15 x bytes +0 / +16."""
    return [((t >> 3 & 1) * 8 + (t & 7)) * 80 + half * 32 + (t >> 4) * 16 for t in range(32)]


def key_dot_k5v4(page: np.ndarray, bh: np.ndarray, bl: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """The kernel's S^T = K Q^T for one k5v4 page (its key region copied as it is): the high plane (``code >> 1``,
    4-bit, k4v4's packing) through k4v4's int8 planes 16 (hi - 8), the low plane (byte j bit i = channel j + 16 i)
    through ldmatrix.x2 of the 16-byte low rows (lanes 0-15 give ``lk5 + 64``) and per chunk c bits 2 c, 2 c + 1
    moved to bit 3 (int8 8 lo), both into the same two chains. Returns the int32 C fragments of the high- and
    low-digit chains and the worst bank conflict of the reads."""
    chi = np.zeros((32, 4), np.int64)
    clo = np.zeros((32, 4), np.int64)
    ways = 1
    for half in range(2):
        addrs = k5_row_addr(half)
        ways = max(ways, bank_ways(addrs))
        r = ldmatrix_x4(page, addrs, trans=False)
        a_lo = np.array([[lop(np.uint32(r[t, i]) << np.uint32(4), 0xF0F0F0F0, 0x80808080, True) for i in range(4)]
                         for t in range(32)], np.uint32)
        a_hi = np.array([[lop(r[t, i], 0xF0F0F0F0, 0x80808080, True) for i in range(4)] for t in range(32)], np.uint32)
        chi += mma_s8(a_lo, bh[half]) + mma_s8(a_hi, bh[2 + half])
        clo += mma_s8(a_lo, bl[half]) + mma_s8(a_hi, bl[2 + half])
    lo_addrs = [a + 64 for a in k5_row_addr(0)]             # x2: matrices 0, 1 (lanes 0-15) are tokens 0-7, 8-15
    ways = max(ways, bank_ways(lo_addrs[:16] * 2))
    w = ldmatrix_x4(page, lo_addrs[:16] * 2, trans=False)[:, :2]

    def to_bit3(x, i):
        x = np.uint32(x)
        return (x << np.uint32(3 - i) if i <= 3 else x >> np.uint32(i - 3)) & np.uint32(0x08080808)

    for c in range(4):
        a = np.array([[to_bit3(w[t, 0], 2 * c), to_bit3(w[t, 1], 2 * c), to_bit3(w[t, 0], 2 * c + 1),
                       to_bit3(w[t, 1], 2 * c + 1)] for t in range(32)], np.uint32)
        chi += mma_s8(a, bh[c])
        clo += mma_s8(a, bl[c])
    return chi, clo, ways


def value_dot(smem: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The kernel's O^T contribution of one k4v4 page in shared memory (``to_smem``): [8 channel tiles, 32, 4]
    float64 C fragments for the P^T B fragments ``b`` [32, 2] (tile 4 p + 2 half + e: plane p, bytes 32 half +
    16 e)."""
    tc = np.zeros((8, 32, 4))
    for half in range(2):
        r = ldmatrix_x4(smem, row_addr(K4V4.v_code_offset, half), trans=True)
        for e in range(2):
            lo, hi = r[:, 2 * e], r[:, 2 * e + 1]
            for p, (mask, c) in enumerate(((0x000F000F, 0x64086408), (0x00F000F0, 0x64806480))):
                a = np.array([[hsub2(lop(lo[t], mask, 0x64006400, False), c),
                               hsub2(lop(lo[t] >> np.uint32(8), mask, 0x64006400, False), c),
                               hsub2(lop(hi[t], mask, 0x64006400, False), c),
                               hsub2(lop(hi[t] >> np.uint32(8), mask, 0x64006400, False), c)] for t in range(32)],
                             np.uint32)
                tc[4 * p + 2 * half + e] += mma_f16(a, b)
    return tc


def value_dot_k4v2(page: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, int]:
    """k4v2 (``VB == 2``): the value region [16 tokens][32 bytes] as the kernel's copy_page() copies it (chunk
    ``lane`` of the 512-byte run at chunk ``lane ^ ((lane >> 3) & 3)``, the 64-byte-row pattern of the key run;
    ``swz_row_chunk2``: chunk ``2 t + j`` of row ``t`` at ``(2 t + j) ^ ((t >> 2) & 3)``), one ldmatrix.x4.trans, and
    per 16-byte half ``e`` and 2-bit plane ``p`` the float16 magic-number unpack (minus 1024 + 2 x 4^p). Returns the
    [8 tiles (2 p + e), 32, 4] C fragments and the worst bank conflict of the read."""
    v_off = K4V2.v_code_offset
    smem = np.zeros(512, np.uint8)
    for lane in range(32):
        d = lane ^ ((lane >> 3) & 3)
        smem[16 * d: 16 * d + 16] = page[v_off + 16 * lane: v_off + 16 * lane + 16]

    def swz2(tok: int, j: int) -> int:     # the kernel's swz_row_chunk2
        return (tok * 2 + j) ^ ((tok >> 2) & 3)

    addrs = [16 * swz2((t >> 3 & 1) * 8 + (t & 7), t >> 4) for t in range(32)]
    r = ldmatrix_x4(smem, addrs, trans=True)
    tc = np.zeros((8, 32, 4))
    for e in range(2):
        lo, hi = r[:, 2 * e], r[:, 2 * e + 1]
        for p in range(4):
            mask, c = 0x00030003 << (2 * p), 0x64006400 | (0x00020002 << (2 * p))
            a = np.array([[hsub2(lop(lo[t], mask, 0x64006400, False), c),
                           hsub2(lop(lo[t] >> np.uint32(8), mask, 0x64006400, False), c),
                           hsub2(lop(hi[t], mask, 0x64006400, False), c),
                           hsub2(lop(hi[t] >> np.uint32(8), mask, 0x64006400, False), c)] for t in range(32)],
                         np.uint32)
            tc[2 * p + e] += mma_f16(a, b)
    return tc, bank_ways(addrs)


def random_page(rng: np.random.Generator, layout) -> np.ndarray:
    """Random code bytes of one page of ``layout`` with sane metadata: float16 K scale 0.05..0.15 and zero -1.2..-0.8
    (the scale alone for symmetric keys); float16 V scale 0.05..0.15, or a uint8 log2 scale code 100..130."""
    page = rng.integers(0, 256, size=layout.page_bytes, dtype=np.uint8)
    km = np.stack([rng.uniform(0.05, 0.15, BS), rng.uniform(-1.2, -0.8, BS)], 1).astype(np.float16)
    km = km[:, :layout.k_meta_bytes // 2]
    page[layout.k_meta_offset:layout.v_meta_offset] = np.frombuffer(km.tobytes(), np.uint8)
    if layout.value_log_scale:
        page[layout.v_meta_offset:] = rng.integers(100, 131, BS).astype(np.uint8)
    else:
        page[layout.v_meta_offset:] = np.frombuffer(rng.uniform(0.05, 0.15, BS).astype(np.float16).tobytes(), np.uint8)
    return page


def query_fragments(dig: np.ndarray) -> np.ndarray:
    """B fragments [4 chunks, 32 lanes, 2] of Q^T from int8 query digits ``dig`` [8 heads, D] (the kernel's
    ``bh`` / ``bl``: chunk c holds channels (c & 1) 32 + (c >> 1) 64 + 4 tq .. + 3 and + 16)."""
    fr = np.zeros((4, 32, 2), np.uint32)
    for c in range(4):
        for t in range(32):
            g, tq = t // 4, t % 4
            ch = (c & 1) * 32 + (c >> 1) * 64 + tq * 4
            for j, off in enumerate((0, 16)):
                fr[c, t, j] = np.frombuffer(dig[g, ch + off: ch + off + 4].astype(np.int8).tobytes(), np.uint32)[0]
    return fr


def weight_fragments(w: np.ndarray) -> np.ndarray:
    """P^T B fragments [32, 2] of the softmax weights ``w`` [16 tokens, 8 heads], packed to float16 as the kernel's
    page_weights() does (C fragments of tokens 0-7 and 8-15, each transposed by movmatrix)."""
    pb = []
    for tokblk in range(2):
        x = np.array([pack_f16x2(w[tokblk * 8 + t // 4, 2 * (t % 4)], w[tokblk * 8 + t // 4, 2 * (t % 4) + 1])
                      for t in range(32)], np.uint32)
        pb.append(movmatrix_t(x))
    return np.stack(pb, 1)


def logits_from_fragments(acc: np.ndarray) -> np.ndarray:
    """[16 tokens, 8 heads] from the S^T C fragments ``acc`` [32, 4] (rows g, g + 8; heads 2 (t % 4), + 1)."""
    out = np.zeros((16, 8), acc.dtype)
    for t in range(32):
        g, h0 = t // 4, 2 * (t % 4)
        out[g, h0], out[g, h0 + 1], out[g + 8, h0], out[g + 8, h0 + 1] = acc[t]
    return out


def outputs_from_tiles(tc: np.ndarray, first_channel) -> np.ndarray:
    """[8 heads, D] from the O^T C fragments ``tc`` [8 tiles, 32, 4]; tile t8 covers channels ``first_channel(t8)``
    .. + 15 (row g: channel + 2 g, row g + 8: + 1)."""
    out = np.zeros((8, D))
    for t8 in range(8):
        ch0 = first_channel(t8)
        for t in range(32):
            g, h0 = t // 4, 2 * (t % 4)
            out[h0, ch0 + 2 * g], out[h0 + 1, ch0 + 2 * g] = tc[t8, t, 0], tc[t8, t, 1]
            out[h0, ch0 + 2 * g + 1], out[h0 + 1, ch0 + 2 * g + 1] = tc[t8, t, 2], tc[t8, t, 3]
    return out


# --- key offset rope-mean (decode.cu rope_setup, rope_sincos, rope_angles, rope_add) -----------------------------------
RPAIRS = 8
ROPE_NEXT = 64                      # decode.cu: WARPS x BS positions between a warp's consecutive pages


def _fma32(a, b, c):
    """float32 ``fmaf(a, b, c)``: the product and sum in float64, then one rounding to float32. For the reduction's
    operands (a multiple k of up to 20 bits, angles below 2^20, times a constant of <= 24 bits, plus a float32) the
    float64 step is exact except in the last, tiny C3 term, so this is the hardware FMA there; elsewhere (the turned
    coefficients) the float64 rounding before the float32 one can differ from a fused operation by one float32 ulp
    in rare ties, far below the tests' bounds."""
    return (np.float64(a) * np.float64(b) + np.float64(c)).astype(np.float32)


def _f(bits) -> np.ndarray:
    return np.asarray(bits, np.uint32).view(np.float32)


# __sinf / __cosf (MUFU.SIN / MUFU.COS): absolute error <= 2^-21.41 / 2^-21.19 on [-pi, pi] (CUDA C++ Programming
# Guide, intrinsic functions). The hardware's approximation is not known bit for bit; rope_sincos models it as the
# correctly rounded value moved by that bound (``mufu_err``), so the tests' bounds hold for the worst case it allows.
MUFU_SIN_ERR, MUFU_COS_ERR = 2.0 ** -21.41, 2.0 ** -21.19


def rope_sincos(a, lo=0.0, mufu_err: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's ``rope_sincos`` on float32 angles ``a`` (>= 0) plus their float32 remainders ``lo`` (the angle is
    ``a + lo``): ``(sin, cos)`` float32, operation by operation (rintf, three FMAs of the pi / 2 reduction, the add of
    ``lo``, the quadrant); the hardware sine / cosine of the remainder as float64's rounded to float32, plus
    ``mufu_err`` times their documented error bounds (``MUFU_SIN_ERR``, ``MUFU_COS_ERR``; +1 / -1: the worst case
    in either direction)."""
    f = np.float32
    a = np.asarray(a, np.float32)
    k = np.rint(a * f(0.636619772367581343)).astype(np.float32)   # rintf: ties to even, as np.rint
    r = _fma32(-k, f(1.5703125), a)
    r = _fma32(-k, f(4.838267923332751e-4), r)
    r = (_fma32(-k, f(2.5632829192545614e-12), r) + np.asarray(lo, np.float32)).astype(np.float32)
    q = k.astype(np.int64)
    r64 = r.astype(np.float64)
    ps = (np.sin(r64) + mufu_err * MUFU_SIN_ERR).astype(np.float32)
    pc = (np.cos(r64) + mufu_err * MUFU_COS_ERR).astype(np.float32)
    sn, cs = np.where(q & 1, pc, ps), np.where(q & 1, ps, pc)
    return np.where(q & 2, -sn, sn).astype(np.float32), np.where((q + 1) & 2, -cs, cs).astype(np.float32)


def f16_split(x) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's ``split_f16x2``: float32 ``x`` -> float16 ``hi`` = x rounded to nearest even and ``lo`` = (x - hi)
    rounded the same way (the float32 difference is exact), so ``|x - hi - lo| <= 2^-22 |x|`` while ``x - hi`` is a
    normal float16, and <= 2^-25 absolute below it."""
    x = np.asarray(x, np.float32)
    hi = x.astype(np.float16)
    return hi, (x - hi.astype(np.float32)).astype(np.float16)


def mma_f16_k16(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """m16n8k16 row.col f16 -> f32 on float16 values: a [32, 4, 2] (a0 = row g, a1 = row g + 8 at k = 2 tq, 2 tq + 1;
    a2, a3 the same rows at k + 8), b [32, 2, 2] (b0: k = 2 tq, 2 tq + 1; b1: k + 8; column g), c [32, 4] -> c + A B
    (float64: the float16 products are exact; the tensor core's float32 accumulation is not emulated)."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for t in range(32):
        g, q = t // 4, t % 4
        for i in range(4):
            A[g + 8 * (i % 2), 2 * q + 8 * (i // 2): 2 * q + 8 * (i // 2) + 2] = a[t, i]
        B[2 * q: 2 * q + 2, g], B[8 + 2 * q: 8 + 2 * q + 2, g] = b[t, 0], b[t, 1]
    return c + _c_fragments(A @ B)


def _sincos_of_product(t, fr, mufu_err: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """``rope_sincos`` of the exact product ``t x fr`` (float32 operands): the ``__fmul_rn`` rounding plus the
    ``__fmaf_rn`` remainder, as the kernel takes every angle."""
    t, fr = np.asarray(t, np.float32), np.asarray(fr, np.float32)
    a = (t * fr).astype(np.float32)                                     # float32 product: one rounding
    return rope_sincos(a, _fma32(t, fr, -a), mufu_err)                  # the remainder: exact in one FMA


def rope_scale_pow2(m: float) -> tuple[np.float32, np.float32]:
    """rope_setup's power-of-two scale of the coefficients: the largest ``|A|, |B|`` of the CTA, ``m``, to [2^12,
    2^13) (e = m's float32 exponent, clamped to [-110, 127]); returns ``(scale, 1 / scale)``, both exact powers of 2."""
    bits = int(np.float32(m).view(np.uint32))
    e = min(max(((bits >> 23) & 255) - 127, -110), 127)
    return np.float32(2.0 ** (12 - e)), np.float32(2.0 ** (e - 12))


def _turn(x, y, s, c) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's turn of (x, y) by an angle of sine ``s`` and cosine ``c`` in float32: ``(fma(x, c, y s),
    fma(y, c, -(x s)))``, each product before the FMA rounded to float32 (``__fmul_rn``)."""
    return (_fma32(x, c, (np.float32(1) * y * s).astype(np.float32)),
            _fma32(y, c, -(np.float32(1) * x * s).astype(np.float32)))


def rope_shared(terms: np.ndarray, freq: np.ndarray, rope_scale: float, b: int, kvh: int, group: int,
                mufu_err: float = 0.0, np_: int = 1) -> tuple:
    """What warp 0 puts in the kernel's ``rope_s`` (``rope_setup``) for a kernel of ``np_`` pages per step, as
    ``(tab, ab, fr, inv, ab_next)``: ``tab`` [2, 32, 4, 2]
    float16: (hi, lo) x lane (g, tq) x the m16n8k16 A fragments (cos of t theta at t = g, g + 8, then sin at g, g + 8)
    x pairs (2 tq, 2 tq + 1); ``ab`` [32, 4] float32: (A, B of pair 2 tq, A, B of pair 2 tq + 1) of head g times
    ``rope_scale`` in float32 (heads past ``group`` 0), times the CTA's power-of-two scale (``rope_scale_pow2``);
    ``fr`` [32, 2] float32: the two pairs' frequencies; ``inv``: 1 / the scale; ``ab_next`` [32, 4]: ``ab`` turned by
    ``ROPE_NEXT`` theta (``rope_sincos``; two-page kernels, None for ``np_`` 1). ``terms``
    float32 [B, Hq, 2 RPAIRS] (A then B), ``freq`` float32 [Hkv, RPAIRS]; ``mufu_err``: rope_sincos's."""
    hq = terms.shape[1]
    rows = terms.reshape(-1, 2 * RPAIRS)
    tab = np.zeros((2, 32, 4, 2), np.float16)
    ab = np.zeros((32, 4), np.float32)
    fr = np.zeros((32, 2), np.float32)
    for lane in range(32):
        g, tq = lane // 4, lane % 4
        f = freq[kvh, 2 * tq: 2 * tq + 2].astype(np.float32)
        fr[lane] = f
        sn, cs = _sincos_of_product([g, g, g + 8, g + 8], np.tile(f, 2), mufu_err)      # [t, pair]: (g, 2tq), (g, 2tq+1), ..
        for i, x in enumerate((cs[:2], cs[2:], sn[:2], sn[2:])):
            tab[0, lane, i], tab[1, lane, i] = f16_split(x)
        if g < group:
            row = rows[b * hq + kvh * group + g]
            s = np.float32(rope_scale)
            ab[lane] = (row[2 * tq] * s, row[RPAIRS + 2 * tq] * s, row[2 * tq + 1] * s, row[RPAIRS + 2 * tq + 1] * s)
    sc, inv = rope_scale_pow2(np.abs(ab).max())
    ab = (ab * sc).astype(np.float32)
    ab_next = None
    if np_ == 2:
        sn, cs = rope_sincos(np.float32(ROPE_NEXT) * fr, 0.0, mufu_err)     # an exact product: a power of two
        ab_next = np.empty_like(ab)
        for j in range(2):
            ab_next[:, 2 * j], ab_next[:, 2 * j + 1] = _turn(ab[:, 2 * j], ab[:, 2 * j + 1], sn[:, j], cs[:, j])
    return tab, ab, fr, inv, ab_next


def rope_add(pos0: int, shared: tuple, mufu_err: float = 0.0, ang=None, second: bool = False) -> np.ndarray:
    """The kernel's ``rope_add`` for the page whose first token is at ``pos0``, from ``rope_shared``'s tuple: the
    correction's C fragments [32, 4] (rows g, g + 8 = tokens pos0 + g, + 8; heads 2 tq, 2 tq + 1), lane by lane: sin / cos
    of the exact angle ``pos0 x theta`` (``_sincos_of_product``), the coefficients turned by it in float32 (``A' =
    fma(A, cos, B sin)``, ``B' = fma(B, cos, -(A sin))``), their float16 hi / lo split and the m16n8k16 MMAs with the
    table in the kernel's order (table hi x coefficients lo, lo x hi, hi x hi), times 1 / the scale; ``mufu_err``:
    rope_sincos's. ``ang``: the angles (sin, cos) [32, 2] each to use instead of ``pos0``'s (``rope_pages``);
    ``second``: the coefficients ``ab_next`` (the second page of a two-page step, at the first page's angles)."""
    tab, ab, fr, inv = shared[:4]
    if second:
        ab = shared[4]
    sn, cs = _sincos_of_product(np.full((32, 2), pos0, np.float32), fr, mufu_err) if ang is None else ang
    A, B = ab[:, 0::2], ab[:, 1::2]                                             # [lane, pair]
    turned = np.stack([_fma32(A, cs, (B * sn).astype(np.float32)), _fma32(B, cs, -(A * sn).astype(np.float32))], 1)
    hi, lo = f16_split(turned)                                                  # [lane, (A', B'), pair]
    c = mma_f16_k16(tab[0], lo, np.zeros((32, 4)))
    c = mma_f16_k16(tab[1], hi, c)
    c = mma_f16_k16(tab[0], hi, c)
    return c * np.float64(inv)


def rope_pages(start: int, steps: int, shared: tuple, np_: int, mufu_err: float = 0.0) -> list:
    """The correction of the pages one warp reads in ``steps`` steps of a kernel of ``np_`` pages per step, as the
    kernel takes their angles: the warp's pages start at ``start`` (a multiple of 16) and lie ``ROPE_NEXT`` positions
    apart; each step's first page takes its exact angle (``rope_angles``), a two-page step's second page uses the
    first's angles with ``ab_next``. Returns ``[(pos0, C fragments [32, 4])]`` in page order."""
    out = []
    for j in range(steps):
        pos = start + j * np_ * ROPE_NEXT
        ang = _sincos_of_product(np.full((32, 2), pos, np.float32), shared[2], mufu_err)
        for k in range(np_):
            out.append((pos + k * ROPE_NEXT, rope_add(pos + k * ROPE_NEXT, shared, ang=ang, second=k == 1)))
    return out
