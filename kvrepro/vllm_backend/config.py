"""What the kvrepro vLLM backend supports, and how its preset is chosen (pure Python: no vLLM needed).

Preset choice (one documented way): the environment variable ``KVREPRO_PRESET`` (default ``k4v4``;
allowed: the compressed presets of ``kvrepro.formats.COMPRESSED_PRESETS``). vLLM loads the plugin in
every process it starts and child processes inherit the environment, so setting it before
``LLM(...)``/``vllm serve`` picks the preset everywhere. A bad value is a ``ValueError`` at engine start.

Supported (everything else is refused at engine start with a message, never a fallback):
decoder self-attention of a non-MLA model, head_dim in ``SUPPORTED_HEAD_DIMS`` (64, 128), model dtype
bf16/fp16, ``kv_cache_dtype="auto"`` (the compression *is* the KV dtype), block_size in
``SUPPORTED_BLOCK_SIZES`` (16, 32, 64), no sliding window, no ALiBi, no logits soft-cap, no attention
sinks, no KV sharing between layers.
"""
from __future__ import annotations

import os

import torch

from kvrepro.formats import COMPRESSED_PRESETS, DEFAULT_PRESET, get_format
from kvrepro.formats.hadamard import SUPPORTED_HEAD_DIMS
from kvrepro.formats.layout import SUPPORTED_BLOCK_SIZES, PageLayout

PRESET_ENV = "KVREPRO_PRESET"
NUM_SPLITS_ENV = "KVREPRO_NUM_SPLITS"
PREFILL_ENV = "KVREPRO_PREFILL"
PREFILL_PATHS = ("fa", "fa-sliced", "dequant", "triton")
BACKEND_NAME = "CUSTOM"  # vLLM's enum slot for out-of-tree backends (--attention-backend CUSTOM)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
SUPPORTED_KV_CACHE_DTYPES = ("auto", "bfloat16", "float16")


def resolve_preset(value: str | None = None) -> str:
    """The compressed preset to use: ``value``, else ``$KVREPRO_PRESET``, else ``k4v4``.

    Raises:
        ValueError: not one of ``COMPRESSED_PRESETS`` (message names KVREPRO_PRESET and the allowed values).
    """
    if value is None:
        value = os.environ.get(PRESET_ENV, "") or DEFAULT_PRESET
    if not isinstance(value, str):
        raise ValueError(f"{PRESET_ENV} must be a preset name (str), got {value!r}; allowed: "
                         f"{', '.join(COMPRESSED_PRESETS)}")
    value = value.strip().lower()
    if value not in COMPRESSED_PRESETS:
        raise ValueError(
            f"{PRESET_ENV}={value!r} is not a kvrepro compressed preset; allowed: {', '.join(COMPRESSED_PRESETS)}"
        )
    return value


def _as_int(value) -> int | None:
    """An int from an int (not a bool) or a string of ASCII digits (surrounding spaces ignored); else None."""
    if isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return None


def resolve_num_splits(value: str | int | None = None) -> int | None:
    """Split-K count of the decode kernel: ``value``, else ``$KVREPRO_NUM_SPLITS``, else None (the
    kernel's ``default_num_splits``, which depends on shapes only, so CUDA graphs see fixed grids).
    Raises ValueError unless a positive int <= 256."""
    if value is None:
        value = os.environ.get(NUM_SPLITS_ENV, "")
        if not value:
            return None
    n = _as_int(value)
    if n is None or not 1 <= n <= 256:
        raise ValueError(f"{NUM_SPLITS_ENV} must be an integer in 1..256, got {value!r}")
    return n


RECENT_WINDOW_ENV = "KVREPRO_RECENT_WINDOW"


