"""kvrepro.hf: the KV cache a real model is served with holds the format's real page bytes,
and attention reads exactly those bytes dequantized (checked against an independent decoder
written from the layout spec), prefill and decode alike."""
import numpy as np
import pytest
import torch

from kvrepro.formats import COMPRESSED_PRESETS, FORMAT_NAMES, get_format
from kvrepro.formats.hadamard import rotation_matrix
from kvrepro.formats.offset import MAX_PAIRS, KeyOffset, RopeMean
from kvrepro.hf import PagedKVLayer, forward, make_cache, prefill, rope_info, teacher_forced_logprobs

H, D = 3, 64  # SmolLM2-135M: 3 KV heads, head_dim 64
STORED_DTYPE = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "k4v4": torch.uint8,
                "k8v4": torch.uint8, "k4v2": torch.uint8, "k5v4": torch.uint8}


def _unpack(page_bytes: np.ndarray, bits: int) -> np.ndarray:
    """Split-plane unpack of one token's codes (layout.py): byte j, plane i -> channel j + i*P."""
    if bits == 8:
        return page_bytes.astype(np.float64)
    n, p = 8 // bits, page_bytes.size
    out = np.zeros(p * n)
    for i in range(n):
        out[i * p:(i + 1) * p] = (page_bytes >> (i * bits)) & ((1 << bits) - 1)
    return out


