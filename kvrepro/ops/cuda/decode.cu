// kvrepro's CUDA decode attention over k4v4, k8v4, k4v2 and k5v4 pages (split-K, hand-written for sm_80+, tuned on
// sm_90): one body, decode_step<KB, VB>, instantiated as kvrepro_decode_k4v4, kvrepro_decode_k8v4 (8-bit keys),
// kvrepro_decode_k4v2 (2-bit values) and kvrepro_decode_k5v4 (5-bit symmetric keys, uint8 log2 value scales); the pages
// below are k4v4's, k8v4 differs in its key region (128 bytes per token, byte j = channel j), k4v2 in its value region
// (32 bytes per token, byte j = channels j, j + 32, j + 64, j + 96 in bits 0-1, 2-3, 4-5, 6-7), k5v4 in its key region
// (80 bytes per token: k4v4's 64 bytes of the high plane code >> 1, then 16 bytes of the low plane code & 1, byte j bit
// i = channel j + 16 i) and its metadata (K: float16 scale, k = (code - 15.5) scale; V: uint8 u, scale 2^((u - 128) /
// 8)), all four in their offsets (page_layout.h, generated from kvrepro.formats.layout).
//
// Built into decode.fatbin by `python -m kvrepro.ops.cuda_build` (flags in decode.json) and run by
// kvrepro.ops.decode_attention(impl="cuda"), its default for these presets / head_dim 128 / block 16 / GQA group <= 8
// on CUDA devices of compute capability >= 8.0. Verified against float64 attention on the H200 (sm_90) only
// (tests/test_ops_cuda_decode.py, every preset).
//
// Same page format, query preparation and split-K workspace as the Triton path (impl="triton", int8 keys),
// but one launch does all three steps that the Triton path launches separately (rotate_query_kernel, attention,
// merge_splits_kernel):
//   query    [B, HQ, D] bfloat16 / float16 (flag bit 0), strides (stride_qb, stride_qh, 1), unrotated; each CTA
//            rotates its GQA group's rows itself: q @ R = H (s * q) / sqrt(D) (kvrepro.formats.hadamard: R =
//            diag(s) H / sqrt(D), H Sylvester) by a fast Walsh-Hadamard transform in registers, times
//            softmax_scale * log2(e) (qmul includes 1 / sqrt(D)), rounded to float16 as rotate_query_kernel does
//   signs    [D] float32 +-1: s (the caller checks that the rotation has this form, kvrepro.ops.cuda_decode)
//   pool     [num_blocks, HKV, PAGE] uint8, pages of 16 tokens, head_dim 128 (kvrepro.formats.layout; k4v4:
//            PAGE 2144, K codes [16][64] at 0, V codes [16][64] at 1024, K meta [16][scale, zero] f16 at 2048,
//            V meta [16] f16 at 2112; byte j of a token = channel j (low nibble) and j + 64 (high nibble))
//   part_o   [B, HQ, S, D] float32 normalized partial outputs (rotated space), part_lse [B, HQ, S] (log2)
//   out      [B, HQ, D] bfloat16 / float16 (flag bit 1), strides (stride_ob, stride_oh, 1)
//   counters [B, HKV] uint32, zero before the launch and left zero after it: the CTAs of one (sequence, KV head)
//            count themselves in (one acquire-release atomic each); the last one resets the counter, merges the S
//            partials (log-sum-exp, as merge_splits_kernel) and rotates the result back, out = s * (H o) / sqrt(D).
//
// Differences from the Triton kernel (notes/kernels.md, "Decode: the CUDA kernel"):
//  - grid (B, S x HKV), blockIdx.y = split x HKV + kvh (split-major); split boundaries weighted by the CTA's round of
//    placement on the SMs (split_weight_prefix; rank_div = SM count, rank_skew per 1024, 0 = equal splits);
//  - one CTA = (sequence, KV head, split) with 4 warps; each warp walks its own pages (page p of the split goes to
//    warp p % 4) with a private STAGES-deep cp.async ring, so the loop has no __syncthreads; the 4 partial softmax
//    states are merged in shared memory at the end;
//  - MMA orientation "tokens x heads": S^T = K Q^T with mma.m16n8k32.s8 (16 tokens of a page as M, up to 8 query
//    heads of the GQA group as N), O^T += V^T P^T with mma.m16n8k16.f16 (16 channels as M, heads as N), so the
//    padding is heads 4..7 of N (GQA 4) instead of 12 of 16 M rows;
//  - key codes: ldmatrix.x4 straight into A fragments, int8 planes 16 (code - 8) by shl + 2 lop3 per 4 bytes;
//  - value codes: ldmatrix.x4.trans gives each lane two consecutive tokens of two adjacent byte-channels, which the
//    fp16 magic number (0x6400 | nibble) turns into A fragments with 1 shift, 4 lop3 and 4 sub.f16x2 per 4 bytes
//    (2-bit values, k4v2: one ldmatrix.x4.trans per page, then per 2-bit plane p a lop3 with mask 3 << 2p and a
//    sub.f16x2 of 1024 + 2 x 4^p give 4^p (code - 2), exact);
//  - P^T fragments from the S^T accumulators with movmatrix.trans (no shared memory);
//  - P.V summed by the tensor cores over FLUSH pages, then added to float32 registers (tensor-core accumulation
//    truncates over long loops); rescaling only when a logit passes its head's reference (max + SLACK; warp
//    vote on each lane's own maxima, the max reduction only then);
//  - two pages per loop step of a warp (PageFmt::STEP; k8v4 one): one vote per 32 tokens, two pages' independent key
//    MMAs in flight, both pages copied in one commit group; the token mask only in a warp's last step (4-bit keys);
//    2^x by ex2.approx.ftz.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "page_layout.h"  // D, BS and PageLayout<KB, VB> (PAGE, V_OFF, KM_OFF, VM_OFF) from kvrepro.formats.layout