def resolve_recent_window(value: str | int | None = None) -> int:
    """Recent-token window (``kvrepro.vllm_backend.window``; opt-in, an experiment): decode steps read each request's
    last W tokens' K/V exact from a side cache instead of their compressed pages. ``0`` / ``off`` (default) or W in
    1..256, from ``value`` or ``$KVREPRO_RECENT_WINDOW`` (an empty variable counts as unset). Its side cache holds the
    next power of two >= ``16 x W x max_num_seqs`` (at least 4,096; at most 2**20) tokens of unquantized K/V per layer
    plus 24 bytes each, allocated before vLLM sizes its KV cache (so vLLM's KV-cache size in tokens shrinks by that
    much). Raises ValueError naming KVREPRO_RECENT_WINDOW and the allowed values."""
    if value is None:
        value = os.environ.get(RECENT_WINDOW_ENV, "").strip() or "0"
    if isinstance(value, str) and value.strip().lower() == "off":
        return 0
    n = _as_int(value)
    if n is None or not 0 <= n <= 256:
        raise ValueError(f"{RECENT_WINDOW_ENV} must be off, 0 or an integer in 1..256, got {value!r}")
    return n


STORE_ROTATE_ENV = "KVREPRO_STORE_ROTATE"
STORE_ROTATE_MODES = ("torch", "kernel")


def resolve_store_rotate(value: str | None = None) -> str:
    """Where ``store_kv`` rotates new K/V: ``torch`` (default: ``x.float() @ R`` in PyTorch, then the
    quantize kernel) or ``kernel`` (inside the Triton store kernel). From ``value`` or
    ``$KVREPRO_STORE_ROTATE``.

    Why ``torch``: the in-kernel rotation keeps a float32 [D, D] operand that spills to a 6,792-byte
    stack per thread (cuobjdump, sm_90, k4v4). The CUDA driver sizes a context's local memory for
    every resident thread of the GPU (6,792 B x 2,048 threads x 132 SMs = 1.7 GiB on the H200) at the
    first launch and keeps it; in vLLM that first launch falls inside its CUDA-graph memory profiling,
    so it was counted twice (as non-torch memory and in the graph estimate): the 2.8 GiB less KV
    cache than bf16 of the 2026-11-29 sweep (notes/vllm.md). Case and surrounding spaces are ignored, as for the
    other settings. Raises ValueError naming the variable and the allowed values."""
    return _choice(STORE_ROTATE_ENV, value, "torch", STORE_ROTATE_MODES)


WARMUP_ENV = "KVREPRO_WARMUP"


def _switch(env: str, value: str | None, default: str) -> bool:
    """A 0/1 switch: ``value``, else ``$env``, else ``default``; surrounding spaces ignored. Raises ValueError naming
    ``env``."""
    if value is None:
        value = os.environ.get(env, "") or default
    value = value.strip() if isinstance(value, str) else value
    if value not in ("0", "1"):
        raise ValueError(f"{env}={value!r}; allowed: 0, 1")
    return value == "1"


def resolve_warmup(value: str | None = None) -> bool:
    """Whether the impl compiles its decode-kernel variants before vLLM's memory profiling:
    ``value``, else ``$KVREPRO_WARMUP``, else on. Raises ValueError unless ``0`` or ``1``."""
    return _switch(WARMUP_ENV, value, "1")


DEBUG_CHECK_ENV = "KVREPRO_DEBUG_CHECK"


def resolve_debug_check(value: str | None = None) -> bool:
    """Debug only (slow, host syncs): compare every eagerly run attention call with the reference.
    ``value``, else ``$KVREPRO_DEBUG_CHECK``, else off. Raises ValueError unless ``0`` or ``1``."""
    return _switch(DEBUG_CHECK_ENV, value, "0")


def _choice(env: str, value: str | None, default: str, allowed: tuple[str, ...]) -> str:
    """``value``, else ``$env``, else ``default``; case and surrounding spaces ignored. Raises ValueError naming
    ``env`` and the allowed values."""
    if value is None:
        value = os.environ.get(env, "") or default
    value = value.strip().lower() if isinstance(value, str) else value
    if value not in allowed:
        raise ValueError(f"{env}={value!r}; allowed: {', '.join(allowed)}")
    return value


