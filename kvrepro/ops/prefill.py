"""``prefill_attention``: (chunked) prefill whose earlier context sits in compressed pages."""
from __future__ import annotations

import torch
import triton

from kvrepro.formats.layout import PageLayout
from kvrepro.ops.common import (check_float, check_heads, check_int, check_pool, check_rotation,
                                next_pow2, pool_tensor)
from kvrepro.ops.decode import LOG2E
from kvrepro.ops.kernels.attention import paged_attn_kernel
from kvrepro.ops.kernels.rotate import rotate_query_kernel

PREFILL_ROWS = 64      # query rows (tokens x heads of one GQA group) per program
PREFILL_BLOCK_N = 64


def prefill_workspace_bytes(num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of temporaries: rotated float16 query, key and value of the current chunk."""
    return 2 * num_tokens * head_dim * (num_q_heads + 2 * num_kv_heads)


def prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, pool,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor,
                      query_start_loc: torch.Tensor, layout: PageLayout, rotation: torch.Tensor,
                      scale: float, out: torch.Tensor | None = None, *,
                      max_query_len: int | None = None, block_n: int = PREFILL_BLOCK_N,
                      rows: int = PREFILL_ROWS, num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """Causal varlen attention of the current chunk: earlier context from compressed pages,
    the chunk's own K/V fresh (not quantized), read directly in one kernel (no dequantized copy).

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

    Decode rows (q_len 1) may be mixed in. Temporaries: ``prefill_workspace_bytes`` (rotated
    chunk), nothing proportional to the context. Returns ``out``.

    Raises:
        ValueError: wrong shapes/dtypes/devices, unsupported head_dim or GQA group size.
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
    if out is None:
        out = torch.empty_like(query)
    else:
        check_float("out", out, (t, hq, d), dev)
    gp = next_pow2(group)
    if rows not in (16, 32, 64, 128) or rows < gp:
        raise ValueError(f"rows={rows}; allowed: 16, 32, 64, 128 and >= {gp} (GQA group rounded up)")
    if t == 0 or nseq == 0:
        return out
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
        block_tables.stride(0),
        NUM_KV_HEADS=hkv, G=group, GP=gp, D=d, BS=layout.block_size, PAGE_BYTES=layout.page_bytes,
        KBITS=layout.key_bits, VBITS=layout.value_bits, V_CODE_OFF=layout.v_code_offset,
        K_META_OFF=layout.k_meta_offset, V_META_OFF=layout.v_meta_offset,
        BLOCK_Q=block_q, BLOCK_M=rows, BLOCK_N=block_n, NUM_SPLITS=1,
        HAS_FRESH=True, SPLIT_OUT=False, IS_DECODE=False, num_warps=num_warps, num_stages=num_stages,
    )
    return out
