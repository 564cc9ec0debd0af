"""The key offset (kvrepro.formats.offset): calibration, the softmax-invariant shift on both engines' store paths,
and what it buys under a key bias, against float64 attention."""
import pytest
import torch

from kvrepro.formats import COMPRESSED_PRESETS, get_format
from kvrepro.formats.offset import (MAX_PAIRS, MODES, KeyOffset, RopeMean, check_mode, rope_inv_freq, rope_of_config,
                                    slow_channels)
from kvrepro.keybias import BAR, SHAPES, rope, stress
from kvrepro.reference import attention_ref
from kvrepro.vllm_backend.runtime import LayerRuntime, reference_attend


def _keys(n=96, h=2, d=64, mean=5.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, h, d, generator=g, dtype=torch.float64) + mean * torch.randn(h, d, generator=g,
                                                                                       dtype=torch.float64)


def test_calibrates_once_to_the_mean_and_refuses_bad_input():
    k = _keys()
    off = KeyOffset(2, 64)
    assert not off.calibrated and off.offset.abs().max() == 0
    off.calibrate(k.float())
    assert off.calibrated and off.tokens == 96
    torch.testing.assert_close(off.offset.double(), k.float().double().mean(0), atol=1e-5, rtol=0)
    first = off.offset.clone()
    off.calibrate(_keys(seed=1).float())                 # one constant for the engine's lifetime
    assert torch.equal(off.offset, first) and off.tokens == 96
    got = off.apply(k.to(torch.bfloat16))
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), (k.to(torch.bfloat16).double() - first.double()), atol=0.06, rtol=0)
    with pytest.raises(ValueError, match=r"key must be \[T >= 1, 2, 64\]"):
        KeyOffset(2, 64).calibrate(torch.zeros(4, 2, 32))
    with pytest.raises(ValueError, match="num_kv_heads must be a positive int"):
        KeyOffset(0, 64)
    with pytest.raises(ValueError, match="key_offset='mean'; allowed: slow-pairs, first-prefill, off, rope-mean"):
        check_mode("mean")
    assert MODES == ("slow-pairs", "first-prefill", "off", "rope-mean")
    ch = torch.zeros(64, dtype=torch.bool)
    ch[60:] = True
    off = KeyOffset(2, 64, channels=ch)
    off.calibrate(k.float())
    assert (off.offset[:, :60] == 0).all() and torch.equal(off.offset[:, 60:], k.float().mean(0)[:, 60:])
    with pytest.raises(ValueError, match=r"channels must be a bool tensor of shape \(64,\)"):
        KeyOffset(2, 64, channels=torch.ones(32, dtype=torch.bool))


def test_slow_channels_are_the_pairs_rope_barely_turns():
    """Against the RoPE angle computed independently: pair i of a half-split layout holds channels i and i + D/2 and
    turns by max_positions x theta^(-2i/D); kept iff that is < pi/4. Interleaved: channels 2i, 2i + 1."""
    import math

    d, theta, n = 128, 1e6, 131_072
    want = [i for i in range(64) if n * theta ** (-2 * i / d) < math.pi / 4]
    m = slow_channels(d, theta, n)
    assert m.nonzero().flatten().tolist() == want + [i + 64 for i in want] and want == list(range(56, 64))
    inter = slow_channels(d, theta, n, neox=False)
    assert inter.nonzero().flatten().tolist() == [c for i in want for c in (2 * i, 2 * i + 1)]
    both = slow_channels(d, theta, n, neox=None)
    assert torch.equal(both, m & inter)
    part = slow_channels(80, theta, n, rotary_dim=64)           # partial rotary: the unrotated tail is constant
    assert part[64:].all() and part[:64].sum() == 2 * len([i for i in range(32) if n * theta ** (-2 * i / 64) < math.pi / 4])
    assert slow_channels(64, 1e5, 8192).sum() == 12            # SmolLM2-135M at its 8K window: 6 of 32 pairs
    for bad in (dict(head_dim=64, rope_theta=0.0, max_positions=8), dict(head_dim=64, rope_theta=1e4, max_positions=8,
                                                                          rotary_dim=65)):
        with pytest.raises(ValueError):
            slow_channels(**bad)


def test_rope_of_config_reads_both_spellings_and_refuses_a_model_without_rope():
    from types import SimpleNamespace as NS

    new = NS(rope_parameters={"rope_theta": 1e5, "rope_type": "default"}, head_dim=64, max_position_embeddings=8192)
    old = NS(rope_theta=1e6, hidden_size=2560, num_attention_heads=32, max_position_embeddings=40960,
             partial_rotary_factor=0.5)
    assert rope_of_config(new) == {"rope_theta": 1e5, "rotary_dim": 64, "head_dim": 64, "max_positions": 8192}
    assert rope_of_config(old, max_positions=131_072) == {"rope_theta": 1e6, "rotary_dim": 40, "head_dim": 80,
                                                          "max_positions": 131_072}
    with pytest.raises(ValueError, match="needs the model's RoPE theta"):
        rope_of_config(NS(head_dim=64, max_position_embeddings=8))


