"""Key centering (opt-in, an experiment; off by default): the compressed pages hold ``k - mu`` instead of ``k``,
with ``mu`` one fixed mean key per layer and KV head.

Measured result first. On the CPU path it rescued one k4v4 miss (below). Through vLLM on the H200 (SmolLM2, the
140-prompt single-needle grid, 2026-11-30) it did not: 133/140 right against 134/140 uncentered, and the
teacher-forced key log-prob fell at long context (mean change vs bf16 at 8,184 tokens -0.075 centered, -0.013
uncentered; 20 of 28 prompts worse by > 0.02). Why is not known. The engine took its mean from its first prefill
step (eight ~1K prompts: positions 1-1,023); on the CPU a mean of early positions raises the key error at the far
end (6-8K), yet with exactly that mean the two 8K prompts vLLM lost or kept still answer right on the CPU
(notes/accuracy.md, prototypes/key_center/). Hence ``KVREPRO_KEY_CENTER=off`` by default.

Why it is free. Softmax is invariant to adding one constant to every logit of a row: for a query ``q``,
``softmax_j(q . (k_j - mu)) = softmax_j(q . k_j - q . mu) = softmax_j(q . k_j)``. Attention over
centered keys is therefore the same function as over the keys themselves, provided every key a query
attends to (paged or fresh) is shifted by the same ``mu``. The decode kernels read the pages unchanged; a
prefill chunk's own fresh keys are shifted before its attention (``kvrepro.vllm_backend.runtime``).
Values are not touched.

Why it helps. An LLM's keys share a large common component per channel (the per-channel key outliers of
KIVI, Liu et al. 2024, arXiv:2402.02750, Sec. 3; KVQuant, Hooper et al. 2024, arXiv:2401.18079, Sec. 3.1).
The Hadamard rotation (``kvrepro.formats.hadamard``) spreads that component over every channel, where it
widens each token's min/max range and so the 4-bit step. On SmolLM2-135M (4K-token needle prompt, every
layer and KV head), subtracting the mean key halves the relative 4-bit key error (mean squared error /
variance 0.0168 -> 0.0079), and the k4v4 miss at 8,184 tokens / depth 0.33 answers right with a mean taken
from another prompt (key log-prob -0.076 against bf16's -0.086; k4v4 uncentered -0.708):
``prototypes/key_center/``.

Which ``mu``. It must be fixed before the first key of any sequence is stored and never change after
(pages written under two means would disagree inside one sequence), and it must be the same for every
sequence (prefix caching shares pages between requests). kvrepro takes the mean key of the first real
prefill the cache sees (vLLM: the engine's first step that stores tokens, if it is a fresh prefill; the CPU path:
the first update of a cache), over its tokens at positions >= 1 (position 0, the attention-sink token, is
excluded), and freezes it. If that first step is not a fresh prefill, or has fewer than ``MIN_CENTER_TOKENS``
such tokens, centering stays off (``mu = 0``) for the cache's life. The mean depends on the text it is taken from; the SmolLM2 figure above used a different
prompt than the one scored.
"""
from __future__ import annotations

import torch

MIN_CENTER_TOKENS = 16


def prefill_key_mean(key: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                     num_decodes: int = 0, slot_mapping: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """Mean key of a batch's prefill tokens at positions >= 1 (and, with ``slot_mapping``, stored: slot >= 0).

    Args:
        key: ``[>= T, Hkv, D]`` this step's keys (bf16/fp16/fp32), T = ``query_start_loc[-1]``.
        query_start_loc: int ``[R + 1]`` cumulative query lengths (vLLM's layout; any device).
        seq_lens: int ``[R]`` tokens in the cache per request after this step.
        num_decodes: the first ``num_decodes`` requests are decodes (excluded).
        slot_mapping: optional int ``[>= T]``; tokens with slot ``-1`` (padding: vLLM's dummy warm-up and
            profiling batches have only these) are left out.

    A request's chunk of ``n`` tokens holds positions ``seq_len - n .. seq_len - 1``; position 0 is
    left out. Reads the index tensors on the host (a sync: call it once, outside CUDA-graph capture).

    Returns:
        ``(mean float32 [Hkv, D] on key's device (zeros if no token counts), number of tokens averaged)``.

    Raises:
        ValueError: inconsistent lengths (a chunk longer than its sequence, or past ``key``'s rows).
    """
    qsl = [int(x) for x in query_start_loc.tolist()]
    lens = [int(x) for x in seq_lens.tolist()]
    if len(qsl) != len(lens) + 1:
        raise ValueError(f"query_start_loc has {len(qsl)} entries, expected len(seq_lens) + 1 = {len(lens) + 1}")
    rows = []
    for r in range(num_decodes, len(lens)):
        qs, qe = qsl[r], qsl[r + 1]
        n = qe - qs
        if n < 0 or n > lens[r] or qe > key.shape[0]:
            raise ValueError(f"request {r}: chunk [{qs}, {qe}) does not fit seq_len {lens[r]} / {key.shape[0]} keys")
        first_pos = lens[r] - n
        start = qs + (1 if first_pos == 0 else 0)
        if qe > start:
            rows.append(torch.arange(start, qe, device=key.device))
    if not rows:
        return torch.zeros(key.shape[1:], dtype=torch.float32, device=key.device), 0
    idx = torch.cat(rows)
    if slot_mapping is not None:
        idx = idx[slot_mapping.to(idx.device)[idx] >= 0]
        if idx.numel() == 0:
            return torch.zeros(key.shape[1:], dtype=torch.float32, device=key.device), 0
    return key[idx].double().mean(0).float(), int(idx.numel())