namespace {

using kvrepro_page::BS;
using kvrepro_page::D;
using kvrepro_page::PageLayout;
// A preset's page layout and how the kernel walks it. KSTAGES: ring depth (k8v4's 3-deep ring keeps the CTA under
// 48 KB of static shared memory, 4 CTAs per SM; k4v2 keeps 6 pages per warp, chosen when an earlier split merge
// needed them for its buffers; the merge now needs ~17 KB, a 4-deep k4v2 ring was not timed). Deeper rings
// (KVREPRO_STAGES_K8V4=4, KVREPRO_STAGES_K4V2=7 or 8: dynamic shared memory, Ring) were no faster on the H200 beyond
// run-to-run noise. A depth must be a multiple of the preset's STEP (2 for k4v4 and k4v2: 7 for k4v2 or 5 for k4v4
// do not build).
template <int KB, int VB> struct PageFmt;
#ifndef KVREPRO_STAGES
#define KVREPRO_STAGES 4
#endif
#ifndef KVREPRO_STAGES_K8V4
#define KVREPRO_STAGES_K8V4 3
#endif
#ifndef KVREPRO_STAGES_K4V2
#define KVREPRO_STAGES_K4V2 6
#endif
#ifndef KVREPRO_STAGES_K5V4
#define KVREPRO_STAGES_K5V4 KVREPRO_STAGES
#endif
// STEP: pages per loop step of a warp, at most KSTAGES - 1, dividing KSTAGES and 32 (one commit group per step; the
// block-table window of 32 pages reloads at step starts) (two: one softmax max reduction per 32 tokens; k8v4 keeps
// one, its 3-deep ring would hold a single page beyond the pair and it spills 8 bytes on sm_80-89 with two).
#ifndef KVREPRO_STEP_K4V4
#define KVREPRO_STEP_K4V4 2
#endif
#ifndef KVREPRO_STEP_K8V4
#define KVREPRO_STEP_K8V4 1
#endif
#ifndef KVREPRO_STEP_K4V2
#define KVREPRO_STEP_K4V2 2
#endif
#ifndef KVREPRO_STEP_K5V4
#define KVREPRO_STEP_K5V4 1
#endif
// ROPE_STEP: STEP of the *_rope kernels: two pages per step for k4v4, k4v2 and k5v4 (the second page then takes no
// sine or cosine, ROPE_NEXT; faster at batches 3-13 on the H200 although these kernels spill at the 128-register cap),
// one for k8v4 as its kernel without the correction.
#ifndef KVREPRO_ROPE_STEP_K4V4
#define KVREPRO_ROPE_STEP_K4V4 2
#endif
#ifndef KVREPRO_ROPE_STEP_K4V2
#define KVREPRO_ROPE_STEP_K4V2 2
#endif
#ifndef KVREPRO_ROPE_STEP_K5V4
#define KVREPRO_ROPE_STEP_K5V4 2
#endif
template <> struct PageFmt<4, 4> : PageLayout<4, 4> {
  static constexpr int KSTAGES = KVREPRO_STAGES, STEP = KVREPRO_STEP_K4V4, ROPE_STEP = KVREPRO_ROPE_STEP_K4V4;
};
template <> struct PageFmt<8, 4> : PageLayout<8, 4> {
  static constexpr int KSTAGES = KVREPRO_STAGES_K8V4, STEP = KVREPRO_STEP_K8V4, ROPE_STEP = KVREPRO_STEP_K8V4;
};
template <> struct PageFmt<4, 2> : PageLayout<4, 2> {
  static constexpr int KSTAGES = KVREPRO_STAGES_K4V2, STEP = KVREPRO_STEP_K4V2, ROPE_STEP = KVREPRO_ROPE_STEP_K4V2;
};
// k5v4: k4v4's walk; its key region keeps the page's 80-byte token rows in shared memory, unswizzled (copy_page)
template <> struct PageFmt<5, 4> : PageLayout<5, 4> {
  static constexpr int KSTAGES = KVREPRO_STAGES_K5V4, STEP = KVREPRO_STEP_K5V4, ROPE_STEP = KVREPRO_ROPE_STEP_K5V4;
};
constexpr int WARPS = 4;
// The CTA's ring: WARPS x KSTAGES pages. Past 44 KB it goes to dynamic shared memory (the launch asks for BYTES and the
// loader raises the kernel's limit, cuFuncSetAttribute): static shared memory stops at 48 KB and the rest of the CTA's
// buffers take ~2.7 KB.
template <int KB, int VB> struct Ring {
  static constexpr int BYTES = WARPS * PageFmt<KB, VB>::KSTAGES * PageFmt<KB, VB>::PAGE;
  static constexpr bool DYNAMIC = BYTES > 44 * 1024;
};
#ifndef KVREPRO_MERGE_PRE  // partial rows per head the merge loads together with the lse values (more: a loop)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#define KVREPRO_MERGE_PRE 16  // sm_80-89: 24 made ptxas spill 32 bytes in k4v4's last (masked) step on sm_80
#else
#define KVREPRO_MERGE_PRE 24  // the split count of batch 3 on 132 SMs (22) in one round trip
#endif
#endif
#ifndef KVREPRO_BT_REGS
#define KVREPRO_BT_REGS 1  // block ids held in a register per lane, 32 pages per load (0: one load per page)
#endif
#ifdef KVREPRO_TRACE  // diagnostic builds only (benchmarks/decode_splits.py --trace): %globaltimer stamps per CTA
#define TRACE(k, v) if (threadIdx.x == 0) kvrepro_trace[blockIdx.y * gridDim.x + blockIdx.x][k] = (v)
#else
#define TRACE(k, v)
#endif
constexpr int FLUSH = 16;        // pages summed by the tensor cores before the float32 add
// Online-softmax reference slack (log2 units): the exponent reference of a head is its largest logit so far + SLACK,
// set anew only when a logit passes it, so most steps skip the rescale of the float32 sums. This is the conditional
// rescaling of FlashAttention-4 (Dao-AILab/flash-attention, 2025; described in Modal's blog post "We
// reverse-engineered Flash Attention 4", September 2025), which rescales only when the max has moved enough to matter
// and lets weights grow past 1; here the reference moves up by the slack instead, so every weight stays <= 1 and the float16 P^T fragments cannot
// overflow (the largest weight of a head is >= 2^-SLACK: one bit of float16 range).
constexpr float SLACK = 1.0f;
constexpr int MERGE_PRE = KVREPRO_MERGE_PRE;
constexpr int MERGE_MAX = 4096;  // num_splits x group the merge's weights hold (in the ring's shared memory)

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// "memory" clobbers: no shared-memory access may move across the copies, the waits or the ldmatrix reads. L2::128B:
// the L2 fetches the whole 128-byte line of each 16-byte request (a page's runs are whole lines): 1.0-1.3% faster at
// batch 3 on the H200 (L2::256B gained less, an evict_first cache policy lost 1.5-5%)
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// Shared-memory swizzle of the code regions: 16-byte chunk j of token row t (64 B per row) is stored at chunk
// j ^ ((t >> 1) & 3) of its row, so the 8 rows an ldmatrix phase reads spread over all 32 banks (rows t and t + 2
// of a 64-byte-row tile share banks otherwise: 4-way conflicts). Chunks 128.. (the metadata) are not moved.
__device__ __forceinline__ int swz_row_chunk(int t, int j) { return t * 4 + (j ^ ((t >> 1) & 3)); }
// k8v4's key region has 128-byte rows: chunk j of row t at j ^ (t & 7), so the 8 rows of a phase hit 8 bank groups
__device__ __forceinline__ int swz_row_chunk8(int t, int j) { return t * 8 + (j ^ (t & 7)); }
// k4v2's value region has 32-byte rows (4 per 128 bytes): chunk c = 2 t + j of row t at c ^ ((t >> 2) & 3), the
// 64-byte-row pattern applied to the run's chunk index (c ^ ((c >> 3) & 3)), so one lane base copies every region
// (issue()); the 8 rows of a phase (same j) hit 8 bank groups (rows t and t + 4 would share banks otherwise)
__device__ __forceinline__ int swz_row_chunk2(int t, int j) { return (t * 2 + j) ^ ((t >> 2) & 3); }

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr) : "memory");
}
// two 8x8 b16 matrices (lanes 0-15 give the row addresses)
__device__ __forceinline__ void ldsm_x2(uint32_t addr, uint32_t& r0, uint32_t& r1) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(addr) : "memory");
}
__device__ __forceinline__ void ldsm_x4_t(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(addr) : "memory");
}
__device__ __forceinline__ uint32_t movm_t(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}
// D (int32) += A (16x32 s8) * B (32x8 s8)
__device__ __forceinline__ void imma(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                     uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// D (f32) += A (16x16 f16) * B (16x8 f16)
__device__ __forceinline__ void hmma(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                     uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t lop3_and_or(uint32_t x, uint32_t mask, uint32_t orv) {
  uint32_t y;  // (x & mask) | orv
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(y) : "r"(x), "r"(mask), "r"(orv));
  return y;
}
__device__ __forceinline__ uint32_t lop3_and_xor(uint32_t x, uint32_t mask, uint32_t xv) {
  uint32_t y;  // (x & mask) ^ xv
  asm("lop3.b32 %0, %1, %2, %3, 0x6A;\n" : "=r"(y) : "r"(x), "r"(mask), "r"(xv));
  return y;
}
__device__ __forceinline__ uint32_t hsub2(uint32_t x, uint32_t y) {
  uint32_t z;
  asm("sub.f16x2 %0, %1, %2;\n" : "=r"(z) : "r"(x), "r"(y));
  return z;
}
// 2^x for the softmax: ex2.approx.ftz.f32, one MUFU.EX2 (exp2f compiles to ex2.approx.f32, which keeps subnormal
// results at the price of a range check and two multiplies around it on sm_90). Results below 2^-126 flush to 0, far
// below what a float16 P^T fragment holds (2^-24); the logits' sums l differ from exp2f's by at most such a flushed
// term per token. 1-2% faster for k4v2 on the H200.
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// ---- key offset rope-mean (the *_rope entry points; kvrepro.formats.offset.RopeMean): the pages hold k_j - R(j) b_hat
// and each paged key's logit gets c_j = sum_i A_i cos(j theta_i) + B_i sin(j theta_i) back, i over the RPAIRS = 8 kept
// pairs of the KV head (A, B per query head from the caller, times softmax_scale x log2 e as the Triton path's
// rb_scale). Angle addition, as the Triton kernel: a page's keys are j = n0 + t, t < 16, so c_j = sum_i A'_i cos(t
// theta_i) + B'_i sin(t theta_i) with (A', B') the coefficients turned by n0 theta_i (A' = A cos + B sin, B' = B cos -
// A sin of n0 theta_i). c of one page is then the GEMM C[16 tokens][8 heads] = CS[16][16] AB'[16][8] of the fixed
// table of cos / sin(t theta_i) (computed once per CTA; k = i: cos of pair i, k = 8 + i: sin) with the turned
// coefficients, whose accumulator fragment is the key logits' own (rows g, g + 8, heads 2 tq, 2 tq + 1), so one
// float16 mma.m16n8k16 per operand part adds it. Lane (g, tq) holds the B fragment of head g, pairs 2 tq and 2 tq + 1,
// so a page costs it two angles (the angle of every key would be 4). Float32 accuracy from float16 operands by a
// three-product split (x = hi + lo, both float16 round-to-nearest: |x - hi - lo| <= 2^-22 |x| while x - hi is a normal
// float16; hi hi + hi lo + lo hi, the lo lo term ~2^-22 of the product, as CUTLASS's 3xTF32 GEMMs do with TF32), the
// coefficients first scaled by a power of two (rope_setup) into float16's range: the CTA's largest to [2^12, 2^13).
constexpr int RPAIRS = 8;  // kvrepro.formats.offset.MAX_PAIRS
// x, y -> float16 hi = (x, y) rounded to nearest and lo = (x - hi, y - hi) rounded so, as half2 words (x low)
__device__ __forceinline__ void split_f16x2(float x, float y, uint32_t& hi, uint32_t& lo) {
  hi = pack_f16x2(x, y);
  const float2 h = __half22float2(*reinterpret_cast<const __half2*>(&hi));
  lo = pack_f16x2(x - h.x, y - h.y);  // exact float32 differences
}
// sin and cos of the exact angle a + lo = j theta >= 0 (a = the float32 product, lo its rounding error, both from
// rope_add and rope_setup): a - k pi / 2 by three FMAs (Cody-Waite: pi / 2 = 1.5703125 + C2 + C3, the first with 8
// significant bits, so that a - k 1.5703125 is exact for every a below 2^20, i.e. positions up to ~1M at theta 1;
// tests/cuda_emulation.py checks it), plus lo, then the hardware's sine and cosine (__sinf / __cosf: MUFU; absolute
// error <= 2^-21.41 / 2^-21.19 on [-pi, pi], CUDA C++ Programming Guide, intrinsic functions; the remainder is in
// [-pi / 4, pi / 4]) and the quadrant k mod 4. Absolute error ~5e-7 at any angle below 2^20 rad (the Cephes
// polynomials it replaced were twice as accurate and slower on the H200: the commit that replaced them has the times).
__device__ __forceinline__ void rope_sincos(float a, float lo, float& s, float& c) {
  const float k = rintf(a * 0.636619772367581343f);
  float r = fmaf(-k, 1.5703125f, a);
  r = fmaf(-k, 4.838267923332751e-4f, r);
  r = fmaf(-k, 2.5632829192545614e-12f, r) + lo;
  const int q = (int)k;
  const float ps = __sinf(r), pc = __cosf(r);
  const float sn = (q & 1) ? pc : ps, cs = (q & 1) ? ps : pc;  // sin / cos (r + q pi / 2)
  s = (q & 2) ? -sn : sn;
  c = ((q + 1) & 2) ? -cs : cs;
}
// What warp 0 puts in shared memory for every warp of the CTA (rope_sm, uint4 units), lane (g, tq) at + lane:
// [0, 32): the table's float16 hi A fragments (a0, a1, a2, a3) = (cos, cos, sin, sin) of t theta for t = g, g + 8,
//   g, g + 8, each word pairs 2 tq and 2 tq + 1; the angle t theta is the exact product (float32 rounding plus its
//   error, one FMA), as RopeMean.angles;
// [32, 64): the same fragments' lo parts;
// [64, 96): float4 (A, B of pair 2 tq, A, B of pair 2 tq + 1) x rope_scale x the CTA's power-of-two scale, head g
//   (0 past the group);
// [96, 112): float2 frequencies of pairs 2 tq, 2 tq + 1;
// [112]: float 1 / the power-of-two scale (x);
// [113, 145), two-page kernels only: [64, 96) turned by ROPE_NEXT theta (as rope_add turns them), lane at + lane.
// terms row of head h: rope_terms + (b Hq + kvh group + h) 2 RPAIRS (A_0..7, B_0..7).
// Written by rope_setup (below the namespace), read by rope_add.
constexpr int ROPE_SM_UINT4 = 113, ROPE_SM_UINT4_TWO = 145;
// A warp's pages are p0 + warp + 4 i, so the second page of a two-page step starts ROPE_NEXT positions after the
// first: its coefficients turned by n0 theta are the ones at 113 turned by the first page's n0 theta (rotations
// compose), and it takes no sine or cosine of its own (the hardware's MUFU unit was a large part of the correction's
// cost on the H200; the commit that added this has the times). The turn by ROPE_NEXT theta (rope_sincos, as any page's)
// adds its sine and cosine's error (~5e-7 absolute) and one float32 rounding to the second page's coefficients.
// Turning each step's first page from the last one's instead of taking its exact angle ran no faster (more spills);
// sincosf here instead of rope_sincos cost the kernels 4-12 more bytes of spills.
constexpr int ROPE_NEXT = WARPS * BS;
// Lane (g, tq)'s sin / cos of n0 theta for pairs 2 tq, 2 tq + 1 (the exact product, as rope_setup's angles), n0 = pos0
// a page's first position: (sin, cos of pair 2 tq, sin, cos of pair 2 tq + 1).
__device__ __forceinline__ float4 rope_angles(int pos0, const uint4* rope_sm, int lane) {
  const float n0 = (float)pos0;
  const float2 fr = reinterpret_cast<const float2*>(rope_sm + 96)[lane];
  float4 r;
  const float a0 = __fmul_rn(n0, fr.x), a1 = __fmul_rn(n0, fr.y);
  rope_sincos(a0, __fmaf_rn(n0, fr.x, -a0), r.x, r.y);
  rope_sincos(a1, __fmaf_rn(n0, fr.y, -a1), r.z, r.w);
  return r;
}
// c[0..3] (tokens n0 + g, n0 + g + 8; MMA columns 2 tq, 2 tq + 1) of a page: lane (g, tq) turns the coefficients
// of column g, pairs 2 tq, 2 tq + 1 (ab) by the angles of rope_angles, splits them into float16 hi / lo and multiplies
// the table: the small products first, then the large one. Both pairs in one m16n8k16: the two-page k4v4 / k4v2 rope
// kernels then spill up to 92 B at the 128-register cap, and still ran faster on the H200 than a rolled loop over the
// pairs (m16n8k8) that spilled nothing. Column n of c depends on column n of the coefficients only.
__device__ __forceinline__ void rope_c(float (&c)[4], float4 ang, float4 ab, const uint4* rope_sm, int lane) {
  const float sn0 = ang.x, cs0 = ang.y, sn1 = ang.z, cs1 = ang.w;  // rope_angles' order
  uint32_t bh0, bl0, bh1, bl1;  // b0: A' of pairs 2 tq, 2 tq + 1 (k = 2 tq, + 1); b1: B' (k = 8 + 2 tq, + 1)
  split_f16x2(__fmaf_rn(ab.x, cs0, __fmul_rn(ab.y, sn0)), __fmaf_rn(ab.z, cs1, __fmul_rn(ab.w, sn1)), bh0, bl0);
  split_f16x2(__fmaf_rn(ab.y, cs0, -__fmul_rn(ab.x, sn0)), __fmaf_rn(ab.w, cs1, -__fmul_rn(ab.z, sn1)), bh1, bl1);
  const uint4 th = rope_sm[lane], tl = rope_sm[32 + lane];
#pragma unroll
  for (int e = 0; e < 4; ++e) c[e] = 0.f;
  hmma(c, th.x, th.y, th.z, th.w, bl0, bl1);
  hmma(c, tl.x, tl.y, tl.z, tl.w, bh0, bh1);
  hmma(c, th.x, th.y, th.z, th.w, bh0, bh1);
}
// s[0..3] (tokens n0 + g, n0 + g + 8; heads 2 tq, 2 tq + 1) += c of those keys, column g of the coefficients head g's
// (ab: rope_sm + 64, or + 113 for the second page of a two-page step, whose angles are then the first page's).
__device__ __forceinline__ void rope_add(float (&s)[4], float4 ang, float4 ab, const uint4* rope_sm, int lane) {
  float c[4];
  rope_c(c, ang, ab, rope_sm, lane);
  const float inv = reinterpret_cast<const float*>(rope_sm + 112)[0];
#pragma unroll
  for (int e = 0; e < 4; ++e) s[e] = __fmaf_rn(c[e], inv, s[e]);
}
// Both pages of a two-page step in one rope_c, for GQA groups of at most 4 heads (the MMA's columns 4-7 would otherwise
// hold padding heads): columns 0-3 take the first page's coefficients of heads 0-3 (rope_sm + 64), columns 4-7 the
// second page's (rope_sm + 113, lanes g - 4), both turned by the first page's angles (pos0: its first position). The
// products are those rope_add makes page by page (the same operands in every column), at half the MMAs, splits and
// turns. They depend on positions only, not on the pages' bytes: the step takes them before it waits for its pages.
__device__ __forceinline__ void rope_pair_c(float (&c)[4], int pos0, const uint4* rope_sm, int lane) {
  const int g = lane >> 2;
  rope_c(c, rope_angles(pos0, rope_sm, lane), reinterpret_cast<const float4*>(rope_sm + (g < 4 ? 64 : 113 - 16))[lane],
         rope_sm, lane);
}
// s0 += the first page's c (lanes tq = 0, 1: heads 2 tq, 2 tq + 1), s1 += the second page's (from lane + 2, tq + 2):
// the same bits as rope_add on each page. Padding heads (lanes tq = 2, 3) get nothing, as rope_add gives them 0.
__device__ __forceinline__ void rope_pair_add(float (&s0)[4], float (&s1)[4], const float (&c)[4],
                                              const uint4* rope_sm, int lane) {
  const float inv = reinterpret_cast<const float*>(rope_sm + 112)[0];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const float c1 = __shfl_down_sync(0xffffffffu, c[e], 2);
    if ((lane & 3) < 2) {
      s0[e] = __fmaf_rn(c[e], inv, s0[e]);
      s1[e] = __fmaf_rn(c1, inv, s1[e]);
    }
  }
}

