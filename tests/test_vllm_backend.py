"""The backend inside vLLM 0.20.2 (GPU machines with vLLM only; skipped elsewhere)."""
import pytest
import torch

vllm = pytest.importorskip("vllm")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, TQFullAttentionSpec  # noqa: E402

import kvrepro.vllm_backend as plugin  # noqa: E402
from kvrepro.formats import get_format  # noqa: E402
from kvrepro.vllm_backend.backend import KVReproAttentionBackend, KVReproAttentionImpl  # noqa: E402


def test_register_binds_custom_and_is_idempotent():
    plugin.register()
    plugin.register()
    assert AttentionBackendEnum.CUSTOM.get_class() is KVReproAttentionBackend
    assert KVReproAttentionBackend.get_name() == "CUSTOM"


def test_entry_point_is_visible_to_vllm():
    from importlib.metadata import entry_points

    eps = [e for e in entry_points(group="vllm.general_plugins") if e.value == "kvrepro.vllm_backend:register"]
    assert eps, "kvrepro is not registered under the vllm.general_plugins entry point"


def test_page_size_through_vllm_spec():
    layout = get_format("k4v4").layout(128, 16)
    spec = TQFullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, head_size_v=128, dtype=torch.uint8,
                               tq_slot_size=layout.page_bytes // 16)
    bf16 = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    assert spec.page_size_bytes == 8 * layout.page_bytes
    assert bf16.page_size_bytes / spec.page_size_bytes == pytest.approx(512 / layout.bytes_per_token)
    assert KVReproAttentionBackend.get_kv_cache_shape(5, 16, 8, 128) == (5, 8, layout.page_bytes)


def test_validate_configuration_refuses_with_reasons():
    from vllm.platforms import current_platform

    cap = current_platform.get_device_capability()
    ok = dict(head_size=128, dtype=torch.bfloat16, kv_cache_dtype="auto", block_size=16, use_mla=False,
              has_sink=False, use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
              device_capability=cap, attn_type="decoder")
    assert KVReproAttentionBackend.validate_configuration(**ok) == []
    r = KVReproAttentionBackend.validate_configuration(**dict(ok, head_size=96, use_mla=True))
    assert any("head_dim=96" in x for x in r) and any("MLA" in x for x in r)


def test_impl_refuses_sliding_window_and_encoder():
    with pytest.raises(ValueError, match="sliding window"):
        KVReproAttentionImpl(32, 128, 128 ** -0.5, 8, sliding_window=4096)
    with pytest.raises(ValueError, match="encoder"):
        KVReproAttentionImpl(32, 128, 128 ** -0.5, 8, attn_type="encoder")
