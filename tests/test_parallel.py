"""Tensor parallel without a second GPU: vLLM 0.20.2's per-rank head split (``kvrepro.parallel``, checked against
the rule written out here from ``QKVParallelLinear``), and a fake two-rank layout through the backend's per-layer
glue (``LayerRuntime``, real kernels under the Triton interpreter on CPU): each rank stores and attends with its own
half of the KV heads, its pages are byte-for-byte the single-GPU pages of those heads, and the two halves' outputs
concatenated are the single-GPU output, both against attention over the dequantized pages in float64."""
import pytest
import torch

from kvrepro import parallel
from kvrepro.vllm_backend import config
from kvrepro.vllm_backend.runtime import LayerRuntime, reference_attend


# --- the head split -------------------------------------------------------------------------------------------------

def test_qwen3_heads_per_rank_by_hand():
    # Qwen3-32B: 64 query heads, 8 KV heads. TP=2: rank 0 q 0..31 / kv 0..3, rank 1 q 32..63 / kv 4..7.
    assert parallel.rank_q_heads(64, 2, 0) == range(0, 32) and parallel.rank_q_heads(64, 2, 1) == range(32, 64)
    assert parallel.rank_kv_heads(8, 2, 0) == range(0, 4) and parallel.rank_kv_heads(8, 2, 1) == range(4, 8)
    assert parallel.kv_heads_per_rank(8, 2) == 4 and parallel.kv_head_replicas(8, 2) == 1
    # TP=8: one KV head each, none replicated.
    assert [parallel.rank_kv_heads(8, 8, r) for r in range(8)] == [range(r, r + 1) for r in range(8)]
    # Qwen3-4B (32 q / 8 kv) at TP=16: each rank 2 query heads and 1 KV head, each KV head on 2 ranks
    # (vLLM: num_kv_head_replicas = 16 / 8, shard_rank = tp_rank // 2).
    assert parallel.kv_heads_per_rank(8, 16) == 1 and parallel.kv_head_replicas(8, 16) == 2
    assert [parallel.rank_kv_heads(8, 16, r).start for r in range(16)] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7]


