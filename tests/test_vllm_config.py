"""Pure parts of the vLLM plugin (no vLLM needed): settings per engine, refusals, page sizing, the spec patch."""
import dataclasses
import logging

import pytest
import torch

from kvrepro.formats import COMPRESSED_PRESETS, get_format
from kvrepro.vllm_backend import config as cfg
from kvrepro.vllm_backend import spec_patch


@pytest.fixture(autouse=True)
def _fresh_engine_settings(monkeypatch):
    """Each test starts with no engine resolved in this process (settings_for_engine keeps them per process)."""
    monkeypatch.setattr(cfg, "_ENGINE_SETTINGS", {})
    monkeypatch.setattr(cfg, "_LAST", [])


def test_settings_for_engine_resolves_once_per_engine_and_logs_once(caplog):
    """One Settings object per vLLM config (every layer of an engine gets the same one), logged once at engine
    start with a warning naming unknown KVREPRO_ variables; a new engine resolves again."""
    class Engine:  # stands in for vLLM's VllmConfig (only its identity matters)
        pass

    a, b = Engine(), Engine()
    env_a = {"KVREPRO_PRESET": "k8v4", "KVREPRO_RECENT_WINDOW": "32"}
    with caplog.at_level(logging.INFO, logger=cfg.LOGGER_NAME):
        s = cfg.settings_for_engine(a, env_a)
        assert cfg.settings_for_engine(a, {"KVREPRO_PRESET": "k4v2"}) is s   # later layers: the same object
        t = cfg.settings_for_engine(b, {"KVREPRO_NUM_SPLITS": "8"})
    assert (s.preset, t.preset, t.num_splits) == ("k8v4", "k5v4", 8)
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos == ["kvrepro settings: preset=k8v4 decode_impl=auto num_splits=auto prefill=fa store_rotate=kernel "
                     "key_offset=rope-mean warmup=1 debug_check=0",
                     "kvrepro settings: preset=k5v4 decode_impl=auto num_splits=8 prefill=fa store_rotate=kernel "
                     "key_offset=rope-mean warmup=1 debug_check=0"]
    warns = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warns) == 1 and "KVREPRO_RECENT_WINDOW set but not a kvrepro setting (ignored)" in warns[0]
    assert cfg.settings_for_engine() is t          # outside an engine build: the last engine's settings
    with pytest.raises(ValueError, match="KVREPRO_PREFILL='sdpa'; allowed: fa, fa-sliced, fa-pages, dequant, triton"):
        cfg.settings_for_engine(Engine(), {"KVREPRO_PREFILL": "sdpa"})


@pytest.mark.parametrize("preset", list(COMPRESSED_PRESETS))
@pytest.mark.parametrize("head_dim,block_size", [(128, 16), (64, 32), (128, 64)])
def test_slot_bytes_match_page_layout(preset, head_dim, block_size):
    kb, vb = COMPRESSED_PRESETS[preset]
    # codes + fp16 K scale/zero + fp16 V scale; k5v4: fp16 K scale + one-byte log2 V scale
    per_token = head_dim * (kb + vb) // 8 + (3 if preset == "k5v4" else 6)
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
    # the preset is the engine's (resolved once per vLLM config), not re-read from the environment per layer
    monkeypatch.setenv(cfg.PRESET_ENV, "k8v4")
    assert spec_patch.compressed_spec(cls(FakeBackend), 16, FakeTQSpec, vllm_config=FakeVllmConfig).tq_slot_size \
        == 134
    other = type("OtherEngineConfig", (), {"cache_config": FakeVllmConfig.cache_config})
    assert spec_patch.compressed_spec(cls(FakeBackend), 16, FakeTQSpec, vllm_config=other).tq_slot_size == 198
    with pytest.raises(ValueError, match="KVREPRO_PRESET='int3' is not a kvrepro compressed preset"):
        cfg.page_layout("int3", 128, 16)


def _fake_vllm(monkeypatch, version):
    """Just enough of vLLM for ``register``: the package with a version and the backend registry."""
    import enum
    import sys
    import types

    from kvrepro.vllm_backend import spec_patch

    registered = []
    vllm = types.ModuleType("vllm")
    vllm.__version__ = version
    registry = types.ModuleType("vllm.v1.attention.backends.registry")
    registry.AttentionBackendEnum = enum.Enum("AttentionBackendEnum", ["CUSTOM"])
    registry.register_backend = lambda slot, cls: registered.append((slot.name, cls))
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.v1.attention.backends.registry", registry)
    monkeypatch.setattr(spec_patch, "install", lambda: None)
    return registered


@pytest.mark.parametrize("version, warned", [("0.20.2", False), ("0.21.0", True)])
def test_register_warns_on_another_vllm_version(monkeypatch, caplog, version, warned):
    from kvrepro import vllm_backend

    registered = _fake_vllm(monkeypatch, version)
    monkeypatch.delenv("KVREPRO_PRESET", raising=False)
    with caplog.at_level("WARNING", logger="vllm.kvrepro"):
        vllm_backend.register()
    assert registered == [("CUSTOM", vllm_backend.BACKEND_CLASS)]
    assert ("built for vLLM 0.20.2, this is vLLM 0.21.0" in caplog.text) == warned


def test_register_refuses_a_bad_setting_before_registering(monkeypatch):
    from kvrepro import vllm_backend

    registered = _fake_vllm(monkeypatch, "0.20.2")
    monkeypatch.setenv("KVREPRO_PRESET", "k5v5")
    with pytest.raises(ValueError, match="KVREPRO_PRESET='k5v5' is not a kvrepro compressed preset"):
        vllm_backend.register()
    assert registered == []
