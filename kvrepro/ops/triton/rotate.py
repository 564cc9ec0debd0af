"""Small kernels around attention: rotate + prescale the query; merge split-K partials.

Split-K merge (FlashDecoding, Dao et al. 2023): with per-split log2-sum-exp ``lse_s`` and
normalized partial outputs ``o_s``, ``o = sum_s 2**(lse_s - M) o_s / sum_s 2**(lse_s - M)``,
``M = max_s lse_s``; empty splits carry ``lse = -inf`` and weigh exactly 0.
"""
import triton
import triton.language as tl


@triton.jit
def rotate_query_kernel(q_ptr, rot_ptr, out_ptr, stride_qt, stride_qh, mult,
                        HQ: tl.constexpr, D: tl.constexpr):
    """Grid ``(T * HQ,)``: ``out[t, h] = float16((q[t, h] @ R) * mult)``; out is contiguous."""
    pid = tl.program_id(0)
    t = (pid // HQ).to(tl.int64)
    h = pid % HQ
    d = tl.arange(0, D)
    q = tl.load(q_ptr + t * stride_qt + h * stride_qh + d).to(tl.float32)
    rot = tl.load(rot_ptr + d[:, None] * D + d[None, :])
    qr = tl.sum(q[:, None] * rot, axis=0) * mult
    tl.store(out_ptr + pid.to(tl.int64) * D + d, qr.to(tl.float16))


@triton.jit
def merge_splits_kernel(po_ptr, plse_ptr, rot_ptr, out_ptr, stride_ot, stride_oh,
                        HQ: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                        SP: tl.constexpr):
    """Grid ``(T * HQ,)``. ``po`` [T, HQ, S, D] f32 rotated partials, ``plse`` [T, HQ, S] log2.
    Writes ``out[t, h] = merged @ R.T`` (zeros where every split is empty; NaN where a split's
    log-sum-exp is NaN, i.e. a NaN reached that split's softmax)."""
    pid = tl.program_id(0)
    t = (pid // HQ).to(tl.int64)
    h = pid % HQ
    sp = tl.arange(0, SP)
    s_ok = sp < NUM_SPLITS
    base = pid.to(tl.int64) * NUM_SPLITS
    lse = tl.load(plse_ptr + base + sp, mask=s_ok, other=float("-inf"))
    mx = tl.max(lse, axis=0)
    mx_use = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.where(s_ok & (lse > float("-inf")), tl.exp2(lse - mx_use), 0.0)
    wsum = tl.sum(w, axis=0)
    d = tl.arange(0, D)
    po = tl.load(po_ptr + (base + sp)[:, None] * D + d[None, :], mask=(w > 0)[:, None], other=0.0)
    o = tl.sum(po * w[:, None], axis=0) / tl.where(wsum > 0, wsum, 1.0)
    o = tl.where(tl.max((lse != lse).to(tl.int32), axis=0) > 0, float("nan"), o)   # masked lanes are -inf
    rot = tl.load(rot_ptr + d[:, None] * D + d[None, :])           # rot[c, j] = R[c, j]
    out = tl.sum(rot * o[None, :], axis=1)                         # out[c] = sum_j o[j] R[c, j]
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))