def decode_pages_independently(pool, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """float64 K, V ``[seq_len, H, D]`` from ``pool.data`` read byte by byte (blocks in order)."""
    fmt, bs = pool.fmt, pool.block_size
    k = np.zeros((seq_len, pool.num_kv_heads, pool.head_dim))
    v = np.zeros_like(k)
    if fmt.name in ("bf16", "fp8"):
        data = pool.data.float().double().numpy()  # [nb, 2, bs, H, D]
        ks, vs = (1.0, 1.0) if fmt.name == "bf16" else (pool.k_scale, pool.v_scale)
        for t in range(seq_len):
            k[t] = data[t // bs, 0, t % bs] * ks
            v[t] = data[t // bs, 1, t % bs] * vs
        return k, v
    L = pool.layout
    raw = pool.data.numpy()  # uint8 [nb, H, page_bytes]
    r = rotation_matrix(pool.head_dim, fmt.seed).double().numpy()
    for t in range(seq_len):
        b, o = divmod(t, bs)
        for h in range(pool.num_kv_heads):
            page = raw[b, h]
            kb = page[L.k_code_offset + o * L.k_code_bytes:][:L.k_code_bytes]
            vc = _unpack(page[L.v_code_offset + o * L.v_code_bytes:][:L.v_code_bytes], L.value_bits)
            if L.key_symmetric:  # k5v4: 4-bit high plane (D/2 bytes), then the low bit plane; float16 scale
                kc = 2 * _unpack(kb[:pool.head_dim // 2], 4) + _unpack(kb[pool.head_dim // 2:], 1)
                k_scale = float(page[L.k_meta_offset + 2 * o:][:2].view(np.float16)[0])
                k[t, h] = (kc - 15.5) * k_scale @ r.T
            else:
                kc = _unpack(kb, L.key_bits)
                k_scale, k_zero = page[L.k_meta_offset + 4 * o:][:4].view(np.float16).astype(np.float64)
                k[t, h] = (kc * k_scale + k_zero) @ r.T
            if L.value_log_scale:  # k5v4: one byte u, scale 2**((u - 128) / 8)
                v_scale = 2.0 ** ((int(page[L.v_meta_offset + o]) - 128) / 8)
            else:
                v_scale = float(page[L.v_meta_offset + 2 * o:][:2].view(np.float16)[0])
            v[t, h] = (vc - ((1 << L.value_bits) - 1) / 2) * v_scale @ r.T
    return k, v


def _kv(t, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda: (scale * torch.randn(1, H, t, D, generator=g)).bfloat16().float()  # noqa: E731
    return mk(), mk()


def rope_offset_float64(rm: RopeMean, seq_len: int) -> np.ndarray:
    """float64 ``R(p) b_hat`` ``[seq_len, H, D]`` from a calibrated ``RopeMean``'s kept pairs (channels x, y, inverse
    frequency, pre-RoPE mean): RoPE's rotation of each pair by ``p * inv_freq``, written out here."""
    out = np.zeros((seq_len, rm.num_kv_heads, rm.head_dim))
    ang_p = np.arange(seq_len, dtype=np.float64)
    for h in range(rm.num_kv_heads):
        for i in range(MAX_PAIRS):
            bx, by = (float(t) for t in rm.bias[h, i])
            if bx == 0.0 and by == 0.0:
                continue
            x, y, a = int(rm.x_ch[h, i]), int(rm.y_ch[h, i]), ang_p * float(rm.inv_freq[h, i])
            out[:, h, x] += bx * np.cos(a) - by * np.sin(a)
            out[:, h, y] += bx * np.sin(a) + by * np.cos(a)
    return out


@pytest.mark.parametrize("name,key_offset", [(n, None) for n in FORMAT_NAMES]
                         + [(n, "slow-pairs") for n in sorted(COMPRESSED_PRESETS)])
def test_layer_stores_page_bytes_and_attends_over_them(name, key_offset):
    """Each format with its default key offset (None: rope-mean for the compressed presets, off for bf16 / fp8) and
    the compressed presets with slow-pairs: the pages hold the format's bytes of the stored keys, and the layer
    returns exactly those bytes dequantized, plus the offset where the offset is added back on read (rope-mean)."""
    fmt = get_format(name)
    rope = {"rope_theta": 1e4, "rotary_dim": D, "head_dim": D, "max_positions": 64}
    layer = PagedKVLayer(fmt, block_size=16, reserve_tokens=0, rope=rope, key_offset=key_offset)
    assert layer.key_offset_mode == (fmt.default_key_offset if key_offset is None else key_offset)
    chunks = [_kv(37, 1), _kv(1, 2), _kv(20, 3)]  # prefill, one decode step, a chunk forcing regrowth
    unbiased_k = torch.cat([c[0] for c in chunks], dim=2)
    if layer.key_offset_mode == "rope-mean":      # a key-projection bias before RoPE, so that rope-mean keeps pairs
        rope["neox"] = True
        b = _pre_rope_bias(58, rope["rope_theta"])
        chunks = [(k + b[:, :, p0:p0 + k.shape[2]], v) for (k, v), p0 in zip(chunks, (0, 37, 38))]
    returned, first_k = None, None
    for i, (k, v) in enumerate(chunks):
        returned = layer.update(k, v)
        if i == 0:
            first_k = returned[0].clone()
            first_blocks = layer.pool.num_blocks
    assert layer.pool.num_blocks > first_blocks  # the pool grew ...
    assert torch.equal(returned[0][:, :, :37], first_k)  # ... and kept the old pages byte for byte
    n = 58
    assert layer.get_seq_length() == n and returned[0].shape == (1, H, n, D)
    pool = layer.pool
    assert pool.data.dtype == STORED_DTYPE[name]
    assert pool.nbytes == pool.num_blocks * 16 * H * fmt.bytes_per_token_per_head(D)
    k_ref, v_ref = decode_pages_independently(pool, n)
    if layer.key_offset_mode == "rope-mean":      # pages hold k - R(p) b_hat; the layer adds R(p) b_hat back
        assert isinstance(layer.key_offset, RopeMean) and layer.key_offset.calibrated
        assert int((layer.key_offset.bias.abs().sum(-1) > 0).sum()) >= H * 2     # the biased pairs of every head
        k_ref = k_ref + rope_offset_float64(layer.key_offset, n)
    np.testing.assert_allclose(returned[0][0].transpose(0, 1).double().numpy(), k_ref, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(returned[1][0].transpose(0, 1).double().numpy(), v_ref, rtol=1e-5, atol=1e-5)
    # relative error vs the input, K and V: quantized for real (not a bf16 copy), and not broken. A constant key
    # offset (kvrepro.formats.offset.KeyOffset) stays subtracted in what the layer returns: add it back to compare.
    assert (layer.key_offset is not None) == (layer.key_offset_mode != "off")
    c = layer.key_offset.offset[:, None, :] if isinstance(layer.key_offset, KeyOffset) else 0.0
    returned = (returned[0] + c, returned[1])
    bounds = {"bf16": ((0, 0), (0, 0)), "fp8": ((0.01, 0.05), (0.01, 0.05)),
              "k8v4": ((0.002, 0.01), (0.05, 0.15)), "k4v4": ((0.05, 0.13), (0.05, 0.15)),
              "k4v2": ((0.05, 0.13), (0.3, 0.7)), "k5v4": ((0.02, 0.08), (0.05, 0.15))}[name]
    for j, (lo, hi) in enumerate(bounds):    # relative to the keys without the bias (the same with none added)
        x_in = torch.cat([c[j] for c in chunks], dim=2)
        err = float((returned[j] - x_in).norm() / (unbiased_k if j == 0 else x_in).norm())
        assert lo <= err <= hi, ("KV"[j], err)


def _pre_rope_bias(seq_len: int, theta: float) -> torch.Tensor:
    """float32 ``[1, H, seq_len, D]``: a bias ``b`` (norm ~60, in two pairs per head, one fast, one slow) added before
    RoPE and turned to each position, half-split pairs (channel i with i + D/2), as a model's key bias reaches the
    cache."""
    out = torch.zeros(1, H, seq_len, D)
    p = torch.arange(seq_len, dtype=torch.float64)
    for h in range(H):
        for i, (bx, by) in ((1 + h, (40.0, -20.0)), (28 - h, (30.0, 25.0))):
            a = p * theta ** (-2 * i / D)
            out[0, h, :, i] = (bx * torch.cos(a) - by * torch.sin(a)).float()
            out[0, h, :, i + D // 2] = (bx * torch.sin(a) + by * torch.cos(a)).float()
    return out.bfloat16().float()


def test_layer_rejects_batch_and_bad_format():
    layer = PagedKVLayer(get_format("k4v4"), key_offset="off")
    with pytest.raises(ValueError, match="batch"):
        layer.update(torch.zeros(2, H, 4, D), torch.zeros(2, H, 4, D))
    with pytest.raises(ValueError, match="allowed"):
        make_cache("int3", 30)
    with pytest.raises(ValueError, match="num_layers"):
        make_cache("bf16", 0)


@pytest.fixture(scope="module")
def model_tok():
    from kvrepro.hf import load_smollm2

    return load_smollm2()


@pytest.fixture(scope="module")
def short_prompt(model_tok):
    from kvrepro.needle import build_prompt

    return build_prompt(model_tok[1], 256, 0.5, "48213")


def _exact_logprobs(model, ids):
    with torch.inference_mode():
        return torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)


def test_model_served_from_pages(model_tok, short_prompt):
    """bf16 pages ~ exact float32 K/V; decode step == prefill; compressed pages change the logits."""
    model, _ = model_tok
    n_layers = model.config.num_hidden_layers
    ids = torch.tensor([short_prompt.input_ids])
    exact = _exact_logprobs(model, ids)[-1]
    bf16 = prefill(model, ids, make_cache("bf16", n_layers))
    assert int(bf16.argmax()) == int(exact.argmax())
    assert torch.isfinite(bf16).all()
    assert float((bf16.exp() - exact.exp()).abs().max()) < 0.02  # bf16 rounding of K/V only
    cache = make_cache("bf16", n_layers)
    prefill(model, ids[:, :-1], cache)
    with torch.inference_mode():
        step = torch.log_softmax(forward(model, ids[:, -1:], cache).logits[0, -1], -1)
    # same pages read at decode as at prefill (bf16 rounding flips from sdpa's different blocking stay tiny)
    assert float((step.exp() - bf16.exp()).abs().max()) < 1e-3
    top = bf16.topk(10).indices
    assert float((step[top] - bf16[top]).abs().max()) < 0.01
    assert cache.get_seq_length() == ids.shape[1]
    k4v2 = prefill(model, ids, make_cache("k4v2", n_layers, rope=rope_info(model)))
    assert float((k4v2 - bf16).abs().max()) > 1e-2  # attention really reads the 2-bit V pages


def test_teacher_forced_logprobs_match_full_forward(model_tok, short_prompt):
    model, _ = model_tok
    p = short_prompt
    cache = make_cache("bf16", model.config.num_hidden_layers)
    ids = torch.tensor([p.input_ids])
    first = prefill(model, ids, cache)
    lps = teacher_forced_logprobs(model, first, p.answer_ids, cache)
    assert cache.get_seq_length() == p.n_tokens  # answer tokens cropped again
    full = _exact_logprobs(model, torch.tensor([p.input_ids + p.answer_ids[:-1]]))
    ref = torch.stack([full[p.n_tokens - 1 + i, t] for i, t in enumerate(p.answer_ids)])
    torch.testing.assert_close(lps, ref, atol=0.05, rtol=0)


def test_forward_refuses_a_cache_the_model_ignored(model_tok, short_prompt, monkeypatch):
    """A transformers version that ignores the cache argument would give exact attention for every format: refused."""
    from kvrepro import hf

    model, _ = model_tok
    ids = torch.tensor([short_prompt.input_ids[:8]])
    monkeypatch.setattr(hf, "_cache_kwarg", lambda cls: "cache_ignored_by_the_model")
    with pytest.raises(RuntimeError, match="did not store its K/V"):
        forward(model, ids, make_cache("k4v4", model.config.num_hidden_layers, rope=rope_info(model)))
