"""Store kernel: rotate, quantize and pack new K/V into compressed pages (``PageLayout``).

Matches ``kvrepro.formats.compressed.quantize_rotated`` (keys asymmetric min/max with float16
scale and zero, or 5-bit symmetric with a float16 scale; values symmetric mid-rise with a float16 scale or a one-byte
log2 scale; round-to-nearest-even conversions), ``round((x - zero) / scale)`` (5-bit keys:
``round(x / scale + 15.5)``) with round-half-even (the 2**23 trick, exact for 0 <= v < 2**22) and correctly rounded
division (``div_rn``).
Only the rotation ``x @ R`` may differ from the reference in the last float32 bit (summation
order), which can move a code by one at an exact tie.
"""
import triton
import triton.language as tl

from kvrepro.ops.triton.scales import log_scale_code, log_scale_value


@triton.jit
def _pack_split_plane(codes, BITS: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr):
    """int32 codes [BLOCK_T, D] (< 2**BITS, BITS in 1, 2, 4, 8) -> split-plane bytes [BLOCK_T, D * BITS / 8] int32."""
    NPL: tl.constexpr = 8 // BITS
    P: tl.constexpr = D // NPL
    planes = tl.reshape(codes, (BLOCK_T, NPL, P))
    sh = tl.arange(0, NPL) * BITS
    return tl.sum(planes << sh[None, :, None], axis=1)  # disjoint bits: sum == or


