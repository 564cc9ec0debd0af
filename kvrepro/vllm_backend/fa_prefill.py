"""Prefill path "dequantize the context, then FlashAttention" (``KVREPRO_PREFILL=fa``, the default on GPU).

Why: kvrepro's own Triton prefill kernel (``kvrepro.ops.prefill_attention``) reads the compressed
context directly, but on the H200 a 128K prompt in 8K chunks costs ~0.96 s of attention per layer
(notes/kernels.md, Prefill), i.e. ~35 s per user for
Qwen3-4B's 36 layers. Here each prefill chunk instead dequantizes its earlier context from the pages
into bf16 (in slices of ``SLICE_TOKENS``, PyTorch, ``kvrepro.formats.compressed`` numerics), rotates it
back (``x = x_rot @ R.T``), appends the chunk's own fresh K/V and runs vLLM's FlashAttention varlen
kernel (causal, bottom-right aligned, GQA). Same function as the Triton path (context from the
dequantized pages, chunk fresh); decode always uses kvrepro's direct-read kernel.

Memory outside vLLM's KV budget: per prefill sequence the dequantized context in bf16,
``2 x ctx x num_kv_heads x head_dim x 2`` bytes (0.5 GiB at 128K for Qwen3-4B), float32 slice
temporaries (gathered K and V plus their rotated copies, ~0.25 GiB at ``SLICE_TOKENS`` = 16K) and the
chunk's output (0.125 GiB for a 16K chunk of 32 heads): < 1 GiB, freed after the call, one sequence
at a time. vLLM does not see it: its profiling run (``GPUModelRunner.profile_run``) passes no
attention metadata, so attention returns early there; it comes out of the card's headroom
(1 - gpu_memory_utilization = 10 % in the sweep). A KV cache 2.8 GiB smaller than bf16's, once measured, was
not this but the store kernel's local-memory reservation (``KVREPRO_STORE_ROTATE`` in ``kvrepro.settings``).

``sliced=True`` (``KVREPRO_PREFILL=fa-sliced``; CPU-tested, not yet run on a GPU, not the default)
never holds the whole context: the chunk attends to itself (causal) and to each dequantized context
slice (non-causal) separately, and the partial outputs are merged with their log-sum-exps
(FlashDecoding-style merge). It does not raise vLLM's KV budget (see above), runs one FlashAttention
call per slice, and its float32 partials of a 16K-token chunk (0.25 GiB each, several live during a
merge) make its peak no lower than ``fa``'s at vLLM's default chunk size; it pays off only for
prompts much longer than 128K.
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

    def __init__(self, fmt, num_kv_heads: int, head_size: int, fa=None, sliced: bool = False,
                 chunk_from_pages: bool = False):
        """``fa``: a ``flash_attn_varlen_func`` stand-in (tests); default vLLM's FlashAttention.
        ``chunk_from_pages`` (``KVREPRO_PREFILL=fa-pages``): the chunk's own K/V are read back from the pages
        (vLLM stores them before attention runs) instead of used fresh, so every prompt position attends to the
        compressed KV exactly as a decode step would; vLLM's own FlashAttention backend does the same for
        bf16/fp8 (it attends over its paged cache). Needed for prompt log-probs that measure the format
        (kvrepro.fidelity); slower than ``fa`` by the chunk's dequantization."""
        if sliced and chunk_from_pages:
            raise ValueError("sliced and chunk_from_pages cannot both be set (KVREPRO_PREFILL is one path)")
        if fa is None:
            from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func, get_flash_attn_version

            fa, self.fa_version = flash_attn_varlen_func, get_flash_attn_version(head_size=head_size)
        else:
            self.fa_version = None
        self.fa = fa
        self.sliced = sliced
        self.chunk_from_pages = chunk_from_pages
        self.fmt, self.num_kv_heads, self.head_size = fmt, num_kv_heads, head_size
        self._pool = None
        # key offset rope-mean (LayerRuntime sets it): ``(keys [n, Hkv, D], positions [n]) -> keys`` (in their dtype)
        # putting R(p) b_hat back on keys read from the pages (the chunk's fresh keys are unshifted); None: as read.
        self.key_restore = None

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
            if self.sliced:
                out[qs:qe] = self._sliced(query[qs:qe], key[qs:qe], value[qs:qe], pool_obj, block_tables[b], ctx,
                                          rotation, scale)
                continue
            from_pages = s if self.chunk_from_pages else ctx  # tokens read back from the pages
            if from_pages:
                k = torch.empty(s, self.num_kv_heads, self.head_size, dtype=key.dtype, device=dev)
                v = torch.empty_like(k)
                dequant_context(pool_obj, block_tables[b], from_pages, rotation, key.dtype, k, v)
                if self.key_restore is not None:
                    k[:from_pages] = self.key_restore(k[:from_pages], torch.arange(from_pages, device=dev)).to(k.dtype)
                if from_pages < s:
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

    def _fa(self, q, k, v, scale, causal, lse):
        dev = q.device
        kw = dict(q=q, k=k, v=v, cu_seqlens_q=torch.tensor([0, q.shape[0]], dtype=torch.int32, device=dev),
                  cu_seqlens_k=torch.tensor([0, k.shape[0]], dtype=torch.int32, device=dev),
                  max_seqlen_q=q.shape[0], max_seqlen_k=k.shape[0], softmax_scale=scale, causal=causal)
        if lse:
            kw["return_softmax_lse"] = True
        if self.fa_version is not None:
            kw["fa_version"] = self.fa_version
        return self.fa(**kw)

    def _sliced(self, q, k_chunk, v_chunk, pool_obj, block_row, ctx, rotation, scale):
        """Chunk attention over [dequantized context | fresh chunk] without materializing the context."""
        if ctx == 0:
            return self._fa(q, k_chunk, v_chunk, scale, True, False)
        o, lse = self._fa(q, k_chunk, v_chunk, scale, True, True)       # lse: [Hq, q_len], natural log
        o, lse = o.float(), lse.float()
        bs = pool_obj.block_size
        rt = rotation.T
        for s in range(0, ctx, SLICE_TOKENS):
            n = min(SLICE_TOKENS, ctx - s)
            k_rot, v_rot = pool_obj.gather_rotated(block_row[s // bs:], n)
            k_s = k_rot @ rt
            if self.key_restore is not None:
                k_s = self.key_restore(k_s, torch.arange(s, s + n, device=k_s.device))
            o_s, lse_s = self._fa(q, k_s.to(q.dtype), (v_rot @ rt).to(q.dtype), scale, False, True)
            o, lse = merge_partials(o, lse, o_s.float(), lse_s.float())
        return o.to(q.dtype)


def merge_partials(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor):
    """Merge two softmax-attention partials over disjoint key sets.

    ``o_*``: ``[T, H, D]`` float32, each normalized over its own keys; ``lse_*``: ``[H, T]`` natural-log
    sum of exp(logits) over those keys (FlashAttention's ``softmax_lse`` layout). Returns ``(o, lse)`` of
    the union: ``o = (e^{lse_a} o_a + e^{lse_b} o_b) / (e^{lse_a} + e^{lse_b})`` (Milakov & Gimelshein 2018;
    FlashDecoding, Dao et al. 2023), computed stably.
    """
    m = torch.maximum(lse_a, lse_b)
    wa, wb = torch.exp(lse_a - m), torch.exp(lse_b - m)
    tot = wa + wb
    o = (o_a * (wa / tot).T.unsqueeze(-1)) + (o_b * (wb / tot).T.unsqueeze(-1))
    return o, m + torch.log(tot)


ONE_PIECE = 1 << 20  # tokens: [context | chunk] always in one FlashAttention call for vLLM's lengths


class RotatedDequantPrefill:
    """``KVREPRO_PREFILL=dequant``: ``kvrepro.ops.prefill_attention(impl="dequant")`` with vLLM's
    FlashAttention varlen as its dense attention, in one call per sequence.

    Everything stays in the pages' rotated space (notes/kernels.md, Prefill): the chunk's q/k/v are
    rotated with ``R`` (float32 matmuls over the chunk only), the context is dequantized by a
    stack-free Triton kernel without the inverse rotation (a byte-bound pass; the float32 inverse
    rotation of the whole context is what makes ``fa`` slow), one bottom-right-causal FlashAttention
    call runs over [context | chunk], and the output is rotated back with ``R.T``. Measured by the
    kernel owner with PyTorch's FA2 in 32K pieces: 1.08x bf16 FA2 for a 128K prompt in 8K chunks
    (``fa``'s unrotated dequantization: 2.55x). With vLLM's FlashAttention 3 on the H200, one layer, a 16K
    chunk after 112K of context: 51.6 ms vs ``fa``'s 56.3 ms, relerr 5.7e-3 (``tests/test_vllm_gpu_runtime.py``
    measures it; ``scripts/h200_sweep.sh``'s ``PREFILL_AUTO=1`` selects this path for a sweep where it passes).

    Memory outside vLLM's accounting (its profiling run skips attention), per prefill sequence: the
    context and chunk K/V in bf16, ``2 x seq_len x Hkv x D x 2`` bytes (0.5 GiB at 132K for Qwen3-4B),
    plus the chunk's rotated q/k/v and output (float32 temporaries, ~0.6 GiB for a 16K chunk of 32
    heads): ~1.1 GiB at most, one sequence at a time, freed after the call.

    ``fa``, ``fa_version``: a ``flash_attn_varlen_func`` stand-in for tests (default: vLLM's, with
    its FA version for ``head_size``).
    """

    def __init__(self, head_size: int, fa=None, fa_version: int | None = None, piece_tokens: int = ONE_PIECE):
        if fa is None:
            from vllm.v1.attention.backends.fa_utils import flash_attn_varlen_func, get_flash_attn_version

            fa, fa_version = flash_attn_varlen_func, get_flash_attn_version(head_size=head_size)
        from kvrepro.ops.prefill import vllm_dense_attn

        self.dense_attn = vllm_dense_attn(fa, fa_version)
        self.piece_tokens = piece_tokens

    def __call__(self, query, key, value, pool, block_tables, seq_lens, query_start_loc, layout, rotation,
                 scale, out=None, max_query_len=None):
        from kvrepro.ops.prefill import prefill_attention

        return prefill_attention(query, key, value, pool, block_tables, seq_lens, query_start_loc, layout,
                                 rotation, scale, out=out, max_query_len=max_query_len, impl="dequant",
                                 dense_attn=self.dense_attn, piece_tokens=self.piece_tokens)
