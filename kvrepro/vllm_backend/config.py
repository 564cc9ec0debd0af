"""What the kvrepro vLLM backend supports, and the settings of an engine (pure Python: no vLLM needed).

Settings: every ``KVREPRO_*`` variable is declared in ``kvrepro.settings`` (``KVREPRO_PRESET`` picks the
compressed preset, default ``k4v4``; ``python -m kvrepro.settings`` lists them all). vLLM loads the plugin in
every process it starts and child processes inherit the environment, so setting them before
``LLM(...)``/``vllm serve`` applies them everywhere. They are resolved once per engine
(:func:`settings_for_engine`), logged at engine start and used by every layer; a bad value is a ``ValueError``
at engine start.

Supported (everything else is refused at engine start with a message, never a fallback):
decoder self-attention of a non-MLA model, head_dim in ``SUPPORTED_HEAD_DIMS`` (64, 128), model dtype
bf16/fp16, ``kv_cache_dtype="auto"`` (the compression *is* the KV dtype), block_size in
``SUPPORTED_BLOCK_SIZES`` (16, 32, 64), no sliding window, no ALiBi, no logits soft-cap, no attention
sinks, no KV sharing between layers.
"""
from __future__ import annotations

import logging
import os

import torch

from kvrepro.formats import get_format
from kvrepro.formats.hadamard import SUPPORTED_HEAD_DIMS
from kvrepro.formats.layout import SUPPORTED_BLOCK_SIZES, PageLayout
from kvrepro.settings import SETTINGS, Settings, parse, unknown_variables

PRESET_ENV = "KVREPRO_PRESET"
BACKEND_NAME = "CUSTOM"  # vLLM's enum slot for out-of-tree backends (--attention-backend CUSTOM)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
SUPPORTED_KV_CACHE_DTYPES = ("auto", "bfloat16", "float16")
# vLLM prints the records of its own "vllm" logger tree (its handler, its level); a child of it makes the
# settings line appear in the engine's log next to vLLM's own start-up lines.
LOGGER_NAME = "vllm.kvrepro"

# Settings resolved per engine: {id(vllm_config): (vllm_config, Settings)}. The config object is kept so that
# its id is not reused by another engine's config while the entry exists.
_ENGINE_SETTINGS: dict[int, tuple[object, Settings]] = {}
_LAST: list[Settings] = []


def settings_for_engine(vllm_config=None, environ=None) -> Settings:
    """The engine's :class:`kvrepro.settings.Settings`, resolved from the environment once per engine.

    ``vllm_config``: vLLM's ``VllmConfig`` of the engine being built (the backend passes
    ``get_current_vllm_config_or_none()``; the page-size patch the config vLLM hands it). The first call for a
    config resolves ``Settings.from_env(environ)``, logs it once (``kvrepro settings: preset=k4v4 ...``, logger
    ``LOGGER_NAME``, with a warning naming any unknown ``KVREPRO_*`` variable) and keeps it; every later call for
    that config (every layer) returns the same object. Without a config (outside an engine build): the settings
    of the last engine resolved in this process, else ``Settings.from_env(environ)`` (neither kept nor logged).

    Raises:
        ValueError: a bad ``KVREPRO_*`` value (names the variable and the allowed values).
    """
    if vllm_config is None:
        return _LAST[-1] if _LAST else Settings.from_env(environ)
    hit = _ENGINE_SETTINGS.get(id(vllm_config))
    if hit is not None and hit[0] is vllm_config:
        return hit[1]
    s = Settings.from_env(environ)
    _ENGINE_SETTINGS[id(vllm_config)] = (vllm_config, s)
    _LAST[:] = [s]
    log = logging.getLogger(LOGGER_NAME)
    log.info("%s", s.describe())
    unknown = unknown_variables(os.environ if environ is None else environ)
    if unknown:
        log.warning("kvrepro: %s set but not a kvrepro setting (ignored); the settings are %s",
                    ", ".join(unknown), ", ".join(d.env for d in SETTINGS))
    return s


def page_layout(preset: str, head_dim: int, block_size: int) -> PageLayout:
    """Page layout of ``preset`` (one block x one KV head). Raises ValueError on unsupported sizes."""
    return get_format(parse("preset", preset)).layout(head_dim, block_size)


