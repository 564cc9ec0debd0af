"""Pure parts of the vLLM plugin (no vLLM needed): preset choice, refusals, page sizing, the spec patch."""
import dataclasses

import pytest
import torch

from kvrepro.formats import COMPRESSED_PRESETS, get_format
from kvrepro.vllm_backend import config as cfg
from kvrepro.vllm_backend import spec_patch


def test_preset_default_env_and_refusal(monkeypatch):
    monkeypatch.delenv(cfg.PRESET_ENV, raising=False)
    assert cfg.resolve_preset() == "k4v4"
    monkeypatch.setenv(cfg.PRESET_ENV, " K8V4 ")
    assert cfg.resolve_preset() == "k8v4"
    monkeypatch.setenv(cfg.PRESET_ENV, "int3")
    with pytest.raises(ValueError, match="KVREPRO_PRESET.*k4v4"):
        cfg.resolve_preset()
    assert cfg.resolve_preset("k4v2") == "k4v2"
    with pytest.raises(ValueError, match=r"KVREPRO_PRESET must be a preset name \(str\), got 4; allowed: k4v4"):
        cfg.resolve_preset(4)


def test_prefill_path(monkeypatch):
    monkeypatch.delenv(cfg.PREFILL_ENV, raising=False)
    assert cfg.resolve_prefill() == "fa"
    monkeypatch.setenv(cfg.PREFILL_ENV, "fa-sliced")
    assert cfg.resolve_prefill() == "fa-sliced"
    with pytest.raises(ValueError, match="KVREPRO_PREFILL.*triton"):
        cfg.resolve_prefill("sdpa")


def test_decode_impl_choice(monkeypatch):
    monkeypatch.delenv(cfg.DECODE_IMPL_ENV, raising=False)
    assert cfg.resolve_decode_impl() is None                 # auto: kvrepro.ops.decode.resolve_impl decides
    monkeypatch.setenv(cfg.DECODE_IMPL_ENV, " CUDA ")
    assert cfg.resolve_decode_impl() == "cuda"
    assert cfg.resolve_decode_impl("triton") == "triton" and cfg.resolve_decode_impl("auto") is None
    with pytest.raises(ValueError, match="KVREPRO_DECODE_IMPL='fast'; allowed: auto, cuda, triton"):
        cfg.resolve_decode_impl("fast")


def test_warmup_switch(monkeypatch):
    monkeypatch.delenv("KVREPRO_WARMUP", raising=False)
    assert cfg.resolve_warmup() is True
    monkeypatch.setenv("KVREPRO_WARMUP", "0")
    assert cfg.resolve_warmup() is False
    with pytest.raises(ValueError, match="KVREPRO_WARMUP.*allowed: 0, 1"):
        cfg.resolve_warmup("yes")


def test_num_splits(monkeypatch):
    monkeypatch.delenv(cfg.NUM_SPLITS_ENV, raising=False)
    assert cfg.resolve_num_splits() is None
    monkeypatch.setenv(cfg.NUM_SPLITS_ENV, "8")
    assert cfg.resolve_num_splits() == 8
    for bad in ("0", "x", "1000"):
        with pytest.raises(ValueError, match="KVREPRO_NUM_SPLITS"):
            cfg.resolve_num_splits(bad)


@pytest.mark.parametrize("preset", list(COMPRESSED_PRESETS))
@pytest.mark.parametrize("head_dim,block_size", [(128, 16), (64, 32), (128, 64)])
def test_slot_bytes_match_page_layout(preset, head_dim, block_size):
    kb, vb = COMPRESSED_PRESETS[preset]
    per_token = head_dim * (kb + vb) // 8 + 6  # codes + fp16 K scale/zero + fp16 V scale
    assert cfg.slot_bytes(preset, head_dim, block_size) == per_token
    assert cfg.kv_cache_shape(7, block_size, 3, head_dim, preset) == (7, 3, per_token * block_size)


def test_k4v4_page_is_3_76x_smaller_than_bf16():
    # vLLM's bf16 page per token per head: 2 (K,V) x 128 x 2 B = 512 B; k4v4: 64 + 64 + 6 = 134 B.
    assert 512 / cfg.slot_bytes("k4v4", 128, 16) == pytest.approx(3.8209, abs=1e-4)


def test_unsupported_reasons():
    ok = dict(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16)
    assert cfg.unsupported_reasons(**ok) == []
    assert cfg.unsupported_reasons(**dict(ok, block_size=None, kv_cache_dtype=None)) == []
    cases = {"head_dim=96": dict(head_size=96), "float32": dict(dtype=torch.float32),
             "kv_cache_dtype='fp8'": dict(kv_cache_dtype="fp8"), "block_size=128": dict(block_size=128),
             "MLA": dict(use_mla=True), "sinks": dict(has_sink=True), "attention type": dict(attn_type="encoder")}
    for needle, change in cases.items():
        reasons = cfg.unsupported_reasons(**dict(ok, **change))
        assert len(reasons) == 1 and needle in reasons[0], (needle, reasons)