@pytest.mark.parametrize("hq,hkv,tp", [(64, 8, 2), (32, 8, 4), (32, 8, 16), (32, 8, 32), (14, 2, 14), (9, 3, 3)])
def test_gqa_groups_never_straddle_ranks(hq, hkv, tp):
    """Every query head of a rank maps (GQA: kv = q // (hq / hkv)) to a KV head the same rank holds."""
    group = hq // hkv
    for r in range(tp):
        kv = parallel.rank_kv_heads(hkv, tp, r)
        assert {q // group for q in parallel.rank_q_heads(hq, tp, r)} <= set(kv)
        assert config.group_reason(hq // tp, len(kv)) is None     # the per-rank geometry the backend sees


def test_bad_tensor_parallel_sizes_name_the_parameter_and_allowed_values():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 .* allowed: \[1, 2, 4, 8, 16, 32\]"):
        parallel.check_tensor_parallel(32, 8, 3, 9728)                 # Qwen3-4B: 9,728 = 2^9 x 19
    with pytest.raises(ValueError, match=r"tensor_parallel_size=12 .*allowed: \[1, 2, 4, 8, 16, 32, 64\]"):
        parallel.check_tensor_parallel(64, 8, 12)                       # 64 % 12 != 0
    with pytest.raises(ValueError, match=r"tensor_parallel_size=6 .*allowed: \[1, 2, 4, 12\]"):
        parallel.check_tensor_parallel(12, 4, 6)                        # 12 q heads split, but 6 % 4 KV heads != 0; 12 = 3 x 4 replicas is fine
    for bad in (0, -2, 2.0, True, "2"):
        with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
            parallel.check_tensor_parallel(32, 8, bad)
    with pytest.raises(ValueError, match=r"rank must be an int in 0..1"):
        parallel.rank_kv_heads(8, 2, 2)
    with pytest.raises(ValueError, match="does not split num_kv_heads=8"):
        parallel.rank_kv_heads(8, 3, 0)


def test_pp_layer_ranges_as_vllm_get_pp_indices():
    # vLLM: L // M each, remainder one each to partitions[-2], [-3], ... (not the last stage).
    assert parallel.pp_layer_ranges(64, 2) == [(0, 32), (32, 64)]
    assert parallel.pp_layer_ranges(36, 1) == [(0, 36)]
    assert parallel.pp_layer_ranges(7, 2) == [(0, 4), (4, 7)]            # 3 + 3, the extra one to stage 0
    assert parallel.pp_layer_ranges(10, 4) == [(0, 2), (2, 5), (5, 8), (8, 10)]   # 2,2,2,2 + 2 -> 2,3,3,2
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=40 exceeds the model's 36 layers \(allowed: 1..36\)"):
        parallel.pp_layer_ranges(36, 40)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be a positive integer"):
        parallel.pp_layer_ranges(36, 0)


def test_slice_heads_flat_and_pool():
    x = torch.arange(2 * 4 * 3).view(2, 12)                      # [T, Hkv * D], Hkv 4, D 3
    assert torch.equal(parallel.slice_heads(x, range(2, 4), 1, head_size=3), x.view(2, 4, 3)[:, 2:4].reshape(2, 6))
    pool = torch.arange(5 * 4 * 7).view(5, 4, 7)
    assert torch.equal(parallel.slice_heads(pool, range(0, 2)), pool[:, :2])


# --- a fake two-rank layout through the backend's per-layer glue ---------------------------------------------------

def _layout(seed, hkv, d, bs, seq, ql):
    g = torch.Generator().manual_seed(seed)
    nb = sum(-(-s // bs) for s in seq) + 2
    perm = torch.randperm(nb, generator=g).tolist()
    bt = torch.zeros(len(seq), 8, dtype=torch.int32)
    c = 0
    for b, s in enumerate(seq):
        n = -(-s // bs)
        bt[b, :n] = torch.tensor(perm[c:c + n])
        c += n
    return g, nb, bt


@pytest.mark.parametrize("preset", ["k4v4", "k5v4"])
@pytest.mark.parametrize("key_offset", ["off", "first-prefill"])
def test_two_ranks_store_and_attend_with_their_own_heads(preset, key_offset):
    """Rank r of TP=2 holds KV heads r*H/2 .. (r+1)*H/2 - 1 and their query heads: it stores them into its own pool
    and attends with its own runtime. The pages equal the single-GPU pool's heads byte for byte (the rotation is per
    head_dim, the pages per KV head), the key offset calibrated per rank equals the single-GPU one's slice, and the
    ranks' outputs concatenated equal the single-GPU output; all against the float64 reference."""
    hq, hkv, d, bs, tp = 8, 4, 64, 16, 2
    seq, ql, nd = [40, 23, 30], [1, 1, 9], 2                      # 2 decodes + a prefill chunk with 21 tokens context
    g, nb, bt = _layout(7, hkv, d, bs, seq, ql)
    slot = lambda b, i: int(bt[b, i // bs]) * bs + i % bs          # noqa: E731
    hist = [(torch.randn(s - q, hkv, d, generator=g).bfloat16() * 2, torch.randn(s - q, hkv, d, generator=g).bfloat16())
            for s, q in zip(seq, ql)]
    t = sum(ql)
    q = torch.randn(t, hq, d, generator=g).bfloat16()
    k = torch.randn(t, hkv, d, generator=g).bfloat16() * 2
    v = torch.randn(t, hkv, d, generator=g).bfloat16()
    sl = torch.tensor(seq, dtype=torch.int32)
    qsl = torch.tensor([0] + torch.tensor(ql).cumsum(0).tolist(), dtype=torch.int32)
    hist_slots = [torch.tensor([slot(b, i) for i in range(seq[b] - ql[b])]) for b in range(len(seq))]
    new_slots = torch.tensor([slot(b, i) for b in range(len(seq)) for i in range(seq[b] - ql[b], seq[b])])

    def run(num_q, kv_heads: range, q_heads: range):
        # num_splits fixed: the split-K count must not depend on the rank's head count for a bitwise comparison
        rt = LayerRuntime(preset, num_q, len(kv_heads), d, d ** -0.5, num_splits=2, key_offset=key_offset)
        pool = torch.zeros(nb, len(kv_heads), rt.fmt.layout(d, bs).page_bytes, dtype=torch.uint8)
        take = lambda x: parallel.slice_heads(x, kv_heads).contiguous()   # noqa: E731
        # first store = the engine's first prefill: calibrates the key offset (when on) on all its rows
        kh = torch.cat([h[0] for h in hist])
        vh = torch.cat([h[1] for h in hist])
        rt.store(take(kh).flatten(1), take(vh).flatten(1), pool, torch.cat(hist_slots), calibrate=(0, kh.shape[0]))
        rt.store(take(k).flatten(1), take(v).flatten(1), pool, new_slots)
        qr = parallel.slice_heads(q, q_heads).contiguous()
        out = torch.full((t, num_q, d), float("nan"), dtype=torch.bfloat16)
        args = (qr, take(k), take(v), pool, bt, sl, qsl, t, nd)
        rt.attend(*args[:8], nd, nd, out, max_query_len=max(ql))
        return rt, pool, out, reference_attend(rt, *args)

    full_rt, full_pool, full_out, full_ref = run(hq, range(hkv), range(hq))
    ranks = [run(hq // tp, parallel.rank_kv_heads(hkv, tp, r), parallel.rank_q_heads(hq, tp, r)) for r in range(tp)]
    assert [len(parallel.rank_kv_heads(hkv, tp, r)) for r in range(tp)] == [2, 2]
    for r, (rt, pool, _, _) in enumerate(ranks):
        heads = parallel.rank_kv_heads(hkv, tp, r)
        assert torch.equal(pool, full_pool[:, heads.start:heads.stop])          # the same bytes, head by head
        assert torch.equal(rt.rotation, full_rt.rotation)                       # one rotation per head_dim
        if key_offset != "off":
            assert torch.equal(rt.key_offset.offset, full_rt.key_offset.offset[heads.start:heads.stop])
    cat_out = torch.cat([o for _, _, o, _ in ranks], dim=1)
    cat_ref = torch.cat([ref for _, _, _, ref in ranks], dim=1)
    assert torch.isfinite(cat_out).all()
    assert torch.equal(cat_ref, full_ref)          # the float64 reference splits exactly by heads
    assert torch.equal(cat_out, full_out)          # per-head kernels: the same numbers on one GPU or two
    err = (cat_out.double() - full_ref).abs().max() / full_ref.abs().max()
    assert err < 2e-2, err


def test_engine_geometry_is_per_rank():
    """What the backend checks at engine start is vLLM's per-rank geometry (``ModelConfig.get_num_kv_heads``):
    Qwen3-32B at TP=2 is 32 query / 4 KV heads per rank, served (GQA group 8) like TP=1's 64 / 8."""
    class MC:
        def get_head_size(self):
            return 128

        def get_num_attention_heads(self, pc):
            return 64 // pc.tensor_parallel_size

        def get_num_kv_heads(self, pc):                                  # vLLM 0.20.2's rule, verbatim
            return max(1, 8 // pc.tensor_parallel_size)

    class PC:
        tensor_parallel_size = 2

    class VC:
        model_config, parallel_config = MC(), PC()

    if torch.cuda.is_available() and not torch.cuda.is_initialized():
        pytest.skip("engine_geometry reads no config where CUDA exists uninitialized (not a worker)")
    g = config.engine_geometry(VC())
    assert (g["num_q_heads"], g["num_kv_heads"], g["head_dim"]) == (32, 4, 128)
    assert config.group_reason(g["num_q_heads"], g["num_kv_heads"]) is None


# --- notebook 02 takes tensor_parallel_size ---------------------------------------------------------------------------

def _run_02(params: dict, out, kernel: str) -> str:
    import json
    from pathlib import Path

    import papermill as pm
    import yaml

    from kvrepro import provenance

    nb = Path(__file__).resolve().parents[1] / "notebooks" / "02_capacity.ipynb"
    params = yaml.safe_load((nb.parent / "params" / "02_ci.yaml").read_text()) | params
    provenance.check_parameters(nb, params)
    pm.execute_notebook(str(nb), str(out), parameters=params, kernel_name=kernel, cwd=str(nb.parent),
                        progress_bar=False, log_output=False)
    cells = json.loads(out.read_text())["cells"]
    return "\n".join("".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/markdown", ""))
                     + "".join(o.get("data", {}).get("text/html", ""))
                     for c in cells for o in c.get("outputs", []))


def test_02_reports_tensor_parallel_capacity(tmp_path, notebook_kernel):
    """Qwen3-32B at TP=2 on 80 GiB GPUs, 128K + 1K per user: the report names the split and shows the users of
    tests/test_capacity.py's hand computation (bf16 2, fp8 4, k4v4 9)."""
    text = _run_02({"model": "qwen3-32b", "formats": ["bf16", "fp8", "k4v4"], "context_tokens": 131072,
                    "decode_tokens": 1024, "gpu_memory_gb": 80.0, "tensor_parallel_size": 2}, tmp_path / "o.ipynb",
                   notebook_kernel)
    assert "tensor_parallel_size 2 (2 GPUs of 80 GiB, 4 of 8 KV heads per GPU)" in text
    from kvrepro import capacity
    t = capacity.capacity_table(["bf16", "fp8", "k4v4"], 131072, 1024, cfg=capacity.load_model_config("qwen3-32b"),
                                tensor_parallel_size=2)
    # the arithmetic table's note carries the split (one value for every format: capacity.arithmetic_view)
    assert ("Every format: tensor_parallel_size 2, pipeline_parallel_size 1, 2 GPUs, 4 KV heads per GPU, weights "
            f"{t['weights_gib_per_gpu'].iloc[0]:.2f} GiB per GPU.") in text
    assert list(t["users_fit"]) == [2, 4, 9]


def test_02_refuses_a_tensor_parallel_size_that_does_not_split_the_model(tmp_path, notebook_kernel):
    import papermill as pm

    with pytest.raises(pm.PapermillExecutionError) as err:
        _run_02({"tensor_parallel_size": 3}, tmp_path / "o.ipynb", notebook_kernel)
    assert err.value.ename == "ValueError"
    assert "tensor_parallel_size=3 does not split" in err.value.evalue and "allowed: [1, 2, 4, 8, 16, 32]" in err.value.evalue
