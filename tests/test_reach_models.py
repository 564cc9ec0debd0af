"""Reach across model families (issue 22, parts 2 and 4), without a GPU: the bundled configs' derived facts against a
count by hand, and the engine-start matrix: every head_dim in {64, 128, 256} and GQA group 1..16 is served (the CUDA
decode kernel where it applies, Triton otherwise) or refused naming head_dim / group size and what is supported; the
Triton decode kernel matches float64 attention over the pages for each served head_dim at groups 1, 3, 7, 16."""
from test_ops_helpers import DEV, block_tables, fill, make_pool, relerr  # noqa: I001  (TRITON_INTERPRET first)

import json
import types

import pytest
import torch

from kvrepro.configs import config_dir, load_config, model_names
from kvrepro.configs.facts import KV_FORMATS, facts_from_config, model_facts, models_table
from kvrepro.ops import decode_attention
from kvrepro.reference import paged_attention_ref
from kvrepro.vllm_backend import config as cfg

# name: (hidden, query heads, KV heads, layers, head_dim, GQA group, rope theta, max positions, key bias), as the
# models' cards and configs state them (SOURCES.md)
EXPECTED = {
    "llama-3.1-8b-instruct": (4096, 32, 8, 32, 128, 4, 500000.0, 131072, False),
    "llama-3.2-3b-instruct": (3072, 24, 8, 28, 128, 3, 500000.0, 131072, False),
    "llama-3.2-1b-instruct": (2048, 32, 8, 16, 64, 4, 500000.0, 131072, False),
    "qwen3-0.6b": (1024, 16, 8, 28, 128, 2, 1e6, 40960, False),
    "qwen3-4b-instruct-2507": (2560, 32, 8, 36, 128, 4, 5e6, 262144, False),
    "qwen3-8b": (4096, 32, 8, 36, 128, 4, 1e6, 40960, False),
    "qwen3-32b": (5120, 64, 8, 64, 128, 8, 1e6, 40960, False),
    "qwen2.5-7b-instruct": (3584, 28, 4, 28, 128, 7, 1e6, 32768, True),
    "mistral-7b-instruct-v0.3": (4096, 32, 8, 32, 128, 4, 1e6, 32768, False),
}
BITS = {"k8v4": (8, 4), "k5v4": (5, 4), "k4v4": (4, 4), "k4v2": (4, 2)}


def _bytes_per_token_and_head(fmt: str, d: int) -> int:
    """K and V of one token and KV head: bf16 2 x 2 x D, fp8 2 x D; a compressed preset its codes (D x bits / 8 per
    K and V) plus per-token metadata: float16 K scale and zero and V scale (6 B), k5v4 a float16 K scale and a
    one-byte V log-scale (3 B)."""
    if fmt in ("bf16", "fp8"):
        return 2 * d * (2 if fmt == "bf16" else 1)
    kb, vb = BITS[fmt]
    return d * kb // 8 + d * vb // 8 + (3 if fmt == "k5v4" else 6)


