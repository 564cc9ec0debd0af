"""What the kvrepro vLLM backend supports, and the settings of an engine (pure Python: no vLLM needed).

Settings: every ``KVREPRO_*`` variable is declared in ``kvrepro.settings`` (``KVREPRO_PRESET`` picks the
compressed preset, default ``k4v4``; ``python -m kvrepro.settings`` lists them all). vLLM loads the plugin in
every process it starts and child processes inherit the environment, so setting them before
``LLM(...)``/``vllm serve`` applies them everywhere. They are resolved once per engine
(:func:`settings_for_engine`), logged at engine start and used by every layer; a bad value is a ``ValueError``
at engine start.

Supported (everything else is refused at engine start with a message, never a fallback):
decoder self-attention of a non-MLA model, head_dim in ``SUPPORTED_HEAD_DIMS`` (64, 128), GQA groups of
1..``MAX_GQA_GROUP`` (32) query heads per KV head, model dtype bf16/fp16, ``kv_cache_dtype="auto"`` (the
compression *is* the KV dtype), block_size in ``SUPPORTED_BLOCK_SIZES`` (16, 32, 64), no sliding window, no
ALiBi, no logits soft-cap, no attention sinks, no KV sharing between layers, an NVIDIA GPU of compute
capability >= 8.0. Which decode kernel serves a supported shape (the CUDA kernel where it applies, Triton
otherwise) is :func:`serving_plan`'s answer; :func:`engine_summary` is the line logged at engine start.
"""
from __future__ import annotations

import logging
import os

import torch

import dataclasses

from kvrepro.formats import get_format
from kvrepro.formats.hadamard import SUPPORTED_HEAD_DIMS
from kvrepro.formats.layout import SUPPORTED_BLOCK_SIZES, PageLayout
from kvrepro.settings import SETTINGS, Settings, parse, unknown_variables

PRESET_ENV = "KVREPRO_PRESET"
BACKEND_NAME = "CUSTOM"  # vLLM's enum slot for out-of-tree backends (--attention-backend CUSTOM)
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16)
SUPPORTED_KV_CACHE_DTYPES = ("auto", "bfloat16", "float16")
# The kernels need sm_80+: bf16 tensor-core MMA (Triton's tl.dot on bfloat16), cp.async and mma.m16n8k32.s8 (CUDA).
MIN_CAPABILITY = (8, 0)
# Query heads per KV head the Triton kernels are built for: kvrepro.ops.common.MAX_GROUP (a test holds them equal),
# repeated here so that importing the plugin's config does not import the kernels.
MAX_GQA_GROUP = 32
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
    geometry = engine_geometry(vllm_config)
    if geometry is not None:
        log.info("%s", engine_summary(s, **geometry))
    return s


def engine_geometry(vllm_config) -> dict | None:
    """``{head_dim, num_q_heads, num_kv_heads, block_size, device}`` of the engine's model, per tensor-parallel rank,
    from vLLM's ``VllmConfig`` (``model_config`` / ``parallel_config`` / ``cache_config``; the device: the current
    CUDA device, else CPU). None where the config lacks a model (unit tests' stand-ins) or where CUDA exists but this
    process has not initialized it (not a worker: touching CUDA there would break the engine processes vLLM starts
    later)."""
    mc = getattr(vllm_config, "model_config", None)
    if mc is None or not hasattr(mc, "get_head_size"):
        return None
    if torch.cuda.is_available() and not torch.cuda.is_initialized():
        return None
    pc = getattr(vllm_config, "parallel_config", None)
    block = getattr(getattr(vllm_config, "cache_config", None), "block_size", None) or 16
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return {"head_dim": int(mc.get_head_size()), "num_q_heads": int(mc.get_num_attention_heads(pc)),
            "num_kv_heads": int(mc.get_num_kv_heads(pc)), "block_size": int(block), "device": device}


def _capability(value) -> tuple[int, int] | None:
    """``(major, minor)`` of vLLM's ``DeviceCapability`` (``.major`` / ``.minor``), a pair, or its ``to_int()`` form
    (``80``); None stays None. Raises ValueError for anything else."""
    if value is None:
        return None
    if hasattr(value, "major") and hasattr(value, "minor"):
        return int(value.major), int(value.minor)
    if isinstance(value, (tuple, list)) and len(value) == 2:
        return int(value[0]), int(value[1])
    if isinstance(value, int) and not isinstance(value, bool) and value >= 10:
        return value // 10, value % 10
    raise ValueError(f"device_capability must be (major, minor), a DeviceCapability or an int such as 80, got {value!r}")


def capability_reason(capability) -> str | None:
    """Why the backend refuses a GPU of compute capability ``capability`` (None = it serves it: >= 8.0)."""
    cap = _capability(capability)
    if cap is not None and cap < MIN_CAPABILITY:
        return (f"kvrepro: compute capability {cap[0]}.{cap[1]} not supported (needs >= {MIN_CAPABILITY[0]}."
                f"{MIN_CAPABILITY[1]}, e.g. A100, A10, L4 / L40S, RTX 30 / 40 / 50, H100 / H200, B200: the kernels use "
                f"bfloat16 tensor cores and cp.async)")
    return None


