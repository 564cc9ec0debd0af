"""Reference attention (PyTorch, float32 or float64) over paged KV in any format.

Used by the CPU path and as the test oracle for the Triton kernels in ``kvrepro.ops``.
Method: softmax attention (Vaswani et al., 2017) with grouped-query attention (GQA; Ainslie
et al., 2023, arXiv:2305.13245): query head ``h`` reads KV head ``h // (num_q_heads // num_kv_heads)``.
"""
from __future__ import annotations

import torch

from kvrepro.formats.base import KVPool


def attention_ref(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Causal attention of the last ``q_len`` positions of one sequence.

    Args:
        query: ``[q_len, num_q_heads, head_dim]``; query ``i`` sits at position
            ``seq_len - q_len + i`` and sees keys ``0 .. seq_len - q_len + i``.
        key, value: ``[seq_len, num_kv_heads, head_dim]``.
        scale: softmax scale (usually ``head_dim ** -0.5``).
        dtype: compute dtype (float32 or float64).

    Returns:
        ``[q_len, num_q_heads, head_dim]`` in ``dtype``.

    Raises:
        ValueError: num_q_heads not a multiple of num_kv_heads, or q_len > seq_len.
    """
    q_len, hq, d = query.shape
    seq_len, hkv, _ = key.shape
    if hq % hkv:
        raise ValueError(f"num_q_heads={hq} must be a multiple of num_kv_heads={hkv}")
    if q_len > seq_len:
        raise ValueError(f"q_len={q_len} > seq_len={seq_len}")
    group = hq // hkv
    q = query.to(dtype).transpose(0, 1)  # [Hq, q, D]
    k = key.to(dtype).repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, s, D]
    v = value.to(dtype).repeat_interleave(group, dim=1).transpose(0, 1)
    logits = (q @ k.transpose(1, 2)) * scale  # [Hq, q, s]
    qpos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
    kpos = torch.arange(seq_len, device=query.device)[None, :]
    logits = logits.masked_fill(kpos > qpos, float("-inf"))
    return (torch.softmax(logits, dim=-1) @ v).transpose(0, 1)


def paged_attention_ref(query: torch.Tensor, pool: KVPool, block_tables: torch.Tensor,
                        seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                        scale: float | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Attention of a mixed prefill/decode batch over a paged pool (dequantized, then attention).

    Layout follows vLLM's varlen convention::

        query_start_loc: [num_seqs + 1]   query rows of seq b are query[qsl[b]:qsl[b+1]]
        seq_lens:        [num_seqs]       tokens in the cache for seq b, new ones included
        block_tables:    [num_seqs, max_blocks]  block ids of seq b, in order

    Args:
        query: ``[num_tokens, num_q_heads, head_dim]``.
        pool: a ``KVPool`` already holding every token of every sequence.

    Returns:
        ``[num_tokens, num_q_heads, head_dim]`` in ``dtype``. Sequences with ``seq_len == 0``
        (CUDA-graph padding) produce zeros.
    """
    out = torch.zeros(query.shape, dtype=dtype, device=query.device)
    d = query.shape[-1]
    scale = d**-0.5 if scale is None else scale
    for b in range(seq_lens.numel()):
        qs, qe, s = int(query_start_loc[b]), int(query_start_loc[b + 1]), int(seq_lens[b])
        if qe == qs or s == 0:
            continue
        k, v = pool.gather(block_tables[b], s)
        out[qs:qe] = attention_ref(query[qs:qe], k, v, scale, dtype)
    return out
