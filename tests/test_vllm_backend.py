"""The backend inside vLLM 0.20.2 (GPU machines with vLLM only; skipped elsewhere).

vLLM's modules are imported inside the tests: this file is collected (and its tests skipped with the reason)
where vLLM is not installed."""
import pytest
import torch

import kvrepro.vllm_backend as plugin
from kvrepro.formats import get_format

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]


@pytest.fixture(scope="module")
def backend():
    from kvrepro.vllm_backend import backend

    return backend


def test_register_binds_custom_and_is_idempotent(backend):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    plugin.register()
    plugin.register()
    assert AttentionBackendEnum.CUSTOM.get_class() is backend.KVReproAttentionBackend
    assert backend.KVReproAttentionBackend.get_name() == "CUSTOM"


def test_register_refuses_a_bad_setting(monkeypatch):
    monkeypatch.setenv("KVREPRO_DECODE_IMPL", "fast")
    with pytest.raises(ValueError, match="KVREPRO_DECODE_IMPL='fast'; allowed: auto, cuda, triton"):
        plugin.register()


def test_entry_point_is_visible_to_vllm():
    from importlib.metadata import entry_points

    eps = [e for e in entry_points(group="vllm.general_plugins") if e.value == "kvrepro.vllm_backend:register"]
    assert eps, "kvrepro is not registered under the vllm.general_plugins entry point"


def test_page_size_through_vllm_spec(backend):
    from vllm.v1.kv_cache_interface import FullAttentionSpec, TQFullAttentionSpec

    layout = get_format("k4v4").layout(128, 16)
    spec = TQFullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, head_size_v=128, dtype=torch.uint8,
                               tq_slot_size=layout.page_bytes // 16)
    bf16 = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    assert spec.page_size_bytes == 8 * layout.page_bytes
    assert bf16.page_size_bytes / spec.page_size_bytes == pytest.approx(512 / layout.bytes_per_token)
    assert backend.KVReproAttentionBackend.get_kv_cache_shape(5, 16, 8, 128) == (5, 8, layout.page_bytes)


def test_validate_configuration_refuses_with_reasons(backend):
    from vllm.platforms import current_platform

    cap = current_platform.get_device_capability()
    ok = dict(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16, use_mla=False,
              has_sink=False, use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
              device_capability=cap, attn_type="decoder")
    assert backend.KVReproAttentionBackend.validate_configuration(**ok) == []
    r = backend.KVReproAttentionBackend.validate_configuration(**dict(ok, head_size=96, use_mla=True))
    assert any("head_dim=96" in x for x in r) and any("MLA" in x for x in r)


def test_impl_refuses_sliding_window_and_encoder(backend):
    with pytest.raises(ValueError, match="sliding window"):
        backend.KVReproAttentionImpl(32, 128, 128 ** -0.5, 8, sliding_window=4096)
    with pytest.raises(ValueError, match="encoder"):
        backend.KVReproAttentionImpl(32, 128, 128 ** -0.5, 8, attn_type="encoder")


def test_every_layer_of_an_engine_uses_one_settings_object(backend, monkeypatch):
    """Outside an engine build (no current vLLM config) the impl takes the settings of the environment; inside one,
    every layer gets the engine's one object (config.settings_for_engine)."""
    from kvrepro.vllm_backend import config as cfg

    monkeypatch.setattr(cfg, "_ENGINE_SETTINGS", {})
    monkeypatch.setattr(cfg, "_LAST", [])
    monkeypatch.setenv("KVREPRO_PRESET", "k8v4")
    monkeypatch.setenv("KVREPRO_WARMUP", "0")
    a = backend.KVReproAttentionImpl(32, 128, 128 ** -0.5, 8)
    assert a.settings.preset == a.rt.fmt.name == "k8v4" and a._warmup is False
    engine = object()
    monkeypatch.setattr(backend, "engine_settings", lambda: cfg.settings_for_engine(engine))
    layers = [backend.KVReproAttentionImpl(32, 128, 128 ** -0.5, 8) for _ in range(3)]
    assert len({id(x.settings) for x in layers}) == 1
