"""Which heads and layers each rank holds under vLLM 0.20.2's tensor and pipeline parallelism (pure Python).

Tensor parallel (TP = N), as vLLM shards attention (``QKVParallelLinear`` in
``vllm/model_executor/layers/linear.py``, ``ModelConfig.get_num_kv_heads`` / ``verify_with_parallel_config`` in
``vllm/config/model.py``):

- query heads: ``num_q_heads % N == 0`` is required; rank ``r`` holds query heads ``r*Hq/N .. (r+1)*Hq/N - 1``;
- KV heads, ``N <= Hkv``: ``Hkv % N == 0`` is required; rank ``r`` holds KV heads ``r*Hkv/N .. (r+1)*Hkv/N - 1``;
- KV heads, ``N > Hkv``: ``N % Hkv == 0`` is required; every rank holds ONE KV head, each head replicated on
  ``N / Hkv`` consecutive ranks: rank ``r`` holds KV head ``r // (N / Hkv)``.

In both cases a rank's query heads attend only to that rank's KV heads (GQA groups never straddle ranks), and each
rank has its own KV cache in its own GPU memory: a pool ``[num_blocks, heads_per_rank, page_bytes]`` per layer.
kvrepro's pages are per (block, KV head) (``kvrepro.formats.layout``) and the Hadamard rotation depends only on
``head_dim`` (the same matrix on every rank), so a rank stores and attends with nothing but its own heads; the key
offset is one constant per KV head (``kvrepro.formats.offset``), so a rank's calibration is the slice of the
single-GPU one. ``tests/test_parallel.py`` checks all three on a fake two-rank layout.

Pipeline parallel (PP = M): stage ``s`` holds the decoder layers ``get_pp_indices`` gives it
(``vllm/distributed/utils.py``; :func:`pp_layer_ranges` reproduces its default split, without the
``VLLM_PP_LAYER_PARTITION`` override), the first stage the embedding, the last the final norm and ``lm_head``
(Qwen2/Qwen3 with tied embeddings: the embedding on the last stage too). vLLM gives every worker the smallest
``num_gpu_blocks`` of all workers (``get_kv_cache_configs`` in ``vllm/v1/core/kv_cache_utils.py``).
"""
from __future__ import annotations

VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE (vocab_parallel_embedding.py): vocab rows padded to it


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer (1, 2, 4, ...), got {value!r}")
    return value


def check_tensor_parallel(num_q_heads: int, num_kv_heads: int, tensor_parallel_size: int,
                          intermediate_size: int | None = None) -> int:
    """Validate ``tensor_parallel_size`` against a model's heads the way vLLM does; return it.

    Raises:
        ValueError: ``tensor_parallel_size`` not a positive int; ``num_q_heads`` not divisible by it; with it
            <= ``num_kv_heads``, ``num_kv_heads`` not divisible by it; with it > ``num_kv_heads``, it not a multiple
            of ``num_kv_heads``; ``intermediate_size`` (MLP, sharded N ways) not divisible by it. The message names
            ``tensor_parallel_size`` and the sizes this model allows.
    """
    _positive_int("num_q_heads", num_q_heads)
    _positive_int("num_kv_heads", num_kv_heads)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    tp = _positive_int("tensor_parallel_size", tensor_parallel_size)
    if intermediate_size is not None:
        _positive_int("intermediate_size", intermediate_size)

    def ok(n: int) -> bool:
        if num_q_heads % n:
            return False
        if (num_kv_heads % n) if n <= num_kv_heads else (n % num_kv_heads):
            return False
        return intermediate_size is None or intermediate_size % n == 0

    if not ok(tp):
        allowed = [n for n in range(1, num_q_heads + 1) if ok(n)]
        raise ValueError(
            f"tensor_parallel_size={tp} does not split this model ({num_q_heads} query heads, {num_kv_heads} KV heads"
            + (f", MLP {intermediate_size}" if intermediate_size is not None else "")
            + f"): vLLM needs query heads % N == 0 and KV heads % N == 0 (or N % KV heads == 0 when N > KV heads); "
              f"allowed: {allowed}")
    return tp