// In-place unnormalized Walsh-Hadamard transform (Sylvester order) of 128 values held 4 per lane, lane l holding
// elements 4 l .. 4 l + 3: strides 1 and 2 in registers, strides 4 .. 64 with lanes l ^ 1 .. l ^ 16.
__device__ __forceinline__ void fwht_warp(float (&x)[4], int lane) {
  const float a0 = x[0] + x[1], a1 = x[0] - x[1], a2 = x[2] + x[3], a3 = x[2] - x[3];
  x[0] = a0 + a2; x[1] = a1 + a3; x[2] = a0 - a2; x[3] = a1 - a3;
#pragma unroll
  for (int m = 1; m < 32; m <<= 1) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float o = __shfl_xor_sync(0xffffffffu, x[i], m);
      x[i] = (lane & m) ? o - x[i] : x[i] + o;
    }
  }
}

#ifdef KVREPRO_TRACE
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned sm_id() {
  unsigned r;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(r));
  return r;
}
#endif

__device__ __forceinline__ float load_act(const void* p, int64_t i, bool bf16) {
  return bf16 ? __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(p)[i])
              : __half2float(reinterpret_cast<const __half*>(p)[i]);
}

// The split partition (kvrepro.ops.cuda_decode.split_pages is its Python twin): split s of a (sequence, KV head)
// weighs 1024 - rank_skew * rank(s), where rank(s) = min(L / rank_div, 3) and L = s P + c is the CTA's linear block
// index (P = batch x KV heads, c = kvh x batch + b): the round in which the block scheduler places it on an SM, if CTAs
// go out in linear order, rank_div = the SM count apart (on the H200 this held for 116 of 132 SMs; the other ~9% of
// CTAs get another round's weight). The warp schedulers favour the older CTAs of an SM, so later rounds stream slower
// (about 5% per round on the H200); lighter splits there end closer to the rest. The cut depends on
// the row b and the SM count, never on timing: same inputs, batch layout and GPU give the same bits. Returns W(s) = sum
// over s' < s of the weights (closed form: rank is non-decreasing in s'); split s holds pages [pages W(s) / W(S),
// pages W(s + 1) / W(S)) (integer division), whole pages, in order. rank_skew 0: equal splits; the caller keeps
// rank_skew in 0..255 and 1 <= rank_div <= 65535 (kvrepro.ops.cuda_decode.rank_args: the SM count), so every weight
// stays positive and every term here fits in 32 bits (W <= 1024 x num_splits <= 2^22; j rank_div + P < 2^31 for any
// batch x KV heads below 2^30). The page cut pages x W(s) / W(S) is taken in double precision: the product is exact
// (< 2^53) and the floor of the correctly rounded quotient equals the integer floor whenever pages x W(S) < 2^53 (a
// quotient k + 1 - q >= 1 / W(S) below an integer cannot round up to it), which holds for every seq_len <= 2^31 - 16
// (the kernel's int page count (seq_len + 15) / 16 and p1 x 16 overflow above that). 32-bit and double arithmetic
// instead of eleven 64-bit integer divisions: ~0.5 us less before the first page is requested.
__device__ __forceinline__ unsigned split_weight_prefix(int s, int c, int P, int rank_div, int rank_skew) {
  unsigned w = 1024u * (unsigned)s;
  for (int j = 1; j <= 3; ++j) {  // splits s' < s of rank >= j: s' P + c >= j rank_div (the numerator is >= P - c > 0)
    const int first = (int)(((unsigned)(j * rank_div) + (unsigned)(P - 1 - c)) / (unsigned)P);
    w -= (unsigned)rank_skew * (unsigned)max(0, s - first);
  }
  return w;
}

}  // namespace