DECODE_IMPL_ENV = "KVREPRO_DECODE_IMPL"
DECODE_IMPL_CHOICES = ("auto", "cuda", "triton")


def resolve_decode_impl(value: str | None = None) -> str | None:
    """Decode kernel: ``cuda`` (kvrepro's CUDA kernels: k4v4, k8v4 or k4v2, head_dim 128, block 16, GQA group <= 8,
    compute capability >= 8.0; anything else is refused at engine start), ``triton`` (every preset and shape) or ``auto``
    (default: ``kvrepro.ops.decode.resolve_impl``, i.e. ``cuda`` where it applies, else ``triton``). From
    ``value`` or ``$KVREPRO_DECODE_IMPL`` (case and surrounding spaces ignored). Returns None for ``auto``.
    Raises ValueError naming KVREPRO_DECODE_IMPL and the allowed values."""
    value = _choice(DECODE_IMPL_ENV, value, "auto", DECODE_IMPL_CHOICES)
    return None if value == "auto" else value


KEY_CENTER_ENV = "KVREPRO_KEY_CENTER"
KEY_CENTER_CHOICES = ("first-prefill", "off")


def resolve_key_center(value: str | None = None) -> bool:
    """Key centering (``kvrepro.formats.centering``): ``off`` (default) or ``first-prefill`` (opt-in, an experiment:
    the pages hold each key minus the mean key, per layer and KV head, of the engine's first prefill; attention is
    unchanged by softmax's shift invariance). Off by default because through vLLM on the H200 it made long-context
    retrieval worse (SmolLM2, 8,184 tokens: 20 of 28 single-needle prompts lost key log-prob against uncentered k4v4;
    notes/accuracy.md). From ``value`` or ``$KVREPRO_KEY_CENTER`` (case and surrounding spaces ignored; an empty
    variable counts as unset, as for every KVREPRO_ variable). Whether it came on is in each result row's
    ``kvrepro_settings.key_center_state`` (``measure.key_center_summary``).
    Raises ValueError naming KVREPRO_KEY_CENTER and the allowed values."""
    return _choice(KEY_CENTER_ENV, value, "off", KEY_CENTER_CHOICES) == "first-prefill"


def resolve_prefill(value: str | None = None) -> str:
    """Prefill path: ``fa`` (dequantize the context, then vLLM's FlashAttention; default, measured),
    ``fa-sliced`` (the same slice by slice with a log-sum-exp merge: bounded temporaries; not yet run on a
    GPU), ``dequant`` (``fa_prefill.RotatedDequantPrefill``: context dequantized in the rotated space by
    a Triton kernel, one FlashAttention call; in the H200 GPU smoke of 2026-11-30, one layer with vLLM's
    FA3, 16K chunk after 112K of context: 51.6 ms vs ``fa`` 56.3 ms, relerr 5.7e-3; the kvrepro rows of every
    capacity sweep since 2026-11-30 04:49 UTC used it, set by ``scripts/h200_sweep.sh``'s ``PREFILL_AUTO=1`` after its
    smoke check) or ``triton`` (kvrepro's direct-read prefill kernel: correct at 120K context since the run-7
    fix, but 3.0x bf16 at 128K: notes/kernels.md). From ``value`` or ``$KVREPRO_PREFILL`` (case and surrounding
    spaces ignored, as for the preset).
    Raises ValueError naming KVREPRO_PREFILL and the allowed values."""
    return _choice(PREFILL_ENV, value, "fa", PREFILL_PATHS)


def page_layout(preset: str, head_dim: int, block_size: int) -> PageLayout:
    """Page layout of ``preset`` (one block x one KV head). Raises ValueError on unsupported sizes."""
    return get_format(resolve_preset(preset)).layout(head_dim, block_size)


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
    """Shape of one layer's pool as vLLM must allocate it: uint8 ``(num_blocks, num_kv_heads, page_bytes)``."""
    return (num_blocks, num_kv_heads, page_layout(resolve_preset(preset), head_size, block_size).page_bytes)


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
