"""prefill_attention (chunked prefill over compressed context + fresh chunk) vs float64."""
from test_ops_helpers import DEV, block_tables, chunk_reference, fill, make_pool, relerr  # noqa: I001
from devguard import host_device_guard  # noqa: F401, I001  (fixture: misplaced tensors fail on CPU too)

import pytest
import torch

from kvrepro.ops import prefill_attention, vllm_dense_attn
from kvrepro.ops.prefill import ROPE_GPU_PRESETS, check_rope_prefill

CTXS, QLENS = [0, 5, 40, 97, 300], [7, 1, 20, 3, 1]   # mixed: prefill chunks and decode rows


def _batch(preset, hq, hkv, d, bs, seed, dtype=torch.float16):
    gen = torch.Generator().manual_seed(seed)
    maxb = max(-(-(c + q) // bs) for c, q in zip(CTXS, QLENS)) + 1
    nb = len(CTXS) * maxb + 3
    pool = make_pool(preset, hkv, d, bs, nb, gen)
    bt = block_tables(len(CTXS), maxb, nb, gen)
    qs, ks, vs, refs = [], [], [], []
    for b, (c, ql) in enumerate(zip(CTXS, QLENS)):
        k, v = fill(pool, bt[b], c + ql, gen, dtype)   # the chunk is stored too; it must be read fresh
        q = torch.randn(ql, hq, d, generator=gen).to(DEV, dtype)
        refs.append(chunk_reference(q, pool, bt[b], c, k[c:], v[c:], d ** -0.5))
        qs.append(q), ks.append(k[c:]), vs.append(v[c:])
    qsl = torch.tensor([0] + torch.tensor(QLENS).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    sl = torch.tensor([c + q for c, q in zip(CTXS, QLENS)], dtype=torch.int32, device=DEV)
    return pool, bt, sl, qsl, torch.cat(qs), torch.cat(ks), torch.cat(vs), torch.cat(refs)


def _dense64(q, k, v, scale, causal):
    """float64 dense attention returning (o, lse) like ``flash_dense_attn``."""
    g = q.shape[1] // k.shape[1]
    qq = q.double().transpose(0, 1)
    kk = k.double().repeat_interleave(g, 1).transpose(0, 1)
    vv = v.double().repeat_interleave(g, 1).transpose(0, 1)
    lg = qq @ kk.transpose(1, 2) * scale
    if causal:
        tq, tk = q.shape[0], k.shape[0]
        lg = lg.masked_fill(torch.arange(tk, device=q.device)[None] > torch.arange(tq, device=q.device)[:, None] + tk - tq,
                            float("-inf"))
    return (torch.softmax(lg, -1) @ vv).transpose(0, 1).to(q.dtype), torch.logsumexp(lg, -1).transpose(0, 1).float()


def _dense64_br(q, k, v, scale, causal):
    return _dense64(q, k, v, scale, causal)


_dense64_br.bottom_right_causal = True


@pytest.mark.parametrize("preset,hq,hkv,d,bs,rows", [
    ("k4v4", 32, 8, 128, 16, 64), ("k4v2", 9, 3, 64, 32, 16), ("k8v4", 28, 4, 128, 16, 32),
    ("k5v4", 12, 2, 128, 16, 32), ("k5v4", 9, 3, 64, 64, 16)])   # k5v4: groups 6 and 3
def test_prefill_paged_matches_reference(preset, hq, hkv, d, bs, rows):
    pool, bt, sl, qsl, q, k, v, ref = _batch(preset, hq, hkv, d, bs, seed=hq + d)
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, k, v, pool.data, bt, sl, qsl, pool.layout, pool.rotation, d ** -0.5, out=out,
                      rows=rows, max_query_len=max(QLENS))
    assert torch.isfinite(out).all()
    assert relerr(out, ref) < 2e-3


def test_prefill_paged_nan_query_stays_nan():
    """A NaN in one query row and head of a chunk gives NaN there (as the reference does) and nothing
    else changes. (The paged prefill writes its output without a split merge, so this held before
    the decode fix too; it guards the shared ``_finish``, which now keeps a NaN softmax sum NaN.)"""
    pool, bt, sl, qsl, q, k, v, ref = _batch("k4v4", 8, 2, 64, 16, seed=77)
    q[10, 1, 0] = float("nan")                         # sequence 2: 40 tokens of paged context
    out = prefill_attention(q, k, v, pool.data, bt, sl, qsl, pool.layout, pool.rotation, 0.125, rows=16,
                            max_query_len=max(QLENS))
    assert torch.isnan(out[10, 1]).all()
    ok = torch.ones(out.shape[:2], dtype=torch.bool)
    ok[10, 1] = False
    assert torch.isfinite(out[ok]).all()
    assert relerr(out[ok], ref[ok]) < 2e-3


@pytest.mark.parametrize("piece_tokens,bottom_right,preset", [(32, True, "k4v4"), (4096, True, "k4v4"),
                                                               (4096, False, "k4v4"), (32, True, "k5v4")])
def test_prefill_dequant_impl_matches_reference(piece_tokens, bottom_right, preset):
    """impl="dequant" (rotated space): context in pieces of 32 tokens through a dense attention
    + LSE merge, or (4096, bottom-right causal attention) context and chunk in one causal call."""
    pool, bt, sl, qsl, q, k, v, ref = _batch(preset, 8, 2, 64, 16, seed=3)
    calls = []

    def top_left_only(q_, k_, v_, scale, causal):
        """Like PyTorch's FA: a causal call with Tq != Tk would be top-left aligned: refuse it."""
        calls.append((q_.shape[0], k_.shape[0], causal))
        assert not (causal and q_.shape[0] != k_.shape[0])
        return _dense64(q_, k_, v_, scale, causal)

    out = torch.full_like(q, float("nan"))
    prefill_attention(q, k, v, pool.data, bt, sl, qsl, pool.layout, pool.rotation, 0.125, out=out,
                      impl="dequant", piece_tokens=piece_tokens,
                      dense_attn=_dense64_br if bottom_right else top_left_only)
    assert relerr(out, ref) < 2e-3
    if not bottom_right:
        assert (20, 40, False) in calls and (20, 20, True) in calls


@pytest.mark.parametrize("rotated", [False, True])
@pytest.mark.parametrize("preset,d,bs", [("k4v2", 64, 32), ("k5v4", 64, 32), ("k5v4", 128, 16)])
def test_dequantize_context_matches_pool_dequantization(rotated, preset, d, bs):
    """The Triton dequantization pass vs the PyTorch reference of the format (float64)."""
    from kvrepro.ops import dequantize_context
    pool, bt, sl, qsl, q, k, v, ref = _batch(preset, 9, 3, d, bs, seed=4)
    n = CTXS[-1]
    kd = torch.full((n, 3, d), float("nan"), dtype=torch.float16, device=DEV)
    vd = torch.full_like(kd, float("nan"))
    dequantize_context(pool.data, bt[-1], 0, n, pool.layout, pool.rotation, kd, vd, rotated=rotated)
    k_rot, v_rot = pool.gather_rotated(bt[-1], n)
    r = pool.rotation.double()
    k_ref = k_rot.double() if rotated else k_rot.double() @ r.T
    v_ref = v_rot.double() if rotated else v_rot.double() @ r.T
    assert relerr(kd, k_ref) < 1e-3 and relerr(vd, v_ref) < 1e-3


def test_prefill_dequant_impl_through_vllm_adapter():
    """The FA-varlen adapter's plumbing, with a float64 stand-in returning lse as [Hq, Tq]."""
    calls = []

    def fake_fa(q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, cu_seqlens_k, softmax_scale, causal,
                return_softmax_lse, fa_version):
        calls.append((max_seqlen_q, max_seqlen_k, causal, fa_version))
        assert return_softmax_lse and cu_seqlens_q.tolist() == [0, max_seqlen_q]
        o, lse = _dense64(q, k, v, softmax_scale, causal)
        return o, lse.transpose(0, 1).contiguous()

    pool, bt, sl, qsl, q, k, v, ref = _batch("k4v4", 8, 2, 64, 16, seed=6)
    out = prefill_attention(q, k, v, pool.data, bt, sl, qsl, pool.layout, pool.rotation, 0.125,
                            impl="dequant", piece_tokens=64, dense_attn=vllm_dense_attn(fake_fa, 3))
    assert relerr(out, ref) < 2e-3
    # ctx 40 + chunk 20 fit one piece: one causal call over [context | chunk]; ctx 300 does not:
    # the chunk (causal) and pieces of 64 + 64 + 64 + 64 + 44 context tokens (non-causal).
    assert (20, 60, True, 3) in calls and (20, 40, False, 3) not in calls
    assert (1, 1, True, 3) in calls and (1, 64, False, 3) in calls and (1, 44, False, 3) in calls


def test_prefill_rejects_bad_inputs():
    pool, bt, sl, qsl, q, k, v, _ = _batch("k4v4", 8, 2, 64, 16, seed=4)
    with pytest.raises(ValueError, match="impl"):
        prefill_attention(q, k, v, pool.data, bt, sl, qsl, pool.layout, pool.rotation, 0.125, impl="fa9")
    with pytest.raises(ValueError, match="query_start_loc"):
        prefill_attention(q, k, v, pool.data, bt, sl, qsl[:-1], pool.layout, pool.rotation, 0.125)
    with pytest.raises(ValueError, match="rows"):
        prefill_attention(q, k, v, pool.data, bt, sl, qsl, pool.layout, pool.rotation, 0.125, rows=48)


def test_prefill_refuses_inconsistent_lengths_and_options():
    """Rows that would never be written, an unknown dequant mode and bad tiling
    are refused with the parameter's name instead of returning uninitialised memory."""
    pool, bt, sl, qsl, q, k, v, ref = _batch("k4v4", 8, 2, 64, 16, seed=5)
    args = (pool.data, bt, sl)
    tail = (pool.layout, pool.rotation, 0.125)
    with pytest.raises(ValueError, match="max_query_len=0 is below the longest query"):
        prefill_attention(q, k, v, *args, qsl, *tail, max_query_len=0)
    short = qsl.clone()
    short[-1] -= 1                                  # last sequence one row short of T
    with pytest.raises(ValueError, match="query_start_loc must start at 0"):
        prefill_attention(q, k, v, *args, short, *tail)
    with pytest.raises(ValueError, match="max_query_len must be a non-negative int"):
        prefill_attention(q, k, v, *args, qsl, *tail, max_query_len=2.5)
    with pytest.raises(ValueError, match=r"dequant='ptx'; allowed: \('triton', 'asm'\)"):
        prefill_attention(q, k, v, *args, qsl, *tail, dequant="ptx")
    with pytest.raises(ValueError, match="block_n=48"):
        prefill_attention(q, k, v, *args, qsl, *tail, block_n=48)
    with pytest.raises(ValueError, match="num_warps=3"):
        prefill_attention(q, k, v, *args, qsl, *tail, num_warps=3)
    with pytest.raises(ValueError, match="num_stages=0"):
        prefill_attention(q, k, v, *args, qsl, *tail, num_stages=0)
    if DEV == "cpu":
        with pytest.raises(ValueError, match="needs a CUDA device; pass dense_attn"):
            prefill_attention(q, k, v, *args, qsl, *tail, impl="dequant")


@pytest.mark.parametrize("preset,hq,hkv,d,bs", [("k4v4", 8, 2, 64, 16), ("k5v4", 9, 3, 64, 32),
                                                ("k8v4", 8, 2, 64, 16), ("k4v2", 8, 2, 64, 16)])
def test_prefill_rope_mean_context_gets_its_bias_back_and_the_chunk_stays_exact(preset, hq, hkv, d, bs,
                                                                              host_device_guard):
    """Context pages stored under the key offset rope-mean (k - R(p) b_hat, bias of norm 600 in fast and slow pairs),
    the chunk's own keys raw: the kernel's output equals float64 attention over [context restored (+ R(p) b_hat) |
    raw chunk], and is close to attention over the raw keys everywhere."""
    from kvrepro.formats.offset import RopeMean
    from kvrepro.keybias import rope
    from kvrepro.ops import store_kv
    from kvrepro.reference import attention_ref

    gen = torch.Generator().manual_seed(hq + bs)
    maxb = max(-(-(c + q) // bs) for c, q in zip(CTXS, QLENS)) + 1
    nb = len(CTXS) * maxb + 3
    pool = make_pool(preset, hkv, d, bs, nb, gen)
    bt = block_tables(len(CTXS), maxb, nb, gen)
    b = torch.zeros(hkv, d, dtype=torch.float64)
    b[:, [0, 1, d // 2 - 1]] = 250.0
    b[:, [d // 2, d - 1]] = -250.0
    rm = RopeMean(hkv, d, {"rope_theta": 1e4, "neox": True}, device=DEV)
    qs, ks, vs, refs, exacts = [], [], [], [], []
    for r in sorted(range(len(CTXS)), key=lambda i: -CTXS[i]):       # calibrate on the longest context first
        c, ql = CTXS[r], QLENS[r]
        pos = torch.arange(c + ql, device=DEV)
        k = rope(b[:, None] + torch.randn(hkv, c + ql, d, generator=gen, dtype=torch.float64), pos.cpu(), 1e4)
        k = k.transpose(0, 1).to(DEV, torch.float16)
        v = torch.randn(c + ql, hkv, d, generator=gen).to(DEV, torch.float16)
        if c:
            rm.calibrate(k[:c], pos[:c])
        slots = (bt[r][pos // bs].long() * bs + pos % bs).to(torch.int32)
        store_kv(rm.remove(k, pos), v, pool.data, slots, pool.layout, pool.rotation)
        ks.append((r, k, v))
    ks.sort(key=lambda x: x[0])
    for r, k, v in ks:
        c, ql = CTXS[r], QLENS[r]
        q = torch.randn(ql, hq, d, generator=gen).to(DEV, torch.float16)
        kd = rm.restore(pool.gather(bt[r], c)[0], torch.arange(c, device=DEV)) if c else k[:0].float()
        vd = pool.gather(bt[r], c)[1] if c else v[:0].float()
        refs.append(attention_ref(q, torch.cat([kd.double(), k[c:].double()]), torch.cat([vd.double(),
                                  v[c:].double()]), d ** -0.5, torch.float64))
        exacts.append(attention_ref(q, k.double(), v.double(), d ** -0.5, torch.float64))
        qs.append((q, k[c:], v[c:]))
    q, kf, vf = (torch.cat(x) for x in zip(*qs))
    qsl = torch.tensor([0] + torch.tensor(QLENS).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    sl = torch.tensor([c + ql for c, ql in zip(CTXS, QLENS)], dtype=torch.int32, device=DEV)
    a_, b_ = rm.score_terms(q)
    rope_bias = (torch.cat([a_, b_], -1).contiguous(), rm.inv_freq.contiguous())
    if DEV == "cuda" and preset not in ROPE_GPU_PRESETS:              # faults on the H200: refused on a GPU
        with pytest.raises(ValueError, match=f"preset {preset} is not supported there.*allowed presets: k4v4, k5v4"):
            prefill_attention(q, kf, vf, pool.data, bt, sl, qsl, pool.layout, pool.rotation, d ** -0.5,
                              rope_bias=rope_bias)
        return
    out = prefill_attention(q, kf, vf, pool.data, bt, sl, qsl, pool.layout, pool.rotation, d ** -0.5,
                            rope_bias=rope_bias)
    assert relerr(out, torch.cat(refs)) < 3e-3
    assert relerr(out, torch.cat(exacts)) < (0.6 if preset == "k4v2" else 0.25)
    with pytest.raises(ValueError, match="rope_bias needs impl='paged'"):
        prefill_attention(q, kf, vf, pool.data, bt, sl, qsl, pool.layout, pool.rotation, d ** -0.5, impl="dequant",
                          dense_attn=_dense64, rope_bias=(torch.cat([a_, b_], -1).contiguous(), rm.inv_freq))


def test_rope_bias_on_a_gpu_is_refused_for_the_presets_whose_prefill_faults_there():
    """check_rope_prefill looks only at the device type and the layout's bits, so the GPU refusal is checked here
    without a GPU: k8v4 and k4v2 with rope_bias on CUDA raise (naming the preset and the allowed ones); k4v4, k5v4,
    a CPU device and no rope_bias pass."""
    from kvrepro.formats import get_format

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for preset in ("k8v4", "k4v2"):
        layout = get_format(preset).layout(128, 16)
        with pytest.raises(ValueError, match=f"preset {preset} is not supported there.*allowed presets: k4v4, k5v4"):
            check_rope_prefill(layout, cuda, 8)
        check_rope_prefill(layout, cpu, 8)
        check_rope_prefill(layout, cuda, 0)
    for preset in ROPE_GPU_PRESETS:
        check_rope_prefill(get_format(preset).layout(128, 16), cuda, 8)
