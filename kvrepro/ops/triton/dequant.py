"""Dequantize a run of compressed pages into a dense K/V workspace.

``out[i, h] = (code * scale + zero)`` for keys, ``(code - c) * scale`` for values
(``kvrepro.formats.compressed``), in the rotated space (``ROTATE=False``, a pure byte-bound pass)
or rotated back, ``@ R.T`` (``ROTATE=True``, a float32 matmul per tile), written in the workspace
dtype (bfloat16/float16).
"""
import triton
import triton.language as tl


@triton.jit
def _dequant_tile(pool_ptr, page, t_in, ok, d, rt, CODE_OFF: tl.constexpr, META_OFF: tl.constexpr,
                  BITS: tl.constexpr, SYMMETRIC: tl.constexpr, D: tl.constexpr, ROTATE: tl.constexpr):
    P: tl.constexpr = D * BITS // 8
    MASK: tl.constexpr = (1 << BITS) - 1
    byte = d % P
    shift = (d // P) * BITS
    c = tl.load(pool_ptr + page[:, None] + CODE_OFF + t_in[:, None] * P + byte[None, :],
                mask=ok[:, None], other=0).to(tl.int32)
    code = ((c >> shift[None, :]) & MASK).to(tl.float32)
    if SYMMETRIC:
        m = (pool_ptr + page + META_OFF + t_in * 2).to(tl.pointer_type(tl.float16))
        s = tl.load(m, mask=ok, other=0.0).to(tl.float32)
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
    k = _dequant_tile(pool_ptr, page, t_in, ok, d, rt, 0, K_META_OFF, KBITS, False, D, ROTATE)
    tl.store(k_out_ptr + dst, k.to(k_out_ptr.dtype.element_ty), mask=ok[:, None])
    v = _dequant_tile(pool_ptr, page, t_in, ok, d, rt, V_CODE_OFF, V_META_OFF, VBITS, True, D, ROTATE)
    tl.store(v_out_ptr + dst, v.to(v_out_ptr.dtype.element_ty), mask=ok[:, None])
