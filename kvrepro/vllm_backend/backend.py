"""kvrepro's compressed KV cache as a vLLM 0.20.2 attention backend (registered as ``CUSTOM``).

Four pieces, as in vLLM's ``triton_attn.py``: a metadata dataclass, its builder, the backend class
(static declarations of what it supports) and the impl. The kernels live in ``kvrepro.ops``.

Per layer the KV cache is uint8 ``[num_blocks, num_kv_heads, page_bytes]`` (``kvrepro.formats.layout``;
vLLM sizes it through ``kvrepro.vllm_backend.spec_patch``). A step of the model runner does::

    do_kv_cache_update: kvrepro.ops.store_kv(K, V, pool, slot_mapping)     every new token, compressed
    forward, batch reordered by vLLM as [decodes | prefills] (reorder_batch_threshold = 1):
      decodes  (query_len 1):  decode_attention(q, pool, block_table, seq_lens)   all keys from pages
      prefills (query_len >1): prefill_attention(q, k, v, pool, ...)   chunk's own K/V fresh (bf16),
                               earlier context (chunked prefill, prefix-cache hits) from pages

Lengths per sequence (vLLM's convention)::

    |<------------------- seq_len ------------------->|
    |<---- context (in pages) ---->|<-- query_len -->|   query_len = qsl[i+1] - qsl[i]

CUDA graphs: pure-decode batches are captured as full graphs (``UNIFORM_SINGLE_TOKEN_DECODE``):
the decode path has no host sync, a split count fixed per graph batch (``runtime.decode_splits``, or
``KVREPRO_NUM_SPLITS``) and one split-K workspace shared by all layers, reserved at load time (no
allocation inside a captured forward); padded rows have seq_len 0 and slot -1. Every kernel
variant is compiled before vLLM's memory profiling (``KVREPRO_WARMUP``), and no kernel of the path
has a register-spill stack (``KVREPRO_STORE_ROTATE``). Mixed and prefill batches run piecewise (attention
outside the graph). Prefix caching works like chunked prefill (cached blocks are read as context).

Settings (``kvrepro.settings``): resolved once per engine by :func:`engine_settings` (the first layer built
resolves and logs them, every layer uses that one object).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills

from kvrepro.formats.layout import SUPPORTED_BLOCK_SIZES
from kvrepro.vllm_backend import config as cfg
from kvrepro.vllm_backend.runtime import LayerRuntime, record_check


class KVReproAttentionBackend(AttentionBackend):
    """Declarations of what kvrepro's compressed-KV backend supports (see ``config``)."""

    kvrepro_compressed = True  # read by spec_patch.is_kvrepro_layer
    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = list(cfg.SUPPORTED_DTYPES)
    supported_kv_cache_dtypes: ClassVar[list] = list(cfg.SUPPORTED_KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return cfg.BACKEND_NAME

    @staticmethod
    def get_supported_kernel_block_sizes() -> list:
        return list(SUPPORTED_BLOCK_SIZES)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(cfg.SUPPORTED_HEAD_DIMS)

    @staticmethod
    def get_impl_cls() -> type["KVReproAttentionImpl"]:
        return KVReproAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["KVReproMetadataBuilder"]:
        return KVReproMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        return cfg.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, engine_settings().preset)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        if include_num_layers_dimension:
            raise NotImplementedError("kvrepro pools are per layer")
        return (0, 1, 2)

    @classmethod
    def validate_configuration(cls, **kwargs) -> list[str]:
        reasons = super().validate_configuration(**kwargs)
        # Our own messages first: they name kvrepro and what it supports.
        return cfg.unsupported_reasons(**kwargs) + [r for r in reasons if "not supported" not in r]

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER


