"""kvrepro.hf: the KV cache a real model is served with holds the format's real page bytes,
and attention reads exactly those bytes dequantized (checked against an independent decoder
written from the layout spec), prefill and decode alike."""
import numpy as np
import pytest
import torch

from kvrepro.formats import FORMAT_NAMES, get_format
from kvrepro.formats.hadamard import rotation_matrix
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


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_layer_stores_page_bytes_and_attends_over_them(name):
    fmt = get_format(name)
    rope = {"rope_theta": 1e4, "rotary_dim": D, "head_dim": D, "max_positions": 64}
    layer = PagedKVLayer(fmt, block_size=16, reserve_tokens=0, rope=rope)
    chunks = [_kv(37, 1), _kv(1, 2), _kv(20, 3)]  # prefill, one decode step, a chunk forcing regrowth
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
    np.testing.assert_allclose(returned[0][0].transpose(0, 1).double().numpy(), k_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(returned[1][0].transpose(0, 1).double().numpy(), v_ref, rtol=1e-5, atol=1e-5)
    # relative error vs the input, K and V: quantized for real (not a bf16 copy), and not broken. The compressed
    # presets hold keys minus the key offset (kvrepro.formats.offset): add it back to compare with the input.
    assert (layer.key_offset is not None) == (fmt.default_key_offset != "off")
    c = 0.0 if layer.key_offset is None else layer.key_offset.offset[:, None, :]
    returned = (returned[0] + c, returned[1])
    bounds = {"bf16": ((0, 0), (0, 0)), "fp8": ((0.01, 0.05), (0.01, 0.05)),
              "k8v4": ((0.002, 0.01), (0.05, 0.15)), "k4v4": ((0.05, 0.13), (0.05, 0.15)),
              "k4v2": ((0.05, 0.13), (0.3, 0.7)), "k5v4": ((0.02, 0.08), (0.05, 0.15))}[name]
    for j, (lo, hi) in enumerate(bounds):
        x_in = torch.cat([c[j] for c in chunks], dim=2)
        err = float((returned[j] - x_in).norm() / x_in.norm())
        assert lo <= err <= hi, ("KV"[j], err)


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
