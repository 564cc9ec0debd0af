"""Dequantize a run of compressed pages into a dense K/V workspace.

``out[i, h] = (code * scale + zero)`` for keys, ``(code - c) * scale`` for values and 5-bit keys
(``kvrepro.formats.compressed``; a ``value_log_scale`` page's scale is ``2**((u - 128) / 8)``), in the rotated space
(``ROTATE=False``, a pure byte-bound pass) or rotated back, ``@ R.T`` (``ROTATE=True``, a float32 matmul per tile),
written in the workspace dtype (bfloat16/float16).
"""
import triton
import triton.language as tl

from kvrepro.ops.triton.scales import log_scale_value


@triton.jit
def _dequant_tile(pool_ptr, page, t_in, ok, d, rt, CODE_OFF: tl.constexpr, META_OFF: tl.constexpr,
                  BITS: tl.constexpr, SYMMETRIC: tl.constexpr, D: tl.constexpr, ROTATE: tl.constexpr,
                  LOG_SCALE: tl.constexpr = False):
    MASK: tl.constexpr = (1 << BITS) - 1
    if BITS == 5:       # high plane: 4-bit split-plane over D / 2 bytes; low plane: 1-bit over D / 8 bytes
        TOK: tl.constexpr = D * 5 // 8
        row = pool_ptr + page[:, None] + CODE_OFF + t_in[:, None] * TOK
        h = tl.load(row + (d % (D // 2))[None, :], mask=ok[:, None], other=0).to(tl.int32)
        lb = tl.load(row + D // 2 + (d % (D // 8))[None, :], mask=ok[:, None], other=0).to(tl.int32)
        hi = (h >> ((d // (D // 2)) * 4)[None, :]) & 15
        code = ((hi << 1) | ((lb >> (d // (D // 8))[None, :]) & 1)).to(tl.float32)
    else:
        P: tl.constexpr = D * BITS // 8
        byte = d % P
        shift = (d // P) * BITS
        c = tl.load(pool_ptr + page[:, None] + CODE_OFF + t_in[:, None] * P + byte[None, :],
                    mask=ok[:, None], other=0).to(tl.int32)
        code = ((c >> shift[None, :]) & MASK).to(tl.float32)
    if LOG_SCALE:
        u = tl.load(pool_ptr + page + META_OFF + t_in, mask=ok, other=0)
        s = log_scale_value(u)
        x = (code - MASK / 2) * s[:, None]
    elif SYMMETRIC:
        m = (pool_ptr + page + META_OFF + t_in * 2).to(tl.pointer_type(tl.float16))
        s = tl.load(m, mask=ok, other=0.0).to(tl.float32)
        if BITS == 5:
            x = (code - MASK / 2) * s[:, None]
        else:
            x = code * s[:, None] + (-(MASK / 2) * s)[:, None]
    else:
        m = (pool_ptr + page + META_OFF + t_in * 4).to(tl.pointer_type(tl.float16))
        s = tl.load(m, mask=ok, other=0.0).to(tl.float32)
        z = tl.load(m + 1, mask=ok, other=0.0).to(tl.float32)
        x = code * s[:, None] + z[:, None]
    if ROTATE:
        x = tl.dot(x, rt, input_precision="ieee")
    return x


@triton.jit
def dequant_pages_kernel(pool_ptr, bt_ptr, rot_ptr, k_out_ptr, v_out_ptr, first_tok, num_tok,
                         NUM_KV_HEADS: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                         PAGE_BYTES: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
                         V_CODE_OFF: tl.constexpr, K_META_OFF: tl.constexpr, V_META_OFF: tl.constexpr,
                         KSYM: tl.constexpr, VLOG: tl.constexpr,
                         BLOCK_T: tl.constexpr, ROTATE: tl.constexpr = True):
    """Grid ``(cdiv(num_tok, BLOCK_T), NUM_KV_HEADS)``: tokens ``first_tok + i`` of one sequence
    (block-table row ``bt_ptr``) into ``k_out/v_out [num_tok, NUM_KV_HEADS, D]`` (contiguous)."""
    h = tl.program_id(1)
    i = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    ok = i < num_tok
    n = first_tok + i
    blk = tl.load(bt_ptr + n // BS, mask=ok, other=0).to(tl.int64)
    page = (blk * NUM_KV_HEADS + h) * PAGE_BYTES
    t_in = n % BS
    d = tl.arange(0, D)
    if ROTATE:
        rt = tl.load(rot_ptr + d[None, :] * D + d[:, None])        # rt[j, c] = R[c, j]
    else:
        rt = rot_ptr
    dst = (i.to(tl.int64) * NUM_KV_HEADS + h)[:, None] * D + d[None, :]
    k = _dequant_tile(pool_ptr, page, t_in, ok, d, rt, 0, K_META_OFF, KBITS, KSYM, D, ROTATE)
    tl.store(k_out_ptr + dst, k.to(k_out_ptr.dtype.element_ty), mask=ok[:, None])
    v = _dequant_tile(pool_ptr, page, t_in, ok, d, rt, V_CODE_OFF, V_META_OFF, VBITS, True, D, ROTATE, VLOG)
    tl.store(v_out_ptr + dst, v.to(v_out_ptr.dtype.element_ty), mask=ok[:, None])
