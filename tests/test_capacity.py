"""Capacity arithmetic against hand-computed cases (numbers written out here, not recomputed by the
function under test) and against vLLM's measured KV-token counts in REPRODUCTION-CARD.md."""
import math
import re

import pytest

from kvrepro import capacity as cap
from kvrepro.formats import get_format

QWEN = cap.load_model_config("qwen3-4b-instruct-2507")


def test_bundled_config_matches_card():
    assert (QWEN.num_layers, QWEN.num_q_heads, QWEN.num_kv_heads, QWEN.head_dim) == (36, 32, 8, 128)
    assert (QWEN.hidden_size, QWEN.intermediate_size, QWEN.vocab_size) == (2560, 9728, 151936)
    assert QWEN.tie_word_embeddings


def test_qwen3_4b_weights_by_hand():
    # per layer: q 2560x4096, k and v 2560x1024, o 4096x2560, MLP 3 x 2560x9728, norms 2x2560 + 2x128
    per_layer = 10_485_760 + 2 * 2_621_440 + 10_485_760 + 74_711_040 + 5_120 + 256
    params = 36 * per_layer + 151_936 * 2_560 + 2_560  # + tied embedding + final norm
    assert params == 4_022_468_096
    assert QWEN.num_params == params
    assert QWEN.weights_bytes == 8_044_936_192
    assert abs(QWEN.weights_bytes / 1e9 - 8.05) < 0.02  # card: "weights ~8.05 GB"


@pytest.mark.parametrize("fmt,expected", [("bf16", 147_456), ("fp8", 73_728)])
def test_bytes_per_token_by_hand(fmt, expected):
    # 36 layers x 8 KV heads x 128 x 2 (K, V) x 2 B (bf16) or 1 B (fp8)
    assert cap.bytes_per_token(fmt, QWEN) == expected
    assert cap.page_bytes_all_layers(fmt, QWEN, 16) == 16 * expected


def test_compressed_page_is_the_layout_page():
    for name in ("k4v4", "k8v4", "k4v2", "k5v4"):
        page = get_format(name).layout(128, 16).page_bytes
        assert cap.page_bytes_all_layers(name, QWEN, 16) == 36 * 8 * page


def test_blocks_per_request_rounds_up():
    assert cap.blocks_per_request(16, 16) == 1
    assert cap.blocks_per_request(17, 16) == 2
    assert cap.blocks_per_request(131_072 + 1_024, 16) == 8_256
    assert cap.blocks_per_request(131_072 + 256, 16) == 8_208


def test_toy_model_whole_blocks():
    # 2 layers, 1 KV head, head_dim 64, bf16: 2*1*64*2*2 = 512 B/token, page of 16 tokens = 8192 B.
    toy = cap.ModelConfig("toy", num_layers=2, num_q_heads=1, num_kv_heads=1, head_dim=64, hidden_size=64,
                          intermediate_size=64, vocab_size=10)
    kw = dict(gpu_memory_gb=1 / 1024, gpu_memory_utilization=1.0, weights_gb=0.0, overhead_gb=0.0, cfg=toy)
    # 1 MiB of KV = 128 blocks; one is vLLM's null block -> 127 usable.
    r = cap.users_that_fit("bf16", 16, 0, **kw)
    assert (r["bytes_per_token"], r["page_bytes"], r["num_gpu_blocks"], r["kv_cache_tokens"]) == (512, 8192, 128, 2048)
    assert r["users_fit"] == 127  # 1 block each
    assert cap.users_that_fit("bf16", 16, 1, **kw)["users_fit"] == 63  # 17 tokens -> 2 blocks
    assert cap.users_that_fit("bf16", 30, 3, **kw)["users_fit"] == 42  # 33 tokens -> 3 blocks
    assert cap.users_that_fit("fp8", 30, 3, **kw)["users_fit"] == 85  # 256 blocks -> 255 usable // 3