def group_reason(num_heads: int, num_kv_heads: int) -> str | None:
    """Why the backend refuses ``num_heads`` query heads over ``num_kv_heads`` KV heads (None = it serves them: a
    GQA group of 1..``MAX_GQA_GROUP``)."""
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        return f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}"
    group = num_heads // num_kv_heads
    if not 1 <= group <= MAX_GQA_GROUP:
        return (f"GQA group size {group} (num_heads={num_heads} / num_kv_heads={num_kv_heads}) not supported "
                f"(supported: 1..{MAX_GQA_GROUP} query heads per KV head with the Triton kernels; the CUDA decode "
                f"kernel takes 1..8 at head_dim 128)")
    return None


def head_dim_reason(head_dim: int) -> str | None:
    """Why the backend refuses ``head_dim`` (None = it serves it)."""
    if head_dim not in SUPPORTED_HEAD_DIMS:
        return (f"head_dim={head_dim} not supported (supported: {', '.join(map(str, SUPPORTED_HEAD_DIMS))}: the "
                f"Hadamard rotation and the Triton kernels; the CUDA decode kernel: 128)")
    return None


@dataclasses.dataclass(frozen=True)
class ServingPlan:
    """What the backend does with one attention geometry on one GPU (:func:`serving_plan`).

    Attributes:
        decode: ``"cuda"`` or ``"triton"``: the decode kernel that serves it; None when refused.
        why: why that kernel (the rule and, for Triton under ``auto``, why not the CUDA kernel).
        refusals: why the engine refuses to start (empty when it serves).
    """

    decode: str | None
    why: str
    refusals: tuple[str, ...]


def serving_plan(*, head_dim: int, num_q_heads: int, num_kv_heads: int, capability, preset: str = "k4v4",
                 decode_impl: str = "auto", block_size: int = 16, sliding_window=None, mla: bool = False) -> ServingPlan:
    """Whether the backend serves an attention geometry on a GPU of compute capability ``capability``
    (``(major, minor)``), and with which decode kernel, without a GPU: the engine-start refusals (head_dim, GQA group,
    block size, sliding window, MLA, compute capability < 8.0, ``decode_impl="cuda"`` where the CUDA kernel does not
    apply) and the decode rule of ``kvrepro.ops.decode.resolve_impl`` (``auto``: the CUDA kernel for every preset
    at head_dim 128, block 16, GQA group <= 8, where the fatbin holds code for the GPU; Triton otherwise). On a GPU
    ``resolve_impl`` also tries to load the fatbin (a driver older than its CUDA release: Triton with a warning).

    Raises:
        ValueError: a bad ``preset`` / ``decode_impl`` value (names the setting and the allowed values).
    """
    from kvrepro.ops import cuda_decode

    preset = parse("preset", preset)
    decode_impl = parse("decode_impl", decode_impl)
    cap = _capability(capability)
    refusals = [r for r in (head_dim_reason(head_dim), group_reason(num_q_heads, num_kv_heads)) if r]
    if block_size not in SUPPORTED_BLOCK_SIZES:
        refusals.append(f"block_size={block_size} not supported (supported: {SUPPORTED_BLOCK_SIZES})")
    if sliding_window is not None:
        refusals.append(f"sliding window ({sliding_window}) not supported (full attention only)")
    if mla:
        refusals.append("MLA not supported (decoder attention with per-head K and V only)")
    refusals += [r for r in (capability_reason(cap),) if r]
    if refusals:
        return ServingPlan(None, "", tuple(refusals))
    group = num_q_heads // num_kv_heads
    why_not = (cuda_decode.shape_reason(page_layout(preset, head_dim, block_size), group)
               or cuda_decode.fatbin_gap(cap))
    if decode_impl == "triton":
        return ServingPlan("triton", "KVREPRO_DECODE_IMPL=triton", ())
    code = cuda_decode.fatbin_code_for(cap)
    how = f"SASS {code}" if code and code.startswith("sm_") else f"PTX {code}, compiled by the driver at load"
    if decode_impl == "cuda":
        if why_not:
            return ServingPlan(None, "", (f"KVREPRO_DECODE_IMPL=cuda: {why_not}; set KVREPRO_DECODE_IMPL=triton "
                                          f"or auto",))
        return ServingPlan("cuda", f"KVREPRO_DECODE_IMPL=cuda, {how}", ())
    if why_not:
        return ServingPlan("triton", f"auto: {why_not}", ())
    return ServingPlan("cuda", f"auto: the CUDA kernel applies, {how}", ())