def test_every_issue_22_model_is_bundled():
    assert set(EXPECTED) == set(model_names())
    for name in model_names():
        assert (config_dir(name) / "config.json").is_file()
    sources = (config_dir().parent / "SOURCES.md").read_text()
    for name in model_names():
        assert f"| `{name}` |" in sources and "https://huggingface.co/" in sources


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_facts(name):
    """head_dim = the config's ``head_dim`` if it has one, else hidden // heads (Qwen3-0.6B / -4B / -32B give one
    that differs from hidden // heads); group = heads // KV heads; KV bytes per token = layers x KV heads x the
    per-head bytes of each format."""
    raw = load_config(name)
    hidden, hq, hkv, layers, d, group, theta, max_pos, bias = EXPECTED[name]
    assert (raw["hidden_size"], raw["num_attention_heads"], raw["num_key_value_heads"], raw["num_hidden_layers"]) == \
        (hidden, hq, hkv, layers)
    assert d == raw.get("head_dim", hidden // hq)
    f = model_facts(name)
    assert (f.head_dim, f.num_q_heads, f.num_kv_heads, f.group, f.num_layers) == (d, hq, hkv, group, layers)
    assert (f.rope_theta, f.max_positions, f.has_key_bias) == (theta, max_pos, bias)
    assert f.sliding_window is None and not f.mla
    assert f.kv_bytes_per_token == {fmt: layers * hkv * _bytes_per_token_and_head(fmt, d) for fmt in KV_FORMATS}
    assert [r["name"] for r in models_table()] == list(model_names())


def test_facts_read_what_vllm_reads():
    """A config's ``sliding_window`` counts only where ``use_sliding_window`` is not false (Qwen2.5 ships 131072 with
    the window off); no ``num_key_value_heads`` = one KV head per query head; ``attention_bias`` decides key bias, and
    Qwen2 has q/k/v biases without saying so; a ``kv_lora_rank`` marks MLA; a broken config is refused by field."""
    base = dict(load_config("qwen2.5-7b-instruct"))
    assert base["sliding_window"] == 131072 and facts_from_config(base).sliding_window is None
    assert facts_from_config(base | {"use_sliding_window": True}).sliding_window == 131072
    mistral = load_config("mistral-7b-instruct-v0.3")
    assert facts_from_config(mistral | {"sliding_window": 4096}).sliding_window == 4096
    mha = {k: v for k, v in mistral.items() if k != "num_key_value_heads"}
    assert (facts_from_config(mha).num_kv_heads, facts_from_config(mha).group) == (32, 1)
    assert facts_from_config(mistral | {"attention_bias": True}).has_key_bias
    assert not facts_from_config(load_config("qwen3-8b")).has_key_bias
    assert facts_from_config(mistral | {"kv_lora_rank": 512}).mla
    assert facts_from_config(mistral | {"head_dim": 256}).kv_bytes_per_token["k4v4"] is None   # no 256 format
    with pytest.raises(ValueError, match="lacks num_hidden_layers"):
        facts_from_config({"num_attention_heads": 8, "hidden_size": 64})
    with pytest.raises(ValueError, match="num_attention_heads=28 is not a multiple of num_key_value_heads=3"):
        facts_from_config(base | {"num_key_value_heads": 3})


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (9, 0), (10, 0), (12, 0)])
def test_head_dim_and_group_matrix_is_served_or_refused_by_name(capability):
    """head_dim 64 / 128 at every group 1..16: served (the CUDA kernel for k4v4 at head_dim 128, block 16, group <= 8;
    Triton otherwise, saying why); head_dim 256: refused naming it and the supported values."""
    for head_dim in (64, 128, 256):
        for group in range(1, 17):
            plan = cfg.serving_plan(head_dim=head_dim, num_q_heads=2 * group, num_kv_heads=2, capability=capability)
            if head_dim == 256:
                assert plan.decode is None and len(plan.refusals) == 1
                assert "head_dim=256 not supported (supported: 64, 128" in plan.refusals[0]
                continue
            assert not plan.refusals, (head_dim, group, plan)
            if head_dim == 128 and group <= 8:
                assert plan.decode == "cuda" and f"SASS sm_{capability[0]}{capability[1]}" in plan.why
            else:
                assert plan.decode == "triton"
                assert (f"head_dim={head_dim}" in plan.why) if head_dim != 128 else \
                    f"GQA groups of 1..8 query heads, got {group}" in plan.why


def test_refusals_at_engine_start_name_the_reason():
    """A GPU below compute capability 8.0, a sliding window, MLA, a group past the Triton kernels' 32, block 128 and
    KVREPRO_DECODE_IMPL=cuda where the CUDA kernel does not apply are refused with the reason; k5v4 has no CUDA
    kernel (auto: Triton); a GPU with no SASS of its major runs the fatbin's PTX."""
    plan = cfg.serving_plan(head_dim=128, num_q_heads=32, num_kv_heads=8, capability=(7, 5))
    assert plan.decode is None and "compute capability 7.5 not supported (needs >= 8.0" in plan.refusals[0]
    plan = cfg.serving_plan(head_dim=128, num_q_heads=32, num_kv_heads=8, capability=(9, 0), sliding_window=4096,
                            mla=True, block_size=128)
    assert plan.decode is None and len(plan.refusals) == 3
    assert any("sliding window (4096) not supported" in r for r in plan.refusals)
    assert any(r.startswith("MLA not supported") for r in plan.refusals)
    assert any("block_size=128 not supported (supported: (16, 32, 64))" in r for r in plan.refusals)
    plan = cfg.serving_plan(head_dim=128, num_q_heads=66, num_kv_heads=2, capability=(9, 0))
    assert "GQA group size 33 (num_heads=66 / num_kv_heads=2) not supported (supported: 1..32" in plan.refusals[0]
    plan = cfg.serving_plan(head_dim=128, num_q_heads=36, num_kv_heads=4, capability=(9, 0), decode_impl="cuda")
    assert plan.decode is None and "KVREPRO_DECODE_IMPL=cuda: the CUDA decode kernel supports GQA groups of 1..8 " \
                                   "query heads, got 9; set KVREPRO_DECODE_IMPL=triton or auto" in plan.refusals[0]
    plan = cfg.serving_plan(head_dim=128, num_q_heads=32, num_kv_heads=8, capability=(9, 0), preset="k5v4")
    assert plan.decode == "triton" and "no kernel for k5v4" in plan.why
    plan = cfg.serving_plan(head_dim=128, num_q_heads=32, num_kv_heads=8, capability=(11, 0))
    assert plan.decode == "cuda" and "PTX compute_80, compiled by the driver at load" in plan.why
    plan = cfg.serving_plan(head_dim=128, num_q_heads=32, num_kv_heads=8, capability=(9, 0), decode_impl="triton")
    assert (plan.decode, plan.why) == ("triton", "KVREPRO_DECODE_IMPL=triton")
    with pytest.raises(ValueError, match="KVREPRO_DECODE_IMPL='fast'; allowed: auto, cuda, triton"):
        cfg.serving_plan(head_dim=128, num_q_heads=32, num_kv_heads=8, capability=(9, 0), decode_impl="fast")