// rope_setup: fills rope_sm as laid out at ROPE_SM_UINT4. Not inlined: its registers then stay out of the kernel
// body's allocation (inlined, k5v4_rope spilled 76 bytes on sm_90). In a named namespace: in the anonymous one its name would be hashed from
// the source path, and the fatbin would depend on where it was built.
namespace kvrepro_rope {
__device__ __noinline__ void rope_setup(uint4* rope_sm, const float* __restrict__ rope_terms,
                                           const float* __restrict__ rope_freq, float rope_scale, int b, int hq,
                                           int kvh, int group, int g, int tq, int lane, int np) {
  const float f0 = rope_freq[kvh * RPAIRS + 2 * tq], f1 = rope_freq[kvh * RPAIRS + 2 * tq + 1];
  float sn[4], cs[4];  // [2 r + j]: token g + 8 r, pair 2 tq + j
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float t = (float)(g + 8 * r);
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float fr = j ? f1 : f0, a = __fmul_rn(t, fr);
      rope_sincos(a, __fmaf_rn(t, fr, -a), sn[2 * r + j], cs[2 * r + j]);
    }
  }
  uint32_t hi[4], lo[4];
  split_f16x2(cs[0], cs[1], hi[0], lo[0]);
  split_f16x2(cs[2], cs[3], hi[1], lo[1]);
  split_f16x2(sn[0], sn[1], hi[2], lo[2]);
  split_f16x2(sn[2], sn[3], hi[3], lo[3]);
  rope_sm[lane] = make_uint4(hi[0], hi[1], hi[2], hi[3]);
  rope_sm[32 + lane] = make_uint4(lo[0], lo[1], lo[2], lo[3]);
  const float* row = rope_terms + ((int64_t)b * hq + kvh * group + g) * (2 * RPAIRS);
  const bool in = g < group;
  const float A0 = in ? row[2 * tq] * rope_scale : 0.f, B0 = in ? row[RPAIRS + 2 * tq] * rope_scale : 0.f;
  const float A1 = in ? row[2 * tq + 1] * rope_scale : 0.f, B1 = in ? row[RPAIRS + 2 * tq + 1] * rope_scale : 0.f;
  // the power-of-two scale: the largest |A|, |B| of the CTA to [2^12, 2^13), so a turned coefficient (<= sqrt 2 of
  // it) stays below float16's 65504 and the split keeps 22 bits of each down to 2^-10 of the largest; exponent
  // clamped so that the scale and its inverse are normal floats (0 coefficients: any scale)
  float m = fmaxf(fmaxf(fabsf(A0), fabsf(B0)), fmaxf(fabsf(A1), fabsf(B1)));
  for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  const int e = min(max((int)((__float_as_uint(m) >> 23) & 255u) - 127, -110), 127);
  const float sc = __uint_as_float((uint32_t)(127 + 12 - e) << 23);
  reinterpret_cast<float4*>(rope_sm + 64)[lane] = make_float4(A0 * sc, B0 * sc, A1 * sc, B1 * sc);
  if (np == 2) {  // the coefficients turned by ROPE_NEXT theta (rope_add's turn; the norm of each (A, B) pair is kept)
    float s0, c0, s1, c1;  // ROPE_NEXT: a power of two, its product with a float32 frequency is exact
    rope_sincos((float)ROPE_NEXT * f0, 0.f, s0, c0);
    rope_sincos((float)ROPE_NEXT * f1, 0.f, s1, c1);
    const float a0s = A0 * sc, b0s = B0 * sc, a1s = A1 * sc, b1s = B1 * sc;
    reinterpret_cast<float4*>(rope_sm + 113)[lane] =
        make_float4(__fmaf_rn(a0s, c0, __fmul_rn(b0s, s0)), __fmaf_rn(b0s, c0, -__fmul_rn(a0s, s0)),
                    __fmaf_rn(a1s, c1, __fmul_rn(b1s, s1)), __fmaf_rn(b1s, c1, -__fmul_rn(a1s, s1)));
  }
  reinterpret_cast<float2*>(rope_sm + 96)[lane] = make_float2(f0, f1);
  if (lane == 0) reinterpret_cast<float*>(rope_sm + 112)[0] = __uint_as_float((uint32_t)(127 - 12 + e) << 23);
}
}  // namespace kvrepro_rope

#ifdef KVREPRO_TRACE
extern "C" {
__device__ unsigned long long kvrepro_trace[KVREPRO_TRACE][8];  // read by cuModuleGetGlobal
}
#endif

// The CTA's partial from its 4 warps' softmax states in shared memory (w_o [WARPS][8][D] float32 sums of the warps, w_s
// [WARPS][8][m, l, z]): warp w takes heads w, w + 4, lane l its channels 4 l .. 4 l + 3 (one plane factor, float4 loads
// and store), so each thread forms a head's log-sum-exp factors once. Writes part_o row (b, head, split) normalized and
// part_lse (log2; -inf for a split without tokens, NaN if a NaN reached the head). Not inlined: its registers do not add
// to the attention loop's (the kernel runs at the 128-register cap); 1.0 us from a CTA's loop end to its partial's
// stores, 1.8 us with the earlier block-wide version.
template <int KB, int VB, bool ROPE>  // ROPE: its own copy per entry point (see merge_splits)
__device__ __noinline__ void cta_partial(const float* w_o, const float* w_s, float* __restrict__ part_o,
                                         float* __restrict__ part_lse, int b, int kvh, int hq, int group,
                                         int num_splits, int split) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int c4 = lane * 4;
  // plane p of the values was summed as 16^p (4-bit) / 4^p (2-bit) times the code offset: exact powers of two
  const float plane = VB == 4 ? (c4 < 64 ? 1.f : 1.0f / 16.0f) : __int_as_float((127 - 2 * (c4 >> 5)) << 23);
  for (int h = warp; h < group; h += WARPS) {
    float mw[WARPS], lw[WARPS];
    float M = -INFINITY;
    int nan = 0;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      mw[w] = w_s[(w * 8 + h) * 3]; lw[w] = w_s[(w * 8 + h) * 3 + 1];
      M = fmaxf(M, mw[w]); nan |= (lw[w] != lw[w]);
    }
    float L = 0.f, Z = 0.f;
    float4 O = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float f = mw[w] == -INFINITY ? 0.f : ex2(mw[w] - M);   // a warp without pages weighs nothing
      const float4 x = *reinterpret_cast<const float4*>(w_o + (w * 8 + h) * D + c4);
      L += f * lw[w]; Z += f * w_s[(w * 8 + h) * 3 + 2];
      O.x += f * x.x; O.y += f * x.y; O.z += f * x.z; O.w += f * x.w;
    }
    const int64_t row = ((int64_t)b * hq + kvh * group + h) * num_splits + split;
    float4 o;
    float lse;
    if (nan) { o.x = o.y = o.z = o.w = lse = __int_as_float(0x7fc00000); }
    else if (L == 0.f) { o = make_float4(0.f, 0.f, 0.f, 0.f); lse = -INFINITY; }
    else {
      // o = (O plane + Z) / L; L >= 2^-SLACK when a token reached the head, so the fast reciprocal and log2 (MUFU,
      // ~2 ulp) stay far from their denormal ranges
      const float inv = __fdividef(1.f, L), pz = Z * inv, pp = plane * inv;
      o = make_float4(O.x * pp + pz, O.y * pp + pz, O.z * pp + pz, O.w * pp + pz);
      lse = M + __log2f(L);
    }
    reinterpret_cast<float4*>(part_o + row * D)[lane] = o;
    if (lane == 0) part_lse[row] = lse;
  }
}

// The split merge of the last CTA of a (sequence, KV head), one warp per head (heads w, w + 4): lane l holds channels
// 4 l .. 4 l + 3 of the head's weighted sum over all S splits, so neither a block barrier nor a cross-warp sum is
// needed. The first MERGE_PRE partial rows, the S lse values and the signs are requested together, before the
// log-sum-exp weights are known (one round trip to L2 for S <= MERGE_PRE); then the weights w_s = 2^(lse_s - max) (a
// warp's own region of the shared buffer), the weighted sum, the rotation back (Walsh-Hadamard transform) and the
// output. The caller's atom.acq_rel and barrier order these loads after every other CTA's partial stores. Not inlined,
// as cta_partial. 1.8 us from the count-in to the output's stores, 3.5 us with the earlier block-wide merge.
template <int KB, int VB, bool ROPE>  // ROPE: one copy per entry point; a callee shared by two kernels changed the
                                      // code ptxas made for the kernel without the correction
__device__ __noinline__ void merge_splits(uint8_t* smem, const float* __restrict__ part_o,
                                          const float* __restrict__ part_lse, const float* __restrict__ signs,
                                          void* __restrict__ out, int b, int kvh, int hq, int group, int num_splits,
                                          long long stride_ob, long long stride_oh, bool o_bf16) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float* wl = reinterpret_cast<float*>(smem);   // [group][num_splits] weights (num_splits x group <= MERGE_MAX)
  const int64_t row_b = ((int64_t)b * hq + kvh * group) * num_splits;   // head h's splits: rows row_b + h S + s
  float sg[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) sg[i] = signs[lane * 4 + i] * 0.08838834764831845f;  // s / sqrt(128)
  for (int h = warp; h < group; h += WARPS) {
    const float* lse_h = part_lse + row_b + (int64_t)h * num_splits;
    const float4* o_h = reinterpret_cast<const float4*>(part_o + (row_b + (int64_t)h * num_splits) * D) + lane;
    float* w_h = wl + h * num_splits;
    float4 pre[MERGE_PRE];
#pragma unroll
    for (int u = 0; u < MERGE_PRE; ++u)
      pre[u] = u < num_splits ? __ldcg(o_h + u * (D / 4)) : make_float4(0.f, 0.f, 0.f, 0.f);
    float M = -INFINITY;
    int nan = 0;
    for (int s = lane; s < num_splits; s += 32) {
      const float l = __ldcg(lse_h + s);
      w_h[s] = l;
      nan |= (l != l);
      M = fmaxf(M, l);
    }
    for (int o = 16; o; o >>= 1) {
      M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
      nan |= __shfl_xor_sync(0xffffffffu, nan, o);
    }
    float W = 0.f;
    for (int s = lane; s < num_splits; s += 32) {
      const float l = w_h[s];
      const float w = l > -INFINITY ? ex2(l - M) : 0.f;   // empty splits (and NaN ones) weigh nothing
      w_h[s] = w;
      W += w;
    }
    for (int o = 16; o; o >>= 1) W += __shfl_xor_sync(0xffffffffu, W, o);
    __syncwarp();
    const float inv = nan ? __int_as_float(0x7fc00000) : (W > 0.f ? 1.f / W : 0.f);
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int u = 0; u < MERGE_PRE; ++u) {
      if (u < num_splits) {
        const float w = w_h[u];
        a.x += w * pre[u].x; a.y += w * pre[u].y; a.z += w * pre[u].z; a.w += w * pre[u].w;
      }
    }
#pragma unroll 8
    for (int s = MERGE_PRE; s < num_splits; ++s) {
      const float4 x = __ldcg(o_h + s * (D / 4));
      const float w = w_h[s];
      a.x += w * x.x; a.y += w * x.y; a.z += w * x.z; a.w += w * x.w;
    }
    float x[4] = {a.x * inv, a.y * inv, a.z * inv, a.w * inv};
    fwht_warp(x, lane);
    const int64_t oi = (int64_t)b * stride_ob + (int64_t)(kvh * group + h) * stride_oh + lane * 4;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float y = x[i] * sg[i];
      if (o_bf16) reinterpret_cast<__nv_bfloat16*>(out)[oi + i] = __float2bfloat16_rn(y);
      else reinterpret_cast<__half*>(out)[oi + i] = __float2half_rn(y);
    }
  }
}

