"""Variant v1 (measured on the H200; superseded by v2 as the default, notes/kernels.md): full-width dequantization.

One program = (sequence, query tile, KV head, split). Its rows are ``BLOCK_Q`` query tokens x
``GP`` query heads of one GQA group (``GP`` = group size rounded up to a power of two; rows
padded to at least 16 for ``tl.dot``), so each page is read once for the whole group.

Work happens in the rotated space: ``q`` arrives rotated and pre-multiplied by
``softmax_scale * log2(e)`` (float16); logits use ``exp2``. Dequantization is folded into the
dot products (per token ``k = code * s + z``, ``v = (code - c) * s_v``, ``c = (2**vb - 1) / 2``)::

    q . k = s * (q . code) + z * sum(q)
    sum_n p_n v_n = (p * s_v) @ code_v - c * sum_n p_n s_v[n]

Codes become float16 without an int->float instruction: ``(code | 0x6400)`` is the float16
``1024 + code``; subtracting 1024 is exact. Accumulation is float32 (online softmax, Milakov &
Gimelshein 2018; FlashAttention, Dao et al. 2022; split-K merge as FlashDecoding, Dao et al. 2023).
"""
import triton
import triton.language as tl

from kvrepro.ops.kernels.attention import _acc_dot


@triton.jit
def _codes_f16(packed, shift, MASK: tl.constexpr, CENTER: tl.constexpr = 0):
    c = (packed.to(tl.int16) >> shift) & MASK
    return (c | 0x6400).to(tl.float16, bitcast=True) - (1024.0 + CENTER)


@triton.jit
def paged_attn_kernel_v1(
    q_ptr, pool_ptr, bt_ptr, seq_lens_ptr, qsl_ptr,
    fk_ptr, fv_ptr,            # fresh rotated K/V [T, Hkv, D] float16 (HAS_FRESH) or dummies
    o_ptr, lse_ptr, rot_ptr,   # SPLIT_OUT: o [T, Hq, S, D] f32 (rotated), lse [T, Hq, S] f32 (log2);
    stride_bt,                 # else o = out [T, Hq, D] (rotated back with rot [D, D] f32)
    NUM_KV_HEADS: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
    BS: tl.constexpr, PAGE_BYTES: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
    V_CODE_OFF: tl.constexpr, K_META_OFF: tl.constexpr, V_META_OFF: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS, HAS_FRESH: tl.constexpr, SPLIT_OUT: tl.constexpr,
    IS_DECODE: tl.constexpr,
):
    b = tl.program_id(0)
    qt = tl.program_id(1)
    kvh = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    HQ: tl.constexpr = NUM_KV_HEADS * G

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
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (tok * HQ + head)[:, None] * D + d[None, :],
                mask=(row_ok & (seq_len > 0))[:, None], other=0.0)
    qsum = tl.sum(q.to(tl.float32), axis=1)
    qpos = ctx + tq                          # absolute position of each query row

    # This split's range of paged keys (empty splits skip the loop).
    per_split = tl.cdiv(tl.cdiv(n_paged, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, n_paged)
    end = tl.where(qt * BLOCK_Q >= q_len, start, end)   # query tile past this chunk: no work

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    accz = tl.zeros([BLOCK_M], tl.float32)

    KP: tl.constexpr = D * KBITS // 8
    VP: tl.constexpr = D * VBITS // 8
    kbyte = d % KP
    kshift = ((d // KP) * KBITS).to(tl.int16)
    vbyte = d % VP
    vshift = ((d // VP) * VBITS).to(tl.int16)
    KMASK: tl.constexpr = (1 << KBITS) - 1
    VMASK: tl.constexpr = (1 << VBITS) - 1
    VC: tl.constexpr = VMASK / 2             # values: v = (code - VC) * scale (mid-rise)
    nn = tl.arange(0, BLOCK_N)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        n = n0 + nn
        n_ok = n < end
        blk = tl.load(bt_row + n // BS, mask=n_ok, other=0).to(tl.int64)
        page = (blk * NUM_KV_HEADS + kvh) * PAGE_BYTES
        t_in = n % BS
        kc = tl.load(pool_ptr + page[:, None] + t_in[:, None] * KP + kbyte[None, :],
                     mask=n_ok[:, None], other=0)
        k16 = _codes_f16(kc, kshift[None, :], KMASK)               # [N, D] codes
        km = (pool_ptr + page + K_META_OFF + t_in * 4).to(tl.pointer_type(tl.float16))
        ks = tl.load(km, mask=n_ok, other=0.0).to(tl.float32)
        kz = tl.load(km + 1, mask=n_ok, other=0.0).to(tl.float32)
        qk = tl.dot(q, tl.trans(k16))                               # [M, N] f32
        s = qk * ks[None, :] + qsum[:, None] * kz[None, :]
        vis = n_ok[None, :] & (n[None, :] <= qpos[:, None])
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        vc = tl.load(pool_ptr + page[:, None] + V_CODE_OFF + t_in[:, None] * VP + vbyte[None, :],
                     mask=n_ok[:, None], other=0)
        v16 = _codes_f16(vc, vshift[None, :], VMASK, (VMASK + 1) // 2)   # centred, as in v2
        vm = (pool_ptr + page + V_META_OFF + t_in * 2).to(tl.pointer_type(tl.float16))
        vs = tl.load(vm, mask=n_ok, other=0.0).to(tl.float32)
        pvs = p * vs[None, :]
        acc = _acc_dot(pvs.to(tl.float16), v16, acc, alpha)
        accz = accz * alpha + ((VMASK + 1) // 2 - VC) * tl.sum(pvs, axis=1)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new

    if HAS_FRESH:
        # The chunk's own keys: fresh rotated K/V, causal within the chunk.
        f_end = tl.minimum(q_len, (qt + 1) * BLOCK_Q)
        if qt * BLOCK_Q >= q_len:
            f_end = 0
        for j0 in range(0, f_end, BLOCK_N):
            j = j0 + nn
            j_ok = j < f_end
            ftok = (q_start + j).to(tl.int64)
            fo = (ftok * NUM_KV_HEADS + kvh)[:, None] * D + d[None, :]
            kf = tl.load(fk_ptr + fo, mask=j_ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(kf))
            vis = j_ok[None, :] & (j[None, :] <= tq[:, None])
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            vf = tl.load(fv_ptr + fo, mask=j_ok[:, None], other=0.0)
            acc = _acc_dot(p.to(tl.float16), vf, acc, alpha)
            accz = accz * alpha
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = (acc + accz[:, None]) / l_safe[:, None]
    o = tl.where((l_i > 0)[:, None], o, 0.0)
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
    if SPLIT_OUT:
        base = (tok * HQ + head) * NUM_SPLITS + split
        tl.store(o_ptr + base[:, None] * D + d[None, :], o, mask=row_ok[:, None])
        tl.store(lse_ptr + base, lse, mask=row_ok)
    else:
        rt = tl.load(rot_ptr + d[None, :] * D + d[:, None])        # rt[j, c] = R[c, j]
        o = tl.dot(o, rt, input_precision="ieee")
        tl.store(o_ptr + (tok * HQ + head)[:, None] * D + d[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
