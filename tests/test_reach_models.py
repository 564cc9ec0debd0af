"""Reach across model families (issue 22, parts 2 and 4), without a GPU: the bundled configs' derived facts against a
count by hand, and the engine-start matrix: every head_dim in {64, 128, 256} and GQA group 1..16 is served (the CUDA
decode kernel where it applies, Triton otherwise) or refused naming head_dim / group size and what is supported; the
Triton decode kernel matches float64 attention over the pages for each served head_dim at groups 1, 3, 7, 16."""
from test_ops_helpers import DEV, block_tables, fill, make_pool, relerr  # noqa: I001  (TRITON_INTERPRET first)

import json
import types

import pytest
import torch

import scripts_module
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
    assert plan.decode == "cuda" and "CUDA kernel applies" in plan.why
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


# ---------------------------------------------------------------- scripts/reach_models.py and 02's model table

def _script():
    """scripts/reach_models.py as a module (its CPU-side logic; the engine part needs a GPU and vLLM)."""
    return scripts_module.load("reach_models")


def test_reach_models_refuses_bad_arguments_by_name():
    rm = _script()
    assert rm.check_args("", "fp8,kvrepro:k4v4", 80, 1024) == (model_names(), ("fp8", "kvrepro:k4v4"))
    assert rm.check_args("qwen3-0.6b", ["fp8"], 40.0, 1, 300)[0] == ("qwen3-0.6b",)
    for kw, match in [
        (dict(models="qwen3-0.5b"), "models: unknown \\['qwen3-0.5b'\\]; allowed: llama-3.1-8b-instruct"),
        (dict(models="qwen3-8b,qwen3-8b"), "named more than once"),
        (dict(modes="fp16"), "modes: unknown \\['fp16'\\]; allowed: bf16, fp8"),
        (dict(modes="fp8,fp8"), "named more than once"),
        (dict(gpu_memory_gib=0), "gpu_memory_gib must be a number of GiB > 0, got 0"),
        (dict(gpu_memory_gib=True), "gpu_memory_gib must be"),
        (dict(decode_tokens=0), "decode_tokens must be an int in 1..1024"),
        (dict(decode_tokens=1025), "decode_tokens must be an int in 1..1024"),
        (dict(decode_tokens=2.0), "decode_tokens must be an int"),
        (dict(budget_s=-5), "budget_s must be a number of seconds > 0"),
    ]:
        args = dict(models="", modes="fp8", gpu_memory_gib=80, decode_tokens=64, budget_s=None) | kw
        with pytest.raises(ValueError, match=match):
            rm.check_args(**args)
    with pytest.raises(SystemExit) as e:                    # the CLI reports them through argparse (exit 2)
        rm.main(["--plan", "--models", "nope"])
    assert e.value.code == 2


def test_workload_is_128k_plus_decode_or_the_models_window():
    from kvrepro import reach

    assert reach.workload("qwen3-4b-instruct-2507") == {"max_model_len": 132096, "prompt_tokens": 131072,
                                                        "decode_tokens": 1024}
    assert reach.workload("llama-3.1-8b-instruct")["max_model_len"] == 131072          # its window
    assert reach.workload("qwen3-0.6b") == {"max_model_len": 40960, "prompt_tokens": 39936, "decode_tokens": 1024}
    assert reach.workload("mistral-7b-instruct-v0.3")["prompt_tokens"] == 32768 - 1024
    assert (reach.kv_format("fp8"), reach.kv_format("kvrepro:k4v4"), reach.kv_format("turboquant_k8v4")) == \
        ("fp8", "k4v4", None)


