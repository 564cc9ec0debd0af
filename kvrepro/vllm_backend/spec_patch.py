"""The one patch of vLLM internals: the KV-cache spec of layers served by kvrepro's backend.

Why a patch: in vLLM 0.20.2 the page size vLLM budgets and allocates per layer comes from
``Attention.get_kv_cache_spec`` (``vllm/model_executor/layers/attention/attention.py``), which picks
the spec from ``kv_cache_dtype`` alone; an attention backend has no hook to change it. The in-tree
TurboQuant gets its smaller page through a special case there that returns
``TQFullAttentionSpec(tq_slot_size=...)`` (``vllm/v1/kv_cache_interface.py``), whose
``real_page_size_bytes = block_size x num_kv_heads x tq_slot_size``. We reuse exactly that spec
class: for a layer whose backend is kvrepro's, the wrapped method returns
``TQFullAttentionSpec(dtype=torch.uint8, tq_slot_size=page_bytes / block_size)``, so vLLM sizes,
allocates and views each layer's cache as uint8 ``[num_blocks, num_kv_heads, page_bytes]``
(``kvrepro.formats.layout``). Every other layer goes to the original method unchanged.

The patch is idempotent (vLLM may load plugins several times per process) and reversible
(:func:`uninstall`), and it is written against injected classes so it is tested without vLLM.
"""
from __future__ import annotations

import torch

from kvrepro.vllm_backend.config import check_layer, settings_for_engine, slot_bytes

MARKER = "_kvrepro_spec_patch"


def is_kvrepro_layer(layer) -> bool:
    """True when ``layer.attn_backend`` is kvrepro's backend (it carries ``kvrepro_compressed = True``)."""
    backend = getattr(layer, "attn_backend", None)
    return bool(getattr(backend, "kvrepro_compressed", False))


def compressed_spec(layer, block_size: int, spec_cls, preset: str | None = None, vllm_config=None):
    """The spec vLLM must use for a kvrepro layer.

    Args:
        layer: vLLM ``Attention`` module (reads ``num_kv_heads``, ``head_size``, ``num_heads``,
            ``sliding_window``, ``kv_cache_dtype``, ``attn_type``).
        block_size: ``vllm_config.cache_config.block_size`` (tokens per block).
        spec_cls: ``vllm.v1.kv_cache_interface.TQFullAttentionSpec`` (injected for tests).
        preset: compressed preset; default: the engine's (``config.settings_for_engine(vllm_config)``).
        vllm_config: vLLM's ``VllmConfig`` of the engine (None outside an engine).

    Raises:
        ValueError: unsupported layer (see ``config.check_layer``), head_dim or block_size.
    """
    check_layer(num_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads, head_size=layer.head_size,
                sliding_window=getattr(layer, "sliding_window", None),
                attn_type=getattr(layer, "attn_type", "decoder"),
                kv_cache_dtype=getattr(layer, "kv_cache_dtype", "auto"))
    return spec_cls(
        block_size=block_size,
        num_kv_heads=layer.num_kv_heads,
        head_size=layer.head_size,
        head_size_v=layer.head_size,
        dtype=torch.uint8,
        tq_slot_size=slot_bytes(preset or settings_for_engine(vllm_config).preset, layer.head_size, block_size),
    )


def install(attention_cls=None, spec_cls=None) -> bool:
    """Wrap ``attention_cls.get_kv_cache_spec`` (default: vLLM's ``Attention``). Returns True if it
    installed the wrapper now, False if it was already installed."""
    if attention_cls is None:
        from vllm.model_executor.layers.attention.attention import Attention as attention_cls
    if spec_cls is None:
        from vllm.v1.kv_cache_interface import TQFullAttentionSpec as spec_cls
    original = attention_cls.get_kv_cache_spec
    if getattr(original, MARKER, False):
        return False

    def get_kv_cache_spec(self, vllm_config):
        if is_kvrepro_layer(self):
            return compressed_spec(self, vllm_config.cache_config.block_size, spec_cls, vllm_config=vllm_config)
        return original(self, vllm_config)

    setattr(get_kv_cache_spec, MARKER, True)
    get_kv_cache_spec.__wrapped__ = original
    get_kv_cache_spec.__doc__ = original.__doc__
    attention_cls.get_kv_cache_spec = get_kv_cache_spec
    return True


def uninstall(attention_cls) -> bool:
    """Restore the original method; returns False if no wrapper was installed."""
    current = attention_cls.get_kv_cache_spec
    if not getattr(current, MARKER, False):
        return False
    attention_cls.get_kv_cache_spec = current.__wrapped__
    return True
