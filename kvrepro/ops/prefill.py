"""``prefill_attention``: (chunked) prefill whose earlier context sits in compressed pages."""
from __future__ import annotations

import torch
import triton

from kvrepro.formats import preset_of
from kvrepro.formats.layout import PageLayout
from kvrepro.ops.common import (check_block_n, check_block_tables, check_float, check_heads, check_int,
                                check_launch, check_pool, check_rotation, check_scale, next_pow2, page_constexprs,
                                pool_tensor, want_checks)
from kvrepro.ops.decode import LOG2E, _rope_bias_args, check_rope_bias, resolve_dequant
from kvrepro.ops.triton.attention import paged_attn_kernel
from kvrepro.ops.triton.dequant import dequant_pages_kernel
from kvrepro.ops.triton.rotate import rotate_query_kernel

# Presets whose rope_bias path of the paged prefill kernel passed its tests on a GPU (H200, Triton 3.6). For k8v4 and
# k4v2 it faults there (compute-sanitizer: an out-of-range shared-memory address at the kernel's tl.dot) or returns wrong
# scores, while the CPU interpreter runs them right; CUDA calls refuse them (check_rope_prefill).
ROPE_GPU_PRESETS = ("k4v4", "k5v4")
PREFILL_ROWS = 64      # query rows (tokens x heads of one GQA group) per program
PREFILL_BLOCK_N = 64
PIECE_TOKENS = 32768   # impl="dequant": context dequantized in pieces of at most this many tokens
IMPLS = ("paged", "dequant")


def check_rope_prefill(layout: PageLayout, device: torch.device, npairs: int) -> None:
    """Refuse ``rope_bias`` (``npairs > 0``) on a CUDA ``device`` for a page ``layout`` whose preset is not in
    :data:`ROPE_GPU_PRESETS`. Raises ValueError naming the preset and the allowed ones."""
    if not npairs or device.type != "cuda":
        return
    name = preset_of(layout) or repr(layout)
    if name not in ROPE_GPU_PRESETS:
        raise ValueError(f"rope_bias (key offset rope-mean) with the paged prefill kernel on a GPU: preset {name} is not "
                         f"supported there (the kernel faults on the H200: notes/kernels.md, Known limits); allowed "
                         f"presets: {', '.join(ROPE_GPU_PRESETS)}. For {name} under rope-mean use KVREPRO_PREFILL=fa "
                         "(the default), fa-pages or fa-sliced, which restore the keys before FlashAttention")


def flash_dense_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool):
    """Dense bf16/fp16 attention of one sequence with its log-sum-exp, through PyTorch's
    FlashAttention-2 kernel (``aten._flash_attention_forward``, CUDA only; GQA native).

    q ``[Tq, Hq, D]``, k/v ``[Tk, Hkv, D]``; ``causal`` aligns the last query with the last key.
    Returns ``(o [Tq, Hq, D] in q's dtype, lse [Tq, Hq] float32, natural log)``.
    """
    tq, hq, _ = q.shape
    cq = torch.tensor([0, tq], dtype=torch.int32, device=q.device)
    ck = torch.tensor([0, k.shape[0]], dtype=torch.int32, device=q.device)
    res = torch.ops.aten._flash_attention_forward(q, k, v, cq, ck, tq, k.shape[0], 0.0, causal, False,
                                                  scale=scale)
    return res[0], res[1].reshape(hq, tq).transpose(0, 1).float()


# PyTorch aligns ``is_causal`` to the top-left corner when Tq != Tk (pytorch/pytorch#108108): only
# call it causally with Tq == Tk. FlashAttention's own varlen API is bottom-right aligned.
flash_dense_attn.bottom_right_causal = False


def vllm_dense_attn(flash_attn_varlen_func, fa_version: int | None = 3):
    """Adapter: vLLM's ``flash_attn_varlen_func`` (FA2/FA3, ``return_softmax_lse=True``) as a
    ``dense_attn(q, k, v, scale, causal) -> (o [Tq, Hq, D], lse [Tq, Hq] float32)`` for
    ``prefill_attention(impl="dequant")``. Not yet run against vLLM here (CPU test uses a stand-in)."""
    def attn(q, k, v, scale, causal):
        tq, tk = q.shape[0], k.shape[0]
        cq = torch.tensor([0, tq], dtype=torch.int32, device=q.device)
        ck = torch.tensor([0, tk], dtype=torch.int32, device=q.device)
        kw = {} if fa_version is None else {"fa_version": fa_version}
        o, lse = flash_attn_varlen_func(q=q, k=k, v=v, max_seqlen_q=tq, cu_seqlens_q=cq, max_seqlen_k=tk,
                                        cu_seqlens_k=ck, softmax_scale=scale, causal=causal,
                                        return_softmax_lse=True, **kw)
        return o, lse.reshape(q.shape[1], tq).transpose(0, 1).float()
    attn.bottom_right_causal = True   # FlashAttention >= 2.1 varlen: causal mask bottom-right aligned
    return attn