def kv_head_replicas(num_kv_heads: int, tensor_parallel_size: int) -> int:
    """Ranks holding each KV head: ``N / Hkv`` when ``N > Hkv``, else 1 (vLLM's ``num_kv_head_replicas``)."""
    return tensor_parallel_size // num_kv_heads if tensor_parallel_size > num_kv_heads else 1


def kv_heads_per_rank(num_kv_heads: int, tensor_parallel_size: int) -> int:
    """KV heads in each rank's cache: ``max(1, Hkv // N)`` (vLLM's ``ModelConfig.get_num_kv_heads``)."""
    return max(1, num_kv_heads // tensor_parallel_size)


def rank_q_heads(num_q_heads: int, tensor_parallel_size: int, rank: int) -> range:
    """Global indices of the query heads rank ``rank`` holds (``ColumnParallelLinear`` order).

    Raises:
        ValueError: ``rank`` not in ``0 .. tensor_parallel_size - 1``; ``num_q_heads`` not divisible.
    """
    _check_rank(rank, tensor_parallel_size)
    if num_q_heads % tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} does not divide num_q_heads={num_q_heads}")
    n = num_q_heads // tensor_parallel_size
    return range(rank * n, (rank + 1) * n)


def rank_kv_heads(num_kv_heads: int, tensor_parallel_size: int, rank: int) -> range:
    """Global indices of the KV heads rank ``rank`` holds (vLLM's ``shard_rank = tp_rank // num_kv_head_replicas``).

    Raises:
        ValueError: ``rank`` out of range, or a size vLLM refuses (:func:`check_tensor_parallel`'s KV rule).
    """
    _check_rank(rank, tensor_parallel_size)
    tp = tensor_parallel_size
    if (num_kv_heads % tp) if tp <= num_kv_heads else (tp % num_kv_heads):
        raise ValueError(f"tensor_parallel_size={tp} does not split num_kv_heads={num_kv_heads} (needs "
                         f"KV heads % N == 0, or N % KV heads == 0 when N > KV heads)")
    per = kv_heads_per_rank(num_kv_heads, tp)
    first = (rank // kv_head_replicas(num_kv_heads, tp)) * per
    return range(first, first + per)


def _check_rank(rank, tensor_parallel_size) -> None:
    _positive_int("tensor_parallel_size", tensor_parallel_size)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < tensor_parallel_size:
        raise ValueError(f"rank must be an int in 0..{tensor_parallel_size - 1}, got {rank!r}")


def slice_heads(x, heads: range, dim: int = 1, head_size: int | None = None):
    """The part of ``x`` that belongs to ``heads`` (a :func:`rank_q_heads` / :func:`rank_kv_heads` range).

    ``x``: ``[..., H, D, ...]`` with heads on ``dim`` (``head_size`` None), or heads flattened with their channels
    on ``dim`` (``[T, H * D]`` as vLLM passes K/V to ``do_kv_cache_update``; give ``head_size``). A pool
    ``[num_blocks, Hkv, page_bytes]`` slices on ``dim=1``. Returns a view (``narrow``).
    """
    step = 1 if head_size is None else head_size
    return x.narrow(dim, heads.start * step, len(heads) * step)


def pp_layer_ranges(num_layers: int, pipeline_parallel_size: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]`` decoder layers of each pipeline stage, vLLM's default split (``get_pp_indices``):
    ``L // M`` each, the ``L % M`` extra layers one each to the stages before the last (from the second-to-last
    backwards), which holds the final norm and ``lm_head``.

    Raises:
        ValueError: ``pipeline_parallel_size`` not a positive int or more stages than layers.
    """
    _positive_int("num_layers", num_layers)
    pp = _positive_int("pipeline_parallel_size", pipeline_parallel_size)
    if pp > num_layers:
        raise ValueError(f"pipeline_parallel_size={pp} exceeds the model's {num_layers} layers (allowed: 1..{num_layers})")
    parts = [num_layers // pp] * pp
    for i in range(2, num_layers % pp + 2):   # as vLLM: partitions[-i] += 1
        parts[-i] += 1
    out, start = [], 0
    for n in parts:
        out.append((start, start + n))
        start += n
    return out


def padded_vocab(vocab_size: int) -> int:
    """Vocabulary rows vLLM allocates: ``vocab_size`` rounded up to a multiple of :data:`VOCAB_PADDING`."""
    return -(-vocab_size // VOCAB_PADDING) * VOCAB_PADDING