def test_slow_pairs_never_hurt_where_a_short_first_prefill_misleads_every_channel():
    """The fault class behind the default: keys RoPE(m + noise) with a mean m in every pair, the offset calibrated on a
    64-token first prefill, keys read at positions 3,000-4,095. In the pairs that turn between the two, the
    every-channel mean is the wrong constant (it makes those keys' mean larger than no offset at all); the slow-pairs
    offset removes the mean where it is constant and leaves the rest as it was, so it is never worse than off."""
    g = torch.Generator().manual_seed(4)
    d, n = 128, 4096
    m = 8.0 * torch.randn(d, generator=g, dtype=torch.float64)
    keys = rope((m + torch.randn(1, n, d, generator=g, dtype=torch.float64)), torch.arange(n), base=1e4)[0]
    far = keys[3000:]
    def mean_norm(mode):
        if mode == "off":
            c = torch.zeros(d, dtype=torch.float64)
        else:
            ch = slow_channels(d, 1e4, n) if mode == "slow-pairs" else torch.ones(d, dtype=torch.bool)
            c = keys[:64].mean(0) * ch
        return float((far - c).mean(0).norm())     # what the quantizer still sees of the keys' mean far out
    off, every, slow = mean_norm("off"), mean_norm("first-prefill"), mean_norm("slow-pairs")
    assert every > off                     # the every-channel mean from 64 tokens is wrong far away
    assert slow < off                      # the slow pairs' part is removed, nothing is added