def test_check_layer_refusals():
    ok = dict(num_heads=32, num_kv_heads=8, head_size=128)
    cfg.check_layer(**ok)
    for needle, change in {"sliding window": dict(sliding_window=4096), "ALiBi": dict(alibi_slopes=[1.0]),
                           "logits_soft_cap": dict(logits_soft_cap=30.0),
                           "KV sharing": dict(kv_sharing_target_layer_name="l0"),
                           "encoder_only": dict(attn_type="encoder_only"), "fp8": dict(kv_cache_dtype="fp8"),
                           "head_dim=80": dict(head_size=80), "multiple": dict(num_heads=30)}.items():
        with pytest.raises(ValueError, match=needle):
            cfg.check_layer(**dict(ok, **change))


# --- spec patch, against stand-ins with vLLM 0.20.2's field names and page formula ---------------------

@dataclasses.dataclass(frozen=True)
class FakeTQSpec:  # vllm.v1.kv_cache_interface.TQFullAttentionSpec (fields used, same page formula)
    block_size: int
    num_kv_heads: int
    head_size: int
    head_size_v: int
    dtype: torch.dtype
    tq_slot_size: int

    @property
    def page_size_bytes(self):
        return self.block_size * self.num_kv_heads * self.tq_slot_size


class FakeBackend:
    kvrepro_compressed = True


class FakeAttention:
    def __init__(self, backend, num_kv_heads=8, head_size=128, sliding_window=None):
        self.attn_backend, self.num_heads, self.num_kv_heads = backend, 4 * num_kv_heads, num_kv_heads
        self.head_size, self.sliding_window, self.kv_cache_dtype, self.attn_type = head_size, sliding_window, "auto", "decoder"

    def get_kv_cache_spec(self, vllm_config):
        return "original"


class FakeVllmConfig:
    class cache_config:  # noqa: N801
        block_size = 16


def test_spec_patch_sizes_pages_exactly(monkeypatch):
    monkeypatch.setenv(cfg.PRESET_ENV, "k4v4")
    cls = type("Attn", (FakeAttention,), {})
    assert spec_patch.install(cls, FakeTQSpec) is True
    assert spec_patch.install(cls, FakeTQSpec) is False  # idempotent
    spec = cls(FakeBackend).get_kv_cache_spec(FakeVllmConfig)
    layout = get_format("k4v4").layout(128, 16)
    assert spec.dtype == torch.uint8 and spec.page_size_bytes == 8 * layout.page_bytes == 8 * 16 * 134
    assert cls(object).get_kv_cache_spec(FakeVllmConfig) == "original"  # other backends untouched
    with pytest.raises(ValueError, match="sliding window"):
        cls(FakeBackend, sliding_window=128).get_kv_cache_spec(FakeVllmConfig)
    assert spec_patch.uninstall(cls) is True
    assert cls(FakeBackend).get_kv_cache_spec(FakeVllmConfig) == "original"
    assert spec_patch.uninstall(cls) is False


def test_debug_check_switch_is_validated(monkeypatch):
    from kvrepro.vllm_backend import config as cfg
    monkeypatch.delenv("KVREPRO_DEBUG_CHECK", raising=False)
    assert cfg.resolve_debug_check() is False
    monkeypatch.setenv("KVREPRO_DEBUG_CHECK", "1")
    assert cfg.resolve_debug_check() is True
    monkeypatch.setenv("KVREPRO_DEBUG_CHECK", "true")
    with pytest.raises(ValueError, match="KVREPRO_DEBUG_CHECK='true'; allowed: 0, 1"):
        cfg.resolve_debug_check()


def test_store_rotate_and_switches_ignore_case_and_spaces_like_the_other_settings(monkeypatch):
    """KVREPRO_STORE_ROTATE reads like KVREPRO_PRESET (case and surrounding spaces ignored); the 0/1 switches ignore
    surrounding spaces; anything else is still refused with the variable and the allowed values."""
    monkeypatch.setenv("KVREPRO_STORE_ROTATE", " Kernel ")
    assert cfg.resolve_store_rotate() == "kernel"
    monkeypatch.delenv("KVREPRO_STORE_ROTATE")
    assert cfg.resolve_store_rotate() == "torch"
    with pytest.raises(ValueError, match="KVREPRO_STORE_ROTATE='numpy'; allowed: torch, kernel"):
        cfg.resolve_store_rotate("numpy")
    monkeypatch.setenv("KVREPRO_WARMUP", " 0 ")
    assert cfg.resolve_warmup() is False
    with pytest.raises(ValueError, match="KVREPRO_WARMUP='on'; allowed: 0, 1"):
        cfg.resolve_warmup(" on ")