#define KVREPRO_DECODE_PARAMS                                                                                    \
  const void* __restrict__ query, const float* __restrict__ signs, const uint8_t* __restrict__ pool,               \
      const int* __restrict__ block_tables, const int* __restrict__ seq_lens, float* __restrict__ part_o,          \
      float* __restrict__ part_lse, void* __restrict__ out, unsigned* __restrict__ counters, long long stride_qb,  \
      long long stride_qh, long long stride_ob, long long stride_oh, float qmul, int flags, int stride_bt,          \
      int num_splits, int num_kv_heads, int group, int rank_div, int rank_skew
#define KVREPRO_DECODE_ARGS                                                                                      \
  query, signs, pool, block_tables, seq_lens, part_o, part_lse, out, counters, stride_qb, stride_qh, stride_ob,    \
      stride_oh, qmul, flags, stride_bt, num_splits, num_kv_heads, group, rank_div, rank_skew

// The whole decode step for KB-bit keys and VB-bit values (k4v4, k8v4, k4v2); the __global__ entry points below
// instantiate it. ROPE (the *_rope entry points): each paged key's logit gets the rope-mean correction (rope_add) from
// rope_terms float32 [B, HQ, 2 RPAIRS] (A then B of each query head, unscaled), rope_freq float32 [HKV, RPAIRS] and
// rope_scale = softmax_scale x log2(e); without it (ROPE false) the code is the kernel without the correction.
template <int KB, int VB, bool ROPE>
__device__ __forceinline__ void decode_step(KVREPRO_DECODE_PARAMS, const float* __restrict__ rope_terms,
                                            const float* __restrict__ rope_freq, float rope_scale) {
  using F = PageFmt<KB, VB>;
  constexpr int PAGE = F::PAGE, V_OFF = F::V_OFF, KM_OFF = F::KM_OFF, VM_OFF = F::VM_OFF, STAGES = F::KSTAGES;
  constexpr int NP = ROPE ? F::ROPE_STEP : F::STEP;  // pages per loop step of a warp
  constexpr bool K5 = KB == 5;                    // k5v4: symmetric 5-bit keys (two planes), log2 value scales
  constexpr bool K4 = KB == 4 || K5;              // a 4-bit key plane of 64-byte rows at 0 (k4v4's key path)
  constexpr int K_BYTES = BS * D * KB / 8;        // key code region: 1024 (4-bit) / 1280 (5-bit) / 2048 (8-bit) bytes
  constexpr int V_BYTES = BS * D * VB / 8;        // value code region: 1024 (4-bit) / 512 (2-bit) bytes
  constexpr int META_CHUNKS = (PAGE - K_BYTES - V_BYTES) / 16;  // 16-byte chunks of K and V metadata: 6 (k5v4: 3)
  static_assert(V_OFF == K_BYTES && KM_OFF == V_OFF + V_BYTES && VM_OFF == KM_OFF + F::KM_BYTES * BS &&
                PAGE == VM_OFF + F::VM_BYTES * BS && F::KM_BYTES == (K5 ? 2 : 4) && F::VM_BYTES == (K5 ? 1 : 2),
                "PageFmt: regions in order, as kvrepro.formats.layout");
  const int b = blockIdx.x;
  const int split = blockIdx.y / num_kv_heads;  // split-major: every (sequence, KV head) has CTAs in every round
  const int kvh = blockIdx.y % num_kv_heads;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, tq = lane & 3;  // MMA fragment row group and thread-in-quad
  const int hq = num_kv_heads * group;

  uint8_t* ring;  // [WARPS][STAGES][PAGE]
  if constexpr (Ring<KB, VB>::DYNAMIC) {
    extern __shared__ __align__(128) uint8_t kvrepro_ring_dyn[];
    ring = kvrepro_ring_dyn;
  } else {
    __shared__ __align__(128) uint8_t ring_s[WARPS * STAGES * PAGE];
    ring = ring_s;
  }
  __shared__ __align__(16) int8_t qd_hi[8][D], qd_lo[8][D];  // read back as 32-bit words
  __shared__ float s_q[8], q_sum[8];
  __shared__ int s_last;
  const bool q_bf16 = flags & 1, o_bf16 = flags & 2;
  TRACE(0, global_ns());
  TRACE(7, sm_id());

  // ---- the group's query rows h = warp, warp + 4 and the signs, loaded first: their latency overlaps the page setup
  float q_in[2][4], sg[4];
  for (int i = 0; i < 4; ++i) sg[i] = signs[lane * 4 + i];
  for (int j = 0; j < 2; ++j) {
    const int h = warp + j * WARPS;
    const int64_t base = (int64_t)b * stride_qb + (int64_t)(kvh * group + h) * stride_qh + lane * 4;
    for (int i = 0; i < 4; ++i) q_in[j][i] = h < group ? load_act(query, base + i, q_bf16) : 0.f;
  }

  // ---- this split's pages [p0, p1): whole 16-token pages, weighted by the CTA's round (split_weight_prefix; the
  // split merge accepts any partition); the first STAGES - STEP pages of each warp's ring go in flight before the
  // query work
  const int seq_len = seq_lens[b];
  const int pages_all = (seq_len + BS - 1) / BS;
  const int c = kvh * gridDim.x + b, P = gridDim.x * num_kv_heads;
  const double w_all = (double)split_weight_prefix(num_splits, c, P, rank_div, rank_skew);
  const int p0 = (int)((double)pages_all * (double)split_weight_prefix(split, c, P, rank_div, rank_skew) / w_all);
  const int p1 =
      (int)((double)pages_all * (double)split_weight_prefix(split + 1, c, P, rank_div, rank_skew) / w_all);
  const int end = min(p1 * BS, seq_len);
  const int n_pages = p1 - p0;
  const int my_pages = n_pages > warp ? (n_pages - warp + WARPS - 1) / WARPS : 0;  // pages p0 + warp + 4 i
  const int* bt = block_tables + (int64_t)b * stride_bt;
#if KVREPRO_BT_REGS
  // lane l holds the block of this warp's page w + 32 k + l of the window k being issued (one load per 32 pages)
  int bt_win = lane < my_pages ? bt[p0 + warp + lane * WARPS] : 0;
#endif

  uint8_t* my_ring = ring + warp * STAGES * PAGE;
  // Every 512-byte run of a page's code regions (4-bit keys, 4-bit or 2-bit values) goes to chunk lane ^ ((lane >> 3) &
  // 3) of its run: for 64-byte code rows, chunk lane + 32 k is row (lane >> 2) + 8 k, column lane & 3, stored at column
  // (lane & 3) ^ ((row >> 1) & 3) (swz_row_chunk); for k4v2's 32-byte value rows, chunk lane is row lane >> 1, column
  // lane & 1, stored at chunk lane ^ ((row >> 2) & 3) (swz_row_chunk2). Lanes 0-7 keep their chunk, so the metadata
  // (chunks 0-5 past KM_OFF) lands unswizzled at the same lane offset: one lane base for every copy.
  const uint32_t ring_code = smem_u32(my_ring) + (lane ^ ((lane >> 3) & 3)) * 16;
  // 128-byte key rows (k8v4): chunk lane + 32 k is row (lane >> 3) + 4 k, column lane & 7, stored at column
  // (lane & 7) ^ (row & 7) (swz_row_chunk8): two offsets, even and odd k
  const uint32_t ring_k8e = smem_u32(my_ring) + ((lane >> 3) * 8 + ((lane & 7) ^ (lane >> 3))) * 16;
  const uint32_t ring_k8o = smem_u32(my_ring) + ((lane >> 3) * 8 + ((lane & 7) ^ ((lane >> 3) + 4))) * 16;
  const uint32_t ring_meta = smem_u32(my_ring) + KM_OFF + lane * 16;
  const uint8_t* pool_lane = pool + (int64_t)kvh * PAGE + lane * 16;
  const int blk_stride = num_kv_heads * PAGE;
  // one page (block blk) into the ring slot at byte offset `stage` (cp.async, no commit)
  auto copy_page = [&](int blk, uint32_t stage) {
    const uint8_t* src = pool_lane + (int64_t)blk * blk_stride;
    if constexpr (K5) {  // the key region as it is (80-byte rows: unswizzled, 8 rows hit 8 bank groups), then as k4v4
#pragma unroll
      for (int k = 0; k < 3; ++k)
        if (k < 2 || lane < 16) cp_async16(ring_meta - KM_OFF + stage + 512 * k, src + 512 * k);
#pragma unroll
      for (int k = 0; k < 2; ++k) cp_async16(ring_code + stage + V_OFF + 512 * k, src + V_OFF + 512 * k);
      if (lane < META_CHUNKS) cp_async16(ring_code + stage + KM_OFF, src + KM_OFF);
    } else if (KB == 4) {  // k4v4 / k4v2: code runs 0 .. KM_OFF / 512 - 1, then the metadata (lanes 0-7 keep their chunk)
#pragma unroll
      for (int k = 0; k < KM_OFF / 512; ++k) cp_async16(ring_code + stage + 512 * k, src + 512 * k);
      if (lane < META_CHUNKS) cp_async16(ring_code + stage + KM_OFF, src + KM_OFF);
    } else {        // k8v4: 128-byte key rows, then 64-byte value rows
#pragma unroll
      for (int k = 0; k < 4; ++k) cp_async16((k & 1 ? ring_k8o : ring_k8e) + stage + 512 * k, src + 512 * k);
#pragma unroll
      for (int k = 0; k < 2; ++k) cp_async16(ring_code + stage + V_OFF + 512 * k, src + V_OFF + 512 * k);
      if (lane < META_CHUNKS) cp_async16(ring_meta + stage, src + KM_OFF);
    }
  };
  // pages i0 .. i0 + NP - 1 (i0 a multiple of NP) into the ring slots at stage_off, + PAGE, ... (no wrap: STAGES is a
  // multiple of NP), one commit group per step's pages, empty or not, so wait_group counts stay uniform
  auto issue = [&](int i0, uint32_t stage_off) {
    if (i0 < my_pages) {
#if KVREPRO_BT_REGS
      if ((i0 & 31) == 0 && i0 > 0) bt_win = i0 + lane < my_pages ? bt[p0 + warp + (i0 + lane) * WARPS] : 0;
#endif
#pragma unroll
      for (int k = 0; k < NP; ++k) {
        if (k > 0 && i0 + k >= my_pages) break;
#if KVREPRO_BT_REGS
        const int blk = __shfl_sync(0xffffffffu, bt_win, (i0 + k) & 31);
#else
        const int blk = bt[p0 + warp + (i0 + k) * WARPS];
#endif
        copy_page(blk, stage_off + k * PAGE);
      }
    }
    cp_commit();
  };
  static_assert(STAGES >= 1 + NP && STAGES % NP == 0 && 32 % NP == 0,
                "PageFmt: STEP must divide KSTAGES (one commit group per step) and 32 (the block-table window), and "
                "leave at least one page in flight");
  static_assert(WARPS * STAGES * PAGE >= WARPS * 8 * D * 4 + WARPS * 8 * 3 * 4 && WARPS * STAGES * PAGE >= MERGE_MAX * 4,
                "the ring doubles as the merge buffers");
  for (int i = 0; i < STAGES - NP; i += NP) issue(i, i * PAGE);

  // ---- the group's query rows, rotated (q @ R = H (s q) / sqrt(D)), scaled and rounded to float16 as
  // rotate_query_kernel does; then the digits (Triton _query_digits): S_q = max|q| / 16255 per head,
  // qi = round(q / S_q) = 128 qh + ql
  for (int j = 0; j < 2; ++j) {
    const int h = warp + j * WARPS;
    float q[4] = {0.f, 0.f, 0.f, 0.f};
    if (h < group && seq_len > 0) {
      for (int i = 0; i < 4; ++i) q[i] = q_in[j][i] * sg[i];
      fwht_warp(q, lane);
      for (int i = 0; i < 4; ++i) q[i] = __half2float(__float2half_rn(q[i] * qmul));
    }
    float amax = 0.f;
    int nan = 0;
    for (int i = 0; i < 4; ++i) { amax = fmaxf(amax, fabsf(q[i])); nan |= (q[i] != q[i]); }
    for (int o = 16; o; o >>= 1) {
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      nan |= __shfl_xor_sync(0xffffffffu, nan, o);
    }
    float sq = amax > 0.f ? amax * (1.0f / 16255.0f) : 1.0f;
    if (nan) sq = __int_as_float(0x7fc00000);
    const float inv = 1.0f / sq;
    int isum = 0;
    for (int i = 0; i < 4; ++i) {
      const int qi = nan ? 0 : (int)floorf(q[i] * inv + 0.5f);
      const int qh = (qi + 64) >> 7;
      qd_hi[h][lane * 4 + i] = (int8_t)qh;
      qd_lo[h][lane * 4 + i] = (int8_t)(qi - (qh << 7));
      isum += qi;
    }
    for (int o = 16; o; o >>= 1) isum += __shfl_xor_sync(0xffffffffu, isum, o);
    if (lane == 0) { s_q[h] = sq; q_sum[h] = (float)isum * sq; }
  }
  // ROPE: the table and the group's coefficients (rope_setup), the same in every warp: warp 0 puts them in shared
  // memory, read back per page (in registers, ptxas spilled ~200 bytes)
  const uint4* rope_sm = nullptr;
  const bool rope_pair = group <= 4;  // two-page rope kernels: rope_pair_c / rope_pair_add (one MMA set, both pages)
  if constexpr (ROPE) {
    static_assert(NP <= 2, "rope_add: the second page's coefficients are turned by ROPE_NEXT, a third's are not");
    __shared__ __align__(16) uint4 rope_s[NP == 2 ? ROPE_SM_UINT4_TWO : ROPE_SM_UINT4];
    rope_sm = rope_s;
    if (warp == 0)
      kvrepro_rope::rope_setup(rope_s, rope_terms, rope_freq, rope_scale, b, hq, kvh, group, g, tq, lane, NP);
  }
  __shared__ unsigned log_mant[8];  // k5v4's value scales: kvrepro_page::LOG_MANT_NEAR
  if constexpr (K5) {
    if (threadIdx.x < 8) log_mant[threadIdx.x] = kvrepro_page::LOG_MANT_NEAR[threadIdx.x];
  }
  __syncthreads();
  TRACE(1, global_ns());

  // B fragments of Q^T (32 channels x 8 heads) per key chunk: chunk 0 / 1 = plane 0 channels 0-31 / 32-63 (low
  // nibbles of bytes 0-31 / 32-63), chunk 2 / 3 = plane 1 channels 64-95 / 96-127 (high nibbles).
  uint32_t bh[4][2], bl[4][2];
  for (int c = 0; c < 4; ++c) {
    const int ch = (c & 1) * 32 + (c >> 1) * 64 + tq * 4;
    bh[c][0] = *reinterpret_cast<const uint32_t*>(&qd_hi[g][ch]);
    bh[c][1] = *reinterpret_cast<const uint32_t*>(&qd_hi[g][ch + 16]);
    bl[c][0] = *reinterpret_cast<const uint32_t*>(&qd_lo[g][ch]);
    bl[c][1] = *reinterpret_cast<const uint32_t*>(&qd_lo[g][ch + 16]);
  }
  const int h0 = tq * 2;  // the two heads (N columns) of this lane's accumulators
  // k4v4's int8 planes are 16 x the code; k5v4's two planes sum to 8 (code - 16) (page_logits)
  constexpr float KPLANE = KB == 4 ? 1.0f / 16.0f : K5 ? 1.0f / 8.0f : 1.0f;
  const float kmul0 = s_q[h0] * KPLANE, kmul1 = s_q[h0 + 1] * KPLANE;
  const float qs0 = q_sum[h0], qs1 = q_sum[h0 + 1];

  float m0 = -INFINITY, m1 = -INFINITY;  // running max (log2) of heads h0, h0 + 1
  float l0 = 0.f, l1 = 0.f, z0 = 0.f, z1 = 0.f;  // lane-partial softmax sums and 0.5 * sum p * v_scale
  float acc[8][4], tc[8][4];             // O^T: 8 channel tiles x (rows g, g + 8) x (heads h0, h0 + 1)
  for (int t = 0; t < 8; ++t)
    for (int j = 0; j < 4; ++j) acc[t][j] = tc[t][j] = 0.f;

  // ldmatrix row addresses of this lane, computed once (matrix lane >> 3 = tokens 0-7 / 8-15 x the first / second 16
  // bytes of a 32-byte run, row lane & 7): 64-byte code rows, bytes [32 half, +32) (swz_row_chunk); 32-byte value rows
  // (swz_row_chunk2)
  const uint32_t lk0 = swz_row_chunk(((lane >> 3) & 1) * 8 + (lane & 7), lane >> 4) * 16;
  const uint32_t lk1 = swz_row_chunk(((lane >> 3) & 1) * 8 + (lane & 7), 2 + (lane >> 4)) * 16;
  const uint32_t lv2 = V_OFF + swz_row_chunk2(((lane >> 3) & 1) * 8 + (lane & 7), lane >> 4) * 16;
  // k5v4's key rows (80 bytes, unswizzled): the same matrices of its high plane, bytes [0, 32) (+ 32: [32, 64))
  const uint32_t lk5 = (((lane >> 3) & 1) * 8 + (lane & 7)) * 80 + (lane >> 4) * 16;
  // One page's logits (log2 domain) S^T = K Q^T: s = S_q KPLANE ks acc + S_q sum(qi) (KMID ks + kz) (k4v4: KPLANE
  // 1 / 16, KMID 8; k8v4: 1, 128); s[0], s[1] = token g, heads h0, h0 + 1; s[2], s[3] = token g + 8. Tokens at or past
  // `end` (the split's last, partial page) get -inf and okA / okB false when `masked` (the caller's full steps pass
  // false: every token there is < end); their bytes are never used, so stale NaN scales there cannot leak.
  // ROPE: k, the page's index in its step; ang, the angles of the step's first page (rope_angles' order), set at k = 0
  // (after the key MMAs: taken before them, the two-page kernels spilled more).
  auto page_logits = [&](const uint8_t* pg, int tok0, float (&s)[4], bool& okA, bool& okB, bool masked, int k,
                         float4& ang) {
    // two int32 chains (high and low query digits), exact
    int chi[4] = {0, 0, 0, 0}, clo[4] = {0, 0, 0, 0};
    if (KB == 8) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {  // bytes 32 c .. 32 c + 31 of each token = channels 32 c .. (int8: code - 128)
        uint32_t r0, r1, r2, r3;
        const int mat = lane >> 3, row = lane & 7;
        ldsm_x4(smem_u32(pg + swz_row_chunk8((mat & 1) * 8 + row, c * 2 + (mat >> 1)) * 16), r0, r1, r2, r3);
        r0 ^= 0x80808080u; r1 ^= 0x80808080u; r2 ^= 0x80808080u; r3 ^= 0x80808080u;
        imma(chi, r0, r1, r2, r3, bh[c][0], bh[c][1]);
        imma(clo, r0, r1, r2, r3, bl[c][0], bl[c][1]);
      }
    }
#pragma unroll
    for (int half = 0; half < (K4 ? 2 : 0); ++half) {  // k4v4 (k5v4's high plane): bytes 0-31, 32-63 of each token
      uint32_t r0, r1, r2, r3;
      // matrices: tokens 0-7 / 8-15 x bytes [32 half, +16), then the next 16 bytes
      ldsm_x4(smem_u32(pg) + (K5 ? lk5 + 32 * half : half ? lk1 : lk0), r0, r1, r2, r3);
      const uint32_t x0 = r0 << 4, x1 = r1 << 4, x2 = r2 << 4, x3 = r3 << 4;
      // plane 0 (low nibbles) as int8 16 (code - 8): ((x << 4) & 0xF0) ^ 0x80; plane 1: (x & 0xF0) ^ 0x80
      const uint32_t a0 = lop3_and_xor(x0, 0xF0F0F0F0u, 0x80808080u), a1 = lop3_and_xor(x1, 0xF0F0F0F0u, 0x80808080u);
      const uint32_t a2 = lop3_and_xor(x2, 0xF0F0F0F0u, 0x80808080u), a3 = lop3_and_xor(x3, 0xF0F0F0F0u, 0x80808080u);
      imma(chi, a0, a1, a2, a3, bh[half][0], bh[half][1]);
      imma(clo, a0, a1, a2, a3, bl[half][0], bl[half][1]);
      const uint32_t e0 = lop3_and_xor(r0, 0xF0F0F0F0u, 0x80808080u), e1 = lop3_and_xor(r1, 0xF0F0F0F0u, 0x80808080u);
      const uint32_t e2 = lop3_and_xor(r2, 0xF0F0F0F0u, 0x80808080u), e3 = lop3_and_xor(r3, 0xF0F0F0F0u, 0x80808080u);
      imma(chi, e0, e1, e2, e3, bh[2 + half][0], bh[2 + half][1]);
      imma(clo, e0, e1, e2, e3, bl[2 + half][0], bl[2 + half][1]);
    }
    if constexpr (K5) {
      // the low plane (byte j bit i = channel j + 16 i): chunk c (channels 32 c ..) is bit 2 c of bytes 0-15 (channels
      // 32 c + j) and bit 2 c + 1 (32 c + 16 + j), so lane (g, tq)'s A fragment is bits 2 c and 2 c + 1 of bytes
      // 4 tq .. 4 tq + 3 of tokens g and g + 8 (ldmatrix.x2: w0, w1), each moved to bit 3: int8 8 lo, into the same
      // sums as the high plane's 16 (hi - 8): 16 hi - 128 + 8 lo = 8 (code - 16)
      uint32_t w0, w1;
      ldsm_x2(smem_u32(pg) + lk5 + 64, w0, w1);   // lanes 0-15 give the rows: lk5 = token lane x 80 there
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const uint32_t a0 = (2 * c <= 3 ? w0 << (3 - 2 * c) : w0 >> (2 * c - 3)) & 0x08080808u;
        const uint32_t a1 = (2 * c <= 3 ? w1 << (3 - 2 * c) : w1 >> (2 * c - 3)) & 0x08080808u;
        const uint32_t a2 = (2 * c + 1 <= 3 ? w0 << (2 - 2 * c) : w0 >> (2 * c - 2)) & 0x08080808u;
        const uint32_t a3 = (2 * c + 1 <= 3 ? w1 << (2 - 2 * c) : w1 >> (2 * c - 2)) & 0x08080808u;
        imma(chi, a0, a1, a2, a3, bh[c][0], bh[c][1]);
        imma(clo, a0, a1, a2, a3, bl[c][0], bl[c][1]);
      }
    }
    // key scale and the zero term per token: asymmetric k = code scale + zero, the int8 planes hold 16 (code - 8) /
    // code - 128: kz = zero + KMID scale; k5v4: k = (code - 15.5) scale, the planes 8 (code - 16): kz = scale / 2
    float ksA, kzA, ksB, kzB;
    if constexpr (K5) {
      ksA = __half2float(*reinterpret_cast<const __half*>(pg + KM_OFF + g * 2)), kzA = 0.5f * ksA;
      ksB = __half2float(*reinterpret_cast<const __half*>(pg + KM_OFF + (g + 8) * 2)), kzB = 0.5f * ksB;
    } else {
      const __half2 kmA = *reinterpret_cast<const __half2*>(pg + KM_OFF + g * 4);        // (scale, zero) token g
      const __half2 kmB = *reinterpret_cast<const __half2*>(pg + KM_OFF + (g + 8) * 4);  // token g + 8
      constexpr float KMID = KB == 4 ? 8.f : 128.f;
      ksA = __low2float(kmA), kzA = __high2float(kmA) + KMID * ksA;
      ksB = __low2float(kmB), kzB = __high2float(kmB) + KMID * ksB;
    }
    s[0] = (float)(chi[0] * 128 + clo[0]) * (kmul0 * ksA) + qs0 * kzA;
    s[1] = (float)(chi[1] * 128 + clo[1]) * (kmul1 * ksA) + qs1 * kzA;
    s[2] = (float)(chi[2] * 128 + clo[2]) * (kmul0 * ksB) + qs0 * kzB;
    s[3] = (float)(chi[3] * 128 + clo[3]) * (kmul1 * ksB) + qs1 * kzB;
    // tok0: the page's first position; page k = 1 starts ROPE_NEXT after k = 0: the first's angles and the coefficients
    // turned by ROPE_NEXT theta (rope_setup)
    if constexpr (ROPE) {
      if (!(NP == 2 && rope_pair)) {  // rope_pair: the step adds both pages' corrections at once (rope_pair_add)
        if (k == 0) ang = rope_angles(tok0, rope_sm, lane);
        rope_add(s, ang, reinterpret_cast<const float4*>(rope_sm + (k ? 113 : 64))[lane], rope_sm, lane);
      }
    }
    okA = true, okB = true;
    if (masked && tok0 + BS > end) {
      okA = tok0 + g < end;
      okB = tok0 + g + 8 < end;
      if (!okA) s[0] = s[1] = -INFINITY;
      if (!okB) s[2] = s[3] = -INFINITY;
    }
  };
  // Online softmax: pm0 / pm1 = this lane's largest logit of head h0 / h0 + 1 among the tokens of this step. m0 / m1
  // are the exponent references (the same in the 8 lanes of a head pair): a warp vote on each lane's own maxima;
  // only if some logit passes its reference are the maxima reduced over the 8 lanes, the reference set to max + SLACK
  // and the sums and float32 accumulators rescaled.
  auto raise_max = [&](float pm0, float pm1) {
    if (__any_sync(0xffffffffu, pm0 > m0 || pm1 > m1)) {
      for (int o = 4; o < 32; o <<= 1) {
        pm0 = fmaxf(pm0, __shfl_xor_sync(0xffffffffu, pm0, o));
        pm1 = fmaxf(pm1, __shfl_xor_sync(0xffffffffu, pm1, o));
      }
      const float n0 = pm0 > m0 ? pm0 + SLACK : m0, n1 = pm1 > m1 ? pm1 + SLACK : m1;
      const float al0 = n0 == -INFINITY ? 1.f : ex2(m0 - n0), al1 = n1 == -INFINITY ? 1.f : ex2(m1 - n1);
      for (int t = 0; t < 8; ++t) {
        acc[t][0] *= al0; acc[t][1] *= al1; acc[t][2] *= al0; acc[t][3] *= al1;
        tc[t][0] *= al0; tc[t][1] *= al1; tc[t][2] *= al0; tc[t][3] *= al1;
      }
      l0 *= al0; l1 *= al1; z0 *= al0; z1 *= al1;
      m0 = n0; m1 = n1;
    }
  };
  // One page's softmax weights times the value scales, w = p v_scale, into the sums and, as float16 P^T fragments
  // (C rows = tokens, cols = heads -> B[k = token][n = head] by an 8x8 transpose), into pb0 (tokens 0-7) and pb1
  // (tokens 8-15).
  auto page_weights = [&](const uint8_t* pg, const float (&s)[4], bool okA, bool okB, uint32_t& pb0, uint32_t& pb1) {
    const float u0 = m0 == -INFINITY ? 0.f : m0, u1 = m1 == -INFINITY ? 0.f : m1;
    const float p0_ = ex2(s[0] - u0), p1_ = ex2(s[1] - u1), p2_ = ex2(s[2] - u0), p3_ = ex2(s[3] - u1);
    l0 += p0_ + p2_; l1 += p1_ + p3_;
    float vsA, vsB;
    if constexpr (K5) {  // uint8 u: 2^((u - 128) / 8), exponent (u >> 3) - 16, as kvrepro.formats.compressed
      const unsigned uA = pg[VM_OFF + g], uB = pg[VM_OFF + g + 8];
      vsA = okA ? __uint_as_float((((uA >> 3) + 111u) << 23) | log_mant[uA & 7]) : 0.f;
      vsB = okB ? __uint_as_float((((uB >> 3) + 111u) << 23) | log_mant[uB & 7]) : 0.f;
    } else {
      vsA = okA ? __half2float(*reinterpret_cast<const __half*>(pg + VM_OFF + g * 2)) : 0.f;
      vsB = okB ? __half2float(*reinterpret_cast<const __half*>(pg + VM_OFF + (g + 8) * 2)) : 0.f;
    }
    const float w0 = p0_ * vsA, w1 = p1_ * vsA, w2 = p2_ * vsB, w3 = p3_ * vsB;
    z0 += 0.5f * (w0 + w2); z1 += 0.5f * (w1 + w3);
    pb0 = movm_t(pack_f16x2(w0, w1));
    pb1 = movm_t(pack_f16x2(w2, w3));
  };
  // O^T += V^T P^T over one page (into the tensor-core sums tc): value codes through ldmatrix.trans, two tokens of two
  // byte-channels per register
  auto page_values = [&](const uint8_t* pg, uint32_t pb0, uint32_t pb1) {
#pragma unroll
    for (int half = 0; half < (VB == 4 ? 2 : 0); ++half) {
      uint32_t r0, r1, r2, r3;
      ldsm_x4_t(smem_u32(pg) + V_OFF + (half ? lk1 : lk0), r0, r1, r2, r3);
      const uint32_t rr[4] = {r0, r1, r2, r3};
#pragma unroll
      for (int e = 0; e < 2; ++e) {  // bytes [32 half + 16 e, +16): channel tiles of plane 0 and plane 1
        const uint32_t lo = rr[2 * e], hi = rr[2 * e + 1];  // tokens 0-7 and 8-15
        const uint32_t lo8 = lo >> 8, hi8 = hi >> 8;         // byte-channel 2g + 1 into bytes 0 and 2
        const uint32_t c0 = 0x64086408u, c1 = 0x64806480u;   // 1032 (plane 0), 1152 (plane 1)
        // plane 0: rows g <- channel 32 half + 16 e + 2g, g + 8 <- + 1; values code - 8
        hmma(tc[half * 2 + e],
             hsub2(lop3_and_or(lo, 0x000F000Fu, 0x64006400u), c0), hsub2(lop3_and_or(lo8, 0x000F000Fu, 0x64006400u), c0),
             hsub2(lop3_and_or(hi, 0x000F000Fu, 0x64006400u), c0), hsub2(lop3_and_or(hi8, 0x000F000Fu, 0x64006400u), c0),
             pb0, pb1);
        // plane 1: channels + 64, values 16 (code - 8)
        hmma(tc[4 + half * 2 + e],
             hsub2(lop3_and_or(lo, 0x00F000F0u, 0x64006400u), c1), hsub2(lop3_and_or(lo8, 0x00F000F0u, 0x64006400u), c1),
             hsub2(lop3_and_or(hi, 0x00F000F0u, 0x64006400u), c1), hsub2(lop3_and_or(hi8, 0x00F000F0u, 0x64006400u), c1),
             pb0, pb1);
      }
    }
    if (VB == 2) {  // 32 bytes per token: byte j = channels j, j + 32, j + 64, j + 96 (planes 0-3, 2 bits each)
      uint32_t r0, r1, r2, r3;
      // matrices: tokens 0-7 / 8-15 x bytes 0-15, then tokens 0-7 / 8-15 x bytes 16-31
      ldsm_x4_t(smem_u32(pg) + lv2, r0, r1, r2, r3);
      const uint32_t rr[4] = {r0, r1, r2, r3};
#pragma unroll
      for (int e = 0; e < 2; ++e) {  // bytes [16 e, +16): channel tiles 32 p + 16 e + (2g, 2g + 1) of plane p
        const uint32_t lo = rr[2 * e], hi = rr[2 * e + 1];  // tokens 0-7 and 8-15
        const uint32_t lo8 = lo >> 8, hi8 = hi >> 8;         // byte-channel 2g + 1 into bytes 0 and 2
#pragma unroll
        for (int p = 0; p < 4; ++p) {
          // plane p: 1024 + 4^p code exactly in float16 (0x6400 | bits), minus 1024 + 2 x 4^p: 4^p (code - 2)
          const uint32_t m = 0x00030003u << (2 * p), cz = 0x64006400u | (0x00020002u << (2 * p));
          hmma(tc[2 * p + e],
               hsub2(lop3_and_or(lo, m, 0x64006400u), cz), hsub2(lop3_and_or(lo8, m, 0x64006400u), cz),
               hsub2(lop3_and_or(hi, m, 0x64006400u), cz), hsub2(lop3_and_or(hi8, m, 0x64006400u), cz), pb0, pb1);
        }
      }
    }
  };
  // P.V summed by the tensor cores over FLUSH pages, then added to the float32 sums
  auto flush = [&]() {
    for (int t = 0; t < 8; ++t)
      for (int j = 0; j < 4; ++j) { acc[t][j] += tc[t][j]; tc[t][j] = 0.f; }
  };

  // NP pages per step: one vote (and, rarely, max reduction and rescale) per 16 NP tokens. Pages i .. i + NP - 1 sit
  // in consecutive ring slots; those past my_pages in the last step are masked (token position `end`: no weight, stale
  // bytes never used). The tensor-core sums are flushed when a step crosses a multiple of FLUSH.
  uint32_t rd = 0;  // (i % STAGES) * PAGE, kept incrementally: STAGES is a multiple of NP
  // One step of the warp: pages i .. i + NP - 1 (ring slots rd, rd + PAGE, ...), the token mask only if `masked`.
  auto step = [&](int i, bool masked) {
    uint32_t o = rd + (STAGES - NP) * PAGE;  // the slot of page i + STAGES - NP
    if (o >= STAGES * PAGE) o -= STAGES * PAGE;
    issue(i + STAGES - NP, o);
    float rc[4];  // ROPE, two pages, group <= 4: both pages' corrections (rope_pair_c), while the pages arrive
    if constexpr (ROPE && NP == 2) {
      if (rope_pair) rope_pair_c(rc, (p0 + warp + i * WARPS) * BS, rope_sm, lane);
    }
    cp_wait<(STAGES - NP) / NP>();  // one commit group per NP pages
    __syncwarp();
    const uint8_t* pg[NP];
    float4 ang;  // ROPE: the angles of the step's first page (a warp's pages are ROPE_NEXT positions apart)
    float s[NP][4];
    bool okA[NP], okB[NP];
#pragma unroll
    for (int k = 0; k < NP; ++k) {
      pg[k] = my_ring + rd + k * PAGE;
      // the page's first token position; past my_pages (masked last step) at or past `end`: every token masked
      const int tok0 = ROPE ? (p0 + warp + (i + k) * WARPS) * BS
                            : !masked ? 0 : i + k < my_pages ? (p0 + warp + (i + k) * WARPS) * BS : end;
      page_logits(pg[k], tok0, s[k], okA[k], okB[k], masked, k, ang);
    }
    if constexpr (ROPE && NP == 2) {  // after the mask: -inf plus a finite correction stays -inf
      if (rope_pair) rope_pair_add(s[0], s[1], rc, rope_sm, lane);
    }
    float pm0 = fmaxf(s[0][0], s[0][2]), pm1 = fmaxf(s[0][1], s[0][3]);
#pragma unroll
    for (int k = 1; k < NP; ++k) {
      pm0 = fmaxf(pm0, fmaxf(s[k][0], s[k][2]));
      pm1 = fmaxf(pm1, fmaxf(s[k][1], s[k][3]));
    }
    raise_max(pm0, pm1);
    uint32_t pb[NP][2];
#pragma unroll
    for (int k = 0; k < NP; ++k) page_weights(pg[k], s[k], okA[k], okB[k], pb[k][0], pb[k][1]);
#pragma unroll
    for (int k = 0; k < NP; ++k) page_values(pg[k], pb[k][0], pb[k][1]);
    if ((i + NP) / FLUSH != i / FLUSH || i + NP >= my_pages) flush();
    __syncwarp();  // every lane is done with these stages before they are refilled
    rd += NP * PAGE;
    if (rd == STAGES * PAGE) rd = 0;
  };
  // Steps whose NP pages all exist and are full need no token mask; only the split's last page can be partial (when
  // end = seq_len < p1 x 16), and it is this warp's last page if (p1 - 1 - p0) % WARPS == warp. The one step left
  // (if any) is masked. k8v4 keeps the masked step throughout: its second copy of the loop body spilled 4 bytes on
  // sm_90 (and it gained < 1% from the unmasked copy).
  if (K4) {
    const int my_full = my_pages - (end < p1 * BS && (p1 - 1 - p0) % WARPS == warp ? 1 : 0);
    int i = 0;
    for (; i + NP <= my_full; i += NP) step(i, false);
    if (i < my_pages) step(i, true);
  } else {
    for (int i = 0; i < my_pages; i += NP) step(i, true);
  }
  cp_wait<0>();
  TRACE(2, global_ns());

  // ---- lane partials -> per warp, then merge the 4 warps in shared memory
  for (int o = 4; o < 32; o <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, o); l1 += __shfl_xor_sync(0xffffffffu, l1, o);
    z0 += __shfl_xor_sync(0xffffffffu, z0, o); z1 += __shfl_xor_sync(0xffffffffu, z1, o);
  }
  __syncthreads();  // the rings become the merge buffer
  TRACE(3, global_ns());
  float* w_o = reinterpret_cast<float*>(ring);  // [WARPS][8 heads][D]
  float* w_s = w_o + WARPS * 8 * D;                          // [WARPS][8][m, l, z]
  for (int t = 0; t < 8; ++t) {
    // channel of tile t, row g (row g + 8: + 1). 4-bit values: plane (t >> 2) * 64 + 32 half + 16 e + 2 g, t = 4 p +
    // 2 half + e; 2-bit values: 32 p + 16 e + 2 g, t = 2 p + e (both: (t >> 1) * 32 + (t & 1) * 16 + 2 g)
    const int ch = (t >> 1) * 32 + (t & 1) * 16 + 2 * g;
    // channels ch, ch + 1 of heads h0 and h0 + 1: one 8-byte store each
    *reinterpret_cast<float2*>(w_o + (warp * 8 + h0) * D + ch) = make_float2(acc[t][0], acc[t][2]);
    *reinterpret_cast<float2*>(w_o + (warp * 8 + h0 + 1) * D + ch) = make_float2(acc[t][1], acc[t][3]);
  }
  if (g == 0) {
    w_s[(warp * 8 + h0) * 3 + 0] = m0; w_s[(warp * 8 + h0) * 3 + 1] = l0; w_s[(warp * 8 + h0) * 3 + 2] = z0;
    w_s[(warp * 8 + h0 + 1) * 3 + 0] = m1; w_s[(warp * 8 + h0 + 1) * 3 + 1] = l1; w_s[(warp * 8 + h0 + 1) * 3 + 2] = z1;
  }
  __syncthreads();
  cta_partial<KB, VB, ROPE>(w_o, w_s, part_o, part_lse, b, kvh, hq, group, num_splits, split);

  // ---- the last CTA of this (sequence, KV head) merges the splits and rotates back. The count-in is one
  // atom.add.acq_rel.gpu by thread 0 after a barrier: the barrier orders the CTA's partial stores before thread 0's
  // release, and the acquire (with the barrier after it) orders the merging CTA's loads after every other CTA's
  // release (PTX ISA, memory consistency model: release and acquire patterns are cumulative; the pattern of CUTLASS's
  // split-K semaphore). It replaces a __threadfence (fence.sc.gpu) in every thread on each side.
  unsigned* counter = counters + (int64_t)b * num_kv_heads + kvh;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned prev;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;\n" : "=r"(prev) : "l"(counter) : "memory");
    s_last = prev == (unsigned)(num_splits - 1);
  }
  __syncthreads();
  TRACE(4, global_ns());
  if (!s_last) return;
  // every CTA of this (sequence, KV head) has counted in: the counter is ready for the next launch (reset before the
  // merge, so that no register stays live across its call)
  if (threadIdx.x == 0) *counter = 0u;
  merge_splits<KB, VB, ROPE>(ring, part_o, part_lse, signs, out, b, kvh, hq, group, num_splits, stride_ob, stride_oh,
               o_bf16);
  TRACE(5, global_ns());
}