def slot_bytes(preset: str, head_dim: int, block_size: int) -> int:
    """Bytes per token per KV head as vLLM must budget them: ``page_bytes / block_size`` (134 for
    k4v4 at head_dim 128). vLLM's page of one layer is then ``block_size x num_kv_heads x slot_bytes``
    = ``num_kv_heads x page_bytes`` exactly (``TQFullAttentionSpec.real_page_size_bytes``)."""
    layout = page_layout(preset, head_dim, block_size)
    if layout.page_bytes % block_size:
        raise ValueError(f"page_bytes={layout.page_bytes} is not a multiple of block_size={block_size}")
    return layout.page_bytes // block_size


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                   preset: str | None = None) -> tuple[int, int, int]:
    """Shape of one layer's pool as vLLM must allocate it: uint8 ``(num_blocks, num_kv_heads, page_bytes)``;
    ``preset`` None: the engine's (:func:`settings_for_engine`)."""
    preset = settings_for_engine().preset if preset is None else preset
    return (num_blocks, num_kv_heads, page_layout(preset, head_size, block_size).page_bytes)


def unsupported_reasons(*, head_size: int, dtype: torch.dtype, kv_cache_dtype: str | None,
                        block_size: int | None, use_mla: bool = False, has_sink: bool = False,
                        use_sparse: bool = False, attn_type: str = "decoder", use_mm_prefix: bool = False,
                        use_per_head_quant_scales: bool = False, use_non_causal: bool = False,
                        use_batch_invariant: bool = False, **_ignored) -> list[str]:
    """Why this backend cannot serve the configuration (empty list = supported).

    The keywords are those of vLLM 0.20.2's ``AttentionSelectorConfig``; vLLM raises
    ``ValueError("Selected backend CUSTOM is not valid ... Reason: [...]")`` with this list.
    """
    r = []
    if head_size not in SUPPORTED_HEAD_DIMS:
        r.append(f"kvrepro: head_dim={head_size} not supported (supported: {SUPPORTED_HEAD_DIMS})")
    if dtype not in SUPPORTED_DTYPES:
        r.append(f"kvrepro: model dtype {dtype} not supported (supported: bfloat16, float16)")
    if kv_cache_dtype is not None and kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
        r.append(f"kvrepro: kv_cache_dtype={kv_cache_dtype!r} not supported: use 'auto' and pick the "
                 f"compression with {PRESET_ENV}")
    if block_size is not None and block_size not in SUPPORTED_BLOCK_SIZES:
        r.append(f"kvrepro: block_size={block_size} not supported (supported: {SUPPORTED_BLOCK_SIZES})")
    for flag, what in ((use_mla, "MLA"), (has_sink, "attention sinks"), (use_sparse, "sparse attention"),
                       (use_mm_prefix, "multimodal prefix attention"),
                       (use_per_head_quant_scales, "per-head quant scales"),
                       (use_non_causal, "non-causal attention"), (use_batch_invariant, "batch invariance")):
        if flag:
            r.append(f"kvrepro: {what} not supported")
    if str(getattr(attn_type, "value", attn_type)) != "decoder":
        r.append(f"kvrepro: attention type {attn_type!r} not supported (decoder self-attention only)")
    return r


def check_layer(*, num_heads: int, num_kv_heads: int, head_size: int, sliding_window=None,
                alibi_slopes=None, logits_soft_cap=None, kv_sharing_target_layer_name=None,
                attn_type: str = "decoder", kv_cache_dtype: str = "auto") -> None:
    """Refuse an attention layer the backend cannot serve (called when vLLM builds the model).

    Raises:
        ValueError: naming the unsupported feature (sliding window, ALiBi, soft-cap, KV sharing,
            encoder/cross attention, a quantized kv_cache_dtype, a GQA group that does not divide).
    """
    problems = []
    if sliding_window is not None:
        problems.append(f"sliding window ({sliding_window}) not supported")
    if alibi_slopes is not None:
        problems.append("ALiBi not supported")
    if logits_soft_cap:
        problems.append(f"logits_soft_cap={logits_soft_cap} not supported")
    if kv_sharing_target_layer_name is not None:
        problems.append("KV sharing between layers not supported")
    if str(getattr(attn_type, "value", attn_type)) != "decoder":
        problems.append(f"attention type {attn_type!r} not supported (decoder self-attention only)")
    if kv_cache_dtype not in SUPPORTED_KV_CACHE_DTYPES:
        problems.append(f"kv_cache_dtype={kv_cache_dtype!r} not supported (use 'auto'; preset via {PRESET_ENV})")
    if head_size not in SUPPORTED_HEAD_DIMS:
        problems.append(f"head_dim={head_size} not supported (supported: {SUPPORTED_HEAD_DIMS})")
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        problems.append(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if problems:
        raise ValueError("kvrepro attention backend (CUSTOM) refuses this layer: " + "; ".join(problems))
