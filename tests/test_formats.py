"""KV formats: byte sizes, packing, quantization vs an independent float64 reference,
paged scatter/gather with padding and shuffled blocks, fp8 scales (field-faults row 3),
shapes (row 2), outlier keys (row 1), and bad input."""
import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from kvrepro.formats import FORMAT_NAMES, get_format
from kvrepro.formats.compressed import (CompressedFormat, log_scale_code, log_scale_value, pack_codes,
                                        quantize_rotated, unpack_codes)
from kvrepro.formats.hadamard import rotation_matrix
from kvrepro.formats.layout import PageLayout
from kvrepro.keybias import rope
from kvrepro.reference import attention_ref

COMPRESSED = ("k4v4", "k8v4", "k4v2", "k5v4")
BITS = {"k4v4": (4, 4), "k8v4": (8, 4), "k4v2": (4, 2), "k5v4": (5, 4)}


def _kv(n, h, d, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, h, d, generator=g).to(dtype), torch.randn(n, h, d, generator=g).to(dtype))


@pytest.mark.parametrize("d,expected", [
    (128, {"bf16": 512, "fp8": 256, "k4v4": 134, "k8v4": 198, "k4v2": 102, "k5v4": 128 * 9 // 8 + 3}),
    (64, {"bf16": 256, "fp8": 128, "k4v4": 70, "k8v4": 102, "k4v2": 54, "k5v4": 64 * 9 // 8 + 3})])
def test_bytes_per_token_per_head(d, expected):
    for name, b in expected.items():
        fmt = get_format(name)
        assert fmt.bytes_per_token_per_head(d) == b
        pool = fmt.new_pool(num_blocks=3, num_kv_heads=2, head_dim=d, block_size=16)
        assert pool.nbytes == 3 * 16 * 2 * b  # the stored bytes are exactly what the format claims


def test_k4v4_fits_issue_budget():
    assert get_format("k4v4").bytes_per_token_per_head(128) <= 136
    # 13 users x ceil(132,096 / 16) blocks must fit the KV bytes vLLM gave bf16 at an emulated
    # 80 GB budget (455,392 tokens x 147,456 B, REPRODUCTION-CARD): needs <= 135.77 B/token/head.
    kv_bytes = 455_392 * 147_456
    page_all_layers = 16 * get_format("k4v4").bytes_per_token_per_head(128) * 8 * 36
    assert kv_bytes // page_all_layers // -(-132_096 // 16) >= 13


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_split_plane_matches_bitwise_definition(bits):
    d = 64
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (5, d), generator=g)
    packed = pack_codes(codes, bits)
    n = 8 // bits
    p = d // n
    assert packed.shape == (5, p) and packed.dtype == torch.uint8
    c = codes.numpy()
    for t in range(5):
        for j in range(p):
            expect = sum(int(c[t, j + i * p]) << (i * bits) for i in range(n))
            assert int(packed[t, j]) == expect
    assert torch.equal(unpack_codes(packed, bits), codes.to(torch.int32))


def _np_rotation(d):
    h = np.array([[1.0]])
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    s = rotation_matrix(d).numpy().astype(np.float64)[:, 0] * math.sqrt(d)  # signs from row scale
    return (s[:, None] * h) / math.sqrt(d)


def test_rotation_is_orthogonal_and_deterministic():
    for d in (64, 128):
        r = rotation_matrix(d).double()
        assert torch.allclose(r @ r.T, torch.eye(d, dtype=torch.float64), atol=1e-6)
        assert torch.equal(rotation_matrix(d), rotation_matrix(d))
        assert set(torch.unique(r.abs() * math.sqrt(d)).round(decimals=5).tolist()) == {1.0}


@pytest.mark.parametrize("name", COMPRESSED)
@pytest.mark.parametrize("d", [64, 128])
def test_compressed_matches_float64_reference(name, d):
    """Independent numpy float64 implementation of the documented method (k5v4: the spec of its keys and of its
    uint8 log2 value scale, u = clamp(ceil(8 log2(s) + 128), 0, 255), s_hat = 2**((u - 128) / 8))."""
    kb, vb = BITS[name]
    k, v = _kv(37, 3, d, seed=d + kb)
    kh, vh = get_format(name).roundtrip(k, v)
    r = _np_rotation(d)
    for x, xh, bits, sym in ((k, kh, kb, kb == 5), (v, vh, vb, True)):
        xr = x.double().numpy() @ r
        lo, hi = xr.min(-1, keepdims=True), xr.max(-1, keepdims=True)
        if sym and x is v and name == "k5v4":  # values: mid-rise symmetric, one-byte log2 scale
            c = ((1 << bits) - 1) / 2
            u = np.clip(np.ceil(8 * np.log2(np.maximum(-lo, hi) / c) + 128), 0, 255)
            s = 2.0 ** ((u - 128) / 8)
            z = -c * s
        elif sym:  # values, 5-bit keys: mid-rise symmetric, float16 scale only
            c = ((1 << bits) - 1) / 2
            s = (np.maximum(-lo, hi) / c).astype(np.float16).astype(np.float64)
            z = -c * s
        else:  # keys: min/max asymmetric
            s = ((hi - lo) / ((1 << bits) - 1)).astype(np.float16).astype(np.float64)
            z = lo.astype(np.float16).astype(np.float64)
        codes = np.clip(np.round((xr - z) / s), 0, (1 << bits) - 1)
        expect = (codes * s + z) @ r.T
        err = np.abs(xh.double().numpy() - expect)
        # identical except round-half ties and float32-vs-float64 rounding (which can move a stored
        # float16 scale by one ulp for a whole vector): at most one step on a few elements
        assert (err < 1e-4).mean() > 0.98
        assert err.max() <= s.max() * 1.01 + 1e-4


@pytest.mark.parametrize("name", COMPRESSED)
def test_quantization_error_within_half_step(name):
    kb, _ = BITS[name]
    k, v = _kv(64, 2, 128, seed=7)
    fmt = get_format(name)
    pool = fmt.new_pool(4, 2, 128, 16)
    pool.write(k, v, torch.arange(64))
    kr, _ = pool.gather_rotated(torch.arange(4), 64)
    xr = k.float() @ rotation_matrix(128)
    step = (xr.amax(-1, keepdim=True) - xr.amin(-1, keepdim=True)) / ((1 << kb) - 1)
    if kb == 5:                                  # symmetric keys: levels over [-max|x|, max|x|]
        step = 2 * xr.abs().amax(-1, keepdim=True) / 31
    assert ((kr - xr).abs() <= step / 2 + 2e-3 * xr.abs().amax(-1, keepdim=True)).all()


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_paged_scatter_gather_with_padding_and_shuffled_blocks(name):
    fmt = get_format(name)
    bs, h, d = 16, 2, 64
    k, v = _kv(45, h, d, seed=3)
    ref_k, ref_v = fmt.roundtrip(k, v, block_size=bs)  # contiguous blocks
    pool = fmt.new_pool(num_blocks=9, num_kv_heads=h, head_dim=d, block_size=bs)
    pool.data.view(torch.uint8).fill_(0xAB)  # poison
    table = torch.tensor([7, 2, 5])
    slots = table.repeat_interleave(bs)[:45] * bs + torch.arange(45) % bs
    # interleave padding rows (slot -1) that must be skipped
    kk = torch.cat([k, torch.full((3, h, d), 99.0, dtype=k.dtype)])
    vv = torch.cat([v, torch.full((3, h, d), 99.0, dtype=v.dtype)])
    ss = torch.cat([slots, torch.full((3,), -1)])
    perm = torch.randperm(48, generator=torch.Generator().manual_seed(1))
    pool.write(kk[perm], vv[perm], ss[perm])
    gk, gv = pool.gather(table, 45)
    assert torch.equal(gk, ref_k) and torch.equal(gv, ref_v)
    untouched = [b for b in range(9) if b not in (7, 2, 5)]
    assert (pool.data[untouched].reshape(-1).view(torch.uint8) == 0xAB).all()


# Attention over each format vs float32 attention on the raw K/V: compression error bound per format.
# Bounds: relative L2 error of the attention output on N(0,1) K/V (diffuse attention, the hard case for
# relative error). Measured on these inputs (CPU): fp8 0.037-0.039, k8v4 0.101-0.110,
# k4v4 0.132-0.148, k4v2 0.51-0.56; bounds are ~1.4x the worst.
# k5v4 0.117-0.127.
ATTN_BOUND = {"bf16": 1e-6, "fp8": 0.06, "k8v4": 0.15, "k4v4": 0.21, "k4v2": 0.78, "k5v4": 0.18}


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (9, 3, 64), (16, 2, 128)])
def test_attention_over_format_vs_float32(name, hq, hkv, d):
    k, v = _kv(97, hkv, d, seed=hq)
    q = torch.randn(5, hq, d, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    kh, vh = get_format(name).roundtrip(k, v)
    scale = d**-0.5
    out = attention_ref(q, kh, vh, scale, torch.float64)
    ref = attention_ref(q, k.float(), v.float(), scale, torch.float64)
    rel = ((out - ref).norm() / ref.norm()).item()
    assert math.isfinite(rel) and rel <= ATTN_BOUND[name], f"{name}: rel err {rel:.4f}"
    if name != "bf16":
        assert rel > 0  # the format really is lossy: we are not comparing a copy with itself


def test_attention_ref_matches_explicit_loop():
    """attention_ref (GQA + causal offset) against a scalar float64 loop."""
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(3, 4, 8, generator=g), torch.randn(6, 2, 8, generator=g), torch.randn(6, 2, 8, generator=g)
    out = attention_ref(q, k, v, 0.3, torch.float64)
    for i in range(3):
        for h in range(4):
            kvh = h // 2
            n = 6 - 3 + i + 1
            w = [math.exp(0.3 * float(q[i, h].double() @ k[j, kvh].double())) for j in range(n)]
            expect = sum(w[j] * v[j, kvh].double() for j in range(n)) / sum(w)
            assert torch.allclose(out[i, h], expect, atol=1e-10)


def test_fp8_scale_field_fault_row3():
    g = torch.Generator().manual_seed(0)
    k = torch.randn(32, 2, 64, generator=g)
    k = (k / k.abs().max() * 1200).to(torch.bfloat16)  # max |x| = 1200 > e4m3 max 448
    v = torch.randn(32, 2, 64, generator=g).to(torch.bfloat16)
    unit = get_format("fp8", scale=1.0).new_pool(2, 2, 64, 16)
    proper = get_format("fp8", scale=1200 / 448).new_pool(2, 2, 64, 16)
    calib = get_format("fp8", scale="amax").new_pool(2, 2, 64, 16)
    for p in (unit, proper, calib):
        p.write(k, v, torch.arange(32))
    assert not torch.equal(unit.data.view(torch.uint8), proper.data.view(torch.uint8))
    ku, _ = unit.gather(torch.arange(2), 32)
    kp, _ = proper.gather(torch.arange(2), 32)
    assert torch.isfinite(ku).all() and torch.isfinite(kp).all()
    assert ku.abs().max() == 448.0  # saturated, not NaN
    assert ((kp - k.float()).abs() <= k.float().abs() * 2**-3 + 1e-3).all()  # e4m3: 3 mantissa bits
    assert calib.k_scale == pytest.approx(float(k.float().abs().max()) / 448)
    assert proper.k_scale == pytest.approx(1200 / 448) and unit.k_scale == 1.0


@pytest.mark.parametrize("name", COMPRESSED)
@pytest.mark.parametrize("d", [80, 192, 96, 256])
def test_unsupported_head_dim_refused(name, d):
    with pytest.raises(ValueError, match=r"head_dim=\d+.*supported head_dim values: \(64, 128\)"):
        get_format(name).new_pool(1, 1, d, 16)


def test_bad_input_messages():
    with pytest.raises(ValueError, match="unknown KV format 'fp16'; allowed: bf16, fp8, k4v4, k8v4, k4v2"):
        get_format("fp16")
    with pytest.raises(ValueError, match="fp8 scale"):
        get_format("fp8", scale=-1.0)
    with pytest.raises(ValueError, match="fp8 scale must be a finite positive float"):
        get_format("fp8", scale=float("inf"))
    for name in ("bf16", "fp8"):
        p = get_format(name, **({"scale": "amax"} if name == "fp8" else {})).new_pool(1, 2, 64, 16)
        kk, vv = _kv(3, 2, 64, 0)
        kk[1, 0, 5] = float("nan")
        with pytest.raises(ValueError, match="non-finite"):
            p.write(kk, vv, torch.tensor([0, 1, 2]))
        assert p.fmt.name == "bf16" or p.k_scale is None  # a refused write calibrates nothing
    with pytest.raises(ValueError, match="block_size=8"):
        PageLayout(128, 8, 4, 4)
    with pytest.raises(ValueError, match="key_bits=3"):
        PageLayout(128, 16, 3, 4)
    with pytest.raises(ValueError, match="num_blocks must be a positive integer"):
        get_format("k4v4").new_pool(0, 1, 128, 16)
    pool = get_format("k4v4").new_pool(1, 2, 128, 16)
    k, v = _kv(3, 2, 128, 0)
    with pytest.raises(ValueError, match="slot_mapping holds slot 16"):
        pool.write(k, v, torch.tensor([0, 1, 16]))
    with pytest.raises(ValueError, match="slot_mapping must be an integer tensor"):
        pool.write(k, v, torch.tensor([0.7, 1.2, 2.9]))
    with pytest.raises(ValueError, match="slot_mapping holds -2"):
        pool.write(k, v, torch.tensor([0, -2, 1]))
    with pytest.raises(ValueError, match=r"key must have shape \[num_tokens, 2, 128\]"):
        pool.write(k[:, :1], v[:, :1], torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="non-finite"):
        pool.write(torch.full_like(k, float("nan")), v, torch.tensor([0, 1, 2]))


def test_page_layout_offsets_aligned():
    for d in (64, 128):
        for bs in (16, 32, 64):
            for name in COMPRESSED:
                L = get_format(name).layout(d, bs)
                offs = [L.k_code_offset, L.v_code_offset, L.k_meta_offset, L.v_meta_offset, L.page_bytes]
                assert all(o % 16 == 0 for o in offs)
                assert L.page_bytes == bs * L.bytes_per_token


# (v_code_offset, k_meta_offset, v_meta_offset, page_bytes) of the existing presets, as they were before k5v4.
EXISTING_OFFSETS = {
    ("k4v4", 64, 16): (512, 1024, 1088, 1120), ("k4v4", 64, 32): (1024, 2048, 2176, 2240),
    ("k4v4", 64, 64): (2048, 4096, 4352, 4480), ("k4v4", 128, 16): (1024, 2048, 2112, 2144),
    ("k4v4", 128, 32): (2048, 4096, 4224, 4288), ("k4v4", 128, 64): (4096, 8192, 8448, 8576),
    ("k8v4", 64, 16): (1024, 1536, 1600, 1632), ("k8v4", 64, 32): (2048, 3072, 3200, 3264),
    ("k8v4", 64, 64): (4096, 6144, 6400, 6528), ("k8v4", 128, 16): (2048, 3072, 3136, 3168),
    ("k8v4", 128, 32): (4096, 6144, 6272, 6336), ("k8v4", 128, 64): (8192, 12288, 12544, 12672),
    ("k4v2", 64, 16): (512, 768, 832, 864), ("k4v2", 64, 32): (1024, 1536, 1664, 1728),
    ("k4v2", 64, 64): (2048, 3072, 3328, 3456), ("k4v2", 128, 16): (1024, 1536, 1600, 1632),
    ("k4v2", 128, 32): (2048, 3072, 3200, 3264), ("k4v2", 128, 64): (4096, 6144, 6400, 6528),
}


def test_existing_presets_keep_their_layouts_and_bytes():
    """k4v4, k8v4, k4v2: the same offsets and, for a fixed input, the same stored bytes as before k5v4 (SHA-256
    recorded then, ``test_ops_helpers.EXISTING_PRESET_SHA256``)."""
    from test_ops_helpers import EXISTING_PRESET_SHA256, fixed_kv, sha256_16

    for (name, d, bs), offs in EXISTING_OFFSETS.items():
        L = get_format(name).layout(d, bs)
        assert (L.v_code_offset, L.k_meta_offset, L.v_meta_offset, L.page_bytes) == offs
        assert L == PageLayout(d, bs, *BITS[name]) and not (L.key_symmetric or L.value_log_scale)
    for (name, d), digest in EXISTING_PRESET_SHA256.items():
        k, v = fixed_kv(d)
        pool = get_format(name).new_pool(3, 2, d, 16)
        pool.write(k, v, torch.arange(k.shape[0]))
        assert sha256_16(pool.data) == digest, (name, d)


def test_k5v4_layout():
    """147 B per token and head at head_dim 128 (75 at 64): K codes 5 D / 8, V codes D / 2, K meta 2, V meta 1."""
    for d, bs in ((128, 16), (128, 32), (64, 16), (64, 64)):
        L = get_format("k5v4").layout(d, bs)
        assert (L.key_bits, L.value_bits, L.key_symmetric, L.value_log_scale) == (5, 4, True, True)
        assert (L.k_code_bytes, L.v_code_bytes, L.k_meta_bytes, L.v_meta_bytes) == (d * 5 // 8, d // 2, 2, 1)
        assert L.v_code_offset == bs * d * 5 // 8
        assert L.k_meta_offset == L.v_code_offset + bs * d // 2
        assert L.v_meta_offset == L.k_meta_offset + 2 * bs
        assert L.page_bytes == L.v_meta_offset + bs == bs * (d * 9 // 8 + 3)
    assert get_format("k5v4").layout(128, 16).page_bytes == 2352
    assert "k5v4" in get_format("k5v4").describe() and "log2" in get_format("k5v4").describe()


def test_bad_bit_and_scheme_combinations_name_the_parameter():
    with pytest.raises(ValueError, match=r"key_bits=5 is not supported.*key_symmetric=True"):
        PageLayout(128, 16, 5, 4)
    with pytest.raises(ValueError, match=r"key_bits=4 is not supported with key_symmetric=True; allowed: \(5,\)"):
        PageLayout(128, 16, 4, 4, key_symmetric=True)
    with pytest.raises(ValueError, match=r"value_bits=5 is not supported; allowed: \(2, 4, 8\)"):
        PageLayout(128, 16, 5, 5, key_symmetric=True)
    with pytest.raises(ValueError, match=r"value_bits=2 is not supported with value_log_scale=True; allowed: \(4,\)"):
        PageLayout(128, 16, 4, 2, value_log_scale=True)
    with pytest.raises(ValueError, match="key_symmetric must be True or False, got 1"):
        PageLayout(128, 16, 5, 4, key_symmetric=1)
    with pytest.raises(ValueError, match=r"key_bits=5 is not supported.*key_symmetric=True"):
        CompressedFormat("k5v4-asym", 5, 4)
    with pytest.raises(ValueError, match="need symmetric=True"):
        quantize_rotated(torch.zeros(2, 64), 5)


def test_pack_5_bit_planes_match_the_byte_definition():
    """5-bit codes: first the high plane code >> 1 as 4-bit split-plane (byte j = hi[j] | hi[j + D/2] << 4), then the
    low plane code & 1, 8 per byte (byte j bit i = lo[j + i D/8])."""
    for d in (64, 128):
        codes = torch.randint(0, 32, (7, d), generator=torch.Generator().manual_seed(d))
        packed = pack_codes(codes, 5)
        assert packed.shape == (7, d * 5 // 8) and packed.dtype == torch.uint8
        c = codes.numpy()
        for t in range(7):
            for j in range(d // 2):
                assert int(packed[t, j]) == (c[t, j] >> 1) | ((c[t, j + d // 2] >> 1) << 4)
            for j in range(d // 8):
                assert int(packed[t, d // 2 + j]) == sum((int(c[t, j + i * d // 8]) & 1) << i for i in range(8))
        assert torch.equal(unpack_codes(packed, 5), codes.to(torch.int32))
    ones = torch.randint(0, 2, (3, 64), generator=torch.Generator().manual_seed(1))
    assert torch.equal(unpack_codes(pack_codes(ones, 1), 1), ones.to(torch.int32))


def _exact_log_code(s: float) -> int:
    """clamp(ceil(8 log2(s) + 128), 0, 255), exactly: the smallest u with s**8 <= 2**(u - 128) (Fractions)."""
    if s == 0:
        return 0
    fs = Fraction(s) ** 8
    u = min(255, max(0, math.ceil(8 * math.log2(s) + 128) - 2))
    while u < 255 and fs > Fraction(2) ** (u - 128):
        u += 1
    while u > 0 and fs <= Fraction(2) ** (u - 1 - 128):
        u -= 1
    return u


def test_log_scale_code_is_the_exact_ceiling():
    """The uint8 log2 value scale: u = clamp(ceil(8 log2(s) + 128), 0, 255) for random s over the whole range and
    for s at, one float32 step below and above every threshold 2**((u - 128) / 8); s_hat = 2**((u - 128) / 8) is the
    float32 nearest it, s_hat >= s and s_hat < s * 2**(1/8) inside the range."""
    g = np.random.default_rng(0)
    s = np.concatenate([2.0 ** g.uniform(-18, 17, 4000), [0.0, 2.0**-20, 2.0**-16, 2.0**15.875, 2.0**16, 1.0, 0.1]])
    t = np.float32(2.0 ** ((np.arange(256) - 128) / 8))
    s = np.concatenate([s, t, np.nextafter(t, np.float32(0)), np.nextafter(t, np.float32(np.inf))]).astype(np.float32)
    u = log_scale_code(torch.from_numpy(s)).numpy().astype(int)
    ref = np.array([_exact_log_code(float(x)) for x in s])
    assert (u == ref).all(), s[u != ref]
    s_hat = log_scale_value(torch.arange(256)).numpy()
    assert s_hat.dtype == np.float32 and (s_hat == t).all()
    inside = (s >= 2.0**-16) & (s <= np.float64(t[-1]))
    sh = s_hat[u].astype(np.float64)
    exact = 2.0 ** ((u - 128) / 8)                     # the real 2**((u - 128) / 8), to float64 precision
    assert (sh[inside] >= s[inside]).all()             # the stored float32 scale: no code clips
    assert (exact[inside] < s[inside].astype(np.float64) * 2 ** (1 / 8)).all()
    assert (sh[inside] < s[inside].astype(np.float64) * 2 ** (1 / 8) * (1 + 2**-24)).all()
    assert (sh[s < 2.0**-16] == 2.0**-16).all()


@pytest.mark.parametrize("d", [64, 128])
def test_k5v4_quantization_error_and_no_clipped_codes(d):
    """k5v4 round trip in the rotated space vs the spec in float64: keys within half a step of the float16 scale
    (the largest element may sit 2**-11 of a step past the top level, the float16 rounding of the scale), values
    within half a step of s_hat and no value code clipped (|x| / s_hat <= 7.5)."""
    k, v = _kv(300, 2, d, seed=d)
    k = k * torch.logspace(-4, 3, 300)[:, None, None].to(k.dtype)      # scales over 7 decades
    v = v * torch.logspace(-3, 3, 300)[:, None, None].to(v.dtype)
    pool = get_format("k5v4").new_pool(-(-300 // 16), 2, d, 16)
    pool.write(k, v, torch.arange(300))
    kr, vr = pool.gather_rotated(torch.arange(pool.num_blocks), 300)
    r = torch.from_numpy(_np_rotation(d))
    for x, xr_hat, c in ((k, kr, 15.5), (v, vr, 7.5)):
        xr = x.double() @ r
        amax = xr.abs().amax(-1, keepdim=True)
        if c == 15.5:
            step = (amax / c).to(torch.float16).double()
            assert ((xr_hat.double() - xr).abs() <= step * (0.5 + 2**-10) + 1e-6 * amax).all()
        else:
            s = amax / c
            u = torch.clamp(torch.ceil(8 * torch.log2(s) + 128), 0, 255)
            s_hat = 2.0 ** ((u - 128) / 8)
            assert (s_hat >= s * (1 - 1e-6)).all() and (s_hat < s * 2 ** (1 / 8) * (1 + 1e-6)).all()
            assert (xr.abs() / s_hat <= 7.5 * (1 + 1e-6)).all()                       # no code clips
            assert ((xr_hat.double() - xr).abs() <= s_hat * (0.5 + 1e-5)).all()
            kc, vc, km, vm = pool.regions()
            assert vm.dtype == torch.uint8 and vm.shape[-1] == 1 and km.shape[-1] == 2


def _outlier_case(channels):
    """field-faults row 1: pre-RoPE keys b + N(0,1), ||b|| = 600 over 4 channels, RoPE applied."""
    g = torch.Generator().manual_seed(1)
    d, n = 128, 4096
    b = torch.zeros(d)
    b[channels] = 300.0  # 4 x 300^2 = 600^2
    k = rope(b + torch.randn(n, d, generator=g), torch.arange(n)).to(torch.bfloat16)
    q = rope(torch.randn(64, d, generator=g), torch.full((64,), n - 1)).to(torch.bfloat16)
    return q, k


def _top1_and_err(name, q, k):
    kh, vh = get_format(name).roundtrip(k[:, None], k[:, None])
    ref_logits = q.double() @ k.double().T
    logits = q.double() @ kh[:, 0].double().T
    top1 = (logits.argmax(-1) == ref_logits.argmax(-1)).double().mean().item()
    out = torch.softmax(logits / 128**0.5, -1) @ vh[:, 0].double()
    ref = torch.softmax(ref_logits / 128**0.5, -1) @ k.double()
    return top1, ((out - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("channels", [[0, 1, 2, 3], [60, 61, 124, 125]])
def test_outlier_keys_attention_output_error(channels):
    """Row 1, measured part: attention-output error (not K cosine). 8-bit keys keep it small."""
    q, k = _outlier_case(channels)
    _, err8 = _top1_and_err("k8v4", q, k)
    assert err8 < 0.09  # measured 0.061 and 0.026 on the CPU


@pytest.mark.xfail(strict=True, reason="known limitation (notes/accuracy.md, 'The open gap'): with a 600-norm key bias, per-token "
                   "4-bit keys change the top-1 key for most random queries; k8v4 is the preset for such models")
def test_outlier_keys_top1_k4v4():
    q, k = _outlier_case([0, 1, 2, 3])
    top1, _ = _top1_and_err("k4v4", q, k)
    assert top1 >= 0.99
