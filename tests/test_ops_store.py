"""store_kv (Triton) vs the PyTorch reference write (kvrepro.formats.compressed)."""
from test_ops_helpers import DEV, EXISTING_PRESET_SHA256, fixed_kv, make_pool, sha256_16  # noqa: I001

import zlib

import pytest
import torch

from kvrepro.formats import get_format
from kvrepro.formats.compressed import unpack_codes
from kvrepro.ops import store_kv


def meta_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per metadata entry, how many representable steps apart two meta regions (uint8 ``[..., bytes]``) are: float16
    ulps for a float16 scale / zero (the int16 views' difference; entries of one sign), code steps for a uint8 log2
    scale."""
    if a.shape[-1] == 1:
        return (a.int() - b.int()).abs()[..., 0]
    return (a.contiguous().view(torch.int16).int() - b.contiguous().view(torch.int16).int()).abs()


@pytest.mark.parametrize("rotate", ["kernel", "torch"])
@pytest.mark.parametrize("preset", ["k4v4", "k8v4", "k4v2", "k5v4"])
@pytest.mark.parametrize("d,bs,dtype", [(128, 16, torch.bfloat16), (64, 32, torch.float16), (64, 64, torch.bfloat16)])
def test_store_matches_reference_bytes(preset, d, bs, dtype, rotate):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{preset}-{d}-{bs}".encode()))   # the same inputs in every process
    hkv, n, nb = 3, 45, 9
    mine = make_pool(preset, hkv, d, bs, nb, gen)
    ref = make_pool(preset, hkv, d, bs, nb, gen)
    ref.data.copy_(mine.data)
    before = mine.data.clone()
    k = (torch.randn(n, hkv, d, generator=gen) * 3).to(DEV, dtype)
    v = torch.randn(n, hkv, d, generator=gen).to(DEV, dtype)
    slots = torch.randperm(nb * bs - 1, generator=gen)[:n]
    slots[1] = nb * bs - 1                                  # the last slot of the pool (distinct)
    slots[[0, 7, 44]] = -1                                  # padding rows are skipped
    ref.write(k, v, slots.to(DEV))
    store_kv(k, v, mine.data, slots.to(torch.int32).to(DEV), mine.layout, mine.rotation, rotate=rotate)
    kc, vc, km, vm = mine.regions()
    rkc, rvc, rkm, rvm = ref.regions()
    for a, b, bits in ((kc, rkc, mine.layout.key_bits), (vc, rvc, mine.layout.value_bits)):
        diff = (unpack_codes(a, bits) - unpack_codes(b, bits)).abs()
        assert int(diff.max()) <= 1                         # only rounding ties may move a code
        assert float((diff > 0).float().mean()) < 1e-3
    # a scale computed from a last-bit-different float32 may round to the neighbouring float16 / log2 code
    for a, b in ((km, rkm), (vm, rvm)):
        steps = meta_steps(a, b)
        assert int(steps.max()) <= 1 and int((steps > 0).sum()) <= max(1, steps.numel() // 200), (rotate, steps.sum())
    # Bytes of slots that were not written (padding, other slots) are untouched.
    written = torch.zeros(nb, bs, dtype=torch.bool)
    keep = slots[slots >= 0]
    written[keep // bs, keep % bs] = True
    untouched = ~written.to(DEV)
    for region_now, region_before in zip(mine.regions(), mine.regions(before)):
        assert torch.equal(region_now.permute(0, 2, 1, 3)[untouched], region_before.permute(0, 2, 1, 3)[untouched])


@pytest.mark.parametrize("rotate", ["torch", "kernel"])
def test_store_bytes_of_existing_presets_unchanged(rotate):
    """k4v4, k8v4, k4v2 through the store kernel: the page bytes recorded before k5v4 was added."""
    for (name, d), digest in EXISTING_PRESET_SHA256.items():
        k, v = fixed_kv(d)
        pool = get_format(name).new_pool(3, 2, d, 16, device=DEV)
        store_kv(k.to(DEV), v.to(DEV), pool.data, torch.arange(k.shape[0], dtype=torch.int32, device=DEV),
                 pool.layout, pool.rotation, rotate=rotate)
        assert sha256_16(pool.data) == digest, (name, d)


@pytest.mark.parametrize("rotate", ["torch", "kernel"])
@pytest.mark.parametrize("d", [64, 128])
def test_store_k5v4_bytes_equal_the_reference(d, rotate):
    """k5v4 through the store kernel, zero vectors and 7 decades of scale included: 5-bit codes in two planes,
    float16 key scale, uint8 log2 value scale. Rotation in PyTorch (one piece): the reference's bytes exactly; in the
    kernel: the same bytes but where the float32 sums' order moves a code by one at a tie."""
    gen = torch.Generator().manual_seed(d)
    n = 70
    k = (torch.randn(n, 2, d, generator=gen) * torch.logspace(-4, 3, n)[:, None, None]).to(torch.bfloat16)
    v = (torch.randn(n, 2, d, generator=gen) * torch.logspace(-3, 4, n)[:, None, None]).to(torch.bfloat16)
    k[3], v[5, 1] = 0, 0
    ref = get_format("k5v4").new_pool(5, 2, d, 16)
    ref.write(k, v, torch.arange(n))
    mine = get_format("k5v4").new_pool(5, 2, d, 16, device=DEV)
    store_kv(k.to(DEV), v.to(DEV), mine.data, torch.arange(n, dtype=torch.int32, device=DEV), mine.layout,
             mine.rotation, rotate=rotate)
    if rotate == "torch":
        assert torch.equal(mine.data.cpu(), ref.data)
    else:
        same = (mine.data.cpu() == ref.data).float().mean().item()
        assert same > 0.995, same
        for a, b, bits in zip(mine.regions()[:2], ref.regions()[:2], (5, 4)):
            diff = (unpack_codes(a.cpu(), bits) - unpack_codes(b, bits)).abs()
            assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 1e-3
        assert torch.equal(mine.regions()[3].cpu(), ref.regions()[3])        # log2 value scales exactly
    u = ref.regions()[3][:, :, :, 0].permute(0, 2, 1).reshape(-1, 2)[:n]
    assert int(u[5, 1]) == 0 and int(u.max()) > 160 and int(u[u > 0].min()) < 60      # codes over the range


def test_store_int64_slots_and_empty():
    gen = torch.Generator().manual_seed(3)
    pool = make_pool("k4v4", 2, 64, 16, 4, gen)
    k = torch.randn(0, 2, 64, dtype=torch.bfloat16, device=DEV)
    before = pool.data.clone()
    store_kv(k, k, pool.data, torch.zeros(0, dtype=torch.int64, device=DEV), pool.layout, pool.rotation)
    assert torch.equal(pool.data, before)


def test_store_rejects_bad_inputs():
    gen = torch.Generator().manual_seed(4)
    pool = make_pool("k4v4", 2, 64, 16, 4, gen)
    k = torch.randn(3, 2, 64, dtype=torch.bfloat16, device=DEV)
    s = torch.arange(3, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="key must be bfloat16 or float16"):
        store_kv(k.float(), k, pool.data, s, pool.layout, pool.rotation)
    with pytest.raises(ValueError, match="value must have shape"):
        store_kv(k, k[:, :1], pool.data, s, pool.layout, pool.rotation)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(k, k, pool.data, s[:2], pool.layout, pool.rotation)
    other = make_pool("k8v4", 2, 64, 16, 4, gen)
    with pytest.raises(ValueError, match="pool must be uint8"):
        store_kv(k, k, pool.data, s, other.layout, pool.rotation)
    with pytest.raises(ValueError, match="rotation"):
        store_kv(k, k, pool.data, s, pool.layout, pool.rotation.double())
    with pytest.raises(ValueError, match="rotate="):
        store_kv(k, k, pool.data, s, pool.layout, pool.rotation, rotate="fwht")


def test_store_in_kernel_rotation_needs_the_hadamard_form():
    """rotate="kernel" multiplies by diag(s) H: another orthogonal rotation is refused by name (it would store another
    function), and rotate="torch" stores it as the reference does."""
    gen = torch.Generator().manual_seed(5)
    pool = make_pool("k4v4", 2, 64, 16, 4, gen)
    q, _ = torch.linalg.qr(torch.randn(64, 64, generator=gen, dtype=torch.float64))
    rot = q.float().to(DEV).contiguous()
    k = torch.randn(3, 2, 64, generator=gen).to(DEV, torch.bfloat16)
    s = torch.arange(3, dtype=torch.int32, device=DEV)
    before = pool.data.clone()
    for n in (3, 0):                                    # refused for an empty batch as well
        with pytest.raises(ValueError, match="rotate='kernel' needs rotation = diag.s. H / sqrt.head_dim.*rotate='torch'"):
            store_kv(k[:n], k[:n], pool.data, s[:n], pool.layout, rot)
    assert torch.equal(pool.data, before)
    store_kv(k, k, pool.data, s, pool.layout, rot, rotate="torch")
    ref = make_pool("k4v4", 2, 64, 16, 4, gen)
    ref.data.copy_(before)
    ref.rotation = rot
    ref.write(k, k, s.long())
    assert torch.equal(pool.data, ref.data)


def test_store_refuses_kv_beyond_float16_range_like_the_reference():
    """K = 60000 fits float16 but its rotated values exceed the float16 scale/zero range: the
    reference (CompressedPool.write) refuses, and so must the kernel path (fresh-user review)."""
    gen = torch.Generator().manual_seed(2)
    pool = make_pool("k4v4", 2, 64, 16, 4, gen)
    k = torch.full((3, 2, 64), 60000.0, dtype=torch.float16, device=DEV)
    v = torch.zeros_like(k)
    s = torch.arange(3, dtype=torch.int32, device=DEV)
    before = pool.data.clone()
    with pytest.raises(ValueError, match="exceeds"):
        pool.write(k, v, s.long())
    for rotate in ("torch", "kernel"):
        with pytest.raises(ValueError, match="exceeds the float16 range"):      # validate: the default on the CPU only
            store_kv(k, v, pool.data, s, pool.layout, pool.rotation, rotate=rotate, validate=True)
    assert torch.equal(pool.data, before)   # nothing written


def test_store_in_kernel_rotation_with_inference_mode_tensors():
    """Rotations made under torch.inference_mode (vLLM runs its forward there) have no version counter: the cached
    rotation is made outside it whoever asks first, and a rotation that is an inference tensor is checked and cached
    by identity, so the store works with either, with the reference's bytes."""
    from kvrepro.formats.hadamard import _rotation_cpu, rotation_matrix

    _rotation_cpu.cache_clear()
    with torch.inference_mode():
        shared = rotation_matrix(64, 0)
        own = shared.clone()                                  # an inference tensor proper
    assert not shared.is_inference() and own.is_inference()
    gen = torch.Generator().manual_seed(6)
    k = torch.randn(5, 2, 64, generator=gen).to(DEV, torch.bfloat16)
    s = torch.arange(5, dtype=torch.int32, device=DEV)
    ref = get_format("k4v4").new_pool(2, 2, 64, 16)
    ref.write(k.cpu(), k.cpu(), s.long().cpu())
    for rot in (shared.to(DEV), own.to(DEV), own.to(DEV)):   # the third: the cached entry of an inference tensor
        pool = get_format("k4v4").new_pool(2, 2, 64, 16, device=DEV)
        store_kv(k, k, pool.data, s, pool.layout, rot)
        assert torch.equal(pool.data.cpu(), ref.data)

