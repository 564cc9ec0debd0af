"""CPU check of the CUDA prototype's register-level data flow for one page (no GPU needed).

Emulates, lane by lane, what ``decode_k4v4.cu`` does with one k4v4 page in shared memory: ``ldmatrix.x4``
(+ ``.trans``) per the PTX ISA fragment layouts, the int8 / float16 unpacking by bit operations, ``mma.m16n8k32.s8``
and ``mma.m16n8k16.f16`` on their documented A / B / C fragments, ``movmatrix.trans``, and the kernel's channel and
head bookkeeping. Compares the page's logits and its P.V contribution with a direct NumPy computation from the page
bytes decoded by kvrepro's PyTorch reference (``CompressedFormat.decode`` path via the pool regions).

    PYTHONPATH=. python prototypes/cuda_decode/emulate_fragments.py
"""
from __future__ import annotations

import numpy as np
import torch

from kvrepro.formats import get_format

D, BS = 128, 16
V_OFF, KM_OFF, VM_OFF = 1024, 2048, 2112


def ldmatrix_x4(smem: np.ndarray, row_addr: list[int], trans: bool) -> np.ndarray:
    """[32 lanes, 4 regs] uint32: lane t gave the address of row t % 8 of matrix t // 8 (16 bytes = 8 b16)."""
    mats = [np.stack([smem[row_addr[8 * i + r]: row_addr[8 * i + r] + 16].view(np.uint16) for r in range(8)])
            for i in range(4)]                                   # 4 x [8 rows, 8 b16]
    out = np.zeros((32, 4), np.uint32)
    for t in range(32):
        for i, m in enumerate(mats):
            if trans:
                lo, hi = m[2 * (t % 4), t // 4], m[2 * (t % 4) + 1, t // 4]
            else:
                lo, hi = m[t // 4, 2 * (t % 4)], m[t // 4, 2 * (t % 4) + 1]
            out[t, i] = np.uint32(lo) | (np.uint32(hi) << np.uint32(16))
    return out


def s8x4(x: np.uint32) -> np.ndarray:
    return np.frombuffer(np.uint32(x).tobytes(), dtype=np.int8).astype(np.int64)


def f16x2(x: np.uint32) -> np.ndarray:
    return np.frombuffer(np.uint32(x).tobytes(), dtype=np.float16).astype(np.float64)


def pack_f16x2(lo: float, hi: float) -> np.uint32:
    return np.frombuffer(np.array([lo, hi], np.float16).tobytes(), dtype=np.uint32)[0]


def mma_s8(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """m16n8k32 row.col s8: a [32, 4] and b [32, 2] uint32 fragments -> C [32, 4] int64 fragments."""
    A = np.zeros((16, 32), np.int64)
    B = np.zeros((32, 8), np.int64)
    for t in range(32):
        g, q = t // 4, t % 4
        for i in range(4):
            A[g + 8 * (i % 2), q * 4 + 16 * (i // 2): q * 4 + 16 * (i // 2) + 4] = s8x4(a[t, i])
        for i in range(2):
            B[q * 4 + 16 * i: q * 4 + 16 * i + 4, g] = s8x4(b[t, i])
    C = A @ B
    return np.array([[C[t // 4, 2 * (t % 4)], C[t // 4, 2 * (t % 4) + 1], C[t // 4 + 8, 2 * (t % 4)],
                      C[t // 4 + 8, 2 * (t % 4) + 1]] for t in range(32)])


def mma_f16(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """m16n8k16 row.col f16 -> f32: a [32, 4], b [32, 2] uint32 (f16x2) -> C [32, 4] float64."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for t in range(32):
        g, q = t // 4, t % 4
        for i in range(4):
            A[g + 8 * (i % 2), 2 * q + 8 * (i // 2): 2 * q + 8 * (i // 2) + 2] = f16x2(a[t, i])
        for i in range(2):
            B[2 * q + 8 * i: 2 * q + 8 * i + 2, g] = f16x2(b[t, i])
    C = A @ B
    return np.array([[C[t // 4, 2 * (t % 4)], C[t // 4, 2 * (t % 4) + 1], C[t // 4 + 8, 2 * (t % 4)],
                      C[t // 4 + 8, 2 * (t % 4) + 1]] for t in range(32)])


def movmatrix_t(x: np.ndarray) -> np.ndarray:
    """movmatrix.m8n8.trans.b16 on [32] uint32 fragments."""
    M = np.zeros((8, 8), np.uint16)
    for t in range(32):
        M[t // 4, 2 * (t % 4)], M[t // 4, 2 * (t % 4) + 1] = x[t] & 0xFFFF, x[t] >> 16
    return np.array([np.uint32(M[2 * (t % 4), t // 4]) | (np.uint32(M[2 * (t % 4) + 1, t // 4]) << np.uint32(16))
                     for t in range(32)], np.uint32)


def lop(x, mask, v, xor):
    x, mask, v = np.uint32(x), np.uint32(mask), np.uint32(v)
    return (x & mask) ^ v if xor else (x & mask) | v


def hsub2(x, c):
    a = np.frombuffer(np.uint32(x).tobytes(), np.float16)
    b = np.frombuffer(np.uint32(c).tobytes(), np.float16)
    return np.frombuffer((a - b).astype(np.float16).tobytes(), np.uint32)[0]


def to_smem(page: np.ndarray) -> np.ndarray:
    """The page as the kernel's cp.async copy lays it out in shared memory: 16-byte chunk ``c < 128`` (the K and V
    code rows, 4 chunks per token) at chunk ``c ^ ((c >> 3) & 3)``, the metadata chunks in place."""
    out = np.zeros_like(page)
    for lane in range(32):                      # the kernel's issue(): ring_code / ring_meta per lane
        for k in range(4):
            d, c = (lane ^ ((lane >> 3) & 3)) + 32 * k, lane + 32 * k
            out[16 * d: 16 * d + 16] = page[16 * c: 16 * c + 16]
        if lane < len(page) // 16 - 128:
            out[16 * (128 + lane): 16 * (129 + lane)] = page[16 * (128 + lane): 16 * (129 + lane)]
    return out


def bank_ways(addrs: list[int]) -> int:
    """Worst bank conflict of one ldmatrix.x4: per matrix (8 lanes' 16-byte rows), the most rows hitting a bank."""
    worst = 1
    for m in range(4):
        hits = np.zeros(32, int)
        for a in addrs[8 * m: 8 * m + 8]:
            for w in range(4):
                hits[(a // 4 + w) % 32] += 1
        worst = max(worst, int(hits.max()))
    return worst


def row_addr(base: int, half: int) -> list[int]:
    """Per lane, the byte address ldmatrix reads (the kernel's ``swz_row_chunk``): matrix ``lane >> 3`` = tokens
    0-7 / 8-15 x bytes +0 / +16 of 32-byte half ``half``, row ``lane & 7``."""
    out = []
    for t in range(32):
        tok, j = (t >> 3 & 1) * 8 + (t & 7), half * 2 + (t >> 4)
        out.append(base + 16 * (tok * 4 + (j ^ ((tok >> 1) & 3))))
    return out


def key_dot(smem: np.ndarray, bh: np.ndarray, bl: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's S^T = K Q^T for one page in shared memory (``to_smem``): int32 C fragments [32, 4] of the
    high- and low-digit chains (``bh`` / ``bl``: [4 chunks, 32, 2] B fragments of the query digits)."""
    chi = np.zeros((32, 4), np.int64)
    clo = np.zeros((32, 4), np.int64)
    for half in range(2):
        r = ldmatrix_x4(smem, row_addr(0, half), trans=False)
        a_lo = np.array([[lop(np.uint32(r[t, i]) << np.uint32(4), 0xF0F0F0F0, 0x80808080, True) for i in range(4)]
                         for t in range(32)], np.uint32)
        a_hi = np.array([[lop(r[t, i], 0xF0F0F0F0, 0x80808080, True) for i in range(4)] for t in range(32)], np.uint32)
        chi += mma_s8(a_lo, bh[half]) + mma_s8(a_hi, bh[2 + half])
        clo += mma_s8(a_lo, bl[half]) + mma_s8(a_hi, bl[2 + half])
    return chi, clo


def value_dot(smem: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The kernel's O^T contribution of one page in shared memory (``to_smem``): [8 channel tiles, 32, 4] float64
    C fragments for the P^T B fragments ``b`` [32, 2] (tile 4 p + 2 half + e: plane p, bytes 32 half + 16 e)."""
    tc = np.zeros((8, 32, 4))
    for half in range(2):
        r = ldmatrix_x4(smem, row_addr(V_OFF, half), trans=True)
        for e in range(2):
            lo, hi = r[:, 2 * e], r[:, 2 * e + 1]
            for p, (mask, c) in enumerate(((0x000F000F, 0x64086408), (0x00F000F0, 0x64806480))):
                a = np.array([[hsub2(lop(lo[t], mask, 0x64006400, False), c),
                               hsub2(lop(lo[t] >> np.uint32(8), mask, 0x64006400, False), c),
                               hsub2(lop(hi[t], mask, 0x64006400, False), c),
                               hsub2(lop(hi[t] >> np.uint32(8), mask, 0x64006400, False), c)] for t in range(32)],
                             np.uint32)
                tc[4 * p + 2 * half + e] += mma_f16(a, b)
    return tc


def value_dot_v2(page: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, int]:
    """k4v2 (decode_k4v4.cu, VB == 2): the value region [16 tokens][32 bytes] at V_OFF2 as the kernel's copy_page()
    copies it (chunk ``lane`` of the 512-byte run at chunk ``lane ^ ((lane >> 3) & 3)``, the 64-byte-row pattern of
    the key run; ``swz_row_chunk2``: chunk ``2 t + j`` of row ``t`` at ``(2 t + j) ^ ((t >> 2) & 3)``), one
    ldmatrix.x4.trans, and
    per 16-byte half ``e`` and 2-bit plane ``p`` the float16 magic-number unpack (minus 1024 + 2 x 4^p). Returns the
    [8 tiles (2 p + e), 32, 4] C fragments and the worst bank conflict of the read."""
    smem = np.zeros(512, np.uint8)
    for lane in range(32):
        d = lane ^ ((lane >> 3) & 3)
        smem[16 * d: 16 * d + 16] = page[V_OFF2 + 16 * lane: V_OFF2 + 16 * lane + 16]

    def swz2(tok: int, j: int) -> int:     # the kernel's swz_row_chunk2
        return (tok * 2 + j) ^ ((tok >> 2) & 3)

    addrs = [16 * swz2((t >> 3 & 1) * 8 + (t & 7), t >> 4) for t in range(32)]
    r = ldmatrix_x4(smem, addrs, trans=True)
    tc = np.zeros((8, 32, 4))
    for e in range(2):
        lo, hi = r[:, 2 * e], r[:, 2 * e + 1]
        for p in range(4):
            mask, c = 0x00030003 << (2 * p), 0x64006400 | (0x00020002 << (2 * p))
            a = np.array([[hsub2(lop(lo[t], mask, 0x64006400, False), c),
                           hsub2(lop(lo[t] >> np.uint32(8), mask, 0x64006400, False), c),
                           hsub2(lop(hi[t], mask, 0x64006400, False), c),
                           hsub2(lop(hi[t] >> np.uint32(8), mask, 0x64006400, False), c)] for t in range(32)],
                         np.uint32)
            tc[2 * p + e] += mma_f16(a, b)
    return tc, bank_ways(addrs)


V_OFF2, KM_OFF2 = 1024, 1536      # k4v2's value codes [16][32] and K metadata


def check_k4v2(rng, b: np.ndarray, w16: np.ndarray) -> bool:
    """The k4v2 value path against a direct decode of 2-bit split-plane codes (byte j = channels j, j + 32, j + 64,
    j + 96 in bits 0-1, 2-3, 4-5, 6-7): sum over tokens of w (code - 2), per head and channel."""
    page = rng.integers(0, 256, size=get_format("k4v2").layout(D, BS).page_bytes, dtype=np.uint8)
    vc = page[V_OFF2:KM_OFF2].reshape(16, 32)
    vcode = np.concatenate([(vc >> (2 * p)) & 3 for p in range(4)], 1).astype(np.int64)   # [16, 128]
    tc, ways = value_dot_v2(page, b)
    emu_o = np.zeros((8, D))
    for t8 in range(8):
        ch0 = (t8 >> 1) * 32 + (t8 & 1) * 16
        for t in range(32):
            g, h0 = t // 4, 2 * (t % 4)
            emu_o[h0, ch0 + 2 * g], emu_o[h0 + 1, ch0 + 2 * g] = tc[t8, t, 0], tc[t8, t, 1]
            emu_o[h0, ch0 + 2 * g + 1], emu_o[h0 + 1, ch0 + 2 * g + 1] = tc[t8, t, 2], tc[t8, t, 3]
    emu_o /= 4.0 ** (np.arange(D) // 32)[None, :]
    direct_o = w16.T @ (vcode - 2).astype(np.float64)
    err = np.abs(emu_o - direct_o).max() / np.abs(direct_o).max()
    print(f"k4v2 O^T (2-bit values, 128 channels x 8 heads): max relative difference {err:.2e}; "
          f"ldmatrix bank conflicts {ways}-way")
    return err < 1e-6 and ways == 1


def main() -> int:
    rng = np.random.default_rng(0)
    fmt = get_format("k4v4")
    pool = fmt.new_pool(1, 1, D, BS, device="cpu")
    page = rng.integers(0, 256, size=pool.layout.page_bytes, dtype=np.uint8)
    page[KM_OFF:VM_OFF] = np.frombuffer(np.stack([rng.uniform(0.05, 0.15, 16), rng.uniform(-1.2, -0.8, 16)], 1)
                                        .astype(np.float16).tobytes(), np.uint8)
    page[VM_OFF:] = np.frombuffer(rng.uniform(0.05, 0.15, 16).astype(np.float16).tobytes(), np.uint8)
    # direct decode of the page (split-plane nibbles: byte j = channel j low, j + 64 high)
    kc = page[:V_OFF].reshape(16, 64)
    vc = page[V_OFF:KM_OFF].reshape(16, 64)
    kcode = np.concatenate([kc & 15, kc >> 4], 1).astype(np.int64)          # [16 tokens, 128 channels]
    vcode = np.concatenate([vc & 15, vc >> 4], 1).astype(np.int64)
    vs = page[VM_OFF:].view(np.float16).astype(np.float64)
    group = 4
    qi = rng.integers(-16255, 16256, size=(8, D))
    qi[group:] = 0
    qh = (qi + 64) >> 7
    ql = qi - (qh << 7)

    # ---- emulate: B fragments of Q^T per chunk (kernel: ch = (c & 1) 32 + (c >> 1) 64 + tq 4)
    def qfrag(dig):
        fr = np.zeros((4, 32, 2), np.uint32)
        for c in range(4):
            for t in range(32):
                g, tq = t // 4, t % 4
                ch = (c & 1) * 32 + (c >> 1) * 64 + tq * 4
                for j, off in enumerate((0, 16)):
                    fr[c, t, j] = np.frombuffer(dig[g, ch + off: ch + off + 4].astype(np.int8).tobytes(), np.uint32)[0]
        return fr
    bh, bl = qfrag(qh), qfrag(ql)
    smem = to_smem(page)
    chi, clo = key_dot(smem, bh, bl)
    acc = chi * 128 + clo                                                  # [lane, (tok g h0, g h1, g+8 h0, g+8 h1)]
    direct = 16 * (kcode - 8) @ qi.T                                       # [16 tokens, 8 heads]
    emu = np.zeros((16, 8), np.int64)
    for t in range(32):
        g, h0 = t // 4, 2 * (t % 4)
        emu[g, h0], emu[g, h0 + 1], emu[g + 8, h0], emu[g + 8, h0 + 1] = acc[t]
    ok_k = np.array_equal(emu, direct)
    print(f"S^T (int32 key dot, 16 tokens x 8 heads): emulated == direct: {ok_k}")

    # ---- P.V: weights w[token, head] (f16-rounded as the kernel packs them)
    w = rng.uniform(0, 1, size=(16, 8)) * vs[:, None]
    w[:, group:] = 0
    pb = []
    for tokblk in range(2):
        x = np.array([pack_f16x2(w[tokblk * 8 + t // 4, 2 * (t % 4)], w[tokblk * 8 + t // 4, 2 * (t % 4) + 1])
                      for t in range(32)], np.uint32)
        pb.append(movmatrix_t(x))
    b = np.stack(pb, 1)                                                    # [32, 2]
    tc = value_dot(smem, b)
    emu_o = np.zeros((8, D))                                               # [head, channel] = sum w (code - 8) (x16 plane 1)
    for t8 in range(8):
        ch0 = (t8 >> 2) * 64 + ((t8 >> 1) & 1) * 32 + (t8 & 1) * 16
        for t in range(32):
            g, h0 = t // 4, 2 * (t % 4)
            emu_o[h0, ch0 + 2 * g], emu_o[h0 + 1, ch0 + 2 * g] = tc[t8, t, 0], tc[t8, t, 1]
            emu_o[h0, ch0 + 2 * g + 1], emu_o[h0 + 1, ch0 + 2 * g + 1] = tc[t8, t, 2], tc[t8, t, 3]
    emu_o[:, 64:] /= 16
    w16 = w.astype(np.float16).astype(np.float64)
    direct_o = w16.T @ (vcode - 8).astype(np.float64)
    err = np.abs(emu_o - direct_o).max() / np.abs(direct_o).max()
    ok_v = err < 1e-6
    print(f"O^T (P.V, 128 channels x 8 heads): max relative difference {err:.2e}: {ok_v}")
    # sanity: the reference decode of the same bytes agrees with the nibble reading used above
    data = torch.from_numpy(page.copy()).view(1, 1, -1)
    pool.data.copy_(data)
    kr, vr = pool.regions()[:2]
    same = torch.equal(kr.reshape(-1), torch.from_numpy(page[:V_OFF].copy())) and \
        torch.equal(vr.reshape(-1), torch.from_numpy(page[V_OFF:KM_OFF].copy()))
    print(f"page regions match the layout offsets used: {same}")
    ways = max(bank_ways(row_addr(base, half)) for base in (0, V_OFF) for half in (0, 1))
    plain = max(bank_ways([base + ((t >> 3 & 1) * 8 + (t & 7)) * 64 + half * 32 + (t >> 4) * 16 for t in range(32)])
                for base in (0, V_OFF) for half in (0, 1))
    print(f"ldmatrix bank conflicts: {ways}-way with the swizzle ({plain}-way without)")
    same = same and ways == 1
    ok_v2 = check_k4v2(rng, b, w16)
    return 0 if ok_k and ok_v and same and ok_v2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