@dataclass
class KVReproMetadata(AttentionMetadata):
    """Per-step metadata (shared by all layers). Tensors are on the GPU, int32.

    Attributes:
        seq_lens: ``[num_reqs]`` tokens in the cache per request, this step's included (0 = padding).
        block_table: ``[num_reqs, max_blocks]`` block ids.
        query_start_loc: ``[num_reqs + 1]`` cumulative query lengths.
        slot_mapping: ``[num_tokens]`` slot of each new token (-1 = padding).
        num_actual_tokens, max_query_len: host ints.
        num_decodes, num_decode_tokens: the first ``num_decodes`` requests are decodes (query_len 1).
        positions: int64 ``[>= num_actual_tokens]`` each token row's position, vLLM's own (the model runner's
            persistent buffer, the one its rotary embedding reads, so CUDA graphs replay it), or None where the runner
            passes none; the key offset ``rope-mean`` stores by it.
    """

    seq_lens: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    slot_mapping: torch.Tensor
    num_actual_tokens: int
    max_query_len: int
    num_decodes: int
    num_decode_tokens: int
    positions: torch.Tensor | None = None


class KVReproMetadataBuilder(AttentionMetadataBuilder[KVReproMetadata]):
    """Builds :class:`KVReproMetadata`; decodes are reordered to the front of the batch."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=False)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KVReproMetadata:
        cam = common_attn_metadata
        num_decodes, _, num_decode_tokens, _ = split_decodes_and_prefills(cam, decode_threshold=1)
        return KVReproMetadata(
            seq_lens=cam.seq_lens, block_table=cam.block_table_tensor,
            query_start_loc=cam.query_start_loc, slot_mapping=cam.slot_mapping,
            num_actual_tokens=cam.num_actual_tokens, max_query_len=cam.max_query_len,
            num_decodes=num_decodes, num_decode_tokens=num_decode_tokens,
            positions=getattr(cam, "positions", None),
        )


_WARMED: dict[tuple, list[int]] = {}


def engine_settings():
    """The ``kvrepro.settings.Settings`` of the engine being built (``config.settings_for_engine`` of vLLM's
    current config: resolved and logged once per engine; outside an engine, see there)."""
    from vllm.config import get_current_vllm_config_or_none

    return cfg.settings_for_engine(get_current_vllm_config_or_none())


def engine_shape() -> dict:
    """What the impl needs from vLLM's current config: CUDA-graph capture sizes, the largest decode
    batch (``max_num_seqs``: a request has at most one decode token per step), block size and
    max_model_len. Called while vLLM builds the model (inside ``set_current_vllm_config``); outside
    an engine (unit tests) there is no config: no graph sizes, no reservation, no warm-up."""
    from vllm.config import get_current_vllm_config_or_none

    c = get_current_vllm_config_or_none()
    if c is None:
        return {"graph_sizes": (), "max_batch": None, "block_size": 0, "max_model_len": 0}
    sizes = tuple(c.compilation_config.cudagraph_capture_sizes or ())
    max_seqs = int(getattr(c.scheduler_config, "max_num_seqs", 0) or 0)
    max_batch = max_seqs or max(sizes, default=0) or None
    return {"graph_sizes": sizes, "max_batch": max_batch,
            "block_size": int(c.cache_config.block_size or 0),
            "max_model_len": int(getattr(c.model_config, "max_model_len", 0) or 0) if c.model_config else 0}


def engine_rope() -> dict:
    """The model's RoPE for the key offset (``kvrepro.formats.offset.rope_of_config`` of vLLM's text config, with the
    engine's ``max_model_len`` as the longest context); ``neox`` is read from vLLM's rotary embeddings at the first
    calibration (:func:`rope_layout`). Outside an engine (unit tests): a ValueError from ``rope_of_config``.

    Raises:
        ValueError: no vLLM config, or no RoPE theta in the model's config (naming KVREPRO_KEY_OFFSET's choices).
    """
    from vllm.config import get_current_vllm_config_or_none

    from kvrepro.formats.offset import rope_of_config

    c = get_current_vllm_config_or_none()
    if c is None or c.model_config is None:
        raise ValueError("KVREPRO_KEY_OFFSET=slow-pairs needs the engine's model config (RoPE theta, max_model_len); "
                         "outside an engine use first-prefill or off")
    mc = c.model_config
    return {**rope_of_config(getattr(mc, "hf_text_config", mc.hf_config), max_positions=int(mc.max_model_len)),
            "neox": None}


def rope_layout(head_size: int) -> bool | None:
    """Whether vLLM built this model's rotary embeddings half-split (True, ``is_neox_style``) or interleaved (False),
    from the embeddings vLLM cached while building the model (``rotary_embedding._ROPE_DICT``); None when none
    match ``head_size`` or they disagree (the key offset then takes only channels slow under both layouts)."""
    from vllm.model_executor.layers.rotary_embedding import _ROPE_DICT

    styles = {bool(r.is_neox_style) for r in _ROPE_DICT.values()
              if getattr(r, "head_size", None) == head_size and hasattr(r, "is_neox_style")}
    return styles.pop() if len(styles) == 1 else None


class KVReproAttentionImpl(AttentionImpl[KVReproMetadata]):
    """Stores K/V compressed and runs attention over compressed pages (``kvrepro.ops``)."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes=None, sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, **kwargs) -> None:
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        cfg.check_layer(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                        sliding_window=sliding_window, alibi_slopes=alibi_slopes,
                        logits_soft_cap=logits_soft_cap,
                        kv_sharing_target_layer_name=kv_sharing_target_layer_name,
                        attn_type=attn_type, kv_cache_dtype=kv_cache_dtype)
        if kwargs.get("sinks") is not None:
            raise ValueError("kvrepro attention backend (CUSTOM) refuses this layer: attention sinks not supported")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        s = engine_settings()
        self.settings = s
        preset = s.preset
        prefill = None
        path = s.prefill
        if path in ("fa", "fa-sliced", "fa-pages"):
            from kvrepro.formats import get_format
            from kvrepro.vllm_backend.fa_prefill import FlashPrefill

            prefill = FlashPrefill(get_format(preset), num_kv_heads, head_size, sliced=path == "fa-sliced",
                                  chunk_from_pages=path == "fa-pages")
        elif path == "dequant":
            from kvrepro.vllm_backend.fa_prefill import RotatedDequantPrefill

            prefill = RotatedDequantPrefill(head_size)
        shape = engine_shape()
        self.rt = LayerRuntime(preset, num_heads, num_kv_heads, head_size, self.scale,
                               s.num_splits, prefill=prefill, graph_sizes=shape["graph_sizes"],
                               max_batch=shape["max_batch"], store_rotate=s.store_rotate,
                               decode_impl=s.decode_impl_arg, key_offset=s.key_offset,
                               rope=engine_rope() if s.key_offset in ("slow-pairs", "rope-mean") else None)
        dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        self.rt.check_decode_impl(shape["block_size"] or 16, dev)
        if prefill is None and s.key_offset == "rope-mean":     # KVREPRO_PREFILL=triton: refused now, not at a prefill
            from kvrepro.formats.offset import MAX_PAIRS
            from kvrepro.ops.prefill import check_rope_prefill
            check_rope_prefill(self.rt.fmt.layout(head_size, shape["block_size"] or 16), dev, MAX_PAIRS)
        self._shape = shape
        self._warmup = s.warmup
        # Debug only (slow, host syncs): compare every eagerly run step with reference_attend.
        self._debug_check = s.debug_check

    def process_weights_after_loading(self, act_dtype: torch.dtype):
        """Before vLLM profiles memory and captures CUDA graphs: reserve the shared decode workspace
        (once per device) and, unless ``KVREPRO_WARMUP=0``, compile/load every decode-kernel variant,
        so that neither happens inside vLLM's CUDA-graph memory profiling (whose per-graph figure it
        multiplies by the number of graphs)."""
        if torch.cuda.is_available():
            dev = torch.device("cuda", torch.cuda.current_device())
            self.rt.prepare(dev)
            if self._warmup and self._shape["block_size"]:
                key = (str(dev), act_dtype, self.rt.fmt.name, self.num_heads, self.num_kv_heads, self.head_size)
                if key not in _WARMED:  # one warm-up per process and geometry, not one per layer
                    _WARMED[key] = self.rt.warmup(dev, act_dtype, self._shape["block_size"],
                                                  self._shape["max_model_len"])

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        self.rt.store(key, value, kv_cache, slot_mapping, calibrate=self._calibration_rows(layer),
                      positions=self._positions(layer, slot_mapping.shape[0], kv_cache.device))

    def _positions(self, layer, num_tokens: int, device: torch.device) -> torch.Tensor | None:
        """Under KVREPRO_KEY_OFFSET=rope-mean: each stored row's position from this step's attention metadata: vLLM's
        positions (``KVReproMetadata.positions``, computed once per step for every layer), or, where the runner passes
        none, ``runtime.token_positions`` of the same metadata (the same values, computed in each layer; no host sync);
        else None. Without metadata (vLLM's profiling run, which stores nothing that is read later) positions 0 on
        ``device`` (the KV cache's: the offset's buffers move there only when the store runs)."""
        from kvrepro.formats.offset import RopeMean

        if not isinstance(self.rt.key_offset, RopeMean):
            return None
        from vllm.model_executor.layers.attention.attention import get_attention_context

        from kvrepro.vllm_backend.runtime import token_positions

        m = get_attention_context(layer.layer_name)[0]
        if not isinstance(m, KVReproMetadata):
            return torch.zeros(num_tokens, dtype=torch.int64, device=device)
        if m.positions is not None:
            return m.positions[:num_tokens]
        return token_positions(m.seq_lens, m.query_start_loc, num_tokens)

    def _calibration_rows(self, layer) -> tuple[int, int] | None:
        """The prefill rows of this step, while the key offset waits for its calibration; else None. vLLM's dummy
        runs (memory profiling, CUDA-graph warm-up and capture) never qualify: they have no metadata, or only
        single-token decode rows (this backend's graphs are uniform decode), or run under capture."""
        off = self.rt.key_offset
        if off is None or off.calibrated or torch.cuda.is_current_stream_capturing():
            return None
        from vllm.model_executor.layers.attention.attention import get_attention_context

        m = get_attention_context(layer.layer_name)[0]
        if not isinstance(m, KVReproMetadata) or m.num_decode_tokens >= m.num_actual_tokens:
            return None
        if self.rt.rope is not None and self.rt.rope.get("neox") is None:
            self.rt.rope["neox"] = rope_layout(self.head_size)
        return m.num_decode_tokens, m.num_actual_tokens

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: KVReproMetadata, output: torch.Tensor | None = None,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("kvrepro backend: fused output quantization is not supported")
        if output is None:
            output = torch.empty(query.shape[0], self.num_heads, self.head_size, dtype=query.dtype,
                                 device=query.device)
        if attn_metadata is None:  # vLLM's memory-profiling run: no KV cache yet
            return output.fill_(0)
        m = attn_metadata
        out3 = output.view(-1, self.num_heads, self.head_size)
        self.rt.attend(query, key, value, kv_cache, m.block_table, m.seq_lens, m.query_start_loc,
                       m.num_actual_tokens, m.num_decodes, m.num_decode_tokens, out3,
                       max_query_len=m.max_query_len)
        if self._debug_check and not torch.cuda.is_current_stream_capturing():   # reference_attend offsets the keys
            record_check(self.rt, out3, query, key, value, kv_cache, m.block_table, m.seq_lens,
                         m.query_start_loc, m.num_actual_tokens, m.num_decodes)
        return output
