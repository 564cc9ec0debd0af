"""The rope-mean offset's fused Triton ops (``kvrepro.ops.offset``) against a float64 reference and against
``RopeMean``'s PyTorch methods. On the CPU they run in Triton's interpreter (tests/conftest.py)."""
import math

import pytest
import torch

from kvrepro.formats.offset import MAX_PAIRS, RopeMean
from kvrepro.ops.offset import rope_offset, rope_terms

DEV = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _offset(hkv=2, d=64, kept=(3, 8), seed=0, theta=1e6):
    """A RopeMean with ``kept[h]`` pairs per KV head (unused slots left empty), chosen among the model's pairs so
    both fast and slow ones are in, biases of a few hundred (the size of models' key biases)."""
    g = torch.Generator().manual_seed(seed)
    off = RopeMean(hkv, d, {"rope_theta": theta, "neox": True}, device=DEV)
    ax, ay, inv = off.all_pairs()
    xs = torch.zeros(hkv, MAX_PAIRS, dtype=torch.int64)
    ys, fs, bias = xs.clone(), torch.zeros(hkv, MAX_PAIRS), torch.zeros(hkv, MAX_PAIRS, 2)
    for h, k in enumerate(kept):
        pick = torch.randperm(d // 2, generator=g)[:k]
        xs[h, :k], ys[h, :k], fs[h, :k] = ax.cpu()[pick], ay.cpu()[pick], inv.cpu()[pick]
        bias[h, :k] = 300 * torch.randn(k, 2, generator=g)
    off.set_slots(xs.to(DEV), ys.to(DEV), fs.to(DEV), bias.to(DEV))
    return off


def _offset64(off, pos):
    """float64 ``[n, H, D]``: ``R(p) b_hat`` in the kept pairs, the angle the exact product and cos / sin in float64."""
    n, (h, d) = pos.shape[0], (off.num_kv_heads, off.head_dim)
    a = pos.double().cpu()[:, None, None] * off.inv_freq.double().cpu()[None]        # [n, H, M]
    bx, by = off.bias.double().cpu()[..., 0], off.bias.double().cpu()[..., 1]
    out = torch.zeros(n, h, d, dtype=torch.float64)
    idx = torch.arange(h)
    for m in range(MAX_PAIRS):
        c, s = a[..., m].cos(), a[..., m].sin()
        out[:, idx, off.x_ch.cpu()[:, m]] += bx[:, m] * c - by[:, m] * s
        out[:, idx, off.y_ch.cpu()[:, m]] += bx[:, m] * s + by[:, m] * c
    return out


@pytest.mark.parametrize("d", [64, 80])
def test_rope_offset_matches_float64_at_long_positions(d):
    """float32 keys at positions up to 2^24 - 1: ``key - R(p) b_hat`` within 2e-6 of the float64 result, relative
    to |b| (the float32 cosine after a float64 reduction: ~1e-7 rad), and +1 puts the keys back; channels outside the
    kept pairs are the key's own, bit for bit."""
    off = _offset(d=d)
    g = torch.Generator().manual_seed(1)
    pos = torch.cat([torch.arange(0, 40), torch.randint(0, 1 << 24, (40,), generator=g),
                     torch.tensor([(1 << 24) - 1, 131071, 2 ** 20])])
    key = torch.randn(pos.shape[0], off.num_kv_heads, d, generator=g) * 30
    ref = key.double() - _offset64(off, pos)
    got = rope_offset(key.to(DEV), pos.to(DEV), off)
    assert got.dtype == torch.float32 and got.shape == key.shape
    scale = off.bias.abs().max().item()
    assert (got.cpu().double() - ref).abs().max().item() < 2e-6 * scale
    back = rope_offset(got, pos.to(DEV), off, sign=+1).cpu()
    assert (back.double() - key.double()).abs().max().item() < 4e-6 * scale
    kept = torch.zeros(off.num_kv_heads, d, dtype=torch.bool)
    for h in range(off.num_kv_heads):
        m = off.bias.cpu()[h].abs().sum(1) > 0
        kept[h, off.x_ch.cpu()[h][m]] = kept[h, off.y_ch.cpu()[h][m]] = True
    assert torch.equal(got.cpu()[:, ~kept], key[:, ~kept])


def test_rope_offset_in_bf16_agrees_with_ropemean_remove_and_restore():
    """bfloat16 keys (the store's): the fused op and RopeMean.remove round the same float32 sum to bfloat16, so they
    differ at most where the ~1e-7 x |b| between their cosines crosses a rounding boundary: one bfloat16 ulp, rarely;
    restore (float32) agrees with RopeMean.restore to float32 rounding of a |b| of hundreds."""
    off = _offset()
    g = torch.Generator().manual_seed(2)
    pos = torch.randint(0, 131072, (64,), generator=g).to(DEV)
    key = (torch.randn(64, 2, 64, generator=g) * 30).bfloat16().to(DEV)
    got, ref = rope_offset(key, pos, off), off.remove(key, pos)
    assert got.dtype == torch.bfloat16
    diff = (got.float() - ref.float()).abs()
    ulp = ref.float().abs().clamp(min=1e-30) * 2.0 ** -7
    assert bool((diff <= ulp).all()) and (diff > 0).float().mean().item() < 0.02
    rest = rope_offset(got.float(), pos, off, sign=+1)
    assert (rest - off.restore(got, pos)).abs().max().item() < 1e-4 * off.bias.abs().max().item()


def test_rope_offset_reads_strided_and_expanded_positions():
    """A strided ``pos`` (a slice of a buffer) and an expanded one (stride 0) give what the same positions give
    contiguous, and what RopeMean.remove gives: the kernel reads each row's position by pos's stride."""
    off = _offset()
    g = torch.Generator().manual_seed(4)
    buf = torch.tensor([0, 100, 2000, 30000, 400000, 7, 8, 9, 10, 11], dtype=torch.int64).to(DEV)
    key = (torch.randn(5, 2, 64, generator=g) * 30).to(DEV)
    for pos in (buf[::2], buf[3:4].expand(5)):
        assert pos.stride(0) != 1
        got = rope_offset(key, pos, off)
        assert torch.equal(got, rope_offset(key, pos.contiguous(), off))
        assert (got - off.remove(key, pos)).abs().max().item() < 1e-3


@pytest.mark.parametrize("hq", [2, 8])
def test_rope_terms_match_packed_terms_and_float64(hq):
    off = _offset()
    g = torch.Generator().manual_seed(3)
    q = torch.randn(5, hq, 64, generator=g).bfloat16().to(DEV)
    got = rope_terms(q, off)
    assert got.dtype == torch.float32 and got.shape == (5, hq, 2 * MAX_PAIRS) and got.is_contiguous()
    assert torch.allclose(got, off.packed_terms(q), rtol=1e-6, atol=1e-4)
    # float64, by hand: query head j reads KV head j // (hq / 2)
    qd, b = q.double().cpu(), off.bias.double().cpu()
    for j in range(hq):
        h = j // (hq // 2)
        qx, qy = qd[:, j, off.x_ch.cpu()[h]], qd[:, j, off.y_ch.cpu()[h]]
        a_ = qx * b[h, :, 0] + qy * b[h, :, 1]
        b_ = qy * b[h, :, 0] - qx * b[h, :, 1]
        assert torch.allclose(got.cpu()[:, j].double(), torch.cat([a_, b_], 1), rtol=1e-6, atol=1e-3)
    assert rope_terms(q[:0], off).shape == (0, hq, 2 * MAX_PAIRS)


def test_fused_offset_ops_refuse_bad_input_by_name():
    off = _offset()
    key = torch.zeros(3, 2, 64, dtype=torch.bfloat16, device=DEV)
    pos = torch.arange(3, device=DEV)
    for args, kw, msg in [
        ((torch.zeros(3, 1, 64, device=DEV), pos, off), {}, r"key must be \[n, num_kv_heads=2, head_dim=64\]"),
        ((key.double(), pos, off), {}, "key must be bfloat16, float16 or float32"),
        ((key.transpose(1, 2).contiguous().transpose(1, 2), pos, off), {}, "contiguous last dimension"),
        ((key, pos.float(), off), {}, "pos must be an int32 or int64 tensor"),
        ((key, pos[:2], off), {}, r"pos must be an int32 or int64 tensor \[3\]"),
        ((key, pos, off), {"sign": 0}, "sign must be the int -1"),
        ((key, pos, off), {"sign": True}, "sign must be the int -1"),
        ((key, pos, off), {"sign": -1.0}, "sign must be the int -1"),
        ((None, pos, off), {}, "key must be a tensor, got NoneType"),
        ((key, pos, "offset"), {}, "offset must be a kvrepro.formats.offset.RopeMean"),
        ((key, torch.tensor([0, 1, 1 << 24], device=DEV), off), {"validate": True}, r"pos values must be in \[0, 2\^24\)"),
        ((key, torch.tensor([0, -1, 2], device=DEV), off), {"validate": True}, r"min -1"),
    ]:
        with pytest.raises(ValueError, match=msg):
            rope_offset(*args, **kw)
    with pytest.raises(ValueError, match="Hq a multiple of num_kv_heads=2"):
        rope_terms(torch.zeros(1, 3, 64, dtype=torch.bfloat16, device=DEV), off)
    with pytest.raises(ValueError, match="query must be a tensor, got NoneType"):
        rope_terms(None, off)
    for q in (torch.zeros(1, 4, 64, dtype=torch.int32, device=DEV), torch.zeros(1, 4, 128, device=DEV)[..., ::2]):
        with pytest.raises(ValueError, match=r"query must be \[T, Hq, head_dim=64\] bfloat16, float16, float32 with a "
                                             r"contiguous last dimension with Hq a multiple of num_kv_heads=2, got"):
            rope_terms(q, off)
    meta = RopeMean(2, 64, {"rope_theta": 1e6, "neox": True}).to("meta")
    with pytest.raises(ValueError, match=f"key is on {DEV.type}.*, the offset's buffers on meta"):
        rope_offset(key, pos, meta)
    with pytest.raises(ValueError, match=f"query is on {DEV.type}.*, the offset's buffers on meta"):
        rope_terms(key, meta)
    with pytest.raises(ValueError, match="pos is on meta"):
        rope_offset(key, pos.to("meta"), off)
    assert math.isfinite(rope_offset(key, pos, off).float().sum().item())


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU tensor where Triton compiles: the GPU machine's case")
def test_fused_offset_ops_name_their_argument_on_the_cpu_without_the_interpreter(monkeypatch):
    off = _offset()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="key is on cpu: kvrepro's Triton kernels need CUDA tensors"):
        rope_offset(torch.zeros(1, 2, 64), torch.zeros(1, dtype=torch.int64), off)
    with pytest.raises(ValueError, match="query is on cpu: kvrepro's Triton kernels need CUDA tensors"):
        rope_terms(torch.zeros(1, 2, 64), off)
