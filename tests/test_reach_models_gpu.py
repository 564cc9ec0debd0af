"""On a GPU (``gpu`` marker; ``pytest -m gpu tests/test_reach_models_gpu.py``, well under 2 minutes on an H200 by
design; skipped without CUDA): every bundled model's attention geometry (query heads, KV heads, head_dim from its
config), for the default preset k5v4 and k4v4 (each with its CUDA kernel where it applies), through the code a
vLLM layer runs (``kvrepro.vllm_backend.runtime.LayerRuntime``: the decode kernel chosen by the default rule at engine
start, the split rule of that kernel, and the engine's default prefill path, ``KVREPRO_PREFILL=fa``: the context
dequantized from the pages, then vLLM's FlashAttention; kvrepro's Triton prefill kernel where vLLM is not importable).

One vLLM-shaped batch per case, ordered [decodes | prefills] with ragged lengths: decode rows of 1, 97, 0 (a padding
row), 8193 and 3000 tokens; prefill rows of a fresh 37-token prompt, a 16-token chunk after 129 tokens of context and
a 300-token chunk after 2000. Every token is stored in the pages first (as vLLM does before attention). Reference:
``runtime.reference_attend`` in float64, attention over the dequantized pages (``kvrepro.formats.compressed``'s
PyTorch numerics, not the kernels) with each prefill chunk's own K/V fresh. The kernel the layer resolves must be the
one ``kvrepro.vllm_backend.config.serving_plan`` names for the model on this GPU (what the README's model table and
the engine-start line say)."""
from test_ops_helpers import DEV, relerr  # noqa: I001  (TRITON_INTERPRET first)

import importlib.util

import pytest
import torch

from kvrepro.configs import model_names
from kvrepro.configs.facts import model_facts
from kvrepro.settings import DEFAULT_PRESET
from kvrepro.vllm_backend.config import serving_plan
from kvrepro.vllm_backend.runtime import LayerRuntime, reference_attend

pytestmark = pytest.mark.gpu
HAS_VLLM = importlib.util.find_spec("vllm") is not None
DECODE_LENS = [1, 97, 0, 8193, 3000]
PREFILLS = [(0, 37), (129, 16), (2000, 300)]      # (context tokens, chunk tokens)
# bf16 queries, K/V and output: the output's rounding alone is ~2e-3 (tests/test_ops_decode.py); the FlashAttention
# path also rounds the dequantized context to bf16 before the dot products.
DECODE_TOL, PREFILL_TOL = 8e-3, 1e-2


def _prefill_path(preset: str, hkv: int, d: int):
    """The engine's default prefill (``FlashPrefill``, vLLM's FlashAttention) where vLLM is importable, else None
    (``LayerRuntime`` then runs kvrepro's Triton prefill kernel, ``KVREPRO_PREFILL=triton``)."""
    if not HAS_VLLM:
        return None, "triton"
    from kvrepro.formats import get_format
    from kvrepro.vllm_backend.fa_prefill import FlashPrefill

    return FlashPrefill(get_format(preset), hkv, d), "fa"


@pytest.mark.parametrize("preset", sorted({DEFAULT_PRESET, "k4v4"}))
@pytest.mark.parametrize("name", model_names())
def test_model_geometry_decode_and_prefill_match_the_pages(name, preset, ragged_batch):
    f = model_facts(name)
    hq, hkv, d = f.num_q_heads, f.num_kv_heads, f.head_dim
    dev = torch.device(DEV)
    cap = tuple(torch.cuda.get_device_capability(dev))
    plan = serving_plan(head_dim=d, num_q_heads=hq, num_kv_heads=hkv, capability=cap, preset=preset,
                        sliding_window=f.sliding_window, mla=f.mla)
    assert plan.decode in ("cuda", "triton"), (name, preset, plan.refusals)

    gen = torch.Generator().manual_seed(sum(map(ord, name + preset)))
    nd = len(DECODE_LENS)
    lens = DECODE_LENS + [c + q for c, q in PREFILLS]
    pool, bt, sl, _, kv = ragged_batch(preset, lens, hkv, d, gen)
    t = nd + sum(q for _, q in PREFILLS)
    query = torch.randn(t, hq, d, generator=gen).to(dev, torch.bfloat16)
    key = torch.zeros(t, hkv, d, dtype=torch.bfloat16, device=dev)        # decode rows read the pages, not these
    value = torch.zeros_like(key)
    qsl, row = list(range(nd + 1)), nd                                   # one query row per decode
    for b, (ctx, q_len) in enumerate(PREFILLS):
        k, v = kv[nd + b]
        key[row:row + q_len], value[row:row + q_len] = k[ctx:], v[ctx:]     # the chunk's own K/V, fresh
        row += q_len
        qsl.append(row)
    qsl = torch.tensor(qsl, dtype=torch.int32, device=dev)

    prefill, path = _prefill_path(preset, hkv, d)
    rt = LayerRuntime(preset, hq, hkv, d, d ** -0.5, prefill=prefill)
    assert rt.check_decode_impl(16, dev) == plan.decode, (name, preset, plan.why)
    out = torch.full((t, hq, d), float("nan"), dtype=torch.bfloat16, device=dev)
    rt.attend(query, key, value, pool.data, bt, sl, qsl, t, nd, nd, out, max_query_len=max(q for _, q in PREFILLS))
    ref = reference_attend(rt, query, key, value, pool.data, bt, sl, qsl, t, nd)

    live = sl[:nd] > 0
    assert relerr(out[:nd][live], ref[:nd][live]) < DECODE_TOL, (name, preset, plan.decode)
    assert (out[:nd][~live] == 0).all()
    assert torch.isfinite(out[nd:]).all()
    assert relerr(out[nd:], ref[nd:]) < PREFILL_TOL, (name, preset, path)
