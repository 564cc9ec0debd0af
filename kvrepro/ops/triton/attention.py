"""Attention over compressed pages (``kvrepro.formats.layout.PageLayout``), split-K capable.

One program = (sequence, query tile, KV head, split). Its rows are ``BLOCK_Q`` query tokens x
``GP`` query heads of one GQA group (``GP`` = group size rounded up to a power of two; rows
padded to at least 16 for ``tl.dot``), so each page is read once for the whole group.

Work happens in the rotated space: ``q`` arrives rotated and pre-multiplied by
``softmax_scale * log2(e)`` (float16); logits use ``exp2``. Codes stay split-plane: plane ``i``
of a ``b``-bit code byte is ``byte & (2**b - 1) << (i*b)``, i.e. ``m_i * code`` with
``m_i = 2**(i*b)``, channels ``[i*P, (i+1)*P)``. It becomes float16 exactly with no int->float
instruction: ``(x | 0x6400)`` is the float16 ``1024 + x`` (x < 1024), minus 1024. Dot products
run per plane (q plane pre-divided by ``m_i``; V accumulators hold ``m_i`` x the value), and
dequantization is folded in (per token ``k = code * s + z``, ``v = (code - c) * s_v``)::

    q . k = s * sum_i (q_i / m_i) . (m_i code_i) + z * sum(q)
    sum_n p_n v_n = [(p * s_v) @ (m_i code_v_i)] / m_i - c * sum_n p_n s_v[n]

``DEQ_ASM`` (GPU only) does the 4- and 8-bit plane extraction with inline PTX (``prmt``,
``lop3``, ``sub.f16x2``: two channels per instruction), as FasterTransformer's int4->fp16 path.
Accumulation is float32 (online softmax, Milakov & Gimelshein 2018; FlashAttention, Dao et al.
2022); the split-K merge follows FlashDecoding (Dao et al. 2023).

``KEY_I8`` (decode only; the default of ``decode_attention`` for 4-, 5- and 8-bit keys): the key dot
products run on int8 tensor cores instead (SageAttention, Zhang et al. 2024/2025, quantizes Q and K
to int8 for attention; here the keys are their exact codes and q is two int8 digits, ~14 bits). Per
query row (one query head) ``S_q = max|q| / 16255``, ``qi = round(q / S_q)`` = ``128 qh + ql``
(``qh`` in [-127, 127], ``ql`` in [-64, 63]); key plane ``i`` as int8 is ``m (code_i - c)`` (4-bit: m 16, c 8, one
``lop3`` per 4 codes; 8-bit: m 1, c 128, one ``xor``). The int32 sum
``acc = 128 qh.P + ql.P = m qi.code - m c sum(qi)`` is exact, and with ``q^ = S_q qi``::

    q^ . k = (S_q / m) s acc + S_q sum(qi) (c s + z)

5-bit keys (``k5v4``: ``KSYM``, symmetric, ``k = (code - 15.5) s``) are read as two planes of ``D / 2`` channels like
4-bit keys: ``code = (hi << 1) | lo`` from the 4-bit high plane and the low bit plane (byte ``j`` bit ``i`` =
channel ``j + i D / 8``, loaded once per plane channel, so each low byte four times). Both key paths use centred
codes: int8 ``8 (code - 16)`` (the 4-bit int8 plane ``16 (hi - 8)`` with the low bit as bit 3; m 8, c 16), float16
``code - 16`` (query planes undivided); with ``z = -15.5 s`` the zero term is ``(16 - 15.5) s sum(q)``.
``VLOG`` (``k5v4``): the value scale is ``2**((u - 128) / 8)`` of a uint8 ``u`` (``kvrepro.ops.triton.scales``).

``NPAIRS > 0`` (key offset ``rope-mean``, ``kvrepro.formats.offset.RopeMean``): the pages hold ``k_j - R(j) b_hat``,
and each paged key's logit gets ``sum_i A_i cos(j theta_i) + B_i sin(j theta_i)`` back (``A``, ``B`` per query row
from the caller, float32), so the scores are those of the exact keys. The angle is the exact product ``j theta_i``
(as ``RopeMean.angles``), which makes the correction separable by angle addition: for the key tile starting at
``n0``, ``j = n0 + t``, it is ``sum_i A'_i cos(t theta_i) + B'_i sin(t theta_i)`` with ``(A', B')`` the terms turned by
``n0 theta_i``. The ``[2 NPAIRS, BLOCK_N]`` cos / sin table of ``t theta_i`` is built once per program
(``_rope_setup``); each tile takes the cos / sin of its ``2 NPAIRS`` start angles (``_rope_cos``: float64 reduction,
float32 cosine), turns the terms and adds one 3xTF32 dot of them with the table (``_rope_tile``): no trigonometry per
key, and none in float64 (with libdevice's float64 sine and cosine in the kernel, ptxas spilled the default k5v4
launch several times more: ``benchmarks/triton_spills.py``). The chunk's fresh keys (prefill) are exact and get nothing.
"""
import triton
import triton.language as tl

from kvrepro.ops.triton.scales import log_scale_value


@triton.jit
def _plane(packed, I: tl.constexpr, BITS: tl.constexpr, CENTER: tl.constexpr):
    """uint8 tile -> float16 tile of ``m_I * (code_I - CENTER)`` (exact; CENTER 0 or 2**(BITS-1))."""
    if BITS == 8:
        c = packed.to(tl.int16)
    else:
        c = (packed & (((1 << BITS) - 1) << (I * BITS))).to(tl.int16)
    return (c | 0x6400).to(tl.float16, bitcast=True) - (1024.0 + CENTER * (1 << (I * BITS)))


