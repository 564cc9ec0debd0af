"""The recent-token window (``kvrepro.vllm_backend.window``): its bookkeeping against hand-computed expectations, and
decode attention through ``LayerRuntime`` (real kernels, Triton interpreter on CPU) against float64 attention where
the last W positions use the exact K/V and the rest the dequantized pages."""
import pytest
import torch

from kvrepro.reference import attention_ref
from kvrepro.vllm_backend.runtime import LayerRuntime
from kvrepro.vllm_backend.window import RecentWindow, default_entries


def test_update_keeps_the_last_w_tokens_of_each_chunk_exactly():
    g = torch.Generator().manual_seed(0)
    w = RecentWindow(4, 64, 2, 8, torch.float32, torch.device("cpu"))
    k = torch.randn(9, 2, 8, generator=g)
    v = torch.randn(9, 2, 8, generator=g)
    # request 0: a chunk of 6 tokens at slots 10..15; request 1: one decode token at slot 40; two padding tokens
    slots = torch.tensor([10, 11, 12, 13, 14, 15, 40, -1, -1])
    qsl = torch.tensor([0, 6, 7], dtype=torch.int32)
    w.update(k, v, slots, qsl, 7)
    for i, s in enumerate(slots[:7].tolist()):
        if i in (0, 1):                                   # not among the chunk's last 4
            assert w.tag[s % 64] == -1
        else:
            assert w.tag[s % 64] == s and torch.equal(w.k[s % 64], k[i]) and torch.equal(w.v[s % 64], v[i])
    assert int((w.tag[:64] >= 0).sum()) == 5 and w.tag[64] == -1
    # a later step stores slot 12 again as a non-window token (its block was freed and reused): the entry is cleared
    w.update(k[:8], v[:8], torch.tensor([12, 20, 21, 22, 23, 24, 25, 26]), torch.tensor([0, 8], dtype=torch.int32), 8)
    assert w.tag[12] == -1 and w.tag[13] == 13
    # two window tokens claiming one entry in a step (slots 5 and 69 = 5 + 64): the larger slot wins, data and tag
    w.update(k[:2], v[:2], torch.tensor([69, 5]), torch.tensor([0, 1, 2], dtype=torch.int32), 2)
    assert w.tag[5] == 69 and torch.equal(w.k[5], k[0]) and torch.equal(w.v[5], v[0])


def test_bad_arguments():
    with pytest.raises(ValueError, match="window must be an int in 1..256"):
        RecentWindow(0, 64, 1, 8, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"entries must be an int in window \(8\)..1048576"):
        RecentWindow(8, 4, 1, 8, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="num_kv_heads must be a positive int"):
        RecentWindow(8, 64, 0, 8, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="dtype must be bfloat16, float16 or float32"):
        RecentWindow(8, 64, 1, 8, torch.int8, torch.device("cpu"))
    with pytest.raises(ValueError, match="GiB of side cache per layer .* lower KVREPRO_RECENT_WINDOW"):
        RecentWindow(32, 1 << 20, 8, 128, torch.bfloat16, torch.device("meta"))
    for bad in (0, -1, "abc", 8.5, True, 2 ** 22):
        with pytest.raises(ValueError, match="window_entries must be None or an int in 8..1048576"):
            LayerRuntime("k4v4", 8, 2, 64, 0.125, recent_window=8, window_entries=bad)
    with pytest.raises(ValueError, match="recent_window must be an int in 0..256"):
        LayerRuntime("k4v4", 8, 2, 64, 0.125, recent_window=-1)
    assert default_entries(32, 128) == 65536 and default_entries(8, 1) == 4096


