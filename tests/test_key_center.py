"""Key centering (``kvrepro.formats.centering``): the pages hold ``k - mu``; attention must stay the function of
the uncentered keys (softmax's shift invariance), with a smaller 4-bit key error when keys share a common offset.
References are PyTorch float64 attention over the keys the format would give back without centering."""
import pytest
import torch

from kvrepro.formats import get_format
from kvrepro.formats.centering import MIN_CENTER_TOKENS, prefill_key_mean
from kvrepro.hf import PagedKVLayer, make_cache
from kvrepro.ops import store_kv
from kvrepro.reference import attention_ref
from kvrepro.vllm_backend import config as cfg
from kvrepro.vllm_backend.runtime import LIVE_RUNTIMES, LayerRuntime, reference_attend


def _offset_keys(g, n, hkv, d, offset):
    """Keys with a large common component per KV head (``offset`` [hkv, d]), as LLM keys have."""
    return (torch.randn(n, hkv, d, generator=g) + offset).bfloat16()


def test_prefill_key_mean_is_the_mean_over_prefill_positions_from_one():
    g = torch.Generator().manual_seed(0)
    hkv, d = 2, 8
    # [2 decodes | a chunk with 30 tokens of context | a fresh 6-token prompt], then 4 padding tokens
    ql, seq = [1, 1, 5, 6], [40, 9, 35, 6]
    key = torch.randn(sum(ql) + 4, hkv, d, generator=g)
    qsl = torch.tensor([0, 1, 2, 7, 13, 13], dtype=torch.int32)[:5]
    mean, n = prefill_key_mean(key, qsl, torch.tensor(seq, dtype=torch.int32), num_decodes=2)
    rows = list(range(2, 7)) + list(range(8, 13))   # all 5 of the chunk; the prompt without its position 0
    want = key[rows].double().mean(0)
    assert n == 10 and mean.dtype == torch.float32
    assert torch.allclose(mean.double(), want, atol=1e-6)
    slots = torch.arange(sum(ql) + 4)
    slots[[3, 9, 10]] = -1   # padding slots are not stored: left out
    m2, n2 = prefill_key_mean(key, qsl, torch.tensor(seq, dtype=torch.int32), 2, slot_mapping=slots)
    rows2 = [i for i in rows if i not in (3, 9, 10)]
    assert n2 == 7 and torch.allclose(m2.double(), key[rows2].double().mean(0), atol=1e-6)
    empty, n0 = prefill_key_mean(key, qsl[:3], torch.tensor(seq[:2], dtype=torch.int32), num_decodes=2)
    assert n0 == 0 and torch.equal(empty, torch.zeros(hkv, d))
    with pytest.raises(ValueError, match="seq_len"):
        prefill_key_mean(key, qsl, torch.tensor([40, 9, 3, 6], dtype=torch.int32), num_decodes=2)
    with pytest.raises(ValueError, match="entries"):
        prefill_key_mean(key, qsl[:4], torch.tensor(seq, dtype=torch.int32))


