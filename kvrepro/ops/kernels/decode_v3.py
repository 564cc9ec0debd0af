"""Decode attention over compressed pages, variant v3 (decode only, one query token per sequence).

Same arithmetic as ``attention.paged_attn_kernel`` (v2: split-plane dot products, dequantization
folded into the logits and the value accumulators, float32 online softmax, split-K partials
merged by ``rotate.merge_splits_kernel``), with the memory access reorganised for the decode
roofline:

* loads are page-shaped: one block-table entry per page (not per token), tiles
  ``[pages, block_size, bytes]`` whose last dimension is contiguous (16-byte vector loads);
* every load of a step (K codes, V codes, K and V metadata) is issued before any math on it,
  and with ``PREFETCH`` the loads of step ``i + 1`` are issued before the math of step ``i``
  (register double-buffering; the raw codes are small: 64 B per thread per tile at 4 warps);
* K metadata (float16 scale, zero) is one 4-byte load per token, split in registers.

Tokens past the split's end inside a page that is read anyway are masked in the logits (their
codes are never used: ``p = 0``); pages past the end are not read.
"""
import triton
import triton.language as tl

from kvrepro.ops.kernels.attention import (_finish, _online_softmax, _pv_planes, _qk_planes, _query_planes,
                                          _softmax_state, _split_range)


@triton.jit
def _load_step(pool_ptr, bt_row, n0, end, kvh, pp, tt, dk, dv, two,
               NUM_KV_HEADS: tl.constexpr, BS: tl.constexpr, PAGE_BYTES: tl.constexpr,
               KP: tl.constexpr, VP: tl.constexpr, BLOCK_N: tl.constexpr,
               V_CODE_OFF: tl.constexpr, K_META_OFF: tl.constexpr, V_META_OFF: tl.constexpr):
    """Raw bytes of the tokens ``[n0, n0 + BLOCK_N)``: K codes ``[BLOCK_N, KP]`` u8, V codes
    ``[BLOCK_N, VP]`` u8, K scale / zero ``[BLOCK_N]`` f16, V scale ``[BLOCK_N]`` f16."""
    pg = n0 // BS + pp
    p_ok = pg * BS < end
    blk = tl.load(bt_row + pg, mask=p_ok, other=0).to(tl.int64)
    base = pool_ptr + (blk * NUM_KV_HEADS + kvh) * PAGE_BYTES                     # [NP]
    m3 = p_ok[:, None, None]
    kc = tl.load(base[:, None, None] + tt[None, :, None] * KP + dk[None, None, :], mask=m3, other=0)
    vc = tl.load(base[:, None, None] + V_CODE_OFF + tt[None, :, None] * VP + dv[None, None, :],
                 mask=m3, other=0)
    kmp = (base[:, None, None] + K_META_OFF + tt[None, :, None] * 4 + two[None, None, :] * 2)
    km = tl.load(kmp.to(tl.pointer_type(tl.float16)), mask=m3, other=0.0)
    vmp = (base[:, None] + V_META_OFF + tt[None, :] * 2).to(tl.pointer_type(tl.float16))
    vm = tl.load(vmp, mask=p_ok[:, None], other=0.0)
    ks, kz = tl.split(tl.reshape(km, [BLOCK_N, 2]))
    return (tl.reshape(kc, [BLOCK_N, KP]), tl.reshape(vc, [BLOCK_N, VP]), ks, kz,
            tl.reshape(vm, [BLOCK_N]))


