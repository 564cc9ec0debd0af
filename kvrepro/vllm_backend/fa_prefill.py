"""Prefill path "dequantize the context, then FlashAttention" (``KVREPRO_PREFILL=fa``, the default on GPU).

Why: kvrepro's own Triton prefill kernel (``kvrepro.ops.prefill_attention``) reads the compressed
context directly, but on the H200 a 128K prompt in 8K chunks costs ~0.96 s of attention per layer
(benchmarks/results/h200_run1, 2.2x FlashAttention's full causal 128K), i.e. ~35 s per user for
Qwen3-4B's 36 layers. Here each prefill chunk instead dequantizes its earlier context from the pages
into bf16 (in slices of ``SLICE_TOKENS``, PyTorch, ``kvrepro.formats.compressed`` numerics), rotates it
back (``x = x_rot @ R.T``), appends the chunk's own fresh K/V and runs vLLM's FlashAttention varlen
kernel (causal, bottom-right aligned, GQA). Same function as the Triton path (context from the
dequantized pages, chunk fresh); decode always uses kvrepro's direct-read kernel.

Memory outside vLLM's KV budget: per prefill sequence the dequantized context in bf16,
``2 x ctx x num_kv_heads x head_dim x 2`` bytes (0.5 GiB at 128K for Qwen3-4B), plus float32 slice
temporaries (~0.1 GiB); freed after the call.
"""
from __future__ import annotations

import torch

SLICE_TOKENS = 16384


def dequant_context(pool_obj, block_row: torch.Tensor, ctx: int, rotation: torch.Tensor,
                    dtype: torch.dtype, out_k: torch.Tensor, out_v: torch.Tensor) -> None:
    """Write the first ``ctx`` tokens' K/V, unrotated, ``dtype``, into ``out_k/out_v [ctx, H, D]``.

    ``pool_obj``: a ``CompressedPool`` whose ``data`` is the layer's pages; ``block_row``: the
    sequence's block-table row; ``rotation``: float32 ``[D, D]``.
    """
    bs = pool_obj.block_size
    rt = rotation.T
    for s in range(0, ctx, SLICE_TOKENS):
        n = min(SLICE_TOKENS, ctx - s)
        first = s // bs  # SLICE_TOKENS is a multiple of every supported block size
        k_rot, v_rot = pool_obj.gather_rotated(block_row[first:], n)
        out_k[s:s + n] = (k_rot @ rt).to(dtype)
        out_v[s:s + n] = (v_rot @ rt).to(dtype)


class FlashPrefill:
    """Callable with the signature of ``kvrepro.ops.prefill_attention`` (the kwargs it needs)."""

    def __init__(self, fmt, num_kv_heads: int, head_size: int, fa=None):
        """``fa``: a ``flash_attn_varlen_func`` stand-in (tests); default vLLM's FlashAttention."""
        if fa is None:
            from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func, get_flash_attn_version

            fa, self.fa_version = flash_attn_varlen_func, get_flash_attn_version(head_size=head_size)
        else:
            self.fa_version = None
        self.fa = fa
        self.fmt, self.num_kv_heads, self.head_size = fmt, num_kv_heads, head_size
        self._pool = None

    def _pool_obj(self, pool: torch.Tensor, layout):
        if self._pool is None or self._pool.block_size != layout.block_size:
            self._pool = self.fmt.new_pool(1, self.num_kv_heads, self.head_size, layout.block_size,
                                           device=pool.device)
        self._pool.data = pool
        return self._pool

    def __call__(self, query, key, value, pool, block_tables, seq_lens, query_start_loc, layout, rotation,
                 scale, out=None, max_query_len=None):
        if out is None:
            out = torch.empty_like(query)
        qsl = query_start_loc.tolist()
        lens = seq_lens.tolist()
        pool_obj = self._pool_obj(pool, layout)
        dev = query.device
        for b, s in enumerate(lens):
            qs, qe = qsl[b], qsl[b + 1]
            ql = qe - qs
            if ql <= 0 or s == 0:
                continue
            ctx = s - ql
            if ctx:
                k = torch.empty(s, self.num_kv_heads, self.head_size, dtype=key.dtype, device=dev)
                v = torch.empty_like(k)
                dequant_context(pool_obj, block_tables[b], ctx, rotation, key.dtype, k, v)
                k[ctx:] = key[qs:qe]
                v[ctx:] = value[qs:qe]
            else:
                k, v = key[qs:qe], value[qs:qe]
            cu_q = torch.tensor([0, ql], dtype=torch.int32, device=dev)
            cu_k = torch.tensor([0, s], dtype=torch.int32, device=dev)
            kw = dict(q=query[qs:qe], k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=ql,
                      max_seqlen_k=s, softmax_scale=scale, causal=True)
            if self.fa_version is not None:
                kw["fa_version"] = self.fa_version
            out[qs:qe] = self.fa(**kw)
        return out
