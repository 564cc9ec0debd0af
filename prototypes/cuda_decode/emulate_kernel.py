"""CPU port of ``decode_k4v4.cu``, statement by statement at warp level, checked against float64 attention.

Uses the fragment emulation of ``emulate_fragments.py`` for ldmatrix / mma / movmatrix and mirrors the kernel's
control flow: query digits per head, per-warp page walk (page p of a split -> warp p % 4), the partial last page,
online softmax with the shuffle reductions (over the 8 lanes of a head pair), lazy rescaling, the tensor-core sum
flushed every FLUSH pages, the lane-to-warp reductions and the 4-warp merge, then the split merge and the rotation
back (as ``merge_splits_kernel``). Compared with ``kvrepro.reference.paged_attention_ref`` in float64 on a small
pool made by ``store_kv``: ragged lengths, padding row, 1 / 3 / 7 splits, GQA 4 and 3, and a NaN query head.

    PYTHONPATH=. python prototypes/cuda_decode/emulate_kernel.py
"""
from __future__ import annotations

import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from emulate_fragments import key_dot, movmatrix_t, pack_f16x2, to_smem, value_dot  # noqa: E402

from kvrepro.formats import get_format  # noqa: E402
from kvrepro.ops import store_kv  # noqa: E402
from kvrepro.reference import paged_attention_ref  # noqa: E402

D, BS, PAGE = 128, 16, 2144
V_OFF, KM_OFF, VM_OFF = 1024, 2048, 2112
WARPS, FLUSH = 4, 16
LOG2E = 1.4426950408889634
LANES = np.arange(32)
G_, TQ = LANES // 4, LANES % 4


def q_digits(q: np.ndarray, group: int, seq_len: int):
    """[8, D] digits hi / lo, s_q[8], q_sum[8] as the kernel's prologue (q: [group, D] float16)."""
    qh = np.zeros((8, D), np.int64)
    ql = np.zeros((8, D), np.int64)
    sq = np.ones(8)
    qs = np.zeros(8)
    for h in range(8):
        x = q[h].astype(np.float32) if (h < group and seq_len > 0) else np.zeros(D, np.float32)
        amax = float(np.max(np.abs(np.nan_to_num(x, nan=0.0))))
        nan = bool(np.isnan(x).any())
        s = amax / 16255.0 if amax > 0 else 1.0
        s = np.float32(s)
        if nan:
            s = np.float32("nan")
        inv = np.float32(1.0) / s
        qi = np.zeros(D, np.int64) if nan else np.floor(x * inv + np.float32(0.5)).astype(np.int64)
        qh[h] = (qi + 64) >> 7
        ql[h] = qi - (qh[h] << 7)
        sq[h] = s
        qs[h] = float(qi.sum()) * s
    return qh, ql, sq, qs


def b_frags(dig: np.ndarray) -> np.ndarray:
    fr = np.zeros((4, 32, 2), np.uint32)
    for c in range(4):
        for t in range(32):
            ch = (c & 1) * 32 + (c >> 1) * 64 + TQ[t] * 4
            for j, off in enumerate((0, 16)):
                fr[c, t, j] = np.frombuffer(dig[G_[t], ch + off: ch + off + 4].astype(np.int8).tobytes(), np.uint32)[0]
    return fr