def _steps(seed, rt, hq, hkv, d, bs, lens, w_entries_check=True):
    """Sequences of ``lens`` tokens: a prefill step (all but the last token of each, one chunk per request), then
    the decode step of the last tokens; both stored and recorded as the backend does. Returns what attend needs and
    the raw K/V of every position."""
    g = torch.Generator().manual_seed(seed)
    layout = rt.fmt.layout(d, bs)
    width = max(-(-n // bs) for n in lens) + 1
    nb = len(lens) * width + 2
    pool = torch.zeros(nb, hkv, layout.page_bytes, dtype=torch.uint8)
    bt = torch.randperm(nb, generator=g)[: len(lens) * width].view(len(lens), width).to(torch.int32)
    raw = [(torch.randn(n, hkv, d, generator=g).bfloat16(), torch.randn(n, hkv, d, generator=g).bfloat16())
           for n in lens]
    slot = lambda b, i: int(bt[b, i // bs]) * bs + i % bs  # noqa: E731
    pre = [n - 1 for n in lens]
    kp = torch.cat([raw[b][0][:pre[b]] for b in range(len(lens))])
    vp = torch.cat([raw[b][1][:pre[b]] for b in range(len(lens))])
    sp = torch.tensor([slot(b, i) for b in range(len(lens)) for i in range(pre[b])])
    qsl_p = torch.tensor([0] + torch.tensor(pre).cumsum(0).tolist(), dtype=torch.int32)
    rt.store(kp, vp, pool, sp)
    rt.update_window(kp, vp, sp, qsl_p, kp.shape[0])
    kd = torch.stack([raw[b][0][-1] for b in range(len(lens))])
    vd = torch.stack([raw[b][1][-1] for b in range(len(lens))])
    sd = torch.tensor([slot(b, lens[b] - 1) for b in range(len(lens))])
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32)
    rt.store(kd, vd, pool, sd)
    rt.update_window(kd, vd, sd, qsl, len(lens))
    q = torch.randn(len(lens), hq, d, generator=g).bfloat16()
    return pool, bt, torch.tensor(lens, dtype=torch.int32), qsl, q, kd, vd, raw


def _reference(rt, pool, bt, lens, q, raw, window, hits=None):
    """float64: positions < L - W from the dequantized pages, >= L - W exact (or, where ``hits[b][j]`` is False,
    from the pages too)."""
    d, hkv = rt.head_size, rt.num_kv_heads
    ref_pool = rt.fmt.new_pool(1, hkv, d, rt.layout(pool).block_size)
    ref_pool.data = pool
    out = []
    for b, n in enumerate(lens.tolist()):
        kq, vq = ref_pool.gather(bt[b], n)
        k, v = kq.double().clone(), vq.double().clone()
        for j, p in enumerate(range(max(0, n - window), n)):
            if hits is None or hits[b][j]:
                k[p], v[p] = raw[b][0][p].double(), raw[b][1][p].double()
        out.append(attention_ref(q[b:b + 1].view(1, -1, d), k, v, rt.scale, torch.float64))
    return torch.cat(out)


@pytest.mark.parametrize("lens", [[40, 9, 70], [5, 33]])
def test_decode_with_window_matches_reference(lens):
    hq, hkv, d, bs, win = 8, 2, 64, 16, 8
    rt = LayerRuntime("k4v4", hq, hkv, d, d ** -0.5, recent_window=win)
    pool, bt, sl, qsl, q, kd, vd, raw = _steps(1, rt, hq, hkv, d, bs, lens)
    out = torch.full((len(lens), hq, d), float("nan"), dtype=torch.bfloat16)
    rt.attend(q, kd, vd, pool, bt, sl, qsl, len(lens), len(lens), len(lens), out, max_query_len=1)
    ref = _reference(rt, pool, bt, sl, q, raw, win)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).abs().max() / ref.abs().max() < 1e-2
    # the window matters: attention over the pages only is measurably different
    pages_only = _reference(rt, pool, bt, sl, q, raw, 0)
    assert (pages_only - ref).abs().max() / ref.abs().max() > 3e-2


def test_window_misses_fall_back_to_the_pages_and_padding_rows_stay_zero():
    """A side cache of 16 entries for 3 sequences: entries collide, the losers read their page bytes; a padded
    CUDA-graph row (seq_len 0) comes out zero."""
    hq, hkv, d, bs, win = 8, 2, 64, 16, 8
    lens = [40, 30, 70]
    rt = LayerRuntime("k4v4", hq, hkv, d, d ** -0.5, recent_window=win, window_entries=16)
    pool, bt, sl, qsl, q, kd, vd, raw = _steps(2, rt, hq, hkv, d, bs, lens)
    tag = rt.window.tag
    hits = []
    for b, n in enumerate(lens):
        s = [int(bt[b, p // bs]) * bs + p % bs for p in range(n - win, n)]
        hits.append([int(tag[x % 16]) == x for x in s])
    assert 0 < sum(map(sum, hits)) < win * len(lens)           # some hits, some misses
    bt_pad = torch.cat([bt, torch.zeros(1, bt.shape[1], dtype=torch.int32)])
    sl_pad = torch.cat([sl, torch.zeros(1, dtype=torch.int32)])
    q_pad = torch.cat([q, torch.randn(1, hq, d).bfloat16()])
    out = torch.full((4, hq, d), float("nan"), dtype=torch.bfloat16)
    rt.attend(q_pad, torch.cat([kd, kd[:1]]), torch.cat([vd, vd[:1]]), pool, bt_pad, sl_pad,
              torch.arange(5, dtype=torch.int32), 4, 4, 4, out, max_query_len=1)
    ref = _reference(rt, pool, bt, sl, q, raw, win, hits)
    assert (out[:3].double() - ref).abs().max() / ref.abs().max() < 1e-2
    assert (out[3] == 0).all()


def test_window_with_centered_pages_computes_the_same_attention():
    """With key centering the pages hold k - mu; the window shifts its exact keys by the same mu, so the merged
    softmax is the uncentered attention."""
    hq, hkv, d, bs, win = 8, 2, 64, 16, 8
    lens = [40, 21]
    rt = LayerRuntime("k4v4", hq, hkv, d, d ** -0.5, recent_window=win, key_center=True)
    rt.prepare(torch.device("cpu"))
    rt.key_mean.copy_(torch.randn(hkv, d, generator=torch.Generator().manual_seed(5)) * 3)
    rt.center_state = "on (test)"
    pool, bt, sl, qsl, q, kd, vd, raw = _steps(3, rt, hq, hkv, d, bs, lens)
    out = torch.empty(len(lens), hq, d, dtype=torch.bfloat16)
    rt.attend(q, kd, vd, pool, bt, sl, qsl, 2, 2, 2, out, max_query_len=1)
    # reference: pages dequantized hold k - mu; exact window keys shifted by mu alike
    mu = rt.key_mean.double()
    shifted = [((k.double() - mu).to(torch.float64), v) for k, v in raw]
    ref = _reference(rt, pool, bt, sl, q, shifted, win)
    assert (out.double() - ref).abs().max() / ref.abs().max() < 1e-2


def test_config_and_accuracy_mode(monkeypatch):
    from kvrepro import accuracy_vllm as av
    from kvrepro.vllm_backend import config as cfg

    monkeypatch.delenv("KVREPRO_RECENT_WINDOW", raising=False)
    assert cfg.resolve_recent_window() == 0
    monkeypatch.setenv("KVREPRO_RECENT_WINDOW", " 32 ")
    assert cfg.resolve_recent_window() == 32
    monkeypatch.setenv("KVREPRO_RECENT_WINDOW", "")
    assert cfg.resolve_recent_window() == 0
    assert cfg.resolve_recent_window("off") == 0 and cfg.resolve_recent_window(8) == 8
    for bad in ("257", "-1", "32 tokens", True):
        with pytest.raises(ValueError, match="KVREPRO_RECENT_WINDOW must be off, 0 or an integer in 1..256"):
            cfg.resolve_recent_window(bad)
    env = av.mode_env("kvrepro:k4v4:window32", {"KVREPRO_RECENT_WINDOW": "8"})
    assert env["KVREPRO_RECENT_WINDOW"] == "32" and env["KVREPRO_PRESET"] == "k4v4"
    assert "KVREPRO_RECENT_WINDOW" not in av.mode_env("kvrepro:k4v4", {"KVREPRO_RECENT_WINDOW": "8"})
    assert av.FORMAT_OF_MODE["kvrepro:k4v4:window32"] == "k4v4-window32"


def test_window_refuses_other_dtypes_and_oversized_caches():
    w = RecentWindow(4, 64, 2, 8, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="key/value must be torch.float32"):
        w.update(torch.zeros(1, 2, 8, dtype=torch.bfloat16), torch.zeros(1, 2, 8, dtype=torch.bfloat16),
                 torch.tensor([3]), torch.tensor([0, 1], dtype=torch.int32), 1)
    with pytest.raises(ValueError, match="more than 1048576; lower KVREPRO_RECENT_WINDOW or max_num_seqs"):
        default_entries(256, 512)
    from kvrepro.vllm_backend import config as cfg
    for bad in (32.7, "\u00b2", "\u0663", "\uff11\uff16"):
        with pytest.raises(ValueError, match="KVREPRO_RECENT_WINDOW must be off"):
            cfg.resolve_recent_window(bad)
    for bad in (True, 3.9, "\u00b2"):
        with pytest.raises(ValueError, match="KVREPRO_NUM_SPLITS must be an integer in 1..256"):
            cfg.resolve_num_splits(bad)
    rt = LayerRuntime("k4v4", 8, 2, 64, 0.125, recent_window=8)
    rt.prepare_window(torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="made for torch.float32 on cpu, now asked for torch.bfloat16"):
        rt.prepare_window(torch.device("cpu"), torch.bfloat16)


def test_padding_row_with_garbage_pages_stays_zero():
    """A padded graph row (seq_len 0) whose block-table row points at pages holding NaN bytes: nothing leaks."""
    hq, hkv, d, bs, win = 8, 2, 64, 16, 8
    rt = LayerRuntime("k4v4", hq, hkv, d, d ** -0.5, recent_window=win)
    pool, bt, sl, qsl, q, kd, vd, raw = _steps(4, rt, hq, hkv, d, bs, [40, 30])
    junk = int(bt[1, -1])                                  # a block no sequence uses (the width has one spare)
    pool[junk].fill_(0xFF)                                 # float16 0xFFFF = NaN scales
    bt_pad = torch.cat([bt, torch.full((1, bt.shape[1]), junk, dtype=torch.int32)])
    sl_pad = torch.cat([sl, torch.zeros(1, dtype=torch.int32)])
    out = torch.full((3, hq, d), float("nan"), dtype=torch.bfloat16)
    rt.attend(torch.cat([q, q[:1]]), torch.cat([kd, kd[:1]]), torch.cat([vd, vd[:1]]), pool, bt_pad, sl_pad,
              torch.arange(4, dtype=torch.int32), 3, 3, 3, out, max_query_len=1)
    assert (out[2] == 0).all() and torch.isfinite(out[:2]).all()
