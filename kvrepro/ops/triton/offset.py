"""``@triton.jit`` code of the rope-mean key offset's per-step work (``kvrepro.ops.offset``): one launch per layer
for the store (``rope_offset_kernel``: ``key -/+ R(p) b_hat`` in the kept pairs) and one for the decode query's terms
(``rope_terms_kernel``: ``A | B`` of ``RopeMean.packed_terms``), in place of PyTorch's chain of small kernels. The
angle is the exact product ``p theta_i`` in float64, reduced modulo 2 pi in float64 and turned by one float32 cosine
(``_rope_cos``), as the decode kernels turn each key tile, so that store and read use the same rotation to ~1e-7."""
import triton
import triton.language as tl

from kvrepro.ops.triton.attention import _HALF_PI, _rope_cos


@triton.jit
def rope_offset_kernel(x_ptr, out_ptr, pos_ptr, xy_ptr, bias_ptr, freq_ptr, stride_xt, stride_xh, stride_ot,
                       stride_oh, stride_pos, head_dim, SIGN: tl.constexpr, BLOCK_D: tl.constexpr, M: tl.constexpr,
                       OUT_BF16: tl.constexpr):
    """Program (row t, KV head h): ``out[t, h] = x[t, h] + SIGN R(pos[t]) b_hat[h]`` in float32, stored in out's
    dtype. Per slot ``m``: ``(bx cos - by sin, bx sin + by cos)`` added at channels ``xy[h, m]`` / ``xy[h, M + m]``
    (unused slots: bias 0 at channel 0). ``OUT_BF16``: ``out_ptr`` is the int16 view of a bfloat16 tensor, written
    rounded to nearest even by integer arithmetic (``_bf16_bits``)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    dm = d < head_dim
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + d, mask=dm, other=0.0).to(tl.float32)
    m = tl.arange(0, M)
    a = tl.load(pos_ptr + t * stride_pos).to(tl.float64) * tl.load(freq_ptr + h * M + m).to(tl.float64)   # exact product
    c = _rope_cos(a, 0.0)
    s = _rope_cos(a, _HALF_PI)
    bx = tl.load(bias_ptr + (h * M + m) * 2)
    by = tl.load(bias_ptr + (h * M + m) * 2 + 1)
    ox = bx * c - by * s
    oy = bx * s + by * c
    xc = tl.load(xy_ptr + h * 2 * M + m)
    yc = tl.load(xy_ptr + h * 2 * M + M + m)
    delta = tl.sum(tl.where(xc[:, None] == d[None, :], ox[:, None], 0.0)
                   + tl.where(yc[:, None] == d[None, :], oy[:, None], 0.0), axis=0)
    y = x + SIGN * delta
    if OUT_BF16:
        y = _bf16_bits(y)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, y.to(out_ptr.dtype.element_ty), mask=dm)


@triton.jit
def _bf16_bits(y):
    """int16 bit patterns of float32 ``y`` rounded to bfloat16, nearest even (PyTorch's ``.to(torch.bfloat16)``):
    Triton's interpreter truncates a float32-to-bfloat16 cast, which on the CPU would bias every stored key toward
    zero by half a unit in the last place, where the compiled cast rounds; the integer form is the same on both."""
    b = y.to(tl.uint32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return b.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def rope_terms_kernel(q_ptr, out_ptr, xy_ptr, bias_ptr, stride_qt, stride_qh, num_q_heads, group,
                      M: tl.constexpr):
    """Program (row t, query head hq of KV head hq // group): float32 ``A = qx bx + qy by`` and ``B = qy bx - qx by``
    per slot, stored as ``out[t, hq, :M]`` / ``out[t, hq, M:]`` (out contiguous ``[T, Hq, 2 M]``)."""
    t = tl.program_id(0)
    hq = tl.program_id(1)
    h = hq // group
    m = tl.arange(0, M)
    row = q_ptr + t * stride_qt + hq * stride_qh
    qx = tl.load(row + tl.load(xy_ptr + h * 2 * M + m)).to(tl.float32)
    qy = tl.load(row + tl.load(xy_ptr + h * 2 * M + M + m)).to(tl.float32)
    bx = tl.load(bias_ptr + (h * M + m) * 2)
    by = tl.load(bias_ptr + (h * M + m) * 2 + 1)
    dst = out_ptr + (t * num_q_heads + hq) * 2 * M
    tl.store(dst + m, qx * bx + qy * by)
    tl.store(dst + M + m, qy * bx - qx * by)