def warp_pages(pool, bt_row, kvh, p0, warp, my_pages, end, bh, bl, kmul, qsv):
    """One warp's loop; returns its per-head m, l, z and O^T accumulators as the kernel holds them."""
    m = np.full((32, 2), -np.inf)
    l = np.zeros((32, 2))
    z = np.zeros((32, 2))
    acc = np.zeros((8, 32, 4))
    tc = np.zeros((8, 32, 4))
    for i in range(my_pages):
        pg = to_smem(pool[bt_row[p0 + warp + i * WARPS], kvh])   # the stage as the cp.async copy fills it
        tok0 = (p0 + warp + i * WARPS) * BS
        chi, clo = key_dot(pg, bh, bl)
        km = pg[KM_OFF:VM_OFF].view(np.float16).reshape(16, 2).astype(np.float32)
        ksA, ksB = km[G_, 0], km[G_ + 8, 0]
        kzA, kzB = km[G_, 1] + 8 * ksA, km[G_ + 8, 1] + 8 * ksB
        acc_i = (chi * 128 + clo).astype(np.float32)
        s = np.stack([acc_i[:, 0] * (kmul[:, 0] * ksA) + qsv[:, 0] * kzA, acc_i[:, 1] * (kmul[:, 1] * ksA) + qsv[:, 1] * kzA,
                      acc_i[:, 2] * (kmul[:, 0] * ksB) + qsv[:, 0] * kzB, acc_i[:, 3] * (kmul[:, 1] * ksB) + qsv[:, 1] * kzB], 1)
        okA = np.ones(32, bool)
        okB = np.ones(32, bool)
        if tok0 + BS > end:
            okA = tok0 + G_ < end
            okB = tok0 + G_ + 8 < end
            s[~okA, 0:2] = -np.inf
            s[~okB, 2:4] = -np.inf
        pm = np.stack([np.fmax(s[:, 0], s[:, 2]), np.fmax(s[:, 1], s[:, 3])], 1)
        for o in (4, 8, 16):                               # __shfl_xor_sync over lanes with the same tq
            pm = np.fmax(pm, pm[LANES ^ o])
        n = np.fmax(m, pm)
        if np.any(n > m):
            al = np.where(n == -np.inf, 1.0, np.exp2(m - n))
            for t in range(8):
                acc[t] *= al[:, [0, 1, 0, 1]]
                tc[t] *= al[:, [0, 1, 0, 1]]
            l *= al
            z *= al
            m = n
        u = np.where(m == -np.inf, 0.0, m)
        p = np.exp2(s - u[:, [0, 1, 0, 1]])
        l += p[:, [0, 1]] + p[:, [2, 3]]
        vsr = pg[VM_OFF:].view(np.float16).astype(np.float32)
        vsA = np.where(okA, vsr[G_], 0.0)
        vsB = np.where(okB, vsr[G_ + 8], 0.0)
        w = p * np.stack([vsA, vsA, vsB, vsB], 1)
        z += 0.5 * (w[:, [0, 1]] + w[:, [2, 3]])
        pb0 = movmatrix_t(np.array([pack_f16x2(w[t, 0], w[t, 1]) for t in range(32)], np.uint32))
        pb1 = movmatrix_t(np.array([pack_f16x2(w[t, 2], w[t, 3]) for t in range(32)], np.uint32))
        b = np.stack([pb0, pb1], 1)
        tc += value_dot(pg, b)
        if (i + 1) % FLUSH == 0 or i + 1 == my_pages:
            acc += tc
            tc[:] = 0
    for o in (4, 8, 16):
        l = l + l[LANES ^ o]
        z = z + z[LANES ^ o]
    return m, l, z, acc


