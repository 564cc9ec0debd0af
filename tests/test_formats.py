"""KV formats: byte sizes, packing, quantization vs an independent float64 reference,
paged scatter/gather with padding and shuffled blocks, fp8 scales (field-faults row 3),
shapes (row 2), outlier keys (row 1), and bad input."""
import math

import numpy as np
import pytest
import torch

from kvrepro.formats import FORMAT_NAMES, get_format
from kvrepro.formats.compressed import pack_codes, unpack_codes
from kvrepro.formats.hadamard import rotation_matrix
from kvrepro.formats.layout import PageLayout
from kvrepro.reference import attention_ref

COMPRESSED = ("k4v4", "k8v4", "k4v2")
BITS = {"k4v4": (4, 4), "k8v4": (8, 4), "k4v2": (4, 2)}


def _kv(n, h, d, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, h, d, generator=g).to(dtype), torch.randn(n, h, d, generator=g).to(dtype))


@pytest.mark.parametrize("d,expected", [(128, {"bf16": 512, "fp8": 256, "k4v4": 134, "k8v4": 198, "k4v2": 102}),
                                        (64, {"bf16": 256, "fp8": 128, "k4v4": 70, "k8v4": 102, "k4v2": 54})])
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
    """Independent numpy float64 implementation of the documented method."""
    kb, vb = BITS[name]
    k, v = _kv(37, 3, d, seed=d + kb)
    kh, vh = get_format(name).roundtrip(k, v)
    r = _np_rotation(d)
    for x, xh, bits, sym in ((k, kh, kb, False), (v, vh, vb, True)):
        xr = x.double().numpy() @ r
        lo, hi = xr.min(-1, keepdims=True), xr.max(-1, keepdims=True)
        if sym:  # values: mid-rise symmetric, scale only
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
ATTN_BOUND = {"bf16": 1e-6, "fp8": 0.06, "k8v4": 0.15, "k4v4": 0.21, "k4v2": 0.78}


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
            for kb, vb in BITS.values():
                L = PageLayout(d, bs, kb, vb)
                offs = [L.k_code_offset, L.v_code_offset, L.k_meta_offset, L.v_meta_offset, L.page_bytes]
                assert all(o % 16 == 0 for o in offs)
                assert L.page_bytes == bs * L.bytes_per_token


def _rope(x, pos, base=1e6):
    half = x.shape[-1] // 2
    inv = base ** (-torch.arange(half, dtype=torch.float64) / half)
    ang = pos[:, None].double() * inv[None]
    c, s = ang.cos(), ang.sin()
    x1, x2 = x[..., :half].double(), x[..., half:].double()
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1)


def _outlier_case(channels):
    """field-faults row 1: pre-RoPE keys b + N(0,1), ||b|| = 600 over 4 channels, RoPE applied."""
    g = torch.Generator().manual_seed(1)
    d, n = 128, 4096
    b = torch.zeros(d)
    b[channels] = 300.0  # 4 x 300^2 = 600^2
    k = _rope(b + torch.randn(n, d, generator=g), torch.arange(n)).to(torch.bfloat16)
    q = _rope(torch.randn(64, d, generator=g), torch.full((64,), n - 1)).to(torch.bfloat16)
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