def dequantize_context(pool, block_row: torch.Tensor, first: int, num: int, layout: PageLayout,
                       rotation: torch.Tensor, k_out: torch.Tensor, v_out: torch.Tensor, *,
                       rotated: bool = False) -> None:
    """Dequantize tokens ``first .. first + num - 1`` of one sequence (block-table row
    ``block_row`` int32) into ``k_out/v_out [>= num, Hkv, D]`` (contiguous, bf16/fp16).

    ``rotated=False``: back in the model's space (``x @ R.T``, a float32 matmul per tile);
    ``rotated=True``: left in the rotated space the pages are stored in (a byte-bound pass; the
    caller rotates queries with ``R`` and outputs back with ``R.T``, attention being invariant to
    an orthogonal rotation of q and k together)."""
    data = pool_tensor(pool)
    _, hkv = check_pool(data, layout)
    dequant_pages_kernel[(triton.cdiv(num, 32), hkv)](
        data, block_row, rotation, k_out, v_out, first, num,
        **page_constexprs(layout, hkv), BLOCK_T=32,
        ROTATE=not rotated)


def _rotate(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """``x @ r`` over the last dim in float32, returned in x's dtype (x ``[T, H, D]``)."""
    return (x.float() @ r).to(x.dtype)


def _prefill_dequant(query, key, value, data, block_tables, seq_lens, query_start_loc, layout,
                     rotation, scale, out, piece_tokens, dense_attn):
    """impl="dequant", in the rotated space: per sequence the chunk's q, k, v are rotated
    (``@ R``, float32), the context is dequantized without rotating it back, piece by piece
    (<= ``piece_tokens`` tokens) into one workspace; if context + chunk fit in a piece and
    ``dense_attn.bottom_right_causal`` is true, one causal ``dense_attn`` call over
    [context | chunk], else the chunk (causal, Tq == Tk) and each piece (non-causal) merged by
    log-sum-exp in float32. The output is rotated back (``@ R.T``).
    Reads lengths on the host (one sync)."""
    hkv, d = data.shape[1], layout.head_dim
    lens = seq_lens.tolist()
    qsl = query_start_loc.tolist()
    rt = rotation.T.contiguous()
    ws_k = ws_v = None

    def workspace(n):
        nonlocal ws_k, ws_v
        if ws_k is None or ws_k.shape[0] < n:
            ws_k = torch.empty((n, hkv, d), dtype=query.dtype, device=query.device)
            ws_v = torch.empty_like(ws_k)
        return ws_k[:n], ws_v[:n]

    for b, sl in enumerate(lens):
        qs, qe = qsl[b], qsl[b + 1]
        ql = qe - qs
        if ql == 0:
            continue
        if sl == 0:
            out[qs:qe] = 0
            continue
        ctx = sl - ql
        q = _rotate(query[qs:qe], rotation)
        k_new, v_new = _rotate(key[qs:qe], rotation), _rotate(value[qs:qe], rotation)
        if ctx + ql <= piece_tokens and getattr(dense_attn, "bottom_right_causal", False):
            k, v = workspace(ctx + ql)
            if ctx:
                dequantize_context(data, block_tables[b], 0, ctx, layout, rotation, k, v, rotated=True)
            k[ctx:] = k_new
            v[ctx:] = v_new
            o, _ = dense_attn(q, k, v, scale, True)
            out[qs:qe] = _rotate(o, rt)
            continue
        o, lse = dense_attn(q, k_new, v_new, scale, True)
        o = o.float()
        for p0 in range(0, ctx, piece_tokens):
            n = min(piece_tokens, ctx - p0)
            k, v = workspace(n)
            dequantize_context(data, block_tables[b], p0, n, layout, rotation, k, v, rotated=True)
            o2, lse2 = dense_attn(q, k, v, scale, False)
            m = torch.maximum(lse, lse2)
            w1, w2 = torch.exp(lse - m), torch.exp(lse2 - m)
            o = (o * w1[..., None] + o2.float() * w2[..., None]) / (w1 + w2)[..., None]
            lse = m + torch.log(w1 + w2)
        out[qs:qe] = (o @ rt).to(out.dtype)
    return out


def prefill_workspace_bytes(num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of temporaries: rotated float16 query, key and value of the current chunk."""
    return 2 * num_tokens * head_dim * (num_q_heads + 2 * num_kv_heads)


def prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pool,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      query_start_loc: torch.Tensor, layout: PageLayout, rotation: torch.Tensor,
                      scale: float, out: torch.Tensor | None = None, *,
                      max_query_len: int | None = None, block_n: int = PREFILL_BLOCK_N,
                      rows: int = PREFILL_ROWS, num_warps: int = 4, num_stages: int = 2,
                      dequant: str | None = None, impl: str = "paged",
                      piece_tokens: int = PIECE_TOKENS, dense_attn=None,
                      validate: bool | None = None, rope_bias=None) -> torch.Tensor:
    """Causal varlen attention of the current chunk: earlier context from compressed pages,
    the chunk's own K/V fresh (not quantized).

    ``impl="paged"`` (default): one Triton kernel reads the compressed pages directly (no
    dequantized copy, no host sync if ``max_query_len`` is given). On the H200 at 128K it took 3.0x the
    time of bf16 FlashAttention-2, relerr 3.7e-4 (fp16) / 1.7e-3 (bf16) vs float64 at ctx 120K.
    ``impl="dequant"`` took 1.08x bf16 there, with the same error. ``impl="dequant"``: per
    sequence, everything happens in the pages' rotated space: the chunk's q/k/v are rotated
    (``@ R``), the context is dequantized without the inverse rotation into a workspace of
    ``piece_tokens`` tokens (``2 * piece_tokens * Hkv * D * 2`` bytes; 128 MiB at 32K x 8 x 128),
    and ``dense_attn(q, k, v, scale, causal) -> (o, lse)`` (default ``flash_dense_attn``:
    PyTorch's FlashAttention-2; the vLLM backend can pass FA3) runs once over [context | chunk]
    when both fit in a piece and ``dense_attn.bottom_right_causal`` (causal mask aligned to the
    last key; PyTorch's is not), else per piece with a float32 log-sum-exp merge (plus
    ``q_len * Hq * D * 4`` bytes); the output is rotated back (``@ R.T``). It reads
    ``seq_lens``/``query_start_loc`` on the host.

    Layout (vLLM varlen)::

        query_start_loc [B + 1] int32   rows of seq b: query[qsl[b]:qsl[b+1]]  (q_len = difference)
        seq_lens        [B]     int32   tokens of seq b including this chunk; context = seq_len - q_len
        block_tables    [B, max_blocks] int32   pages of the context tokens 0 .. seq_len - q_len - 1

    Args:
        query: ``[T, Hq, D]``; key, value: ``[T, Hkv, D]`` (bfloat16/float16, last dim contiguous).
        pool: uint8 ``[num_blocks, Hkv, page_bytes]`` or ``CompressedPool`` holding the context
            tokens (whether this chunk was stored already does not matter: it is not read).
        out: optional ``[T, Hq, D]`` in the query dtype.
        max_query_len: ``max(q_len)``; if omitted it is read from ``query_start_loc`` (host sync).
        block_n, rows, num_warps, num_stages: tiling / launch options.
        dequant: as in ``decode_attention`` (impl="paged").
        impl, piece_tokens, dense_attn: see above.
        rope_bias: ``(terms [T, Hq, 2 NPAIRS], inv_freq [Hkv, NPAIRS])`` float32 for context pages stored with the
            key offset ``rope-mean`` (as ``decode_attention``'s): each context key's logit gets ``q . R(j) b_hat``
            back; the chunk's own keys are taken as given (pass them unshifted). ``impl="paged"`` only.

    Decode rows (q_len 1) may be mixed in. Temporaries: ``prefill_workspace_bytes`` (rotated
    chunk), nothing proportional to the context. Returns ``out``.

    ``validate`` (default: on for CPU tensors, off on CUDA where it needs a host sync) checks
    on the host that ``seq_lens >= 0``, the block table covers them and its block ids are in the
    pool; without it, out-of-range indices are undefined behaviour (as in vLLM's kernels).

    Raises:
        ValueError: wrong shapes/dtypes/devices, unsupported head_dim or GQA group size, a scale
            that is not finite and positive; with ``validate``, bad seq_lens or block ids; ``dequant`` not
            in ``DEQUANT_MODES`` (or ``"asm"`` off CUDA); ``block_n``, ``rows``, ``impl`` or launch options
            outside their allowed values (the message lists them); ``rope_bias`` on a CUDA device for a preset
            outside :data:`ROPE_GPU_PRESETS` (:func:`check_rope_prefill`).
    """
    data = pool_tensor(pool)
    _, hkv = check_pool(data, layout)
    dev = data.device
    if query.dim() != 3:
        raise ValueError(f"query must be [T, Hq, D], got {tuple(query.shape)}")
    t, hq, d = query.shape
    group = check_heads(hq, hkv, d, layout)
    check_float("query", query, (t, hq, d), dev)
    check_float("key", key, (t, hkv, d), dev)
    check_float("value", value, (t, hkv, d), dev)
    check_int("block_tables", block_tables, 2, dev)
    check_int("seq_lens", seq_lens, 1, dev)
    check_int("query_start_loc", query_start_loc, 1, dev)
    nseq = seq_lens.shape[0]
    if block_tables.shape[0] != nseq or query_start_loc.shape[0] != nseq + 1:
        raise ValueError(f"need block_tables [B, *], query_start_loc [B + 1] for seq_lens [B={nseq}]")
    check_rotation(rotation, layout, dev)
    check_scale(scale)
    if max_query_len is not None and (not isinstance(max_query_len, int) or isinstance(max_query_len, bool)
                                      or max_query_len < 0):
        raise ValueError(f"max_query_len must be a non-negative int or None, got {max_query_len!r}")
    if want_checks(validate, dev):
        check_block_tables(block_tables, seq_lens, data.shape[0], layout.block_size)
        qsl = query_start_loc.to(torch.int64).cpu()
        qlen = qsl[1:] - qsl[:-1]
        if qlen.numel() and (int(qsl[0]) != 0 or int(qlen.min()) < 0 or int(qsl[-1]) != t
                             or bool((qlen > seq_lens.cpu()).any())):
            raise ValueError(f"query_start_loc must start at 0, be non-decreasing, end at the number of "
                             f"query rows T={t}, and give each sequence a query length <= its seq_len; "
                             f"got {qsl.tolist()} for seq_lens {seq_lens.tolist()}")
        if max_query_len is not None and qlen.numel() and max_query_len < int(qlen.max()):
            raise ValueError(f"max_query_len={max_query_len} is below the longest query "
                             f"({int(qlen.max())} rows): rows past it would never be computed")
    if out is None:
        out = torch.empty_like(query)
    else:
        check_float("out", out, (t, hq, d), dev)
    check_block_n(block_n)
    check_launch(num_warps, num_stages)
    gp = next_pow2(group)
    if rows not in (16, 32, 64, 128) or rows < gp:
        raise ValueError(f"rows={rows}; allowed: 16, 32, 64, 128 and >= {gp} (GQA group rounded up)")
    if t == 0 or nseq == 0:
        return out
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}; allowed: {IMPLS}")
    npairs = check_rope_bias(rope_bias, t, hq, hkv, dev)
    if npairs and impl != "paged":
        raise ValueError(f"rope_bias needs impl='paged' (the kernel that reads the pages), got impl={impl!r}")
    check_rope_prefill(layout, dev, npairs)
    if impl == "dequant":
        if dense_attn is None and dev.type != "cuda":
            raise ValueError("impl='dequant' without dense_attn uses PyTorch's FlashAttention-2, which needs a "
                             "CUDA device; pass dense_attn=... (e.g. a float64 reference) on CPU")
        if not isinstance(piece_tokens, int) or piece_tokens < 1:
            raise ValueError(f"piece_tokens must be a positive int, got {piece_tokens!r}")
        return _prefill_dequant(query, key, value, data, block_tables, seq_lens, query_start_loc, layout,
                                rotation, scale, out, piece_tokens, dense_attn or flash_dense_attn)
    dequant = resolve_dequant(dequant, dev)
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    q16 = torch.empty((t, hq, d), dtype=torch.float16, device=dev)
    k16 = torch.empty((t, hkv, d), dtype=torch.float16, device=dev)
    v16 = torch.empty((t, hkv, d), dtype=torch.float16, device=dev)
    rotate_query_kernel[(t * hq,)](query, rotation, q16, query.stride(0), query.stride(1),
                                   float(scale) * LOG2E, HQ=hq, D=d)
    rotate_query_kernel[(t * hkv,)](key, rotation, k16, key.stride(0), key.stride(1), 1.0, HQ=hkv, D=d)
    rotate_query_kernel[(t * hkv,)](value, rotation, v16, value.stride(0), value.stride(1), 1.0, HQ=hkv, D=d)
    block_q = rows // gp
    grid = (nseq, triton.cdiv(max_query_len, block_q), hkv)
    paged_attn_kernel[grid](
        q16, data, block_tables, seq_lens, query_start_loc, k16, v16, out, q16, rotation,
        block_tables.stride(0), NUM_SPLITS=1,
        G=group, GP=gp, **page_constexprs(layout, hkv),
        BLOCK_Q=block_q, BLOCK_M=rows, BLOCK_N=block_n, HAS_FRESH=True, SPLIT_OUT=False,
        IS_DECODE=False, DEQ_ASM=dequant == "asm", num_warps=num_warps, num_stages=num_stages,
        **_rope_bias_args(rope_bias, npairs, scale),
    )
    return out