@triton.jit
def _quant_pack_store(x, page_base, off, keep, pool_ptr, CODE_OFF, META_OFF,
                      BITS: tl.constexpr, SYMMETRIC: tl.constexpr, D: tl.constexpr,
                      BLOCK_T: tl.constexpr, LOG_SCALE: tl.constexpr = False):
    """x: [BLOCK_T, D] float32 rotated rows; page_base/off: [BLOCK_T] int64; keep: [BLOCK_T].
    Asymmetric (keys): meta (scale, zero) float16 x 2; symmetric (values, 5-bit keys): meta scale float16;
    ``LOG_SCALE`` (symmetric): meta one uint8 log2 code."""
    QMAX: tl.constexpr = (1 << BITS) - 1
    lo = tl.min(x, axis=1)
    hi = tl.max(x, axis=1)
    if SYMMETRIC:
        amax = tl.maximum(tl.abs(hi), tl.abs(lo))
        if LOG_SCALE:
            u = log_scale_code(tl.math.div_rn(amax, tl.full([BLOCK_T], QMAX / 2, tl.float32)))
            s = log_scale_value(u)
        else:
            scale16 = tl.math.div_rn(amax, tl.full([BLOCK_T], QMAX / 2, tl.float32)).to(tl.float16)
            s = scale16.to(tl.float32)
        z = -(QMAX / 2) * s
    else:
        scale16 = tl.math.div_rn(hi - lo, tl.full([BLOCK_T], QMAX, tl.float32)).to(tl.float16)
        zero16 = lo.to(tl.float16)
        s = scale16.to(tl.float32)
        z = zero16.to(tl.float32)
    safe = tl.where(s > 0, s, 1.0)
    if BITS == 5:       # 5-bit keys: x / scale + c, as the reference
        v = tl.math.div_rn(x, tl.broadcast_to(safe[:, None], (BLOCK_T, D))) + QMAX / 2
    else:
        v = tl.math.div_rn(x - z[:, None], tl.broadcast_to(safe[:, None], (BLOCK_T, D)))
    v = tl.minimum(tl.maximum(v, 0.0), QMAX * 1.0)
    r = (v + 8388608.0) - 8388608.0  # round half to even, as torch.round
    codes = r.to(tl.int32)
    if BITS == 5:       # high plane (4-bit split-plane, D / 2 bytes), then low plane (1-bit, D / 8 bytes)
        TOK: tl.constexpr = D * 5 // 8
        hi_p = _pack_split_plane(codes >> 1, 4, D, BLOCK_T)
        lo_p = _pack_split_plane(codes & 1, 1, D, BLOCK_T)
        hcols = tl.arange(0, D // 2)
        lcols = tl.arange(0, D // 8)
        row = pool_ptr + page_base[:, None] + CODE_OFF + off[:, None] * TOK
        tl.store(row + hcols[None, :], hi_p.to(tl.uint8), mask=keep[:, None])
        tl.store(row + D // 2 + lcols[None, :], lo_p.to(tl.uint8), mask=keep[:, None])
    else:
        NPL: tl.constexpr = 8 // BITS
        P: tl.constexpr = D // NPL
        packed = _pack_split_plane(codes, BITS, D, BLOCK_T)
        pcols = tl.arange(0, P)
        tl.store(pool_ptr + page_base[:, None] + CODE_OFF + off[:, None] * P + pcols[None, :],
                 packed.to(tl.uint8), mask=keep[:, None])
    if LOG_SCALE:
        tl.store(pool_ptr + page_base + META_OFF + off, u.to(tl.uint8), mask=keep)
    elif SYMMETRIC:
        meta = (pool_ptr + page_base + META_OFF + off * 2).to(tl.pointer_type(tl.float16))
        tl.store(meta, scale16, mask=keep)
    else:
        meta = (pool_ptr + page_base + META_OFF + off * 4).to(tl.pointer_type(tl.float16))
        tl.store(meta, scale16, mask=keep)
        tl.store(meta + 1, zero16, mask=keep)


@triton.jit
def _rows(rows, keep, pm_ptr, inv_sqrt_d, D: tl.constexpr, BLOCK_T: tl.constexpr, ROTATE: tl.constexpr,
          CHUNK: tl.constexpr):
    """float32 ``[BLOCK_T, D]``: the rows at ``rows`` (pointers ``[BLOCK_T, 1]``), times ``pm * inv_sqrt_d`` if
    ``ROTATE`` (see :func:`store_kv_kernel`); rows not in ``keep`` are zero."""
    d = tl.arange(0, D)
    if ROTATE:
        x = tl.zeros([BLOCK_T, D], dtype=tl.float32)
        for c in tl.static_range(0, D, CHUNK):
            dc = c + tl.arange(0, CHUNK)
            x = tl.dot(tl.load(rows + dc[None, :], mask=keep[:, None], other=0.0).to(tl.float32),
                       tl.load(pm_ptr + dc[:, None] * D + d[None, :]), x, input_precision="tf32")
        return x * inv_sqrt_d
    else:
        return tl.load(rows + d[None, :], mask=keep[:, None], other=0.0).to(tl.float32)


@triton.jit
def store_kv_kernel(key_ptr, value_ptr, pool_ptr, slot_ptr, pm_ptr, inv_sqrt_d, num_tokens,
                    stride_kt, stride_kh, stride_vt, stride_vh,
                    NUM_KV_HEADS: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                    PAGE_BYTES: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
                    V_CODE_OFF: tl.constexpr, K_META_OFF: tl.constexpr, V_META_OFF: tl.constexpr,
                    KSYM: tl.constexpr, VLOG: tl.constexpr,
                    BLOCK_T: tl.constexpr, ROTATE: tl.constexpr, CHUNK: tl.constexpr = 32):
    """Grid ``(cdiv(num_tokens, BLOCK_T), NUM_KV_HEADS)``. K/V last dim contiguous.

    ``ROTATE``: rotate here by ``R = diag(s) H / sqrt(D)`` as ``(x @ pm) * inv_sqrt_d``, ``pm = diag(s) H`` the float32
    +-1 matrix ``[D, D]``: TF32 tensor-core products are exact here (bfloat16 / float16 inputs have at most TF32's 10
    mantissa bits, and +-1 none), so only the float32 sums round; ``pm`` streams from L2 in ``[CHUNK, D]`` slices, so
    no operand is held whole in registers and nothing spills. Else K/V arrive already rotated (float32) and ``pm`` /
    ``inv_sqrt_d`` are unused. ``KSYM`` / ``VLOG``: the layout's ``key_symmetric`` / ``value_log_scale``."""
    pid_t = tl.program_id(0)
    h = tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = t < num_tokens
    slot = tl.load(slot_ptr + t, mask=in_range, other=-1).to(tl.int64)
    keep = slot >= 0
    slot = tl.where(keep, slot, 0)
    blk = slot // BS
    off = slot % BS
    page_base = (blk * NUM_KV_HEADS + h) * PAGE_BYTES
    t64 = t.to(tl.int64)
    k_rows = key_ptr + t64[:, None] * stride_kt + h * stride_kh
    v_rows = value_ptr + t64[:, None] * stride_vt + h * stride_vh
    xk = _rows(k_rows, keep, pm_ptr, inv_sqrt_d, D, BLOCK_T, ROTATE, CHUNK)
    _quant_pack_store(xk, page_base, off, keep, pool_ptr, 0, K_META_OFF, KBITS, KSYM, D, BLOCK_T)
    xv = _rows(v_rows, keep, pm_ptr, inv_sqrt_d, D, BLOCK_T, ROTATE, CHUNK)
    _quant_pack_store(xv, page_base, off, keep, pool_ptr, V_CODE_OFF, V_META_OFF, VBITS, True, D,
                      BLOCK_T, VLOG)
