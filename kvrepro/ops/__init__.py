"""Kernels that read and write kvrepro's compressed KV pages directly: Triton (store, prefill, decode for every
preset) and a CUDA decode kernel for every preset (``kvrepro.ops.cuda_decode``, chosen by
``decode_attention``'s ``impl``).

| function | what |
| --- | --- |
| ``store_kv(key, value, pool, slot_mapping, layout, rotation)`` | rotate + quantize + pack new K/V into slots |
| ``decode_attention(query, pool, block_tables, seq_lens, layout, rotation, scale, ...)`` | split-K decode (CUDA or Triton) |
| ``prefill_attention(query, key, value, pool, block_tables, seq_lens, query_start_loc, layout, rotation, scale, ...)`` | chunked prefill |

Order per layer and step: ``store_kv`` for the step's new tokens, then attention (decode reads
the current token from the pages; prefill reads the chunk's own K/V fresh). Page format:
``kvrepro.formats.layout``; numerics: ``kvrepro.formats.compressed``. On CPU the kernels run
under ``TRITON_INTERPRET=1`` (set it before importing triton).

Layout: host wrappers here (``store``, ``prefill``, ``decode``, checks in ``common``); ``@triton.jit`` code in
``kvrepro.ops.triton``; the CUDA kernel's source, fatbin and manifest in ``cuda/``, built by ``kvrepro.ops.cuda_build``
and loaded and launched by ``kvrepro.ops.cuda_decode``.
"""
from kvrepro.ops.decode import decode_attention, decode_workspace_numel, default_num_splits
from kvrepro.ops.prefill import (dequantize_context, flash_dense_attn, prefill_attention,
                                 prefill_workspace_bytes, vllm_dense_attn)
from kvrepro.ops.store import store_kv

__all__ = ["store_kv", "decode_attention", "prefill_attention", "decode_workspace_numel",
           "default_num_splits", "prefill_workspace_bytes", "dequantize_context", "flash_dense_attn",
           "vllm_dense_attn"]