@triton.jit
def decode_v3_kernel(
    q_ptr, pool_ptr, bt_ptr, seq_lens_ptr, o_ptr, lse_ptr, stride_bt, NUM_SPLITS,
    NUM_KV_HEADS: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
    BS: tl.constexpr, PAGE_BYTES: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
    V_CODE_OFF: tl.constexpr, K_META_OFF: tl.constexpr, V_META_OFF: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DEQ_ASM: tl.constexpr, PREFETCH: tl.constexpr,
):
    """Grid ``(B, NUM_KV_HEADS * NUM_SPLITS)``. ``q`` [B, Hq, D] float16, rotated and scaled by
    ``softmax_scale * log2(e)``; writes rotated partials ``o`` [B, Hq, S, D] float32 and log2
    sum-exps ``lse`` [B, Hq, S] float32 (``-inf`` for an empty split)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1) // NUM_SPLITS
    split = tl.program_id(1) % NUM_SPLITS
    HQ: tl.constexpr = NUM_KV_HEADS * G
    NPK: tl.constexpr = 8 // KBITS
    NPV: tl.constexpr = 8 // VBITS
    KP: tl.constexpr = D // NPK
    VP: tl.constexpr = D // NPV
    NP: tl.constexpr = BLOCK_N // BS

    seq_len = tl.load(seq_lens_ptr + b)
    g = tl.arange(0, BLOCK_M)
    row_ok = g < G
    head = kvh * G + g
    dk = tl.arange(0, KP)
    dv = tl.arange(0, VP)
    qrow = q_ptr + (b.to(tl.int64) * HQ + head)[:, None] * D
    qmask = (row_ok & (seq_len > 0))[:, None]
    q0, q1, q2, q3, qsum = _query_planes(qrow, qmask, dk, KP, KBITS)

    start, end = _split_range(seq_len, split, NUM_SPLITS, BLOCK_N)
    m_i, l_i, accz, acc0, acc1, acc2, acc3 = _softmax_state(BLOCK_M, VP)

    pp = tl.arange(0, NP)
    tt = tl.arange(0, BS)
    two = tl.arange(0, 2)
    nn = tl.arange(0, BLOCK_N)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    if PREFETCH:
        kc, vc, ks, kz, vs = _load_step(pool_ptr, bt_row, start, end, kvh, pp, tt, dk, dv, two,
                                        NUM_KV_HEADS, BS, PAGE_BYTES, KP, VP, BLOCK_N,
                                        V_CODE_OFF, K_META_OFF, V_META_OFF)
    for n0 in range(start, end, BLOCK_N):
        if PREFETCH:
            kc_n, vc_n, ks_n, kz_n, vs_n = _load_step(
                pool_ptr, bt_row, n0 + BLOCK_N, end, kvh, pp, tt, dk, dv, two,
                NUM_KV_HEADS, BS, PAGE_BYTES, KP, VP, BLOCK_N, V_CODE_OFF, K_META_OFF, V_META_OFF)
        else:
            kc, vc, ks, kz, vs = _load_step(pool_ptr, bt_row, n0, end, kvh, pp, tt, dk, dv, two,
                                            NUM_KV_HEADS, BS, PAGE_BYTES, KP, VP, BLOCK_N,
                                            V_CODE_OFF, K_META_OFF, V_META_OFF)
        n_ok = (n0 + nn) < end
        qk = _qk_planes(kc, q0, q1, q2, q3, KBITS, DEQ_ASM)
        s = qk * ks.to(tl.float32)[None, :] + qsum[:, None] * kz.to(tl.float32)[None, :]
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new, alpha, p = _online_softmax(s, m_i)
        pvs = p * tl.where(n_ok, vs.to(tl.float32), 0.0)[None, :]
        acc0, acc1, acc2, acc3, accz = _pv_planes(pvs, pvs.to(tl.float16), vc, alpha, acc0, acc1, acc2, acc3,
                                                  accz, VBITS, DEQ_ASM)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
        if PREFETCH:
            kc = kc_n
            vc = vc_n
            ks = ks_n
            kz = kz_n
            vs = vs_n

    o0, o1, o2, o3, lse = _finish(acc0, acc1, acc2, acc3, accz, l_i, m_i, VBITS)
    base = (b.to(tl.int64) * HQ + head) * NUM_SPLITS + split
    orow = o_ptr + base[:, None] * D
    tl.store(orow + dv[None, :], o0, mask=row_ok[:, None])
    if NPV > 1:
        tl.store(orow + VP + dv[None, :], o1, mask=row_ok[:, None])
    if NPV > 2:
        tl.store(orow + 2 * VP + dv[None, :], o2, mask=row_ok[:, None])
        tl.store(orow + 3 * VP + dv[None, :], o3, mask=row_ok[:, None])
    tl.store(lse_ptr + base, lse, mask=row_ok)