def kernel(q16, pool, bt, seq_lens, num_splits, hkv, group):
    """The CUDA kernel's grid on the CPU: part_o [B, HQ, S, D], part_lse [B, HQ, S] (log2)."""
    b_n = q16.shape[0]
    hq = hkv * group
    part_o = np.zeros((b_n, hq, num_splits, D))
    part_lse = np.zeros((b_n, hq, num_splits))
    for b in range(b_n):
        for kvh in range(hkv):
            qh, ql, sq, qs = q_digits(q16[b, kvh * group:(kvh + 1) * group], group, int(seq_lens[b]))
            bh, bl = b_frags(qh), b_frags(ql)
            h0 = 2 * TQ
            kmul = np.stack([sq[h0] / 16, sq[h0 + 1] / 16], 1).astype(np.float32)
            qsv = np.stack([qs[h0], qs[h0 + 1]], 1).astype(np.float32)
            for split in range(num_splits):
                sl = int(seq_lens[b])
                per = ((sl + num_splits - 1) // num_splits + BS - 1) // BS * BS
                start, end = split * per, min(split * per + per, sl)
                p0 = start // BS
                n_pages = (end - start + BS - 1) // BS if end > start else 0
                w_o = np.zeros((WARPS, 8, D))
                w_s = np.zeros((WARPS, 8, 3))
                for warp in range(WARPS):
                    my = (n_pages - warp + WARPS - 1) // WARPS if n_pages > warp else 0
                    m, l, z, acc = warp_pages(pool, bt[b], kvh, p0, warp, my, end, bh, bl, kmul, qsv)
                    for t8 in range(8):
                        ch = (t8 >> 2) * 64 + ((t8 >> 1) & 1) * 32 + (t8 & 1) * 16 + 2 * G_
                        w_o[warp, h0, ch] = acc[t8, :, 0]
                        w_o[warp, h0 + 1, ch] = acc[t8, :, 1]
                        w_o[warp, h0, ch + 1] = acc[t8, :, 2]
                        w_o[warp, h0 + 1, ch + 1] = acc[t8, :, 3]
                    for t in range(4):                     # lanes with g == 0
                        w_s[warp, 2 * t] = (m[t, 0], l[t, 0], z[t, 0])
                        w_s[warp, 2 * t + 1] = (m[t, 1], l[t, 1], z[t, 1])
                for h in range(group):
                    M = np.max(w_s[:, h, 0])
                    L = Z = 0.0
                    O = np.zeros(D)
                    nan = bool(np.isnan(w_s[:, h, 1]).any())
                    for w in range(WARPS):
                        if w_s[w, h, 0] == -np.inf:
                            continue
                        f = np.exp2(w_s[w, h, 0] - M)
                        L += f * w_s[w, h, 1]
                        Z += f * w_s[w, h, 2]
                        O += f * w_o[w, h]
                    head = kvh * group + h
                    if nan:
                        part_o[b, head, split], part_lse[b, head, split] = np.nan, np.nan
                    elif L == 0:
                        part_o[b, head, split], part_lse[b, head, split] = 0.0, -np.inf
                    else:
                        O[64:] /= 16
                        part_o[b, head, split] = O / L + Z / L
                        part_lse[b, head, split] = M + np.log2(L)
    return part_o, part_lse


def merge(part_o, part_lse, rot):
    """merge_splits_kernel in NumPy: weights 2**(lse - max) over non-empty splits, then out = o @ R.T."""
    b_n, hq, s, _ = part_o.shape
    out = np.zeros((b_n, hq, D))
    for b in range(b_n):
        for h in range(hq):
            lse = part_lse[b, h]
            if np.isnan(lse).any():
                out[b, h] = np.nan
                continue
            mx = np.max(lse)
            w = np.where(lse > -np.inf, np.exp2(lse - (0.0 if mx == -np.inf else mx)), 0.0)
            o = (part_o[b, h] * w[:, None]).sum(0) / (w.sum() if w.sum() > 0 else 1.0)
            out[b, h] = o @ rot.T
    return out


def case(lens, hq, hkv, splits, nan=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    fmt = get_format("k4v4")
    maxb = max(-(-max(L, 1) // BS) for L in lens) + 1
    nb = len(lens) * maxb + 3
    pool = fmt.new_pool(nb, hkv, D, BS, device="cpu")
    bt = torch.randperm(nb, generator=gen)[: len(lens) * maxb].reshape(len(lens), maxb).to(torch.int32)
    for b, L in enumerate(lens):
        if L:
            k = torch.randn(L, hkv, D, generator=gen).half()
            v = torch.randn(L, hkv, D, generator=gen).half()
            pos = torch.arange(L)
            store_kv(k, v, pool.data, (bt[b, pos // BS].long() * BS + pos % BS).to(torch.int32), pool.layout,
                     pool.rotation)
    q = torch.randn(len(lens), hq, D, generator=gen).half()
    if nan:
        q[1, 1, 3] = float("nan")
    sl = torch.tensor(lens, dtype=torch.int32)
    scale = D ** -0.5
    rot = pool.rotation.double()
    q16 = ((q.double() @ rot) * (scale * LOG2E)).half().numpy()       # rotate_query_kernel (float32 there)
    po, pl = kernel(q16, pool.data.numpy(), bt.numpy(), sl.numpy(), splits, hkv, hq // hkv)
    out = merge(po, pl, rot.numpy())
    ref = paged_attention_ref(q, pool, bt, sl, torch.arange(len(lens) + 1), scale, dtype=torch.float64).numpy()
    keep = np.array([L > 0 for L in lens])
    rows = np.ones(out.shape[:2], bool)
    rows[~keep] = False
    if nan:
        rows[1, 1] = False
    err = np.linalg.norm(out[rows] - ref[rows]) / np.linalg.norm(ref[rows])
    ok = err < 5e-4 and np.all(out[~keep] == 0)
    if nan:
        ok = ok and bool(np.isnan(out[1, 1]).all())
    print(f"lens {lens} {hq}q/{hkv}kv splits {splits}{' NaN head' if nan else ''}: relerr vs float64 {err:.2e} "
          f"-> {'ok' if ok else 'FAIL'}")
    return ok


def main() -> int:
    results = [case([1, 5, 54, 97, 0, 300], 8, 2, 1), case([1, 5, 54, 97, 0, 300], 8, 2, 3),
               case([97, 0, 33, 600], 6, 2, 7, seed=1), case([40, 97, 17], 8, 2, 2, nan=True, seed=2)]
    return 0 if all(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
