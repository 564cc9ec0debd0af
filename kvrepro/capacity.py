"""Capacity arithmetic: how many concurrent users' KV caches fit on one GPU, per KV format,
counted the way vLLM (v1, 0.20.x) counts them.

vLLM's accounting (``vllm/v1/core/kv_cache_utils.py``): after profiling, the KV budget is
``gpu_memory_utilization x total GPU memory - weights - peak activations/graphs - non-torch``; every
attention layer gets the same number of blocks, a block (page) of one layer holds ``block_size`` tokens
of all KV heads, so::

    page_bytes_all_layers = num_layers x num_kv_heads x block_size x bytes_per_token_per_head
    num_gpu_blocks        = floor(kv_cache_bytes / page_bytes_all_layers)
    kv_cache_tokens       = num_gpu_blocks x block_size
    blocks_per_request    = ceil((context_tokens + decode_tokens) / block_size)   (whole blocks)
    users_that_fit        = floor((num_gpu_blocks - 1) / blocks_per_request)

(one block of the pool is vLLM's null block, ``vllm/v1/core/block_pool.py``; vLLM's reported KV-cache
size ``num_gpu_blocks x block_size`` includes it).

Units: every ``*_gb`` argument is in GiB (2**30 bytes), the unit vLLM's logs and nvidia-smi use; the
"A100 80GB" of the seed experiment is 81,920 MiB = 80 GiB.

Calibration of ``overhead_gb`` (what vLLM reserves besides weights and KV: activation peak of the
profiling run, CUDA graphs, non-torch memory): REPRODUCTION-CARD.md, measured 2026-11-29 on one H200
(143,771 MiB) with vLLM 0.20.2, Qwen3-4B-Instruct-2507 with dummy weights, max_model_len 131,328,
gpu_memory_utilization = 0.9 x 81920 / 143771 (an emulated 80 GiB card, budget 72 GiB): bf16 gave
455,392 KV tokens = 28,462 blocks of 16. With the weights computed from the config (4,022,468,096 parameters x 2 B = 8,044,936,192 B)
that leaves 1.9668-1.9690 GiB; the default :data:`DEFAULT_OVERHEAD_GB` = 1.968 reproduces the bf16
measurement exactly and fp8's (910,688 tokens) within 0.011 % (910,784). The overhead depends on the model,
max_model_len, batch limits and CUDA graph sizes: recalibrate it for another setup.

Tensor parallel (``tensor_parallel_size`` N, default 1) and pipeline parallel (``pipeline_parallel_size`` M,
default 1): every GPU has its own KV cache in its own memory, and every ``*_gb`` memory argument is *per GPU*.
A TP rank holds ``max(1, num_kv_heads // N)`` KV heads of every layer of its stage (``kvrepro.parallel``), its
shard of the weights (:meth:`ModelConfig.rank_weights_bytes`: about ``weights / N``; norms and, when N > KV heads,
K/V projections are replicated) and ``overhead_gb``; so per rank::

    page_bytes_rank = stage_layers x kv_heads_per_rank x block_size x bytes_per_token_per_head
    num_gpu_blocks  = min over stages of floor(kv_cache_bytes_rank / page_bytes_rank)

(vLLM gives every worker the smallest block count of all workers, ``get_kv_cache_configs``), and
``kv_cache_tokens`` is what each rank holds of its own heads, the same on every rank: the engine's KV-token
count. ``overhead_gb`` was calibrated at N = M = 1; at N > 1 NCCL and custom all-reduce buffers add to it
(not calibrated: no multi-GPU measurement yet).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kvrepro import parallel
from kvrepro.configs import DEFAULT_MODEL, load_config
from kvrepro.formats import COMPRESSED_PRESETS, FORMAT_NAMES, get_format

GIB = 2**30
DEFAULT_GPU_MEMORY_GB = 80.0  # the seed's A100 80GB (81,920 MiB)
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default
DEFAULT_OVERHEAD_GB = 1.968  # calibrated from the card's bf16 measurement, see module docstring
DEFAULT_BLOCK_SIZE = 16  # vLLM's default block size on CUDA

# Measured anchors (REPRODUCTION-CARD.md; H200 emulating 80 GiB, vLLM 0.20.2, block_size 16):
# kv_cache_dtype -> KV-cache tokens reported by vLLM.
CARD_KV_TOKENS = {
    "auto": 455_392,
    "fp8": 910_688,
    "turboquant_k8v4": 1_010_016,
    "turboquant_4bit_nc": 1_323_728,
}


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _nonneg_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def _number(name: str, value, *, positive: bool = False, lo: float | None = None, hi: float | None = None) -> float:
    kind = "a positive finite number" if positive else "a finite number"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value!r}")
    if hi is not None and value > hi:
        raise ValueError(f"{name} must be <= {hi}, got {value!r}")
    return float(value)


def check_formats(formats, name: str = "formats") -> tuple[str, ...]:
    """Validate a list of KV format names; return them as a tuple.

    Raises:
        ValueError: empty list, a non-string, or an unknown name (message names ``name`` and lists
            the allowed formats).
    """
    if isinstance(formats, str) or not isinstance(formats, (list, tuple)) or not formats:
        raise ValueError(f"{name} must be a non-empty list of KV formats from {FORMAT_NAMES}, got {formats!r}")
    for f in formats:
        if f not in FORMAT_NAMES:
            raise ValueError(f"{name}: unknown KV format {f!r}; allowed: {', '.join(FORMAT_NAMES)}")
    return tuple(formats)


@dataclass(frozen=True)
class ModelConfig:
    """What capacity arithmetic needs from a decoder's config (Qwen3/Llama-style dense model).

    Attributes:
        name: label.
        num_layers, num_kv_heads, head_dim, num_q_heads, hidden_size, intermediate_size, vocab_size:
            from the Hugging Face config.
        tie_word_embeddings: whether lm_head shares the embedding matrix.
        dtype_bytes: bytes per weight (2 for bf16).
    """

    name: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = True
    dtype_bytes: int = 2

    @classmethod
    def from_hf(cls, cfg: dict, name: str = "model") -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict (``head_dim`` defaults to hidden/heads)."""
        heads = cfg["num_attention_heads"]
        return cls(
            name=name,
            num_layers=cfg["num_hidden_layers"],
            num_q_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )

    @property
    def num_params(self) -> int:
        """Parameter count of a Qwen3-style decoder: q/k/v/o projections (no bias), gated MLP
        (gate/up/down), RMSNorm weights (input, post-attention, per-head q_norm and k_norm, final),
        embedding, plus lm_head unless tied. 4,022,468,096 for Qwen3-4B."""
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_q_heads * d + 2 * h * self.num_kv_heads * d + self.num_q_heads * d * h
        mlp = 3 * h * self.intermediate_size
        norms = 2 * h + 2 * d
        emb = self.vocab_size * h
        return self.num_layers * (attn + mlp + norms) + h + emb * (1 if self.tie_word_embeddings else 2)

    @property
    def weights_bytes(self) -> int:
        """Bytes of the weights at ``dtype_bytes`` per parameter (8,044,936,192 for Qwen3-4B bf16)."""
        return self.num_params * self.dtype_bytes

    def check_parallel(self, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> tuple[int, int]:
        """Validate ``(tensor_parallel_size, pipeline_parallel_size)`` for this model as vLLM does; return them.

        Raises:
            ValueError: a size that is not a positive int, a TP size that does not split the query heads, the KV
                heads or the MLP (message lists the allowed sizes), more pipeline stages than layers.
        """
        tp = parallel.check_tensor_parallel(self.num_q_heads, self.num_kv_heads, tensor_parallel_size,
                                            self.intermediate_size)
        parallel.pp_layer_ranges(self.num_layers, pipeline_parallel_size)
        return tp, pipeline_parallel_size

    def rank_weights_bytes(self, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> list[int]:
        """Weight bytes on one GPU of each pipeline stage (all TP ranks of a stage hold the same amount), as vLLM
        shards a Qwen3/Llama decoder: q / o projections, MLP and vocabulary (padded to 64 rows,
        ``parallel.padded_vocab``) split N ways; K / V projections ``kv_heads_per_rank`` heads each; RMSNorms
        replicated. The first stage holds the embedding; the last stage the final norm and ``lm_head`` (with tied
        embeddings, vLLM's Qwen2/Qwen3 put the embedding there and share it: one vocabulary matrix either way).
        N = M = 1 returns ``[weights_bytes]`` unchanged.

        Returns:
            list of M ints (bytes per GPU of stage 0 .. M-1).

        Raises:
            ValueError: as :meth:`check_parallel`.
        """
        tp, pp = self.check_parallel(tensor_parallel_size, pipeline_parallel_size)
        if tp == 1 and pp == 1:
            return [self.weights_bytes]
        h, d = self.hidden_size, self.head_dim
        q = self.num_q_heads // tp
        kv = parallel.kv_heads_per_rank(self.num_kv_heads, tp)
        per_layer = h * q * d + 2 * h * kv * d + q * d * h + 3 * h * (self.intermediate_size // tp) + 2 * h + 2 * d
        vocab = parallel.padded_vocab(self.vocab_size) // tp * h
        ranges = parallel.pp_layer_ranges(self.num_layers, pp)
        out = []
        for s, (a, b) in enumerate(ranges):
            n = (b - a) * per_layer
            if pp == 1:
                n += vocab * (1 if self.tie_word_embeddings else 2) + h
            elif s == 0:
                n += vocab
            elif s == pp - 1:
                n += vocab + h
            out.append(n * self.dtype_bytes)
        return out


def load_model_config(name: str = DEFAULT_MODEL) -> ModelConfig:
    """:class:`ModelConfig` of a bundled model (``kvrepro.configs``). Raises ValueError for unknown names."""
    return ModelConfig.from_hf(load_config(name), name=name)


def bytes_per_token(fmt: str, cfg: ModelConfig, *, tensor_parallel_size: int = 1) -> int:
    """KV bytes of one token over all layers and KV heads (147,456 for bf16 Qwen3-4B); with
    ``tensor_parallel_size`` N, what one TP rank stores: its ``max(1, num_kv_heads // N)`` heads.

    Raises:
        ValueError: unknown format name (lists the allowed ones), unsupported head_dim, or a
            ``tensor_parallel_size`` that does not split the model (:meth:`ModelConfig.check_parallel`).
    """
    check_formats([fmt], "format")
    tp, _ = cfg.check_parallel(tensor_parallel_size)
    heads = parallel.kv_heads_per_rank(cfg.num_kv_heads, tp)
    return cfg.num_layers * heads * get_format(fmt).bytes_per_token_per_head(cfg.head_dim)


def page_bytes_all_layers(fmt: str, cfg: ModelConfig, block_size: int = DEFAULT_BLOCK_SIZE, *,
                          tensor_parallel_size: int = 1, num_layers: int | None = None) -> int:
    """Bytes of one block (page) summed over all layers: what one block id costs vLLM.

    For compressed formats the page is ``PageLayout(head_dim, block_size).page_bytes`` per KV head
    (``kvrepro.formats.layout``), which also refuses unsupported block sizes. With ``tensor_parallel_size`` N: what
    one block id costs one TP rank (its ``max(1, num_kv_heads // N)`` heads); ``num_layers``: the layers of one
    pipeline stage (default all).

    Raises:
        ValueError: unknown format, non-positive ``block_size``, or a block size the format does not support;
            a ``tensor_parallel_size`` that does not split the model; ``num_layers`` not a positive int.
    """
    check_formats([fmt], "format")
    _positive_int("block_size", block_size)
    tp, _ = cfg.check_parallel(tensor_parallel_size)
    layers = cfg.num_layers if num_layers is None else _positive_int("num_layers", num_layers)
    f = get_format(fmt)
    if fmt in COMPRESSED_PRESETS:
        per_head = f.layout(cfg.head_dim, block_size).page_bytes
    else:
        per_head = block_size * f.bytes_per_token_per_head(cfg.head_dim)
    return layers * parallel.kv_heads_per_rank(cfg.num_kv_heads, tp) * per_head


def kv_cache_bytes(gpu_memory_gb: float = DEFAULT_GPU_MEMORY_GB,
                   gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
                   weights_gb: float | None = None, overhead_gb: float = DEFAULT_OVERHEAD_GB,
                   cfg: ModelConfig | None = None, *, tensor_parallel_size: int = 1,
                   pipeline_parallel_size: int = 1, stage: int = 0) -> int:
    """Bytes vLLM leaves for the KV cache on one GPU: ``utilization x memory - weights - overhead`` (GiB inputs,
    per GPU).

    ``weights_gb=None`` takes the weights of one GPU of pipeline stage ``stage`` at ``tensor_parallel_size``
    (:meth:`ModelConfig.rank_weights_bytes`; ``cfg`` default: the bundled Qwen3-4B config; N = M = 1:
    ``cfg.weights_bytes``); a given ``weights_gb`` is the whole model's, split evenly over the N x M GPUs.

    Raises:
        ValueError: a non-positive memory, a utilization outside (0, 1], negative weights/overhead, a parallel size
            that does not split the model, ``stage`` not in 0..M-1, or nothing left for the KV cache (message gives
            the numbers).
    """
    _number("gpu_memory_gb", gpu_memory_gb, positive=True)
    _number("gpu_memory_utilization", gpu_memory_utilization, positive=True, hi=1.0)
    _number("overhead_gb", overhead_gb, lo=0.0)
    cfg = cfg or load_model_config()
    tp, pp = cfg.check_parallel(tensor_parallel_size, pipeline_parallel_size)
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < pp:
        raise ValueError(f"stage must be an int in 0..{pp - 1}, got {stage!r}")
    if weights_gb is None:
        weights = cfg.rank_weights_bytes(tp, pp)[stage]
    else:
        weights = _number("weights_gb", weights_gb, lo=0.0) * GIB / (tp * pp)
    kv = math.floor(gpu_memory_utilization * gpu_memory_gb * GIB - weights - overhead_gb * GIB)
    if kv <= 0:
        raise ValueError(
            f"no memory left for the KV cache: gpu_memory_utilization x gpu_memory_gb = "
            f"{gpu_memory_utilization * gpu_memory_gb:.3f} GiB <= weights {weights / GIB:.3f} GiB + "
            f"overhead_gb {overhead_gb:.3f} GiB"
            + (f" (per GPU, tensor_parallel_size={tp}, pipeline_parallel_size={pp}, stage {stage})"
               if tp * pp > 1 else "")
        )
    return kv


def num_gpu_blocks(kv_bytes: int, page_bytes: int) -> int:
    """Whole blocks that fit: ``floor(kv_bytes / page_bytes)`` (both in bytes, all layers)."""
    _nonneg_int("kv_bytes", kv_bytes)
    _positive_int("page_bytes", page_bytes)
    return kv_bytes // page_bytes


def blocks_per_request(tokens: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Blocks one request of ``tokens`` (prompt + decode) holds at its end: ``ceil(tokens / block_size)``."""
    _positive_int("tokens", tokens)
    _positive_int("block_size", block_size)
    return -(-tokens // block_size)


def users_that_fit(fmt: str, context_tokens: int, decode_tokens: int, *,
                   gpu_memory_gb: float = DEFAULT_GPU_MEMORY_GB,
                   gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
                   weights_gb: float | None = None, overhead_gb: float = DEFAULT_OVERHEAD_GB,
                   block_size: int = DEFAULT_BLOCK_SIZE, cfg: ModelConfig | None = None,
                   tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> dict:
    """Capacity of one format for users of ``context_tokens + decode_tokens`` each.

    With ``tensor_parallel_size`` N and ``pipeline_parallel_size`` M the engine spans N x M GPUs of
    ``gpu_memory_gb`` each; every GPU sizes its own KV cache and vLLM keeps the smallest block count of all of them
    (see the module docstring). Byte and memory figures below are then per GPU (of the stage that sets the block
    count); token and user counts are the engine's (each rank holds those tokens for its own heads).

    Returns:
        dict: format, bytes_per_token (all layers of one rank's KV heads), page_bytes (one block id on one GPU of
        the binding stage), kv_cache_gib (per GPU, that stage), num_gpu_blocks, kv_cache_tokens
        (= num_gpu_blocks x block_size, as vLLM reports it; the KV tokens of every rank), tokens_per_user,
        blocks_per_user, users_fit (= (num_gpu_blocks - 1) // blocks_per_user: the null block is not usable),
        tensor_parallel_size, pipeline_parallel_size, num_gpus (N x M), kv_heads_per_rank, weights_gib_per_gpu
        (that stage's GPU).

    Raises:
        ValueError: unknown format; ``context_tokens`` not a positive int; ``decode_tokens`` negative
            or not an int; any memory parameter out of range (see :func:`kv_cache_bytes`); a parallel size that does
            not split the model (:meth:`ModelConfig.check_parallel`, naming it and the allowed sizes).
    """
    cfg = cfg or load_model_config()
    _positive_int("context_tokens", context_tokens)
    _nonneg_int("decode_tokens", decode_tokens)
    tp, pp = cfg.check_parallel(tensor_parallel_size, pipeline_parallel_size)
    tokens = context_tokens + decode_tokens
    best = None
    for stage, (a, b) in enumerate(parallel.pp_layer_ranges(cfg.num_layers, pp)):
        kv = kv_cache_bytes(gpu_memory_gb, gpu_memory_utilization, weights_gb, overhead_gb, cfg,
                            tensor_parallel_size=tp, pipeline_parallel_size=pp, stage=stage)
        page = page_bytes_all_layers(fmt, cfg, block_size, tensor_parallel_size=tp, num_layers=b - a)
        blocks = num_gpu_blocks(kv, page)
        if best is None or blocks < best[2]:   # vLLM: every worker gets the smallest count of all workers
            best = (kv, page, blocks, stage)
    kv, page, blocks, stage = best
    per_user = blocks_per_request(tokens, block_size)
    if weights_gb is None:
        weights = cfg.rank_weights_bytes(tp, pp)[stage]
    else:
        weights = weights_gb * GIB / (tp * pp)
    return {
        "format": fmt,
        "bytes_per_token": bytes_per_token(fmt, cfg, tensor_parallel_size=tp),
        "page_bytes": page,
        "kv_cache_gib": kv / GIB,
        "num_gpu_blocks": blocks,
        "kv_cache_tokens": blocks * block_size,
        "tokens_per_user": tokens,
        "blocks_per_user": per_user,
        "users_fit": max(0, blocks - 1) // per_user,
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "num_gpus": tp * pp,
        "kv_heads_per_rank": parallel.kv_heads_per_rank(cfg.num_kv_heads, tp),
        "weights_gib_per_gpu": weights / GIB,
    }


def capacity_table(formats=FORMAT_NAMES, context_tokens: int = 131_072, decode_tokens: int = 1024, **kwargs):
    """:func:`users_that_fit` for each format as a pandas DataFrame (one row per format) with
    ``vs_bf16`` = users_fit / bf16's users_fit (NaN when bf16 fits none or is not listed).

    ``kwargs`` go to :func:`users_that_fit`. Raises ValueError like it (``formats`` named on a bad list).
    """
    import pandas as pd

    formats = check_formats(list(formats) if isinstance(formats, tuple) else formats)
    rows = [users_that_fit(f, context_tokens, decode_tokens, **kwargs) for f in formats]
    df = pd.DataFrame(rows)
    base = df.loc[df["format"] == "bf16", "users_fit"]
    df["vs_bf16"] = df["users_fit"] / base.iloc[0] if len(base) and base.iloc[0] > 0 else float("nan")
    return df


# Notebook 02's headers for the columns of capacity_table (units and meanings: arithmetic_view's note).
ARITHMETIC_HEADERS = {"format": "format", "bytes_per_token": "bytes per token", "page_bytes": "page bytes",
                      "kv_cache_gib": "KV GiB", "num_gpu_blocks": "blocks", "kv_cache_tokens": "KV tokens",
                      "tokens_per_user": "tokens per user", "blocks_per_user": "blocks per user", "users_fit": "users",
                      "vs_bf16": "users vs bf16"}
# Columns of the parallel setup: one value for every format, stated once in the note instead of a column each.
SETUP_COLUMNS = {"tensor_parallel_size": lambda v: f"tensor_parallel_size {v}",
                 "pipeline_parallel_size": lambda v: f"pipeline_parallel_size {v}",
                 "num_gpus": lambda v: f"{v} GPU" + ("" if v == 1 else "s"),
                 "kv_heads_per_rank": lambda v: f"{v} KV heads per GPU",
                 "weights_gib_per_gpu": lambda v: f"weights {v:.2f} GiB per GPU"}


def arithmetic_view(table):
    """A :func:`capacity_table` narrow enough to read (notebook 02): short headers (:data:`ARITHMETIC_HEADERS`),
    and the parallel-setup columns (:data:`SETUP_COLUMNS`), the same for every format, moved to a note.

    Returns:
        ``(DataFrame, note)``: the table with renamed columns (a setup column whose values differ between rows stays,
        under its own name) and one markdown sentence with the setup and what each header means.
    """
    setup = [c for c in SETUP_COLUMNS if c in table.columns and table[c].nunique(dropna=False) == 1]
    view = table.drop(columns=setup).rename(columns=ARITHMETIC_HEADERS)
    same = ", ".join(SETUP_COLUMNS[c](table[c].iloc[0]) for c in setup)
    note = ((f"Every format: {same}. " if same else "")
            + "Bytes per token: KV bytes of one token over all layers (one GPU's KV heads); page bytes: one block over "
            "all layers on one GPU; KV GiB: the KV cache of one GPU; blocks: vLLM's num_gpu_blocks; KV tokens = blocks "
            "x block size; tokens per user = context + decode; blocks per user = ceil(tokens per user / block size); "
            "users = floor((blocks - 1) / blocks per user) (vLLM keeps one null block); users vs bf16: users / bf16's "
            "users.")
    return view, note


def derived_bytes_per_token_per_head(kv_tokens: int, kv_bytes: int, cfg: ModelConfig | None = None) -> float:
    """Bytes per token per KV head implied by a measured KV-token count, *assuming* the KV budget
    ``kv_bytes`` (e.g. the one calibrated on bf16): ``kv_bytes / (kv_tokens x layers x kv_heads)``.
    A derived upper estimate, not a measured byte count (modes may differ slightly in overhead)."""
    cfg = cfg or load_model_config()
    _positive_int("kv_tokens", kv_tokens)
    _positive_int("kv_bytes", kv_bytes)
    return kv_bytes / (kv_tokens * cfg.num_layers * cfg.num_kv_heads)


def card_anchor_table(cfg: ModelConfig | None = None, **kwargs):
    """The card's measured KV-token anchors next to this arithmetic (80 GiB emulated, 128K + 256 per user
    as measured, block 16). Columns: kv_cache_dtype, kv_tokens_measured, kv_tokens_arithmetic (NaN for
    vLLM's turboquant modes, which kvrepro does not model), bytes_per_token_per_head (exact for
    bf16/fp8, *derived* from the measured tokens for turboquant), bytes_source, source."""
    import pandas as pd

    cfg = cfg or load_model_config()
    kv = kv_cache_bytes(cfg=cfg, **kwargs)
    ours = {"auto": "bf16", "fp8": "fp8"}
    rows = []
    for dtype, tokens in CARD_KV_TOKENS.items():
        if dtype in ours:
            cap = users_that_fit(ours[dtype], 131_072, 256, cfg=cfg, **kwargs)
            arith, bpth, src = cap["kv_cache_tokens"], get_format(ours[dtype]).bytes_per_token_per_head(cfg.head_dim), "format"
        else:
            arith, bpth, src = float("nan"), derived_bytes_per_token_per_head(tokens, kv, cfg), "derived"
        rows.append({"kv_cache_dtype": dtype, "kv_tokens_measured": tokens, "kv_tokens_arithmetic": arith,
                     "bytes_per_token_per_head": round(bpth, 1), "bytes_source": src,
                     "source": "REPRODUCTION-CARD.md (H200 emulating 80 GiB, vLLM 0.20.2, 2026-11-29)"})
    return pd.DataFrame(rows)


def check_workload(context_tokens: int, decode_tokens: int, max_users: int | None = None,
                   block_size: int = DEFAULT_BLOCK_SIZE) -> None:
    """Validate a per-user workload before any work is done.

    Raises:
        ValueError: ``context_tokens`` or ``max_users`` not a positive int, ``decode_tokens`` negative,
            ``block_size`` not a positive int (the message names the parameter and the value).
    """
    _positive_int("context_tokens", context_tokens)
    _nonneg_int("decode_tokens", decode_tokens)
    _positive_int("block_size", block_size)
    if max_users is not None:
        _positive_int("max_users", max_users)


def check_memory(gpu_memory_gb, gpu_memory_utilization=DEFAULT_GPU_MEMORY_UTILIZATION,
                 overhead_gb=DEFAULT_OVERHEAD_GB) -> None:
    """Validate the memory parameters before any work is done (GiB; the utilization is a fraction).

    Raises:
        ValueError: ``gpu_memory_gb`` not a positive finite number, ``gpu_memory_utilization`` not in (0, 1],
            ``overhead_gb`` negative or not finite (the message names the parameter and the value).
    """
    _number("gpu_memory_gb", gpu_memory_gb, positive=True)
    _number("gpu_memory_utilization", gpu_memory_utilization, positive=True, hi=1.0)
    _number("overhead_gb", overhead_gb, lo=0.0)


def kv_demand(formats, max_users: int, context_tokens: int, decode_tokens: int,
              block_size: int = DEFAULT_BLOCK_SIZE, cfg: ModelConfig | None = None, *,
              tensor_parallel_size: int = 1):
    """KV memory that 1..``max_users`` users need, in whole blocks, per format; with ``tensor_parallel_size`` N,
    on each TP rank (its KV heads only), to compare with :func:`users_that_fit`'s per-GPU ``kv_cache_gib``.

    Returns:
        DataFrame: format, users, kv_gib_needed = users x ceil(tokens / block_size) x page_bytes_all_layers / 2**30.

    Raises:
        ValueError: as :func:`check_workload` and :func:`check_formats`; a ``tensor_parallel_size`` that does not
            split the model.
    """
    import pandas as pd

    formats = check_formats(formats)
    check_workload(context_tokens, decode_tokens, max_users, block_size)
    cfg = cfg or load_model_config()
    per_user = blocks_per_request(context_tokens + decode_tokens, block_size)
    rows = [
        {"format": f, "users": n, "kv_gib_needed":
         n * per_user * page_bytes_all_layers(f, cfg, block_size, tensor_parallel_size=tensor_parallel_size) / GIB}
        for f in formats for n in range(1, max_users + 1)
    ]
    return pd.DataFrame(rows)


def headline(table) -> dict:
    """Notebook 02's headline figures for ``kvrepro.nbsweep`` (recorded by ``nbsweep.record_headline``): the
    memory left for the KV cache (GiB) and, per format, the users that fit, from a :func:`capacity_table`."""
    return {"figures": {"kv_cache_gib": round(float(table["kv_cache_gib"].iloc[0]), 3)},
            "by": ["format"],
            "rows": [{"format": str(r.format), "users_fit": int(r.users_fit)} for r in table.itertuples()]}