def test_seed_workload_80gib_by_hand():
    # KV bytes = 0.9 x 80 GiB - 8,044,936,192 B weights - 1.968 GiB overhead
    kv = math.floor(0.9 * 80 * 2**30 - 8_044_936_192 - 1.968 * 2**30)
    assert cap.kv_cache_bytes(80, 0.9, None, 1.968, QWEN) == kv
    bf16_blocks = kv // (16 * 147_456)
    fp8_blocks = kv // (16 * 73_728)
    assert bf16_blocks * 16 == 455_392  # vLLM measured exactly this (REPRODUCTION-CARD.md)
    r = cap.users_that_fit("bf16", 131_072, 1_024, cfg=QWEN)
    assert (r["num_gpu_blocks"], r["users_fit"]) == (bf16_blocks, (bf16_blocks - 1) // 8_256)
    assert r["users_fit"] == 3
    r = cap.users_that_fit("fp8", 131_072, 1_024, cfg=QWEN)
    assert (r["num_gpu_blocks"], r["users_fit"]) == (fp8_blocks, 6)


def test_k5v4_users_at_the_defaults_by_hand():
    # k5v4: 128 x 5/8 = 80 B K codes + 64 B V codes + 2 B float16 K scale + 1 B uint8 log2 V scale = 147 B per token
    # and KV head; a block = 16 tokens x 8 KV heads x 36 layers x 147 B.
    per_head = 128 * 5 // 8 + 128 * 4 // 8 + 2 + 1
    assert per_head == 147 and cap.bytes_per_token("k5v4", QWEN) == 36 * 8 * 147
    page = 16 * 8 * 36 * per_head
    assert page == 677_376 and cap.page_bytes_all_layers("k5v4", QWEN, 16) == page
    kv = math.floor(0.9 * 80 * 2**30 - 8_044_936_192 - 1.968 * 2**30)
    blocks = kv // page
    users = (blocks - 1) // 8_256             # one null block; 131,072 + 1,024 tokens = 8,256 blocks per user
    r = cap.users_that_fit("k5v4", 131_072, 1_024, cfg=QWEN)
    assert (r["num_gpu_blocks"], r["users_fit"]) == (blocks, users)
    assert users == 12                        # k4v4 (134 B) fits 13, k8v4 (198 B) 8


def test_measured_anchors_and_card_users():
    # The card's "users that fit (131328 tok)": bf16 3, fp8 6; fp8 KV tokens 910,688 measured.
    fp8 = cap.users_that_fit("fp8", 131_072, 256, cfg=QWEN)
    assert abs(fp8["kv_cache_tokens"] - 910_688) / 910_688 < 2e-4
    assert fp8["users_fit"] == 6
    assert cap.users_that_fit("bf16", 131_072, 256, cfg=QWEN)["users_fit"] == 3
    # bytes/token/head derived from bf16's own anchor must give back 512 (within one block of 28,462)
    derived = cap.derived_bytes_per_token_per_head(455_392, cap.kv_cache_bytes(cfg=QWEN), QWEN)
    assert 512 <= derived < 512 * (1 + 1 / 28_462)


def test_capacity_table_ratio_and_demand():
    t = cap.capacity_table(["bf16", "fp8"], 131_072, 1_024, cfg=QWEN)
    assert list(t["users_fit"]) == [3, 6]
    assert list(t["vs_bf16"]) == [1.0, 2.0]
    d = cap.kv_demand(["bf16"], 3, 131_072, 1_024, 16, QWEN)
    assert list(d["users"]) == [1, 2, 3]
    assert d["kv_gib_needed"].iloc[2] == pytest.approx(3 * 8_256 * 2_359_296 / 2**30)


def test_arithmetic_view_has_short_headers_and_the_setup_in_its_note():
    t = cap.capacity_table(["bf16", "fp8"], 131_072, 1_024, cfg=QWEN)
    v, note = cap.arithmetic_view(t)
    assert list(v.columns) == ["format", "bytes per token", "page bytes", "KV GiB", "blocks", "KV tokens",
                               "tokens per user", "blocks per user", "users", "users vs bf16"]
    assert list(v["users"]) == [3, 6] and list(v["bytes per token"]) == [147_456, 73_728]
    assert list(v["blocks per user"]) == [8_256, 8_256] and list(v["users vs bf16"]) == [1.0, 2.0]
    assert note.startswith("Every format: tensor_parallel_size 1, pipeline_parallel_size 1, 1 GPU, 8 KV heads per "
                           f"GPU, weights {QWEN.weights_bytes / 2**30:.2f} GiB per GPU. Bytes per token:")
    assert "users = floor((blocks - 1) / blocks per user)" in note
    # the setup columns hold one value for every format; one that differed would stay a column
    mixed = t.assign(kv_heads_per_rank=[8, 4])
    v2, note2 = cap.arithmetic_view(mixed)
    assert list(v2["kv_heads_per_rank"]) == [8, 4] and "KV heads per GPU" not in note2
    tp2 = cap.capacity_table(["bf16"], 131_072, 1_024, cfg=cap.load_model_config("qwen3-32b"), gpu_memory_gb=40,
                             tensor_parallel_size=2)
    assert "tensor_parallel_size 2, pipeline_parallel_size 1, 2 GPUs, 4 KV heads per GPU" in cap.arithmetic_view(tp2)[1]


@pytest.mark.parametrize("kwargs,needle", [
    (dict(fmt="bf17", context_tokens=1024, decode_tokens=0), "bf17"),
    (dict(fmt="bf16", context_tokens=-5, decode_tokens=0), "context_tokens"),
    (dict(fmt="bf16", context_tokens=0, decode_tokens=0), "context_tokens"),
    (dict(fmt="bf16", context_tokens=1024, decode_tokens=-1), "decode_tokens"),
    (dict(fmt="bf16", context_tokens=1024, decode_tokens=0, block_size=0), "block_size"),
    (dict(fmt="bf16", context_tokens=1024, decode_tokens=0, gpu_memory_gb=-80), "gpu_memory_gb"),
    (dict(fmt="bf16", context_tokens=1024, decode_tokens=0, gpu_memory_utilization=1.5), "gpu_memory_utilization"),
    (dict(fmt="bf16", context_tokens=1024, decode_tokens=0, overhead_gb=-1), "overhead_gb"),
    (dict(fmt="bf16", context_tokens=1024, decode_tokens=0, gpu_memory_gb=8), "no memory left"),
    (dict(fmt="k4v4", context_tokens=1024, decode_tokens=0, block_size=8), "block_size"),
])
def test_bad_inputs_name_the_parameter(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        cap.users_that_fit(cfg=QWEN, **kwargs)


def test_bad_lists_name_the_parameter():
    with pytest.raises(ValueError, match="formats.*'int3'.*allowed: bf16"):
        cap.check_formats(["bf16", "int3"])
    with pytest.raises(ValueError, match="formats"):
        cap.check_formats([])
    with pytest.raises(ValueError, match="max_users"):
        cap.kv_demand(["bf16"], 0, 1024, 0)
    with pytest.raises(ValueError, match="model='nope'"):
        cap.load_model_config("nope")


@pytest.mark.parametrize("kwargs,needle", [
    (dict(gpu_memory_gb=-1), "gpu_memory_gb must be a positive finite number, got -1"),
    (dict(gpu_memory_gb=0.0), "gpu_memory_gb must be a positive finite number, got 0.0"),
    (dict(gpu_memory_gb=float("nan")), "gpu_memory_gb must be a positive finite number, got nan"),
    (dict(gpu_memory_gb="80"), "gpu_memory_gb must be a positive finite number, got '80'"),
    (dict(gpu_memory_gb=80, gpu_memory_utilization=1.2), "gpu_memory_utilization must be <= 1.0"),
    (dict(gpu_memory_gb=80, overhead_gb=-0.5), "overhead_gb must be >= 0.0"),
])
def test_check_memory_names_the_parameter(kwargs, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        cap.check_memory(**kwargs)
    cap.check_memory(80.0, 0.9, 1.968)


# --- tensor / pipeline parallel (per-GPU memory; numbers written out by hand) ---------------------------------------

QWEN32 = cap.load_model_config("qwen3-32b")


def test_qwen3_32b_tp2_rank_weights_by_hand():
    # Qwen3-32B: 64 layers, 64 q / 8 kv heads, head_dim 128, hidden 5120, MLP 25600, vocab 151,936 (= 64 x 2,374,
    # no padding), untied. One TP=2 rank: q 5120x(32x128), k and v 5120x(4x128), o (32x128)x5120, MLP 3 x 5120x12800,
    # norms 2x5120 + 2x128 (replicated), embedding and lm_head 75,968 rows x 5120 each, final norm 5120.
    per_layer = 20_971_520 + 2 * 2_621_440 + 20_971_520 + 196_608_000 + 10_496
    assert per_layer == 243_804_416
    params = 64 * per_layer + 2 * 75_968 * 5_120 + 5_120
    assert params == 16_381_400_064
    assert QWEN32.rank_weights_bytes(2) == [2 * params] == [32_762_800_128]
    # weights / 2 but for the replicated norms: 2 ranks hold them twice
    assert 2 * params - QWEN32.num_params == 64 * (2 * 5_120 + 256) + 5_120


def test_qwen3_4b_tp2_rank_weights_and_tp1_unchanged():
    per_layer = 5_242_880 + 2 * 1_310_720 + 5_242_880 + 37_355_520 + 5_376    # 16 q / 4 kv heads, MLP 4,864
    params = 36 * per_layer + 75_968 * 2_560 + 2_560                          # tied: one vocabulary matrix
    assert QWEN.rank_weights_bytes(2) == [2 * params] == [4_022_664_192]
    assert QWEN.rank_weights_bytes(1) == [8_044_936_192]                     # the calibrated TP=1 figure
    # PP=2: 18 layers each; stage 0 embedding, stage 1 final norm + lm_head (= the tied embedding, vLLM's Qwen3)
    layer1 = 10_485_760 + 2 * 2_621_440 + 10_485_760 + 74_711_040 + 5_376
    assert QWEN.rank_weights_bytes(1, 2) == [2 * (18 * layer1 + 151_936 * 2_560),
                                             2 * (18 * layer1 + 151_936 * 2_560 + 2_560)]


@pytest.mark.parametrize("fmt,per_head,blocks,users", [
    ("bf16", 512, 20_233, 2), ("fp8", 256, 40_467, 4), ("k4v4", 134, 77_311, 9), ("k5v4", 147, 70_474, 8)])
def test_qwen3_32b_tp2_users_at_128k_by_hand(fmt, per_head, blocks, users):
    # Per GPU: 0.9 x 80 GiB - 32,762,800,128 B rank weights - 1.968 GiB overhead = 42,433,487,290 B of KV.
    kv = math.floor(0.9 * 80 * 2**30 - 32_762_800_128 - 1.968 * 2**30)
    assert kv == 42_433_487_290
    page = 64 * 4 * 16 * per_head                    # 64 layers x 4 KV heads per rank x 16 tokens
    assert kv // page == blocks
    r = cap.users_that_fit(fmt, 131_072, 1_024, cfg=QWEN32, tensor_parallel_size=2)
    assert (r["page_bytes"], r["num_gpu_blocks"], r["kv_cache_tokens"], r["users_fit"]) == \
        (page, blocks, 16 * blocks, users)          # (blocks - 1) // 8,256 blocks per user
    assert (r["kv_heads_per_rank"], r["num_gpus"], r["bytes_per_token"]) == (4, 2, 64 * 4 * per_head)
    assert r["weights_gib_per_gpu"] == pytest.approx(32_762_800_128 / 2**30)


def test_qwen3_32b_tp1_vs_tp2_k4v4_by_hand():
    # TP=1 on one 80 GiB GPU: all 65,524,246,528 B of weights (the rank's 2 x 32,762,800,128 less the norms counted
    # twice) leave 9,672,040,890 B of KV: 8,810 blocks of 64 x 8 x 16 x 134 B, one user of 128K + 1K.
    assert QWEN32.weights_bytes == 2 * (2 * 16_381_400_064 - (64 * 10_496 + 5_120)) == 65_524_246_528
    kv = math.floor(0.9 * 80 * 2**30 - 65_524_246_528 - 1.968 * 2**30)
    assert kv == 9_672_040_890 and kv // 1_097_728 == 8_810
    one = cap.users_that_fit("k4v4", 131_072, 1_024, cfg=QWEN32)
    two = cap.users_that_fit("k4v4", 131_072, 1_024, cfg=QWEN32, tensor_parallel_size=2)
    assert (one["num_gpu_blocks"], one["users_fit"]) == (8_810, 1)
    assert (two["num_gpu_blocks"], two["users_fit"]) == (77_311, 9)   # 2 GPUs: 8.8x the KV tokens


@pytest.mark.parametrize("fmt,blocks,users", [("bf16", 27_566, 3), ("fp8", 55_133, 6), ("k4v4", 105_329, 12)])
def test_qwen3_4b_tp2_on_40gib_gpus_by_hand(fmt, blocks, users):
    kv = math.floor(0.9 * 40 * 2**30 - 4_022_664_192 - 1.968 * 2**30)
    per_head = {"bf16": 512, "fp8": 256, "k4v4": 134}[fmt]
    assert kv // (36 * 4 * 16 * per_head) == blocks
    t = cap.capacity_table([fmt], 131_072, 1_024, cfg=QWEN, gpu_memory_gb=40, tensor_parallel_size=2)
    assert (int(t["num_gpu_blocks"].iloc[0]), int(t["users_fit"].iloc[0])) == (blocks, users)
    d = cap.kv_demand([fmt], 2, 131_072, 1_024, 16, QWEN, tensor_parallel_size=2)
    assert d["kv_gib_needed"].iloc[1] == pytest.approx(2 * 8_256 * 36 * 4 * 16 * per_head / 2**30)


def test_pp2_takes_the_smallest_stage():
    # Qwen3-4B PP=2 on 40 GiB GPUs: both stages 18 layers; stage 1 holds 2,560 more parameters (final norm), so it
    # sets the block count: bf16 page 18 x 8 x 16 x 512 B.
    layer1 = 10_485_760 + 2 * 2_621_440 + 10_485_760 + 74_711_040 + 5_376
    w1 = 2 * (18 * layer1 + 151_936 * 2_560 + 2_560)
    kv1 = math.floor(0.9 * 40 * 2**30 - w1 - 1.968 * 2**30)
    r = cap.users_that_fit("bf16", 131_072, 1_024, cfg=QWEN, gpu_memory_gb=40, pipeline_parallel_size=2)
    assert r["num_gpu_blocks"] == kv1 // (18 * 8 * 16 * 512)
    assert r["page_bytes"] == 18 * 8 * 16 * 512 and r["num_gpus"] == 2


def test_tp1_rows_keep_their_values():
    a = cap.users_that_fit("k4v4", 131_072, 1_024, cfg=QWEN)
    b = cap.users_that_fit("k4v4", 131_072, 1_024, cfg=QWEN, tensor_parallel_size=1, pipeline_parallel_size=1)
    assert a == b and a["users_fit"] == 13 and a["kv_heads_per_rank"] == 8


@pytest.mark.parametrize("kwargs,needle", [
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be a positive integer"),
    (dict(tensor_parallel_size=3), r"tensor_parallel_size=3 .*allowed: \[1, 2, 4, 8, 16, 32\]"),
    (dict(tensor_parallel_size=2.0), "tensor_parallel_size must be a positive integer"),
    (dict(pipeline_parallel_size=37), r"pipeline_parallel_size=37 exceeds the model's 36 layers \(allowed: 1..36\)"),
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size must be a positive integer"),
])
def test_bad_parallel_sizes(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        cap.users_that_fit("bf16", 1_024, 0, cfg=QWEN, **kwargs)