def test_vllm_validation_and_layer_check_refuse_the_same():
    """The two places vLLM asks (backend validation with the device's capability; each layer when the model is
    built) refuse what serving_plan refuses, with the same words."""
    from kvrepro.ops.common import MAX_GROUP

    assert cfg.MAX_GQA_GROUP == MAX_GROUP
    ok = dict(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16)
    assert cfg.unsupported_reasons(**ok, device_capability=(9, 0)) == []
    capability = types.SimpleNamespace(major=7, minor=5)             # vLLM's DeviceCapability has .major / .minor
    for cap in (capability, (7, 5), 75):
        reasons = cfg.unsupported_reasons(**ok, device_capability=cap)
        assert len(reasons) == 1 and "compute capability 7.5 not supported" in reasons[0]
    assert "head_dim=256 not supported (supported: 64, 128" in cfg.unsupported_reasons(**ok | {"head_size": 256})[0]
    assert cfg.unsupported_reasons(**ok, use_mla=True) == ["kvrepro: MLA not supported"]
    with pytest.raises(ValueError, match="device_capability must be"):
        cfg.unsupported_reasons(**ok, device_capability="sm_90")
    with pytest.raises(ValueError, match=r"GQA group size 40 \(num_heads=40 / num_kv_heads=1\) not supported"):
        cfg.check_layer(num_heads=40, num_kv_heads=1, head_size=128)
    with pytest.raises(ValueError, match=r"head_dim=256 not supported \(supported: 64, 128") as e:
        cfg.check_layer(num_heads=32, num_kv_heads=8, head_size=256, sliding_window=4096)
    assert "sliding window (4096) not supported" in str(e.value)
    cfg.check_layer(num_heads=28, num_kv_heads=4, head_size=128)                   # Qwen2.5-7B: group 7, served


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_bundled_model_is_served(name):
    """On an H100 / H200 and an A100: the CUDA decode kernel for every head_dim-128 model (groups 2-8), Triton for
    Llama-3.2-1B (head_dim 64)."""
    f = model_facts(name)
    for capability in ((9, 0), (8, 0)):
        plan = cfg.serving_plan(head_dim=f.head_dim, num_q_heads=f.num_q_heads, num_kv_heads=f.num_kv_heads,
                                capability=capability, sliding_window=f.sliding_window, mla=f.mla)
        assert plan.decode == ("triton" if f.head_dim == 64 else "cuda"), (name, plan)


@pytest.mark.parametrize("group", [1, 3, 7, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_triton_decode_serves_the_matrix(head_dim, group):
    """Each served head_dim at groups 1, 3 (SmolLM2, Llama-3.2-3B), 7 (Qwen2.5-7B) and 16: decode through the default
    rule's kernel here (Triton) vs float64 attention over the dequantized pages."""
    gen = torch.Generator().manual_seed(head_dim + group)
    lens, hkv = [1, 37, 0], 2
    maxb = 4
    nb = len(lens) * maxb + 3
    pool = make_pool("k4v4" if group % 2 else "k8v4", hkv, head_dim, 16, nb, gen)
    bt = block_tables(len(lens), maxb, nb, gen)
    for b, n in enumerate(lens):
        if n:
            fill(pool, bt[b], n, gen, torch.float16)
    q = torch.randn(len(lens), hkv * group, head_dim, generator=gen).to(DEV, torch.float16)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, pool.data, bt, sl, pool.layout, pool.rotation, head_dim ** -0.5, out=out, num_splits=2)
    ref = paged_attention_ref(q, pool, bt, sl, torch.arange(len(lens) + 1, device=DEV), head_dim ** -0.5,
                              torch.float64)
    assert relerr(out[:2], ref[:2]) < 2e-3 and torch.equal(out[2], torch.zeros_like(out[2]))


def test_configs_are_plain_json_vllm_can_read():
    """Each folder is a config.json vLLM can be pointed at (--load-format dummy --skip-tokenizer-init): valid JSON,
    a known architecture, bfloat16 weights."""
    for name in model_names():
        raw = json.loads((config_dir(name) / "config.json").read_text())
        assert raw["architectures"][0] in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen2ForCausalLM",
                                           "MistralForCausalLM")
        assert raw["torch_dtype"] == "bfloat16"