// Entry points: one per preset; <name>_dyn_smem = the dynamic shared memory its launch must ask for (0: none), read by
// the loader (kvrepro.ops.cuda_decode._Module) through cuModuleGetGlobal.
// NAME##_rope: the same with the rope-mean correction (decode_step's ROPE), three more parameters after the others.
#define KVREPRO_ENTRY(NAME, KB, VB)                                                                             \
  extern "C" __device__ int NAME##_dyn_smem = Ring<KB, VB>::DYNAMIC ? Ring<KB, VB>::BYTES : 0;                  \
  extern "C" __global__ void __launch_bounds__(WARPS * 32, 4) /* 4 CTAs (16 warps) per SM: <= 128 registers */ \
  NAME(KVREPRO_DECODE_PARAMS) { decode_step<KB, VB, false>(KVREPRO_DECODE_ARGS, nullptr, nullptr, 0.f); }        \
  extern "C" __device__ int NAME##_rope_dyn_smem = Ring<KB, VB>::DYNAMIC ? Ring<KB, VB>::BYTES : 0;             \
  extern "C" __global__ void __launch_bounds__(WARPS * 32, 4)                                                   \
  NAME##_rope(KVREPRO_DECODE_PARAMS, const float* __restrict__ rope_terms, const float* __restrict__ rope_freq, \
              float rope_scale) {                                                                                \
    decode_step<KB, VB, true>(KVREPRO_DECODE_ARGS, rope_terms, rope_freq, rope_scale);                          \
  }

KVREPRO_ENTRY(kvrepro_decode_k4v4, 4, 4)
KVREPRO_ENTRY(kvrepro_decode_k8v4, 8, 4)
KVREPRO_ENTRY(kvrepro_decode_k4v2, 4, 2)
KVREPRO_ENTRY(kvrepro_decode_k5v4, 5, 4)