def _asm_planes4(k_lo: str, k_hi: str) -> str:
    """PTX: 4 packed bytes (8 nibbles) -> 4 x f16x2: low nibbles then high nibbles (x16), each as
    ``(x | 0x6400) - k`` (FasterTransformer's int4 -> fp16 trick); ``k_lo`` / ``k_hi`` are the f16x2
    subtrahends of the low / high plane."""
    return f"""
        {{
        .reg .b32 t, u, k0, k1;
        mov.b32 k0, {k_lo};
        mov.b32 k1, {k_hi};
        prmt.b32 t, $4, 0, 0x4140;
        lop3.b32 u, t, 0x000F000F, 0x64006400, 0xEA;
        sub.f16x2 $0, u, k0;
        lop3.b32 u, t, 0x00F000F0, 0x64006400, 0xEA;
        sub.f16x2 $2, u, k1;
        prmt.b32 t, $4, 0, 0x4342;
        lop3.b32 u, t, 0x000F000F, 0x64006400, 0xEA;
        sub.f16x2 $1, u, k0;
        lop3.b32 u, t, 0x00F000F0, 0x64006400, 0xEA;
        sub.f16x2 $3, u, k1;
        }}
        """


def _asm_plane8(k: str) -> str:
    """PTX: 4 packed bytes -> 2 x f16x2 of ``(0x64 << 8 | byte) - k``."""
    return f"""
        {{
        .reg .b32 t, k;
        mov.b32 k, {k};
        prmt.b32 t, $2, 0x64, 0x4140;
        sub.f16x2 $0, t, k;
        prmt.b32 t, $2, 0x64, 0x4342;
        sub.f16x2 $1, t, k;
        }}
        """


# 0x6400 = 1024 (plain planes: m_i * code); 0x6408 = 1032 and 0x6480 = 1152 (centred planes:
# m_i * (code - 2**(bits-1)) for the low nibble, the high nibble x 16 and an 8-bit code).
_PLANES4_ASM = tl.constexpr(_asm_planes4("0x64006400", "0x64006400"))
_PLANES4C_ASM = tl.constexpr(_asm_planes4("0x64086408", "0x64806480"))
_PLANE8_ASM = tl.constexpr(_asm_plane8("0x64006400"))
_PLANE8C_ASM = tl.constexpr(_asm_plane8("0x64806480"))


@triton.jit
def _planes4_asm(packed, CENTERED: tl.constexpr):
    """uint8 tile of 4-bit pairs -> (low nibble, 16 x high nibble) as exact float16 tiles, centred
    on 8 (and 16 x 8) if ``CENTERED``."""
    return tl.inline_asm_elementwise(
        asm=_PLANES4C_ASM if CENTERED else _PLANES4_ASM,
        constraints="=r,=r,=r,=r,r", args=[packed], dtype=(tl.float16, tl.float16),
        is_pure=True, pack=4)


@triton.jit
def _plane8_asm(packed, CENTERED: tl.constexpr):
    """uint8 tile of 8-bit codes -> exact float16 tile of ``code`` (or ``code - 128`` if ``CENTERED``)."""
    return tl.inline_asm_elementwise(
        asm=_PLANE8C_ASM if CENTERED else _PLANE8_ASM,
        constraints="=r,=r,r", args=[packed], dtype=tl.float16, is_pure=True, pack=4)


# int8 key planes, 4 packed bytes per register: lop3 immLut 0x6A = (a & b) ^ c (a 0xF0, b 0xCC,
# c 0xAA: (0xF0 & 0xCC) ^ 0xAA = 0x6A). Low nibbles: ((x << 4) & 0xF0) ^ 0x80 = 16 (c_lo - 8) as s8;
# high nibbles: (x & 0xF0) ^ 0x80 = 16 (c_hi - 8); 8-bit codes: x ^ 0x80 = c - 128.
_I8_PLANES4_ASM = tl.constexpr("""
        {
        .reg .b32 t;
        shl.b32 t, $2, 4;
        lop3.b32 $0, t, 0xF0F0F0F0, 0x80808080, 0x6A;
        lop3.b32 $1, $2, 0xF0F0F0F0, 0x80808080, 0x6A;
        }
        """)
_I8_PLANE8_ASM = tl.constexpr("xor.b32 $0, $1, 0x80808080;")
# 5-bit keys: the 4-bit int8 planes of the high-plane bytes ($2) with bit 3 = the code's low bit: 8 (code - 16).
# $3: the low-plane byte of each channel, $4: its bit mask 1 << i for plane 0 (bit i + 4 for plane 1, hence the
# shr by 4). Per byte, (lo & mask) is 0 or the mask (1..8), + 7 sets bit 3 exactly when it is not 0 (no carry leaves
# the byte); lop3 immLut 0xF8 = a | (b & c).
_I8_PLANES5_ASM = tl.constexpr("""
        {
        .reg .b32 a, p0, p1, t0, t1;
        shl.b32 a, $2, 4;
        lop3.b32 p0, a, 0xF0F0F0F0, 0x80808080, 0x6A;
        lop3.b32 p1, $2, 0xF0F0F0F0, 0x80808080, 0x6A;
        and.b32 t0, $3, $4;
        shr.b32 t1, $3, 4;
        and.b32 t1, t1, $4;
        add.u32 t0, t0, 0x07070707;
        add.u32 t1, t1, 0x07070707;
        lop3.b32 $0, p0, t0, 0x08080808, 0xF8;
        lop3.b32 $1, p1, t1, 0x08080808, 0xF8;
        }
        """)