def test_users_arithmetic_is_kvrepro_capacity_and_a_count_by_hand():
    """Qwen3-0.6B at 80 GiB, by hand: 596,049,920 parameters (28 layers x (q/o 2 x 1024 x 2048 + k/v 2 x 1024 x 1024
    + MLP 3 x 1024 x 3072 + norms 2 x 1024 + 2 x 128) + final norm 1024 + tied embedding 151,936 x 1024) x 2 B; KV
    bytes = 0.9 x 80 GiB - weights - 1.968 GiB; an fp8 block of 16 tokens is 28 x 8 x 16 x 256 B, a k4v4 block
    28 x 8 x 16 x 134 B; a user holds 40,960 / 16 = 2,560 blocks; vLLM's null block is not usable."""
    from kvrepro import capacity, reach

    params = 28 * (2 * 1024 * 2048 + 2 * 1024 * 1024 + 3 * 1024 * 3072 + 2 * 1024 + 2 * 128) + 1024 + 151936 * 1024
    assert params == 596_049_920 == capacity.load_model_config("qwen3-0.6b").num_params
    kv = int(0.9 * 80 * 2**30 - 2 * params - 1.968 * 2**30)
    for mode, per_block in (("fp8", 28 * 8 * 16 * 256), ("kvrepro:k4v4", 28 * 8 * 16 * 134)):
        want = (kv // per_block - 1) // 2560
        assert reach.arithmetic_users("qwen3-0.6b", mode, 80.0) == want
    assert (reach.arithmetic_users("qwen3-0.6b", "fp8", 80.0), reach.arithmetic_users("qwen3-0.6b", "kvrepro:k4v4",
                                                                                        80.0)) == (31, 60)
    for name in model_names():
        w = reach.workload(name)
        assert reach.arithmetic_users(name, "kvrepro:k4v4", 80.0) == capacity.users_that_fit(
            "k4v4", w["prompt_tokens"], 1024, gpu_memory_gb=80.0, cfg=capacity.load_model_config(name))["users_fit"]
    assert reach.arithmetic_users("qwen3-32b", "fp8", 40.0) == 0                        # weights leave no KV memory
    rm = _script()
    assert "weights 61.0 GiB (bf16, kvrepro.capacity) >= the engine's 36.0 GiB (0.9 x 40.0 GiB)" == \
        rm.weights_exceed("qwen3-32b", 40.0)
    assert rm.weights_exceed("qwen3-32b", 80.0) is None
    assert rm.max_num_seqs("qwen3-0.6b", 80.0) == 74                                  # ceil(60 x 1.1) + 8


def test_weights_over_the_budget_are_a_row_not_an_error():
    """No engine is started (nothing imports vLLM): the row says why."""
    rm = _script()
    row = rm.measure("qwen3-32b", "fp8", 40.0, 16)
    assert row["status"] == "weights exceed budget" and row["users_fit"] == 0 and "61.0 GiB" in row["reason"]
    assert (row["model"], row["mode"], row["kv_cache_dtype"], row["max_model_len"]) == ("qwen3-32b", "fp8", "fp8", 40960)


def test_rows_replace_their_pair_and_resume_skips_final_statuses(tmp_path):
    rm = _script()
    out = str(tmp_path / "models_h200.jsonl")
    base = rm.base_row("qwen3-0.6b", "kvrepro:k4v4", 80.0, 64)
    assert (base["attention_backend"], base["env"], base["kv_cache_dtype"]) == ("CUSTOM", {"KVREPRO_PRESET": "k4v4"},
                                                                               "auto")
    assert base["users_fit_arithmetic"] == 60 and base["prompt_tokens"] == 39936 and base["decode_tokens"] == 64
    rm.put_row(out, dict(base, status="error", reason="boom"))
    rm.put_row(out, dict(rm.base_row("qwen3-0.6b", "fp8", 80.0, 64), status="measured", users_fit=33))
    models, modes = ("qwen3-0.6b", "qwen3-8b"), ("fp8", "kvrepro:k4v4")
    assert rm.todo(rm.read_rows(out), models, modes, 80.0) == [("qwen3-0.6b", "kvrepro:k4v4"), ("qwen3-8b", "fp8"),
                                                          ("qwen3-8b", "kvrepro:k4v4")]     # the error row runs again
    rm.put_row(out, dict(base, status="fits 0 users", users_fit=0))
    rows = rm.read_rows(out)
    assert len(rows) == 2 and {r["status"] for r in rows} == {"measured", "fits 0 users"}
    assert rm.todo(rows, models, modes, 80.0) == [("qwen3-8b", "fp8"), ("qwen3-8b", "kvrepro:k4v4")]
    assert rm.todo(rows, models, modes, 40.0) == [(m, mode) for m in models for mode in modes]   # other budget
    rm.put_row(out, dict(rm.base_row("qwen3-0.6b", "fp8", 40.0, 64), status="measured", users_fit=9))
    assert len(rm.read_rows(out)) == 3                       # a 40 GiB row does not replace the 80 GiB one
    plan = rm.plan_table(models, modes, 80.0, 64, rm.read_rows(out))
    assert plan.count(" done") == 2 and "to run: 2 of 4 engines" in plan
    est = sum(rm.estimate_s("qwen3-8b", m, 80.0, 64) for m in modes)
    assert f"~{est / 60:.1f} min" in plan
    with pytest.raises(ValueError, match="status in"):
        rm.put_row(out, dict(base, status="ok"))
    (tmp_path / "bad.jsonl").write_text('{"model": 1}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not JSON"):
        rm.read_rows(str(tmp_path / "bad.jsonl"))


def test_smoke_verdict_window_end_and_file_name():
    rm = _script()
    assert rm.smoke_result([16, 5], [16, 5])["ok"]
    assert not rm.smoke_result([16, 5], [16, 4])["ok"] and not rm.smoke_result([16, 5], [16])["ok"]
    assert not rm.smoke_result([0], [0])["ok"]                                          # an empty output never passes
    assert rm.window_done([64, 70], [300, 100], 64, 1024)                                 # everyone has 64 more
    assert not rm.window_done([63, 70], [300, 100], 64, 1024)
    assert rm.window_done([10, 10], [1023, 100], 64, 1024)                                # one user at its last token
    assert (rm.gpu_slug("NVIDIA H200"), rm.gpu_slug("NVIDIA A100-SXM4-80GB")) == ("h200", "a100-sxm4-80gb")
    with pytest.raises(ValueError, match="no letters or digits"):
        rm.gpu_slug(" -- ")


def test_plan_lists_every_pair_and_the_cli_needs_a_gpu_to_measure(capsys, monkeypatch, tmp_path):
    rm = _script()
    args = ["--plan", "--models", "qwen3-0.6b,llama-3.2-1b-instruct", "--decode-tokens", "128"]
    assert rm.main([*args, "--out-dir", str(tmp_path)]) == 0           # nothing run there yet
    text = capsys.readouterr().out
    assert text.count("qwen3-0.6b") == 2 and "40,960" in text and "131,072" in text and "to run: 4 of 4" in text
    assert rm.main(args) == 0                                            # the committed file holds both models
    text = capsys.readouterr().out
    assert text.count(" done") == 4 and "to run: 0 of 4 engines, ~0.0 min" in text
    monkeypatch.setattr(rm.sweep, "measurement_blockers", lambda: ["a CUDA GPU (found none)"])
    assert rm.main(["--models", "qwen3-0.6b"]) == 2
    assert "missing: a CUDA GPU" in capsys.readouterr().err


def _model_row(model, mode, users, tok, **kw):
    return {"model": model, "mode": mode, "status": "measured", "users_fit": users, "aggregate_decode_tok_s": tok,
            "gpu_memory_gib": 80.0, "gpu": "NVIDIA H200", "date": "2026-12-02T10:00:00+00:00",
            "preemptions": 0, "smoke": {"ok": True}} | kw


def test_model_table_reads_measured_rows_else_labels_arithmetic(tmp_path):
    from kvrepro import reach

    empty = reach.model_capacity_table(tmp_path, 80.0)
    assert list(empty["model"]) == list(model_names())
    assert (empty["source"] == "not measured (arithmetic, kvrepro.capacity)").all()
    assert empty["tok_s_fp8"].isna().all() and empty["tok_s_k4v4"].isna().all()
    q = empty.set_index("model").loc["qwen3-0.6b"]
    assert (q["users_fp8"], q["users_k4v4"], q["users_ratio"], q["tokens_per_user"]) == (31, 60, 1.94, 40960)

    d = tmp_path / "results" / "reach"
    d.mkdir(parents=True)
    rows = [_model_row("qwen3-0.6b", "fp8", 33, 1000.0), _model_row("qwen3-0.6b", "kvrepro:k4v4", 64, 1500.0),
            _model_row("qwen3-0.6b", "kvrepro:k4v4", 99, 1.0, date="2026-11-01"),        # older: not shown
            _model_row("qwen3-8b", "fp8", 20, 400.0, preemptions=2),
            _model_row("qwen3-32b", "fp8", 0, None, status="fits 0 users"),
            _model_row("llama-3.1-8b-instruct", "fp8", 6, 300.0, gpu_memory_gib=40.0),    # other budget: not shown
            _model_row("mistral-7b-instruct-v0.3", "fp8", 28, 300.0, status="error")]    # not final: not shown
    (d / "models_h200.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = reach.model_capacity_table(tmp_path, 80.0).set_index("model")
    q = t.loc["qwen3-0.6b"]
    assert (q["users_fp8"], q["users_k4v4"], q["users_ratio"]) == (33, 64, 1.94)
    assert (q["tok_s_fp8"], q["tok_s_k4v4"], q["tok_s_ratio"]) == (1000.0, 1500.0, 1.5)
    # both modes from one file, GPU and date: said once
    assert q["source"] == "fp8, k4v4: measured, H200, 2026-12-02 (results/reach/models_h200.jsonl)"
    q8 = t.loc["qwen3-8b"]
    assert q8["users_fp8"] == 20 and "2 preemptions" in q8["source"]
    assert "k4v4: not measured (arithmetic, kvrepro.capacity)" in q8["source"] and q8["tok_s_ratio"] != q8["tok_s_ratio"]
    assert t.loc["qwen3-32b", "users_fp8"] == 0 and "fits 0 users" in t.loc["qwen3-32b", "source"]
    for name in ("llama-3.1-8b-instruct", "mistral-7b-instruct-v0.3"):
        assert t.loc[name, "source"] == "not measured (arithmetic, kvrepro.capacity)"
    with pytest.raises(ValueError, match="gpu_memory_gib must be a number of GiB > 0"):
        reach.model_capacity_table(tmp_path, 0)


def test_notebook_model_view_keeps_every_figure_in_narrow_columns(tmp_path):
    """Notebook 02's per-model table: each fp8 / k4v4 pair in one cell, the arithmetic's count beside vLLM's where
    they differ, the full source (said once where both modes share it), and headers of short words (they wrap)."""
    from kvrepro import reach

    d = tmp_path / "results" / "reach"
    d.mkdir(parents=True)
    rows = [_model_row("qwen3-0.6b", "fp8", 33, 1000.0, decode_tokens=128),
            _model_row("qwen3-0.6b", "kvrepro:k4v4", 64, 1500.4, decode_tokens=128, date="2026-12-03T08:00:00+00:00",
                       kvrepro_settings={"key_offset": "rope-mean"}),
            _model_row("qwen3-8b", "fp8", 20, 400.0, decode_tokens=128, users_fit_arithmetic=21)]
    (d / "models_h200.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = reach.model_capacity_table(tmp_path, 80.0)
    v = reach.model_capacity_view(t).set_index("model")
    assert list(v.index) == list(model_names()) and len(v.columns) == 9
    q = v.loc["qwen3-0.6b"]
    assert (q["tokens per user"], q["decode tokens timed"], q["users, fp8 / k4v4"], q["users, k4v4 / fp8"]) == (
        "40,960", "128", "33 / 64", "1.94")
    assert (q["decode tok/s, fp8 / k4v4"], q["tok/s, k4v4 / fp8"], q["k4v4 key offset"]) == ("1,000 / 1,500", "1.50",
                                                                                            "rope-mean")
    assert q["users by arithmetic, fp8 / k4v4"] == ""
    assert q["source"] == ("fp8: measured, H200, 2026-12-02 (results/reach/models_h200.jsonl); "
                           "k4v4: measured, H200, 2026-12-03 (results/reach/models_h200.jsonl)")
    q8 = v.loc["qwen3-8b"]
    k4v4_users = reach.arithmetic_users("qwen3-8b", "kvrepro:k4v4", 80.0)
    assert q8["users, fp8 / k4v4"] == f"20 / {k4v4_users}" and q8["decode tok/s, fp8 / k4v4"] == "400 / "
    assert q8["users by arithmetic, fp8 / k4v4"] == f"21 / {k4v4_users}"      # k4v4's own count was arithmetic
    assert q8["source"].endswith("k4v4: not measured (arithmetic, kvrepro.capacity)")
    none = v.loc["llama-3.1-8b-instruct"]
    assert (none["decode tokens timed"], none["decode tok/s, fp8 / k4v4"], none["tok/s, k4v4 / fp8"]) == ("", "", "")
    assert max(len(w) for c in v.reset_index().columns for w in c.split()) <= 11
    caption = reach.model_capacity_caption(t, 80.0)
    assert caption.startswith("**80 GiB**: 2 of 9 models with a measured point; tok/s timed over 128 decode tokens")
    assert "Each pair is fp8 / k4v4, each ratio k4v4 / fp8" in caption
    html = reach.model_capacity_styled(t).to_html()
    assert "max-width: 420px" in html and ">1,000 / 1,500<" in html


def test_readme_model_column_states_the_default_preset_and_k4v4():
    """The default preset (k5v4) and k4v4 each have a CUDA kernel: CUDA at head_dim 128, Triton for Llama-3.2-1B
    (head_dim 64)."""
    from kvrepro import reach
    from kvrepro.settings import DEFAULT_PRESET

    assert DEFAULT_PRESET == "k5v4"
    rows = {r["model"]: r["decode"] for r in reach.model_rows()}
    assert rows == {n: " / ".join(["Triton" if model_facts(n).head_dim == 64 else "CUDA"] * 2) for n in model_names()}
    assert "decode kernel on an H100 / H200, k5v4 (default) / k4v4" in reach.block()