def split_rule_text(settings: Settings, decode: str) -> str:
    """How the decode launch picks its split-K count, in words (for the engine-start line)."""
    from kvrepro.ops.decode import CUDA_MIN_SPLITS, CUDA_PROGRAMS_PER_SM, MAX_WAVES, PROGRAMS_PER_SM, WAVE_FILL

    if settings.num_splits is not None:
        return f"fixed: KVREPRO_NUM_SPLITS={settings.num_splits}"
    if decode == "cuda":
        return (f"whole waves: w x resident CTAs per SM x SMs // (batch x KV heads) for the fewest w in 1..{MAX_WAVES} "
                f"that fills >= {WAVE_FILL:.0%} of the launched waves' slots (CUDA graphs serving a range of "
                f"batches: <= {CUDA_PROGRAMS_PER_SM} CTAs per SM, a power of two, >= {CUDA_MIN_SPLITS} splits)")
    return f"~{PROGRAMS_PER_SM} programs per SM, a power of two (Triton)"


def engine_summary(settings: Settings, *, head_dim: int, num_q_heads: int, num_kv_heads: int, block_size: int,
                   device) -> str:
    """The engine-start line: preset, the decode kernel and why, the split rule, the resident CTAs per SM it plans
    with (and where that number comes from) and the prefill path, e.g. ``kvrepro engine: preset=k4v4 decode=cuda
    (auto: the CUDA kernel applies, SASS sm_90) split_rule=whole waves: ... resident_ctas_per_sm=4 (driver occupancy
    query; 132 SMs) prefill=fa``. A geometry the engine refuses says ``decode=refused (<reasons>)``. On a CUDA device
    the fatbin is loaded (as the decode rule does) to ask the driver."""
    from kvrepro.ops import cuda_decode
    from kvrepro.ops.common import sm_count

    device = torch.device(device)
    cap = tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None
    plan = serving_plan(head_dim=head_dim, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, capability=cap,
                        preset=settings.preset, decode_impl=settings.decode_impl, block_size=block_size) \
        if cap is not None else None
    if plan is None:                                   # no GPU: what the Triton kernel does here
        refusals = [r for r in (head_dim_reason(head_dim), group_reason(num_q_heads, num_kv_heads)) if r]
        plan = ServingPlan(None, "", tuple(refusals)) if refusals else \
            ServingPlan("triton", f"no CUDA device ({device}): the Triton kernel", ())
    if plan.decode == "cuda" and settings.decode_impl == "auto":
        why = cuda_decode.load_error(device)
        if why is not None:
            plan = ServingPlan("triton", f"auto: the CUDA kernel applies but {why}", ())
    head = f"kvrepro engine: preset={settings.preset}"
    if plan.decode is None:
        return f"{head} decode=refused ({'; '.join(plan.refusals)}) prefill={settings.prefill}"
    if plan.decode == "cuda":
        bits = get_format(settings.preset).layout(head_dim, block_size)
        n, source = cuda_decode.resident_ctas(device, (bits.key_bits, bits.value_bits))
        ctas = f"{n} ({source}; {sm_count(device)} SMs)"
    else:
        ctas = "n/a (the Triton kernel's split rule counts programs, not resident CTAs)"
    return (f"{head} decode={plan.decode} ({plan.why}) split_rule={split_rule_text(settings, plan.decode)} "
            f"resident_ctas_per_sm={ctas} prefill={settings.prefill}")


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
                        use_batch_invariant: bool = False, device_capability=None, **_ignored) -> list[str]:
    """Why this backend cannot serve the configuration (empty list = supported).

    The keywords are those of vLLM 0.20.2's ``AttentionSelectorConfig`` and ``validate_configuration``'s
    ``device_capability`` (a ``DeviceCapability``, ``(major, minor)`` or None: not checked); vLLM raises
    ``ValueError("Selected backend CUSTOM is not valid ... Reason: [...]")`` with this list.
    """
    r = []
    reason = head_dim_reason(head_size)
    if reason:
        r.append(f"kvrepro: {reason}")
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
    reason = capability_reason(device_capability)
    if reason:
        r.append(reason)
    return r


def check_layer(*, num_heads: int, num_kv_heads: int, head_size: int, sliding_window=None,
                alibi_slopes=None, logits_soft_cap=None, kv_sharing_target_layer_name=None,
                attn_type: str = "decoder", kv_cache_dtype: str = "auto") -> None:
    """Refuse an attention layer the backend cannot serve (called when vLLM builds the model).

    Raises:
        ValueError: naming the unsupported feature (sliding window, ALiBi, soft-cap, KV sharing,
            encoder/cross attention, a quantized kv_cache_dtype, a head_dim or GQA group the kernels do not serve,
            with what they serve).
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
    problems += [r for r in (head_dim_reason(head_size), group_reason(num_heads, num_kv_heads)) if r]
    if problems:
        raise ValueError("kvrepro attention backend (CUSTOM) refuses this layer: " + "; ".join(problems))