@triton.jit
def _low_bit_masks(kl):
    """For a tile ``kl`` [N, KP] of low-plane bytes loaded per channel (column ``j`` = byte ``j % (KP / 4)``): the
    uint8 mask ``1 << (j // (KP / 4))`` of plane 0's bit of each column, broadcast to ``kl``'s shape (plane 1: the
    same mask on ``kl >> 4``)."""
    KP: tl.constexpr = kl.shape[1]
    j = tl.arange(0, KP)
    return tl.broadcast_to((1 << (j // (KP // 4))).to(tl.uint8)[None, :], kl.shape)


@triton.jit
def _key_planes5_i8(kc, kl, ASM: tl.constexpr):
    """5-bit keys: high-plane bytes ``kc`` and low-plane bytes ``kl`` [N, KP] -> int8 planes ``8 (code - 16)`` of
    channels ``[0, KP)`` and ``[KP, 2 KP)``. Exact."""
    m = _low_bit_masks(kl)
    if ASM:
        p0, p1 = tl.inline_asm_elementwise(asm=_I8_PLANES5_ASM, constraints="=r,=r,r,r,r", args=[kc, kl, m],
                                           dtype=(tl.int8, tl.int8), is_pure=True, pack=4)
    else:
        b0 = ((kl & m) != 0).to(tl.uint8) << 3
        b1 = (((kl >> 4) & m) != 0).to(tl.uint8) << 3
        p0 = ((((kc << 4) & 0xF0) | b0) ^ 0x80).to(tl.int8, bitcast=True)
        p1 = (((kc & 0xF0) | b1) ^ 0x80).to(tl.int8, bitcast=True)
    return p0, p1


@triton.jit
def _key_planes5_f16(kc, kl):
    """5-bit keys: float16 planes ``code - 16`` (exact) of channels ``[0, KP)`` and ``[KP, 2 KP)``."""
    m = _low_bit_masks(kl)
    c0 = ((kc & 0xF).to(tl.int16) << 1) | ((kl & m) != 0).to(tl.int16)
    c1 = ((kc >> 4).to(tl.int16) << 1) | (((kl >> 4) & m) != 0).to(tl.int16)
    k0 = (c0 | 0x6400).to(tl.float16, bitcast=True) - 1040.0
    k1 = (c1 | 0x6400).to(tl.float16, bitcast=True) - 1040.0
    return k0, k1


@triton.jit
def _key_planes_i8(kc, KBITS: tl.constexpr, ASM: tl.constexpr):
    """uint8 key tile ``[N, KP]`` -> int8 planes ``(p0, p1)`` = ``m (code_i - c)`` (4-bit: m 16,
    c 8, plane 1 = high nibbles; 8-bit: m 1, c 128, p1 = p0 unused). Exact."""
    if ASM and KBITS == 4:
        p0, p1 = tl.inline_asm_elementwise(asm=_I8_PLANES4_ASM, constraints="=r,=r,r", args=[kc],
                                           dtype=(tl.int8, tl.int8), is_pure=True, pack=4)
    elif ASM:
        p0 = tl.inline_asm_elementwise(asm=_I8_PLANE8_ASM, constraints="=r,r", args=[kc], dtype=tl.int8,
                                       is_pure=True, pack=4)
        p1 = p0
    elif KBITS == 4:
        p0 = (((kc << 4) & 0xF0) ^ 0x80).to(tl.int8, bitcast=True)
        p1 = ((kc & 0xF0) ^ 0x80).to(tl.int8, bitcast=True)
    else:
        p0 = (kc ^ 0x80).to(tl.int8, bitcast=True)
        p1 = p0
    return p0, p1


@triton.jit
def _query_digits(qrow, qmask, dk, KP: tl.constexpr, KBITS: tl.constexpr):
    """int8 query digits for ``KEY_I8``: ``S_q = max|q| / 16255`` per row (query head) over all
    channels (1 for an all-zero or masked row, NaN for a row holding a NaN), so a head with a small
    norm keeps its 14 bits next to a large one of the same GQA group, ``qi = round(q / S_q)`` in
    [-16255, 16255] split as
    ``qi = 128 qh + ql`` with ``qh = floor((qi + 64) / 128)`` in [-127, 127] and ``ql`` in [-64, 63].
    Returns ``(qh0, qh1, ql0, ql1, qsum, s_q)``: int8 [M, KP] per key plane (plane 1 = plane 0 for
    8-bit keys), ``qsum = S_q sum(qi)`` float32 [M] and ``S_q`` float32 [M]."""
    NPK: tl.constexpr = 2 if KBITS == 5 else 8 // KBITS
    tl.static_assert(NPK <= 2, "KEY_I8 supports 4-, 5- and 8-bit keys")
    q0 = tl.load(qrow + dk[None, :], mask=qmask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(q0), axis=1)
    q1 = q0
    if NPK > 1:
        q1 = tl.load(qrow + KP + dk[None, :], mask=qmask, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.abs(q1), axis=1))
    s_q = tl.where(amax > 0, amax * (1.0 / 16255.0), 1.0)
    # A NaN anywhere in a row makes its scale NaN, so the NaN reaches the logits: the integer digits
    # alone would turn it into a finite number (float -> int of NaN).
    nan_row = tl.max((q0 != q0).to(tl.int32), axis=1)
    if NPK > 1:
        nan_row = tl.maximum(nan_row, tl.max((q1 != q1).to(tl.int32), axis=1))
    s_q = tl.where(nan_row > 0, float("nan"), s_q)
    inv = (1.0 / s_q)[:, None]
    qi0 = tl.floor(q0 * inv + 0.5).to(tl.int32)      # |q * inv| <= 16255 (1 ulp): no overflow of 16255
    qh0 = (qi0 + 64) >> 7                             # arithmetic shift = floor
    ql0 = qi0 - (qh0 << 7)
    isum = tl.sum(qi0, axis=1)
    qh1 = qh0
    ql1 = ql0
    if NPK > 1:
        qi1 = tl.floor(q1 * inv + 0.5).to(tl.int32)
        qh1 = (qi1 + 64) >> 7
        ql1 = qi1 - (qh1 << 7)
        isum += tl.sum(qi1, axis=1)
    return (qh0.to(tl.int8), qh1.to(tl.int8), ql0.to(tl.int8), ql1.to(tl.int8),
            isum.to(tl.float32) * s_q, s_q)


@triton.jit
def _qk_i8(kc, kl, qh0, qh1, ql0, ql1, KBITS: tl.constexpr, ASM: tl.constexpr):
    """``qi . P`` = ``m qi.code - m c sum(qi)`` [M, N] int32 (exact) for a packed key tile ``kc``
    ``[N, KP]`` u8 (5-bit keys: with its low-plane bytes ``kl``, else ``kl`` is unused): two independent int32
    tensor-core chains (high and low digits; two chains let
    the IMMAs of one fill the other's dependency stalls), combined as ``128 hi + lo``.
    Bound: |qh|, |P| <= 128 over D <= 128 channels: |qh.P| <= 2^21, x 128 <= 2^28; |ql.P| <= 2^20;
    |acc| < 2^28.1 < 2^31 (Triton 3.6 emits ``mma ... .satfinite.s32``, which would clip, not wrap,
    past that)."""
    if KBITS == 5:
        p0, p1 = _key_planes5_i8(kc, kl, ASM)
    else:
        p0, p1 = _key_planes_i8(kc, KBITS, ASM)
    hi = tl.dot(qh0, tl.trans(p0), out_dtype=tl.int32)
    lo = tl.dot(ql0, tl.trans(p0), out_dtype=tl.int32)
    if KBITS == 4 or KBITS == 5:
        hi = tl.dot(qh1, tl.trans(p1), hi, out_dtype=tl.int32)
        lo = tl.dot(ql1, tl.trans(p1), lo, out_dtype=tl.int32)
    return hi * 128 + lo


@triton.jit
def _planes(packed, BITS: tl.constexpr, ASM: tl.constexpr, CENTERED: tl.constexpr = False):
    """All planes of a packed tile (unused ones are returned as plane 0 and never read).

    ``CENTERED``: plane ``i`` holds ``m_i * (code - 2**(BITS-1))`` instead of ``m_i * code``.
    Used for values: their accumulator then carries no large positive offset (7.5 x the
    probability mass at 4 bits) that the mid-rise correction would have to cancel; tensor-core
    float32 accumulation is not round-to-nearest, and over a 128K-token split that offset's
    rounding bias measured 45 % output error on the H200."""
    C: tl.constexpr = (1 << (BITS - 1)) if CENTERED else 0
    if ASM and BITS == 4:
        p0, p1 = _planes4_asm(packed, CENTERED)
        p2 = p0
        p3 = p0
    elif ASM and BITS == 8:
        p0 = _plane8_asm(packed, CENTERED)
        p1 = p0
        p2 = p0
        p3 = p0
    else:
        p0 = _plane(packed, 0, BITS, C)
        p1 = p0
        p2 = p0
        p3 = p0
        if BITS <= 4:
            p1 = _plane(packed, 1, BITS, C)
        if BITS == 2:
            p2 = _plane(packed, 2, BITS, C)
            p3 = _plane(packed, 3, BITS, C)
    return p0, p1, p2, p3


@triton.jit
def _acc_dot(a, b, acc, alpha, SCALE: tl.constexpr = 1):
    """``acc * alpha[:, None] + a @ b`` with ``a @ b`` summed in a fresh tensor-core accumulator.

    Tensor-core float32 accumulation rounds toward zero (Fasi et al. 2021, "Numerical behavior of
    NVIDIA tensor cores"); chained over a long split (``tl.dot(a, b, acc)``, which is also what
    Triton folds ``acc + tl.dot(a, b)`` into) that bias grows with the split length. Here the
    tensor core sums one tile only and the running sum is a round-to-nearest float32 FFMA. The
    ``acc * 0.0`` start value (not a constant) keeps Triton from folding the add into the dot.
    ``SCALE`` multiplies ``a @ b`` (float32)."""
    return acc * alpha[:, None] + tl.dot(a, b, acc * 0.0) * SCALE


@triton.jit
def _query_planes(qrow, qmask, dk, KP: tl.constexpr, KBITS: tl.constexpr):
    """Query planes for split-plane keys: plane ``i`` (channels ``[i*KP, (i+1)*KP)``) divided by
    ``m_i = 2**(i*KBITS)`` (exact in float16; 5-bit keys: two planes, undivided), and the row sums of q (float32)
    for the zero points. ``qrow`` [M, 1] row pointers, ``qmask`` [M, 1]. Unused planes are returned as plane 0."""
    NPK: tl.constexpr = 2 if KBITS == 5 else 8 // KBITS
    q0 = tl.load(qrow + dk[None, :], mask=qmask, other=0.0)
    qsum = tl.sum(q0.to(tl.float32), axis=1)
    q1 = q0
    q2 = q0
    q3 = q0
    if NPK > 1:
        q1 = tl.load(qrow + KP + dk[None, :], mask=qmask, other=0.0)
        qsum += tl.sum(q1.to(tl.float32), axis=1)
        if KBITS != 5:
            q1 = (q1.to(tl.float32) * (1.0 / (1 << KBITS))).to(tl.float16)
    if NPK > 2:
        q2 = tl.load(qrow + 2 * KP + dk[None, :], mask=qmask, other=0.0)
        q3 = tl.load(qrow + 3 * KP + dk[None, :], mask=qmask, other=0.0)
        qsum += tl.sum(q2.to(tl.float32), axis=1) + tl.sum(q3.to(tl.float32), axis=1)
        q2 = (q2.to(tl.float32) * (1.0 / (1 << (2 * KBITS)))).to(tl.float16)
        q3 = (q3.to(tl.float32) * (1.0 / (1 << (3 * KBITS)))).to(tl.float16)
    return q0, q1, q2, q3, qsum


@triton.jit
def _qk_planes(kc, kl, q0, q1, q2, q3, KBITS: tl.constexpr, ASM: tl.constexpr):
    """``sum_i (q_i / m_i) . (m_i code_i)`` over the key planes of a packed tile ``kc``
    ``[N, KP]`` u8: ``[M, N]`` float32 (logits are ``qk * scale_k + sum(q) * zero_k``). 5-bit keys (with their
    low-plane bytes ``kl``; else unused): ``sum_i q_i . (code_i - 16)``."""
    NPK: tl.constexpr = 2 if KBITS == 5 else 8 // KBITS
    if KBITS == 5:
        k0, k1 = _key_planes5_f16(kc, kl)
        k2 = k0
        k3 = k0
    else:
        k0, k1, k2, k3 = _planes(kc, KBITS, ASM)
    qk = tl.dot(q0, tl.trans(k0))
    if NPK > 1:
        qk = tl.dot(q1, tl.trans(k1), qk)
    if NPK > 2:
        qk = tl.dot(q2, tl.trans(k2), qk)
        qk = tl.dot(q3, tl.trans(k3), qk)
    return qk


# 2 pi = _TWO_PI_1 + _TWO_PI_2 + _TWO_PI_3, each exact in float32 (a Python float constant may be materialized as
# float32 before it meets a float64 tensor), so k x 2 pi is exact to ~1e-16 x k in float64.
_TWO_PI_1 = tl.constexpr(6.28125)
_TWO_PI_2 = tl.constexpr(0.0019353071693331003)          # float32(2 pi - 6.28125)
_TWO_PI_3 = tl.constexpr(1.0253131677018246e-11)         # float32(2 pi - 6.28125 - _TWO_PI_2)
_INV_TWO_PI = tl.constexpr(0.15915494309189535)
_HALF_PI = tl.constexpr(1.5707963267948966)


@triton.jit
def _rope_cos(a64, phase):
    """float32 ``cos(a64 - phase)`` of float64 angles ``a64 >= 0`` (``phase`` 0 or pi / 2, float32, broadcast): ``a64``
    reduced modulo 2 pi in float64 (three-part 2 pi, Cody-Waite), then one float32 cosine on ``[-3 pi / 2, pi]``:
    absolute error ~1e-7 at any angle below 2^40."""
    k = tl.floor(a64 * _INV_TWO_PI + 0.5)
    r = (((a64 - k * _TWO_PI_1) - k * _TWO_PI_2) - k * _TWO_PI_3).to(tl.float32)
    return tl.cos(r - phase)


@triton.jit
def _rope_setup(rf_row, NPAIRS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Per program, for key tiles of ``BLOCK_N`` keys of one KV head (``rf_row``: its ``NPAIRS`` float32 frequencies
    ``theta_i``): ``(f64, table, sgn)``. ``f64`` float64 [2 NPAIRS]: ``theta_(j % NPAIRS)``; ``table`` float32
    ``[2 NPAIRS, BLOCK_N]``: ``cos(t theta_j)`` for ``j < NPAIRS``, ``sin(t theta_(j - NPAIRS))`` after, ``t`` the key's
    offset in its tile; ``sgn`` [2 NPAIRS] +1 / -1 (``_rope_tile``)."""
    jp = tl.arange(0, 2 * NPAIRS)
    f64 = tl.load(rf_row + (jp % NPAIRS)).to(tl.float64)
    phase = tl.where(jp < NPAIRS, 0.0, _HALF_PI)
    table = _rope_cos(tl.arange(0, BLOCK_N).to(tl.float64)[None, :] * f64[:, None], phase[:, None])
    return f64, table, tl.where(jp < NPAIRS, 1.0, -1.0)


@triton.jit
def _rope_tile(ab, ab_sw, f64, sgn, table, n0):
    """``[M, BLOCK_N]`` float32 ``sum_i A_i cos(n theta_i) + B_i sin(n theta_i)`` for the tile's keys ``n = n0 + t``:
    ``ab`` [M, 2 NPAIRS] (``A | B``), ``ab_sw`` (``B | A``), turned by the exact angle ``n0 theta`` (cos / sin of
    [2 NPAIRS] angles per tile, ``_rope_cos``) to ``A' = A c + B s``, ``B' = B c - A s``, then one 3xTF32 dot with
    ``table`` (``_rope_setup``)."""
    a0 = f64 * n0                                  # exact: a position below 2^24 times a float32 theta
    c = _rope_cos(a0, 0.0)
    s = _rope_cos(a0, _HALF_PI)
    abt = ab * c[None, :] + ab_sw * (sgn * s)[None, :]
    return tl.dot(abt, table, input_precision="tf32x3")


@triton.jit
def _split_range(n_keys, split, NUM_SPLITS, BLOCK_N: tl.constexpr):
    """``[start, end)`` of this split's keys: ``n_keys`` cut into ``NUM_SPLITS`` runs of whole
    ``BLOCK_N`` tiles (trailing splits may be empty: their loop does not run)."""
    per_split = tl.cdiv(tl.cdiv(n_keys, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    return start, tl.minimum(start + per_split, n_keys)


@triton.jit
def _softmax_state(BLOCK_M: tl.constexpr, VP: tl.constexpr):
    """Initial online-softmax state: ``(m_i, l_i, accz, acc0, acc1, acc2, acc3)`` (max -inf, sums 0,
    the mid-rise remainder [M] and the four per-plane [M, VP] float32 accumulators at 0)."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    accz = tl.zeros([BLOCK_M], tl.float32)
    acc0 = tl.zeros([BLOCK_M, VP], tl.float32)
    return m_i, l_i, accz, acc0, acc0, acc0, acc0


@triton.jit
def _online_softmax(s, m_i):
    """One online-softmax step over log2-domain logits ``s`` [M, N] (masked keys at -inf):
    ``(m_new, alpha, p)`` with ``alpha = 2**(m_i - m_new)``; rows with no key yet keep m = -inf."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, tl.exp2(m_i - m_use), tl.exp2(s - m_use[:, None])


@triton.jit
def _pv_planes(pvs, pv16, vc, alpha, acc0, acc1, acc2, acc3, accz, VBITS: tl.constexpr, ASM: tl.constexpr):
    """Add ``p @ v`` for a packed value tile ``vc`` [N, VP] u8, given ``pvs = p * scale_v``
    [M, N] float32 (0 for masked keys) and its float16 rounding ``pv16``: per-plane accumulators
    hold ``m_i x sum pv16 (code - 2**(VBITS-1))`` (centred planes), ``accz`` the mid-rise
    remainder ``0.5 x sum pvs``. Returns the updated ``(acc0, acc1, acc2, acc3, accz)``.
    (The caller rounds pv16 before loading ``vc``: that order gives the shorter SASS.)"""
    NPV: tl.constexpr = 8 // VBITS
    VCC: tl.constexpr = (1 << (VBITS - 1)) - ((1 << VBITS) - 1) / 2
    v0, v1, v2, v3 = _planes(vc, VBITS, ASM, True)
    acc0 = _acc_dot(pv16, v0, acc0, alpha)
    if NPV > 1:
        acc1 = _acc_dot(pv16, v1, acc1, alpha)
    if NPV > 2:
        acc2 = _acc_dot(pv16, v2, acc2, alpha)
        acc3 = _acc_dot(pv16, v3, acc3, alpha)
    return acc0, acc1, acc2, acc3, accz * alpha + VCC * tl.sum(pvs, axis=1)


@triton.jit
def _finish(acc0, acc1, acc2, acc3, accz, l_i, m_i, VBITS: tl.constexpr):
    """Normalized per-plane outputs ``o_i = acc_i / (m_i l) + accz / l`` (rotated space) and the
    log2 sum-exp (``-inf`` and zeros for a row that saw no key; NaN for a row whose softmax sum is
    NaN, i.e. a NaN query or cache value reached it, so that it shows in the output)."""
    empty = l_i == 0
    inv_l = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))
    zl = accz * inv_l
    o0 = acc0 * inv_l[:, None] + zl[:, None]
    o1 = acc1 * (inv_l / (1 << VBITS))[:, None] + zl[:, None]
    o2 = acc2 * (inv_l / (1 << (2 * VBITS)))[:, None] + zl[:, None]
    o3 = acc3 * (inv_l / (1 << (3 * VBITS)))[:, None] + zl[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    return o0, o1, o2, o3, lse


@triton.jit
def paged_attn_kernel(
    q_ptr, pool_ptr, bt_ptr, seq_lens_ptr, qsl_ptr,
    fk_ptr, fv_ptr,            # fresh rotated K/V [T, Hkv, D] float16 (HAS_FRESH) or dummies
    o_ptr, lse_ptr, rot_ptr,   # SPLIT_OUT: o [T, Hq, S, D] f32 (rotated), lse [T, Hq, S] f32 (log2);
    stride_bt,                 # else o = out [T, Hq, D] (rotated back with rot [D, D] f32)
    NUM_SPLITS,
    NUM_KV_HEADS: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
    BS: tl.constexpr, PAGE_BYTES: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
    V_CODE_OFF: tl.constexpr, K_META_OFF: tl.constexpr, V_META_OFF: tl.constexpr,
    KSYM: tl.constexpr, VLOG: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_FRESH: tl.constexpr, SPLIT_OUT: tl.constexpr, IS_DECODE: tl.constexpr,
    DEQ_ASM: tl.constexpr, KEY_I8: tl.constexpr = False,
    rb_ptr=None, rf_ptr=None, rb_scale=1.0,   # NPAIRS > 0: terms [T, Hq, 2 NPAIRS] f32 (A, B), freqs [Hkv, NPAIRS] f32
    NPAIRS: tl.constexpr = 0,
):
    b = tl.program_id(0)
    qt = tl.program_id(1)
    kvh = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    HQ: tl.constexpr = NUM_KV_HEADS * G
    NPK: tl.constexpr = 2 if KBITS == 5 else 8 // KBITS     # key planes (5-bit: 4-bit high plane + low bits)
    NPV: tl.constexpr = 8 // VBITS
    KP: tl.constexpr = D // NPK                              # channels per key plane
    VP: tl.constexpr = D // NPV
    KCB: tl.constexpr = D * KBITS // 8                       # key code bytes per token (KP but for 5-bit keys)
    QM1: tl.constexpr = 1 if KBITS == 5 else (1 << KBITS)    # query plane 1's divisor (_query_planes)
    KMB: tl.constexpr = 2 if KSYM else 4                     # key meta bytes per token: scale (, zero)

    seq_len = tl.load(seq_lens_ptr + b)
    if IS_DECODE:                            # one query token per sequence, row b
        q_start = b
        q_len = 1
    else:
        q_start = tl.load(qsl_ptr + b)
        q_len = tl.load(qsl_ptr + b + 1) - q_start
    ctx = seq_len - q_len                    # keys before the first query of this chunk
    if HAS_FRESH:
        n_paged = ctx                        # the chunk's own K/V come fresh
    else:
        n_paged = seq_len                    # everything is in pages (decode)

    rows = tl.arange(0, BLOCK_M)
    tq = qt * BLOCK_Q + rows // GP           # query index within the chunk
    g = rows % GP
    row_ok = (rows < BLOCK_Q * GP) & (g < G) & (tq < q_len)     # rows this program writes
    head = kvh * G + g
    tok = (q_start + tq).to(tl.int64)
    qpos = ctx + tq                          # absolute position of each query row
    dk = tl.arange(0, KP)
    dv = tl.arange(0, VP)

    # Query planes, plane i divided by m_i = 2**(i*KBITS) (exact in float16).
    qrow = q_ptr + (tok * HQ + head)[:, None] * D
    qmask = (row_ok & (seq_len > 0))[:, None]
    if KEY_I8:                               # int8 digits of q (decode only, no fresh keys)
        tl.static_assert(IS_DECODE and not HAS_FRESH, "KEY_I8 is a decode-only path")
        qh0, qh1, ql0, ql1, qsum, s_q = _query_digits(qrow, qmask, dk, KP, KBITS)
        KM: tl.constexpr = 16 if KBITS == 4 else (8 if KBITS == 5 else 1)     # key plane multiplier m
        KC: tl.constexpr = 8.0 if KBITS == 4 else 128.0       # key code centre c (5-bit keys: 16, below)
        k_mul = s_q * (1.0 / KM)
    else:
        q0, q1, q2, q3, qsum = _query_planes(qrow, qmask, dk, KP, KBITS)

    # This split's range of paged keys (empty splits skip the loop).
    start, end = _split_range(n_paged, split, NUM_SPLITS, BLOCK_N)
    end = tl.where(qt * BLOCK_Q >= q_len, start, end)   # query tile past this chunk: no work
    m_i, l_i, accz, acc0, acc1, acc2, acc3 = _softmax_state(BLOCK_M, VP)

    nn = tl.arange(0, BLOCK_N)
    if NPAIRS > 0:                           # rope-mean (module docstring): terms scaled as q (scale x log2 e)
        jp = tl.arange(0, 2 * NPAIRS)
        rb_row = rb_ptr + (tok * HQ + head)[:, None] * (2 * NPAIRS)
        ab = tl.load(rb_row + jp[None, :], mask=qmask, other=0.0) * rb_scale                     # [A | B]
        ab_sw = tl.load(rb_row + ((jp + NPAIRS) % (2 * NPAIRS))[None, :], mask=qmask, other=0.0) * rb_scale  # [B | A]
        rope_f64, rope_tab, rope_sgn = _rope_setup(rf_ptr + kvh * NPAIRS, NPAIRS, BLOCK_N)

    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        n = n0 + nn
        n_ok = n < end
        blk = tl.load(bt_row + n // BS, mask=n_ok, other=0).to(tl.int64)
        page = pool_ptr + (blk * NUM_KV_HEADS + kvh) * PAGE_BYTES
        t_in = n % BS
        kc = tl.load(page[:, None] + (t_in * KCB)[:, None] + dk[None, :], mask=n_ok[:, None], other=0)
        if KBITS == 5:                       # low-plane byte of each plane-0 channel j: byte j % (D / 8)
            kl = tl.load(page[:, None] + (t_in * KCB + D // 2)[:, None] + (dk % (D // 8))[None, :],
                         mask=n_ok[:, None], other=0)
        else:
            kl = kc
        if KEY_I8:
            qk = _qk_i8(kc, kl, qh0, qh1, ql0, ql1, KBITS, DEQ_ASM).to(tl.float32)
        else:
            qk = _qk_planes(kc, kl, q0, q1, q2, q3, KBITS, DEQ_ASM)
        km = (page + K_META_OFF + t_in * KMB).to(tl.pointer_type(tl.float16))
        ks = tl.load(km, mask=n_ok, other=0.0).to(tl.float32)
        if KSYM:                             # z = -15.5 ks; codes centred on 16 on both key paths
            kz = 0.5 * ks
            if KEY_I8:
                s = qk * k_mul[:, None] * ks[None, :] + qsum[:, None] * kz[None, :]
            else:
                s = qk * ks[None, :] + qsum[:, None] * kz[None, :]
        else:
            kz = tl.load(km + 1, mask=n_ok, other=0.0).to(tl.float32)
            if KEY_I8:                       # s = (S_q/m) ks acc + S_q sum(qi) (c ks + kz), S_q per row
                kz = kz + KC * ks
                s = qk * k_mul[:, None] * ks[None, :] + qsum[:, None] * kz[None, :]
            else:
                s = qk * ks[None, :] + qsum[:, None] * kz[None, :]
        if NPAIRS > 0:
            s += _rope_tile(ab, ab_sw, rope_f64, rope_sgn, rope_tab, n0)
        vis = n_ok[None, :] & (n[None, :] <= qpos[:, None])
        s = tl.where(vis, s, float("-inf"))
        m_new, alpha, p = _online_softmax(s, m_i)
        if VLOG:
            vs = log_scale_value(tl.load(page + V_META_OFF + t_in, mask=n_ok, other=0))
        else:
            vm = (page + V_META_OFF + t_in * 2).to(tl.pointer_type(tl.float16))
            vs = tl.load(vm, mask=n_ok, other=0.0).to(tl.float32)
        pvs = p * vs[None, :]
        pv16 = pvs.to(tl.float16)
        vc = tl.load(page[:, None] + V_CODE_OFF + (t_in * VP)[:, None] + dv[None, :], mask=n_ok[:, None], other=0)
        acc0, acc1, acc2, acc3, accz = _pv_planes(pvs, pv16, vc, alpha, acc0, acc1, acc2, acc3, accz, VBITS,
                                                  DEQ_ASM)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

    if HAS_FRESH:
        # The chunk's own keys: fresh rotated K/V (float16), causal within the chunk.
        f_end = tl.minimum(q_len, (qt + 1) * BLOCK_Q)
        f_end = tl.where(qt * BLOCK_Q >= q_len, 0, f_end)
        for j0 in range(0, f_end, BLOCK_N):
            j = j0 + nn
            j_ok = j < f_end
            frow = ((q_start + j).to(tl.int64) * NUM_KV_HEADS + kvh) * D
            fk = fk_ptr + frow[:, None]
            s = tl.dot(q0, tl.trans(tl.load(fk + dk[None, :], mask=j_ok[:, None], other=0.0)))
            if NPK > 1:
                s += QM1 * tl.dot(q1, tl.trans(tl.load(fk + KP + dk[None, :], mask=j_ok[:, None], other=0.0)))
            if NPK > 2:
                s += (1 << (2 * KBITS)) * tl.dot(q2, tl.trans(tl.load(fk + 2 * KP + dk[None, :], mask=j_ok[:, None], other=0.0)))
                s += (1 << (3 * KBITS)) * tl.dot(q3, tl.trans(tl.load(fk + 3 * KP + dk[None, :], mask=j_ok[:, None], other=0.0)))
            vis = j_ok[None, :] & (j[None, :] <= tq[:, None])
            s = tl.where(vis, s, float("-inf"))
            m_new, alpha, p = _online_softmax(s, m_i)
            p16 = p.to(tl.float16)
            fv = fv_ptr + frow[:, None]
            acc0 = _acc_dot(p16, tl.load(fv + dv[None, :], mask=j_ok[:, None], other=0.0), acc0, alpha)
            if NPV > 1:
                acc1 = _acc_dot(p16, tl.load(fv + VP + dv[None, :], mask=j_ok[:, None], other=0.0), acc1, alpha,
                                1 << VBITS)
            if NPV > 2:
                acc2 = _acc_dot(p16, tl.load(fv + 2 * VP + dv[None, :], mask=j_ok[:, None], other=0.0), acc2, alpha,
                                1 << (2 * VBITS))
                acc3 = _acc_dot(p16, tl.load(fv + 3 * VP + dv[None, :], mask=j_ok[:, None], other=0.0), acc3, alpha,
                                1 << (3 * VBITS))
            accz = accz * alpha
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new

    o0, o1, o2, o3, lse = _finish(acc0, acc1, acc2, acc3, accz, l_i, m_i, VBITS)
    if SPLIT_OUT:
        base = (tok * HQ + head) * NUM_SPLITS + split
        orow = o_ptr + base[:, None] * D
        tl.store(orow + dv[None, :], o0, mask=row_ok[:, None])
        if NPV > 1:
            tl.store(orow + VP + dv[None, :], o1, mask=row_ok[:, None])
        if NPV > 2:
            tl.store(orow + 2 * VP + dv[None, :], o2, mask=row_ok[:, None])
            tl.store(orow + 3 * VP + dv[None, :], o3, mask=row_ok[:, None])
        tl.store(lse_ptr + base, lse, mask=row_ok)
    else:
        # Rotate back: out = o @ R.T = sum_i o_i @ R.T[i*VP:(i+1)*VP, :]  (R.T[j, c] = R[c, j]).
        d = tl.arange(0, D)
        rt = rot_ptr + d[None, :] * D + dv[:, None]
        out = tl.dot(o0, tl.load(rt), input_precision="ieee")
        if NPV > 1:
            out = tl.dot(o1, tl.load(rt + VP), out, input_precision="ieee")
        if NPV > 2:
            out = tl.dot(o2, tl.load(rt + 2 * VP), out, input_precision="ieee")
            out = tl.dot(o3, tl.load(rt + 3 * VP), out, input_precision="ieee")
        tl.store(o_ptr + (tok * HQ + head)[:, None] * D + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