def test_shift_is_softmax_invariant_so_attention_is_unchanged():
    """Attention over keys minus any constant equals attention over the keys (float64, to rounding)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(5, 8, 64, generator=g, dtype=torch.float64)
    k, v = _keys(mean=40.0), torch.randn(96, 2, 64, generator=g, dtype=torch.float64)
    c = k.mean(0)
    a = attention_ref(q, k, v, 0.125, torch.float64)
    b = attention_ref(q, k - c, v, 0.125, torch.float64)
    torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


@pytest.mark.parametrize("preset", sorted(COMPRESSED_PRESETS))
def test_roundtrip_with_offset_stores_keys_minus_their_mean(preset):
    f = get_format(preset)
    assert f.default_key_offset == "rope-mean"
    assert get_format("bf16").default_key_offset == get_format("fp8").default_key_offset == "off"
    k, v = _keys(mean=30.0).float(), torch.randn(96, 2, 64).float()
    c = k.mean(0)
    kh, vh = f.roundtrip(k, v, key_offset="first-prefill")
    want_k, want_v = f.roundtrip(k - c, v)
    torch.testing.assert_close(kh, want_k + c, atol=1e-5, rtol=0)
    assert torch.equal(vh, want_v)
    # the offset is what makes 4-bit keys usable under a large mean: error vs the keys, float64
    err_on = (kh.double() - k.double()).norm() / k.double().norm()
    err_off = (f.roundtrip(k, v)[0].double() - k.double()).norm() / k.double().norm()
    assert err_on < 0.5 * err_off, (err_on, err_off)
    ch = torch.zeros(64, dtype=torch.bool)
    ch[32:40] = True
    ks, _ = f.roundtrip(k, v, key_offset="slow-pairs", channels=ch)
    c2 = k.mean(0) * ch
    torch.testing.assert_close(ks, f.roundtrip(k - c2, v)[0] + c2, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="needs channels"):
        f.roundtrip(k, v, key_offset="slow-pairs")


def test_hf_cache_calibrates_on_the_first_write_and_keeps_the_constant():
    from kvrepro.hf import PagedKVLayer

    f = get_format("k4v4")
    with pytest.raises(ValueError, match="needs the model's RoPE"):
        PagedKVLayer(f, 16)
    layer = PagedKVLayer(f, 16, key_offset="first-prefill")
    k1 = _keys(40, mean=20.0).float()
    v1 = torch.randn(40, 2, 64)
    got_k, _ = layer.update(k1.transpose(0, 1)[None], v1.transpose(0, 1)[None])
    c = layer.key_offset.offset
    torch.testing.assert_close(c, k1.mean(0), atol=1e-5, rtol=0)
    want = f.roundtrip(k1 - c, v1)[0]
    torch.testing.assert_close(got_k[0].transpose(0, 1), want, atol=1e-5, rtol=0)
    k2 = _keys(3, mean=20.0, seed=5).float()                      # a decode step: same constant
    got_k, _ = layer.update(k2.transpose(0, 1)[None], torch.randn(1, 2, 3, 64))
    assert torch.equal(layer.key_offset.offset, c)
    torch.testing.assert_close(got_k[0].transpose(0, 1)[40:], f.roundtrip(k2 - c, torch.zeros(3, 2, 64))[0],
                               atol=1e-5, rtol=0)
    layer.reset()
    assert layer.key_offset is None
    assert PagedKVLayer(f, 16, key_offset="off").key_offset_mode == "off"
    with pytest.raises(ValueError, match="key_offset="):
        PagedKVLayer(f, 16, key_offset="always")
    rope = {"rope_theta": 1e4, "rotary_dim": 64, "head_dim": 64, "max_positions": 40}
    assert PagedKVLayer(f, 16, rope=rope).key_offset_mode == "rope-mean"   # the format's default
    layer = PagedKVLayer(f, 16, rope=rope, key_offset="slow-pairs")
    layer.update(k1.transpose(0, 1)[None], v1.transpose(0, 1)[None])
    ch = slow_channels(64, 1e4, 40)
    assert 0 < int(ch.sum()) < 64
    torch.testing.assert_close(layer.key_offset.offset, k1.mean(0) * ch, atol=1e-5, rtol=0)


def test_vllm_runtime_calibrates_on_the_prefill_rows_and_prefill_matches_reference():
    """Store a prefill with ``calibrate`` (the backend passes the step's prefill rows), then attend: the pages hold
    keys minus the offset, and the chunk's own keys are shifted the same way (reference_attend in float64)."""
    hq, hkv, d, bs, n = 8, 2, 64, 16, 37
    with pytest.raises(ValueError, match="needs the model's RoPE"):
        LayerRuntime("k4v4", hq, hkv, d, d ** -0.5, key_offset="slow-pairs")
    assert LayerRuntime("k4v4", hq, hkv, d, d ** -0.5).key_offset is None      # the class default: off
    rt = LayerRuntime("k4v4", hq, hkv, d, d ** -0.5, key_offset="first-prefill")
    g = torch.Generator().manual_seed(2)
    k = (_keys(n, hkv, d, mean=25.0, seed=2)).to(torch.bfloat16)
    v = torch.randn(n, hkv, d, generator=g).bfloat16()
    q = torch.randn(n, hq, d, generator=g).bfloat16()
    pool = torch.zeros(4, hkv, rt.fmt.layout(d, bs).page_bytes, dtype=torch.uint8)
    rt.store(k.view(n, -1), v.view(n, -1), pool, torch.arange(n), calibrate=(0, n))
    assert rt.key_offset.calibrated and rt.key_offset.tokens == n
    c = rt.key_offset.offset
    torch.testing.assert_close(c, k.float().mean(0), atol=1e-4, rtol=0)
    ref_pool = rt.fmt.new_pool(1, hkv, d, bs)
    ref_pool.data = pool
    got_k, _ = ref_pool.gather(torch.arange(4), n)
    want_k = rt.fmt.roundtrip(rt.key_offset.apply(k).float(), v.float(), bs)[0]
    assert torch.isclose(got_k, want_k, atol=1e-3, rtol=1e-3).float().mean() > 0.999
    bt = torch.arange(4, dtype=torch.int32)[None]
    sl, qsl = torch.tensor([n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32)
    out = torch.zeros(n, hq, d, dtype=torch.bfloat16)
    rt.attend(q, k, v, pool, bt, sl, qsl, n, 0, 0, out, max_query_len=n)
    ref = reference_attend(rt, q, k, v, pool, bt, sl, qsl, n, 0)
    assert (out.double() - ref).abs().max() / ref.abs().max() < 2e-2
    # exact attention over the original keys: the shift changes nothing but quantization error
    exact = attention_ref(q, k.double(), v.double(), d ** -0.5, torch.float64)
    assert (out.double() - exact).norm() / exact.norm() < 0.2
    with pytest.raises(ValueError, match="key_offset="):
        LayerRuntime("k4v4", hq, hkv, d, d ** -0.5, key_offset="on")
    rope = {"rope_theta": 1e4, "rotary_dim": 64, "head_dim": 64, "max_positions": 64, "neox": None}
    slow = LayerRuntime("k4v4", hq, hkv, d, d ** -0.5, key_offset="slow-pairs", rope=rope)
    slow.store(k.view(n, -1), v.view(n, -1), torch.zeros_like(pool), torch.arange(n), calibrate=(0, n))
    ch = slow_channels(64, 1e4, 64, neox=None)                 # layout unknown: channels slow under both
    torch.testing.assert_close(slow.key_offset.offset, k.float().mean(0) * ch, atol=1e-4, rtol=0)


@pytest.mark.parametrize("preset", sorted(COMPRESSED_PRESETS))
def test_low_frequency_key_bias_meets_the_bar_on_every_supported_shape(preset):
    """Issue 21 item 5 for the placement where models' key biases and massive key values sit (the slowest RoPE
    pairs): with the default key offset, bias norm 1000 before RoPE leaves the attention-output error within 1.5x
    of the unbiased one. Head dims the rotation cannot take (80, 192) are refused (test_keybias)."""
    for shape in SHAPES:
        if shape[2] not in (64, 128):
            continue
        base = stress(preset, shape, 0.0, "low", tokens=512)["rel_err"]
        r = stress(preset, shape, 1000.0, "low", tokens=512)
        assert r["rel_err"] / base <= BAR, (shape, r["rel_err"] / base)
        off = stress(preset, shape, 1000.0, "low", tokens=512, key_offset="off")["rel_err"]
        assert off / base > BAR, (shape, off / base)      # without the offset the bar is missed: it is what does it


def test_rope_keeps_a_low_frequency_bias_nearly_constant():
    """Why one constant per layer removes such a bias: the slowest pair turns by < 0.01 rad over 4096 positions at
    base 1e6, the fastest by ~1 rad per position."""
    b = torch.zeros(1, 1, 128, dtype=torch.float64)
    b[..., 63] = 1.0
    r = rope(b.expand(1, 4096, 128), torch.arange(4096))[0]
    assert (r[:, 63] - 1.0).abs().max() < 1e-4
    b[..., 63], b[..., 0] = 0.0, 1.0
    r = rope(b.expand(1, 4096, 128), torch.arange(4096))[0]
    assert r[:, 0].min() < -0.99


def _interleaved_rope(x, pos, base):
    """GPT-J style (interleaved pairs 2i, 2i + 1) RoPE in float64 via complex numbers: an independent reference."""
    d = x.shape[-1]
    inv = base ** (-torch.arange(d // 2, dtype=torch.float64) * 2 / d)
    z = torch.complex(x[..., 0::2].double(), x[..., 1::2].double()) * torch.exp(1j * pos[:, None].double() * inv)
    return torch.stack([z.real, z.imag], -1).flatten(-2)


@pytest.mark.parametrize("neox", [True, False])
def test_rope_mean_recovers_a_pre_rope_bias_and_restores_exact_scores(neox):
    """Keys R(p)(b + noise) with b in 3 pairs (a fast one, a middle one, a slow one) at positions 100..611: the
    calibration finds b (un-rotating by position), keeps exactly those pairs, the stored residual has no bias left,
    restore() gives the keys back, and the score correction from (A, B) equals q . R(j) b_hat computed with the
    independent float64 RoPE."""
    g = torch.Generator().manual_seed(7)
    h, d, n, base = 2, 64, 512, 1e4
    pairs = [0, 13, 31]
    chx = pairs if neox else [2 * i for i in pairs]
    chy = [i + 32 for i in pairs] if neox else [2 * i + 1 for i in pairs]
    b = torch.zeros(h, d, dtype=torch.float64)
    b[:, chx] = torch.tensor([[300.0, -120.0, 40.0], [-200.0, 90.0, 500.0]], dtype=torch.float64)
    b[:, chy] = torch.tensor([[100.0, 250.0, -60.0], [10.0, -70.0, 5.0]], dtype=torch.float64)
    pos = torch.arange(100, 100 + n)
    pre = b[:, None] + torch.randn(h, n, d, generator=g, dtype=torch.float64)
    k = (rope(pre, pos, base) if neox else _interleaved_rope(pre, pos, base)).transpose(0, 1).float()   # [n, h, d]
    rm = RopeMean(h, d, {"rope_theta": base, "neox": neox})
    rm.calibrate(k, pos)
    assert rm.calibrated and rm.tokens == n and rm.kept == [3, 3]
    for hh in range(h):
        got = {int(x): (int(y), bx, by) for x, y, (bx, by) in zip(rm.x_ch[hh], rm.y_ch[hh], rm.bias[hh].tolist())
               if (bx, by) != (0.0, 0.0)}
        assert sorted(got) == sorted(chx)
        for x, y in zip(chx, chy):
            assert got[x][0] == y
            assert abs(got[x][1] - b[hh, x]) < 0.2 and abs(got[x][2] - b[hh, y]) < 0.2   # noise / sqrt(512) ~ 0.04
    resid = rm.remove(k, pos).double()
    assert resid.mean(0).abs().max() < 0.3 and resid.abs().max() < 7     # only the N(0, 1) part is left to quantize
    torch.testing.assert_close(rm.restore(resid.float(), pos).double(), k.double(), atol=2e-3, rtol=0)
    q = torch.randn(5, 6, d, generator=g, dtype=torch.float64)
    bb = rm.offset(torch.zeros(1, dtype=torch.int64))[0].double()       # b_hat laid out in channels (R(0) = I)
    rb = rope(bb[:, None].expand(h, n, d), pos, base) if neox else _interleaved_rope(bb[:, None].expand(h, n, d), pos,
                                                                                      base)
    want = torch.einsum("thd,hnd->thn", q, rb.repeat_interleave(3, 0))
    got = rm.score_correction(q.float(), pos).double()
    assert (got - want).abs().max() / want.abs().max() < 1e-5
    a_, b_ = rm.score_terms(q.float())
    assert a_.shape == b_.shape == (5, 6, MAX_PAIRS) and (a_[:, :, 3:] == 0).all()
    rm.calibrate(k[:10] * 0, pos[:10])                                   # one offset for the engine's lifetime
    assert rm.tokens == n


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_mean_packed_paths_round_as_the_pair_formulas(neox, dtype):
    """What runs every step (``remove`` at each KV store, ``packed_terms`` at each decode; ``offset`` and ``restore``
    share ``remove``'s code) is one gather / scatter and one multiply-sum over packed slots; it must give bit for bit
    the float32 pair formulas written out here:
    ``key - (bx cos - by sin, bx sin + by cos)`` in the kept channels and ``A = qx bx + qy by``,
    ``B = qy bx - qx by``. Slots written after calibration (``set_slots``) are repacked, and a float32 key passed to
    ``remove`` is not modified."""
    g = torch.Generator().manual_seed(3)
    h, d, n = 4, 128, 300
    pos = torch.arange(n) * 37 + 5
    key = (torch.randn(n, h, d, generator=g) + 5 * torch.randn(1, h, d, generator=g)).to(dtype)
    rm = RopeMean(h, d, {"rope_theta": 1e6, "neox": neox})
    rm.calibrate(key, pos)
    assert min(rm.kept) >= 1

    def pair_formulas():
        c, s = RopeMean.cos_sin(pos, rm.inv_freq)
        bx, by = rm.bias[..., 0], rm.bias[..., 1]
        off = torch.zeros(n, h, d)
        off.scatter_add_(2, rm.x_ch.expand(n, -1, -1), bx * c - by * s)
        off.scatter_add_(2, rm.y_ch.expand(n, -1, -1), bx * s + by * c)
        qv = q.float().view(7, h, 3, d)
        qx = qv.gather(3, rm.x_ch[None, :, None].expand(7, h, 3, MAX_PAIRS))
        qy = qv.gather(3, rm.y_ch[None, :, None].expand(7, h, 3, MAX_PAIRS))
        bx_, by_ = bx[None, :, None], by[None, :, None]
        return (off, (key.float() - off).to(dtype), (qx * bx_ + qy * by_).reshape(7, 3 * h, MAX_PAIRS),
                (qy * bx_ - qx * by_).reshape(7, 3 * h, MAX_PAIRS))

    q = torch.randn(7, 3 * h, d, generator=g).to(dtype)
    for _ in range(2):
        want_off, want_k, want_a, want_b = pair_formulas()
        before = key.clone()
        assert torch.equal(rm.remove(key, pos), want_k) and torch.equal(key, before)
        assert torch.equal(rm.offset(pos), want_off) and torch.equal(rm.restore(key, pos), key.float() + want_off)
        assert torch.equal(key, before)
        ab = rm.packed_terms(q)
        assert ab.is_contiguous() and ab.shape == (7, 3 * h, 2 * MAX_PAIRS)
        assert torch.equal(ab[..., :MAX_PAIRS], want_a) and torch.equal(ab[..., MAX_PAIRS:], want_b)
        a_, b_ = rm.score_terms(q)
        assert torch.equal(a_, want_a) and torch.equal(b_, want_b)
        b2, x2, y2 = rm.bias.clone(), rm.x_ch.clone(), rm.y_ch.clone()     # other slots: the next calls must see them
        b2[1] *= -2.0
        x2[2], y2[2] = rm.y_ch[2], rm.x_ch[2]
        rm.set_slots(x2, y2, rm.inv_freq.clone(), b2)
    with pytest.raises(ValueError, match=r"set_slots: bias must be \[4, 8, 2\]"):
        rm.set_slots(rm.x_ch, rm.y_ch, rm.inv_freq, rm.bias[:, :, 0])


def test_rope_mean_keeps_at_most_max_pairs_and_only_pairs_above_the_spread_and_refuses_bad_input():
    g = torch.Generator().manual_seed(1)
    h, d, n = 1, 64, 256
    b = torch.zeros(h, d, dtype=torch.float64)
    b[0, :12] = torch.arange(12, dtype=torch.float64) * 10 + 50     # 12 pairs with a large mean
    b[0, 20] = 0.5                                                  # below the spread (~1.4 per pair): not kept
    pos = torch.arange(n)
    k = rope(b[:, None] + torch.randn(h, n, d, generator=g, dtype=torch.float64), pos, 1e4).transpose(0, 1).float()
    rm = RopeMean(h, d, {"rope_theta": 1e4, "neox": True})
    rm.calibrate(k, pos)
    assert rm.kept == [MAX_PAIRS] and sorted(rm.x_ch[0].tolist()) == list(range(4, 12))   # the 8 largest
    rm = RopeMean(h, d, {"rope_theta": 1e4, "neox": True})
    rm.calibrate(rope(torch.randn(h, n, d, generator=g, dtype=torch.float64), pos, 1e4).transpose(0, 1).float(), pos)
    assert rm.kept == [0] and (rm.bias == 0).all()                   # no bias: nothing kept, the format alone
    with pytest.raises(ValueError, match="needs the RoPE pair layout"):       # unknown layout: refused at calibration
        RopeMean(1, 64, {"rope_theta": 1e4, "neox": None}).calibrate(torch.zeros(3, 1, 64), torch.arange(3))
    with pytest.raises(ValueError, match="must be True, False or None"):
        RopeMean(1, 64, {"rope_theta": 1e4, "neox": "yes"})
    with pytest.raises(ValueError, match="needs the model's RoPE"):
        RopeMean(1, 64, {})
    with pytest.raises(ValueError, match=r"key must be \[T >= 1, 1, 64\]"):
        RopeMean(1, 64, {"rope_theta": 1e4, "neox": True}).calibrate(torch.zeros(3, 2, 64), torch.arange(3))
    with pytest.raises(ValueError, match=r"pos must be \[T=3\]"):
        RopeMean(1, 64, {"rope_theta": 1e4, "neox": True}).calibrate(torch.zeros(3, 1, 64), torch.arange(4))
    part = RopeMean(1, 80, {"rope_theta": 1e4, "rotary_dim": 64, "neox": True})   # unrotated tail: frequency-0 pairs
    x, _, inv = part.all_pairs()
    assert x.tolist()[-8:] == [64, 66, 68, 70, 72, 74, 76, 78] and (inv[32:] == 0).all()


def test_rope_mean_refuses_arguments_on_another_device_than_its_buffers():
    """Every method names the argument that is not on the buffers' device (here "meta" buffers, CPU arguments: on a
    GPU, CUDA buffers and a position tensor left on the host) instead of copying it silently."""
    rope_ = {"rope_theta": 1e4, "neox": True}
    rm = RopeMean(2, 64, rope_, device="meta")
    key, pos, q = torch.zeros(3, 2, 64), torch.arange(3), torch.zeros(3, 4, 64)
    for call, name in ((lambda: rm.calibrate(key, pos), "key"), (lambda: rm.offset(pos), "pos"),
                       (lambda: rm.remove(key, pos), "key"), (lambda: rm.restore(key, pos), "key"),
                       (lambda: rm.score_terms(q), "query"), (lambda: rm.score_correction(q, pos), "pos")):
        with pytest.raises(ValueError, match=f"RopeMean: {name} is on cpu, the offset's buffers on meta"):
            call()
    with pytest.raises(ValueError, match="RopeMean.angles: pos is on cpu, inv_freq on meta"):
        RopeMean.angles(pos, rm.inv_freq)
    assert not rm.calibrated
    rm = RopeMean(2, 64, rope_)                                     # buffers where the arguments are: accepted
    rm.calibrate(key, pos)
    assert rm.calibrated and rm.remove(key, pos).device == key.device


def test_rope_mean_angles_are_exact_and_stay_within_float32_rounding_of_the_models_rope():
    """RopeMean's angles are the exact products position x inv_freq (float64), with inv_freq equal to transformers'
    Llama rotary embedding's (the cos/sin cache vLLM's RotaryEmbedding builds the same way); its float32 cos/sin differ
    from the model's, whose angle is rounded to float32 first, by at most that rounding (half a float32 ulp of the
    angle, 2^-8 rad at 131,071 in the fastest pair) plus cos/sin rounding: what the module docstring says stays in the
    stored residual."""
    from types import SimpleNamespace as NS

    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = NS(rope_parameters={"rope_theta": 1e6, "rope_type": "default"}, head_dim=128, hidden_size=4096,
             num_attention_heads=32, max_position_embeddings=131072, partial_rotary_factor=1.0)
    try:
        emb = LlamaRotaryEmbedding(cfg)
    except Exception as e:   # a transformers version reading other config fields
        pytest.skip(f"LlamaRotaryEmbedding does not take this config: {e}")
    inv = rope_inv_freq(128, 1e6)
    torch.testing.assert_close(emb.inv_freq, inv, atol=0, rtol=0)
    pos = torch.tensor([0, 1, 4095, 65_537, 131_071])
    cos, sin = emb(torch.zeros(1, 5, 128), pos[None])
    a = RopeMean.angles(pos, inv)
    exact = pos[:, None].double() * inv.double()[None]
    assert a.dtype == torch.float64 and torch.equal(a, exact)
    c, s = RopeMean.cos_sin(pos, inv)
    torch.testing.assert_close(c, exact.cos().float(), atol=0, rtol=0)
    bound = exact * 2.0 ** -24 + 1.2e-7                   # half an ulp of the angle, plus both cos/sin roundings
    assert ((cos[0, :, :64].double() - c.double()).abs() <= bound).all()
    assert ((sin[0, :, :64].double() - s.double()).abs() <= bound).all()
    assert (cos[0, :, :64].double() - c.double()).abs().max() > 1e-4   # the model's float32 angle at long context


@pytest.mark.parametrize("preset", sorted(COMPRESSED_PRESETS))
def test_roundtrip_with_rope_mean_stores_the_residual_and_hands_back_exact_keys(preset):
    f = get_format(preset)
    g = torch.Generator().manual_seed(5)
    n, h, d = 96, 2, 64
    b = torch.zeros(h, d, dtype=torch.float64)
    b[:, [0, 1, 32, 33]] = 250.0
    k = rope(b[:, None] + torch.randn(h, n, d, generator=g, dtype=torch.float64), torch.arange(n), 1e4)
    k, v = k.transpose(0, 1).float(), torch.randn(n, h, d, generator=g)
    rope_ = {"rope_theta": 1e4, "neox": True}
    kh, vh = f.roundtrip(k, v, key_offset="rope-mean", rope=rope_)
    rm = RopeMean(h, d, rope_)
    rm.calibrate(k, torch.arange(n))
    want = rm.restore(f.roundtrip(rm.remove(k, torch.arange(n)), v)[0], torch.arange(n))
    torch.testing.assert_close(kh, want, atol=1e-3, rtol=0)
    assert torch.equal(vh, f.roundtrip(k, v)[1])
    err = (kh.double() - k.double()).norm() / k.double().norm()
    err_off = (f.roundtrip(k, v)[0].double() - k.double()).norm() / k.double().norm()
    assert err < 0.1 * err_off, (err, err_off)
    with pytest.raises(ValueError, match="needs rope"):
        f.roundtrip(k, v, key_offset="rope-mean")


def test_hf_cache_with_rope_mean_calibrates_on_the_first_write_and_hands_back_restored_keys():
    from kvrepro.hf import PagedKVLayer

    f = get_format("k4v4")
    with pytest.raises(ValueError, match="'rope-mean' needs the model's RoPE"):
        PagedKVLayer(f, 16, key_offset="rope-mean")
    g = torch.Generator().manual_seed(6)
    h, d, n = 2, 64, 40
    b = torch.zeros(h, d, dtype=torch.float64)
    b[:, [0, 32]] = 400.0
    k = rope(b[:, None] + torch.randn(h, n + 3, d, generator=g, dtype=torch.float64), torch.arange(n + 3), 1e4)
    k = k.transpose(0, 1).float()
    v = torch.randn(n + 3, h, d, generator=g)
    rope_ = {"rope_theta": 1e4, "rotary_dim": 64, "head_dim": 64, "max_positions": 64}
    layer = PagedKVLayer(f, 16, key_offset="rope-mean", rope=rope_)
    layer.update(k[:n].transpose(0, 1)[None], v[:n].transpose(0, 1)[None])
    rm = layer.key_offset
    assert isinstance(rm, RopeMean) and rm.tokens == n and rm.kept == [1, 1]
    got, _ = layer.update(k[n:].transpose(0, 1)[None], v[n:].transpose(0, 1)[None])    # decode: positions 40..42
    got = got[0].transpose(0, 1)
    pos = torch.arange(n + 3)
    want = rm.restore(f.roundtrip(rm.remove(k, pos), v)[0], pos)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=0)
    assert (got - k).norm() / k.norm() < 0.01           # the 400-norm bias is exact; only the residual is quantized
    layer.reset()
    assert layer.key_offset is None


def test_rope_mean_refuses_rows_of_another_geometry_positions_of_another_type_and_bad_rope_fields():
    """Keys of a wrong head count or head_dim, a query whose heads are not a multiple of the KV heads and positions
    that are not an int tensor of the rows' length are refused by name (a wrong head count used to leave heads
    untouched, a wider head_dim to pass silently); so are rope fields that used to be coerced or ignored, keys with a
    NaN at calibration (which kept no pair, silently) and slots outside the head."""
    rm = RopeMean(2, 64, {"rope_theta": 1e4, "neox": True})
    key, pos = torch.randn(4, 2, 64), torch.arange(4)
    rm.calibrate(key + 3, pos)
    for bad in (torch.randn(4, 3, 64), torch.randn(4, 1, 64), torch.randn(4, 2, 128), torch.randn(4, 2, 32),
                torch.randn(2, 64)):
        for call in (rm.remove, rm.restore):
            with pytest.raises(ValueError, match=r"key must be \[n, num_kv_heads=2, head_dim=64\], got"):
                call(bad, pos)
    for bad_pos in (pos.float(), pos[:3], pos[None], pos.bool()):
        with pytest.raises(ValueError, match=r"pos must be an int32 or int64 tensor"):
            rm.remove(key, bad_pos)
    with pytest.raises(ValueError, match=r"pos must be an int32 or int64 tensor \[n\]"):
        rm.offset(torch.zeros(3))
    for q in (torch.randn(1, 3, 64), torch.randn(1, 4, 128), torch.randn(1, 1, 64), torch.randn(4, 64)):
        with pytest.raises(ValueError, match=r"query must be \[T, Hq, head_dim=64\] bfloat16, float16, float32, "
                                             r"float64 with Hq a multiple of num_kv_heads=2"):
            rm.packed_terms(q)
    assert rm.packed_terms(torch.randn(1, 6, 64)).shape == (1, 6, 16)           # Hq = 3 x 2: accepted
    with pytest.raises(ValueError, match=r"query must be \[T, Hq, head_dim=64\] bfloat16, float16, float32, float64 "
                                         r"with Hq a multiple of num_kv_heads=2, got \(1, 6, 64\) torch.int32"):
        rm.packed_terms(torch.zeros(1, 6, 64, dtype=torch.int32))
    for rope_, what in (({"rope_theta": "1e6", "neox": True}, r"rope\['rope_theta'\] must be a positive finite"),
                       ({"rope_theta": float("inf")}, r"rope\['rope_theta'\] must be a positive finite"),
                       ({"rope_theta": 0}, r"rope\['rope_theta'\] must be a positive finite"),
                       ({"rope_theta": 1e4, "rotary_dim": 64.7}, r"rope\['rotary_dim'\] must be an int or None"),
                       ({"rope_theta": 1e4, "rotary_dim": 0}, r"rotary_dim must be even and in \(0, head_dim=64\]"),
                       ({"rope_theta": 1e4, "rotary_dims": 32}, r"rope has unknown keys \['rotary_dims'\]"),
                       (1e6, r"rope must be a dict"), ({"rope_theta": None}, r"needs the model's RoPE")):
        with pytest.raises(ValueError, match=what):
            RopeMean(2, 64, rope_)
    nan_key = key.clone()
    nan_key[1, 0, 5] = float("nan")
    fresh = RopeMean(2, 64, {"rope_theta": 1e4, "neox": True})
    with pytest.raises(ValueError, match="key holds NaN or infinite values"):
        fresh.calibrate(nan_key, pos)
    assert not fresh.calibrated
    xs = rm.x_ch.clone()
    xs[0, 0] = 64
    with pytest.raises(ValueError, match=r"x_ch must hold integer channels in \[0, head_dim=64\)"):
        rm.set_slots(xs, rm.y_ch, rm.inv_freq, rm.bias)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="this PyTorch sees no CUDA device"):
            RopeMean(2, 64, {"rope_theta": 1e4}, device="cuda")


def test_key_offset_apply_refuses_keys_of_another_head_count_instead_of_broadcasting():
    """KeyOffset.apply subtracts c [num_kv_heads, head_dim]: a key with one head would broadcast to all of them."""
    ko = KeyOffset(2, 8)
    ko.calibrate(torch.randn(3, 2, 8))
    assert torch.equal(ko.apply(torch.ones(3, 2, 8)), torch.ones(3, 2, 8) - ko.offset)
    with pytest.raises(ValueError, match=r"key must be \[n, num_kv_heads=2, head_dim=8\], got \(3, 1, 8\)"):
        ko.apply(torch.ones(3, 1, 8))