def _slots(bt, b, lo, hi, bs):
    return [int(bt[b, i // bs]) * bs + i % bs for i in range(lo, hi)]


def _engine(key_center, seed=3, hq=8, hkv=2, d=64, bs=16):
    """A LayerRuntime serving two requests the way vLLM batches them: step 1 prefills both prompts (the first
    real prefill: calibration), step 2 is [decode of request 0 | a 9-token chunk of request 1]. Returns the
    step-2 output, the exact keys / values of every position, and what is needed to rebuild references."""
    g = torch.Generator().manual_seed(seed)
    offset = 6.0 * torch.randn(hkv, d, generator=g)
    rt = LayerRuntime("k4v4", hq, hkv, d, d ** -0.5, key_center=key_center)
    layout = rt.fmt.layout(d, bs)
    pool = torch.zeros(12, hkv, layout.page_bytes, dtype=torch.uint8)
    bt = torch.tensor([[3, 7, 1, 0], [10, 2, 5, 9]], dtype=torch.int32)
    keys = [_offset_keys(g, 40, hkv, d, offset), _offset_keys(g, 45, hkv, d, offset)]
    vals = [torch.randn(40, hkv, d, generator=g).bfloat16(), torch.randn(45, hkv, d, generator=g).bfloat16()]
    # step 1: prompts of 39 and 36 tokens
    k1 = torch.cat([keys[0][:39], keys[1][:36]]).view(75, -1)
    v1 = torch.cat([vals[0][:39], vals[1][:36]]).view(75, -1)
    q1 = torch.randn(75, hq * d, generator=g).bfloat16()
    sm1 = torch.tensor(_slots(bt, 0, 0, 39, bs) + _slots(bt, 1, 0, 36, bs))
    sl1, qsl1 = torch.tensor([39, 36], dtype=torch.int32), torch.tensor([0, 39, 75], dtype=torch.int32)
    rt.store(k1, v1, pool, sm1)                     # vLLM stores before the forward ...
    rt.calibrate(k1, v1, pool, sm1, sl1, qsl1, 75, 0, 39)   # ... whose first real prefill calibrates
    rt.attend(q1, k1, v1, pool, bt, sl1, qsl1, 75, 0, 0, torch.empty(75, hq, d, dtype=torch.bfloat16),
              max_query_len=39)
    # step 2: decode token 39 of request 0, chunk 36..44 of request 1
    k2 = torch.cat([keys[0][39:40], keys[1][36:45]]).view(10, -1)
    v2 = torch.cat([vals[0][39:40], vals[1][36:45]]).view(10, -1)
    q2 = torch.randn(10, hq * d, generator=g).bfloat16()
    sm2 = torch.tensor(_slots(bt, 0, 39, 40, bs) + _slots(bt, 1, 36, 45, bs))
    sl2, qsl2 = torch.tensor([40, 45], dtype=torch.int32), torch.tensor([0, 1, 10], dtype=torch.int32)
    assert not rt.calibrate(k2, v2, pool, sm2, sl2, qsl2, 10, 1, 9)   # only once
    rt.store(k2, v2, pool, sm2)
    out = torch.empty(10, hq, d, dtype=torch.bfloat16)
    rt.attend(q2, k2, v2, pool, bt, sl2, qsl2, 10, 1, 1, out, max_query_len=9)
    return dict(rt=rt, pool=pool, bt=bt, out=out, q2=q2, k2=k2, v2=v2, sl2=sl2, qsl2=qsl2, keys=keys, vals=vals,
                hq=hq, hkv=hkv, d=d, bs=bs)


def _exact(e):
    """float64 attention of step 2 over the exact (unquantized) K/V of every position."""
    hq, d = e["hq"], e["d"]
    q = e["q2"].view(10, hq, d)
    o0 = attention_ref(q[0:1], e["keys"][0].double(), e["vals"][0].double(), d ** -0.5, torch.float64)
    o1 = attention_ref(q[1:10], e["keys"][1].double(), e["vals"][1].double(), d ** -0.5, torch.float64)
    return torch.cat([o0, o1])


def test_centered_attention_is_attention_over_the_uncentered_keys():
    e = _engine(key_center=True)
    rt = e["rt"]
    want_mean = torch.cat([e["keys"][0][1:39], e["keys"][1][1:36]]).double().mean(0)
    assert rt.center_state == f"on ({38 + 35} tokens)"
    assert torch.allclose(rt.key_mean.double(), want_mean, atol=1e-5)
    # Independent reference: gather the pages (they hold k - mu), add mu back, attend with the fresh chunk exact.
    fmt_pool = rt.fmt.new_pool(1, e["hkv"], e["d"], e["bs"])
    fmt_pool.data = e["pool"]
    hq, d = e["hq"], e["d"]
    q = e["q2"].view(10, hq, d)
    mu = rt.key_mean.double()
    k0, v0 = fmt_pool.gather(e["bt"][0], 40)
    want0 = attention_ref(q[0:1], k0.double() + mu, v0.double(), d ** -0.5, torch.float64)
    kc, vc = fmt_pool.gather(e["bt"][1], 36)
    kk = torch.cat([kc.double() + mu, e["keys"][1][36:45].double()])
    vv = torch.cat([vc.double(), e["vals"][1][36:45].double()])
    want1 = attention_ref(q[1:10], kk, vv, d ** -0.5, torch.float64)
    want = torch.cat([want0, want1])
    err = (e["out"].double() - want).abs().max() / want.abs().max()
    assert err < 2e-2, err
    # the backend's own oracle agrees (it shifts the fresh keys instead)
    ref = reference_attend(rt, e["q2"], e["k2"], e["v2"], e["pool"], e["bt"], e["sl2"], e["qsl2"], 10, 1)
    assert torch.allclose(ref, want, atol=1e-6 * float(want.abs().max()))
    # the pages of the calibration step were rewritten centered: dequantized + mu is close to the exact key
    rel = (k0.double()[:39] + mu - e["keys"][0][:39].double()).norm() / e["keys"][0][:39].double().norm()
    assert rel < 0.05, rel


def test_centering_shrinks_the_error_against_exact_attention_when_keys_share_an_offset():
    on, off = _engine(key_center=True), _engine(key_center=False)
    assert off["rt"].center_state == "off (disabled)" and off["rt"].key_mean is None   # nothing allocated when off
    exact = _exact(on)
    assert torch.allclose(exact, _exact(off))            # same inputs
    err_on = float((on["out"].double() - exact).norm() / exact.norm())
    err_off = float((off["out"].double() - exact).norm() / exact.norm())
    assert err_on < 0.6 * err_off, (err_on, err_off)


def _rt_pool(hkv=1, d=64):
    rt = LayerRuntime("k4v4", 2, hkv, d, 0.125, key_center=True)
    pool = torch.zeros(4, hkv, rt.fmt.layout(d, 16).page_bytes, dtype=torch.uint8)
    rt.prepare(pool.device)
    return rt, pool


def _step(rt, pool, k, slots, lens, qsl, nd, mql):
    """One vLLM step as the backend runs it: store (do_kv_cache_update), then forward's calibration."""
    t = int(qsl[-1])
    rt.store(k[:t], k[:t], pool, slots[:t])
    return rt.calibrate(k, k, pool, slots, torch.tensor(lens, dtype=torch.int32), torch.tensor(qsl, dtype=torch.int32),
                        t, nd, mql)


def test_calibration_ignores_dummy_batches_and_never_mixes_two_means():
    k = torch.randn(20, 64).bfloat16()
    rt, pool = _rt_pool()
    assert rt in LIVE_RUNTIMES and rt.center_state == "pending"
    ptr = rt.key_mean.data_ptr()
    # vLLM's warm-up / profiling / capture batches store nothing (every slot -1): still pending, prefill or decode
    assert not _step(rt, pool, k, torch.full((20,), -1), [20], [0, 20], 0, 20)
    assert not _step(rt, pool, k, torch.full((2,), -1), [5, 7], [0, 1, 2], 2, 1)
    assert rt.center_state == "pending"
    # the first step that stores real tokens is a decode (a 1-token prompt): off for good
    assert _step(rt, pool, k, torch.tensor([3]), [1], [0, 1], 1, 1)
    assert rt.center_state == "off (the first step that stored tokens was not a fresh prefill: it was a decode step)"
    assert not _step(rt, pool, k, torch.arange(20), [20], [0, 20], 0, 20)     # a later prefill changes nothing
    assert torch.equal(rt.key_mean, torch.zeros(1, 64)) and rt.key_mean.data_ptr() == ptr
    # tokens stored by a step whose forward never ran in Python (a replayed decode graph) are counted too
    rt, pool = _rt_pool()
    rt.store(k[:1], k[:1], pool, torch.tensor([5]))
    assert _step(rt, pool, k, torch.arange(20), [20], [0, 20], 0, 20)
    assert rt.center_state == "off (the first step that stored tokens was not a fresh prefill: 1 tokens were stored before it)"
    assert torch.equal(rt.key_mean, torch.zeros(1, 64))
    # a fresh 16-token prompt has 15 tokens at positions >= 1: too few, off for good
    rt, pool = _rt_pool()
    assert _step(rt, pool, k, torch.arange(16), [MIN_CENTER_TOKENS], [0, 16], 0, 16)
    assert rt.center_state.startswith("off (first prefill had 15 < 16 stored tokens")
    assert torch.equal(rt.key_mean, torch.zeros(1, 64))


def test_calibration_updates_the_mean_in_place():
    """A CUDA graph captured before calibration reads the mean by address: it must not move."""
    rt, pool = _rt_pool()
    ptr = rt.key_mean.data_ptr()
    k = (torch.randn(30, 64) + 5).bfloat16()
    assert _step(rt, pool, k, torch.arange(30), [30], [0, 30], 0, 30)
    assert rt.key_mean.data_ptr() == ptr and rt.center_state == "on (29 tokens)"
    assert torch.allclose(rt.key_mean.double(), k[1:].double().mean(0, keepdim=True), atol=1e-5)


@pytest.mark.parametrize("rotate", ["torch", "kernel"])
def test_store_kv_key_center_writes_the_reference_bytes_and_checks_its_argument(rotate):
    g = torch.Generator().manual_seed(5)
    hkv, d, bs = 2, 64, 16
    fmt = get_format("k4v4")
    layout = fmt.layout(d, bs)
    k = _offset_keys(g, 21, hkv, d, 4.0 * torch.randn(hkv, d, generator=g))
    v = torch.randn(21, hkv, d, generator=g).bfloat16()
    mu = k.float().mean(0)
    slots = torch.randperm(48, generator=g)[:21]
    ref = fmt.new_pool(3, hkv, d, bs)
    if rotate == "torch":   # centered in float32, as the reference
        ref.write(k, v, slots, key_center=mu)
    else:                   # the in-kernel rotation reads the key dtype: the centered key is rounded to it first
        ref.write((k.float() - mu).bfloat16(), v, slots)
    pool = torch.zeros(3, hkv, layout.page_bytes, dtype=torch.uint8)
    store_kv(k, v, pool, slots, layout, ref.rotation, key_center=mu, rotate=rotate)
    got = ref.gather(torch.arange(3), 48)
    ref.data = pool
    want = ref.gather(torch.arange(3), 48)
    for a, b in zip(got, want):   # at most a one-code tie difference (float32 summation order)
        assert (a - b).abs().max() <= 0.25 * float(a.abs().max())
        assert (a - b).abs().mean() < 1e-3 * float(a.abs().max())
    with pytest.raises(ValueError, match=r"key_center must be float32 \[num_kv_heads=2, head_dim=64\]"):
        store_kv(k, v, pool, slots, layout, ref.rotation, key_center=mu.double())
    with pytest.raises(ValueError, match="key_center must be float32"):
        store_kv(k, v, pool, slots, layout, ref.rotation, key_center=mu[:1])
    with pytest.raises(ValueError, match="NaN or an infinity"):
        store_kv(k, v, pool, slots, layout, ref.rotation, key_center=torch.full_like(mu, float("nan")))
    with pytest.raises(ValueError, match="key_center must be None or a float32 tensor"):
        store_kv(k, v, pool, slots, layout, ref.rotation, key_center=mu.tolist())


def test_cpu_path_layer_centers_like_the_backend():
    g = torch.Generator().manual_seed(7)
    h, d = 3, 64
    offset = 5.0 * torch.randn(h, d, generator=g)
    k = (torch.randn(1, h, 40, d, generator=g) + offset[None, :, None, :]).bfloat16().float()
    v = torch.randn(1, h, 40, d, generator=g).bfloat16().float()
    errs = {}
    for center in (True, False):
        layer = PagedKVLayer(get_format("k4v4"), key_center=center)
        layer.update(k[:, :, :37], v[:, :, :37])
        kr, _ = layer.update(k[:, :, 37:], v[:, :, 37:])
        mu = layer.key_mean if center else torch.zeros(h, d)
        if center:
            assert torch.allclose(mu.double(), k[0, :, 1:37].double().mean(1), atol=1e-5)
        errs[center] = float((kr[0] + mu[:, None, :] - k[0]).norm() / k[0].norm())
    assert errs[True] < 0.6 * errs[False], errs
    with pytest.raises(ValueError, match="compressed formats"):
        PagedKVLayer(get_format("bf16"), key_center=True)
    with pytest.raises(ValueError, match="key_center must be True or False"):
        make_cache("k4v4", 1, key_center="off")
    # the mean is fixed by the first update whatever its length: a 1-token start means off for good
    layer = PagedKVLayer(get_format("k4v4"), key_center=True)
    layer.update(k[:, :, :1], v[:, :, :1])
    layer.update(k[:, :, 1:], v[:, :, 1:])
    assert torch.equal(layer.key_mean, torch.zeros(h, d))
    assert all(layer.key_center for layer in make_cache("k4v4", 2, key_center=True).layers)
    assert not any(layer.key_center for layer in make_cache("k4v4", 2).layers)      # off by default
    assert not any(layer.key_center for layer in make_cache("bf16", 2).layers)


def test_key_center_setting(monkeypatch):
    monkeypatch.delenv(cfg.KEY_CENTER_ENV, raising=False)
    assert cfg.resolve_key_center() is False                 # off by default (notes/accuracy.md)
    assert LayerRuntime("k4v4", 2, 1, 64, 0.125).center_state == "off (disabled)"
    assert cfg.resolve_key_center(" First-Prefill ") is True
    monkeypatch.setenv(cfg.KEY_CENTER_ENV, "first-prefill")
    assert cfg.resolve_key_center() is True
    with pytest.raises(ValueError, match="KVREPRO_KEY_CENTER='mean'; allowed: first-prefill, off"):
        cfg.resolve_key_center("mean")
    with pytest.raises(ValueError, match="key_center must be True or False"):
        LayerRuntime("k4v4", 2, 1, 64, 0.125, key_center="on")


def test_centered_accuracy_mode_and_no_leak_from_the_shell():
    from kvrepro import accuracy_vllm as av

    shell = {"KVREPRO_KEY_CENTER": "first-prefill", "KVREPRO_PRESET": "k4v2"}
    assert "KVREPRO_KEY_CENTER" not in av.mode_env("kvrepro:k4v4", shell)   # plain k4v4 rows stay uncentered
    env = av.mode_env("kvrepro:k4v4:centered", {"KVREPRO_KEY_CENTER": "off"})
    assert env["KVREPRO_KEY_CENTER"] == "first-prefill" and env["KVREPRO_PRESET"] == "k4v4"
    assert av.FORMAT_OF_MODE["kvrepro:k4v4:centered"] == "k4v4-centered"
    av.mode_settings("kvrepro:k4v4:centered")["env"]["KVREPRO_KEY_CENTER"] = "off"     # a caller's copy only
    assert av.CONTROL_MODES["kvrepro:k4v4:centered"]["env"]["KVREPRO_KEY_CENTER"] == "first-prefill"
