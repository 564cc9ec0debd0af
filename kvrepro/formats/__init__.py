"""KV-cache formats. ``get_format(name)`` returns one; ``FORMAT_NAMES`` lists them all.

| name  | what                                               | B/token/head at head_dim 128 |
| ----- | -------------------------------------------------- | ---------------------------- |
| bf16  | 16-bit KV in the model dtype (vLLM ``auto``)       | 512 |
| fp8   | E4M3, per-layer scale (vLLM ``fp8``)               | 256 |
| k8v4  | compressed: 8-bit K, 4-bit V                       | 198 |
| k4v4  | compressed: 4-bit K, 4-bit V (kvrepro's default)   | 134 |
| k4v2  | compressed: 4-bit K, 2-bit V (sub-4-bit: 3 b/elem) | 102 |
"""
from __future__ import annotations

from kvrepro.formats.base import KVFormat, KVPool
from kvrepro.formats.compressed import CompressedFormat
from kvrepro.formats.dense import BF16Format, FP8Format
from kvrepro.formats.layout import PageLayout

COMPRESSED_PRESETS = {"k4v4": (4, 4), "k8v4": (8, 4), "k4v2": (4, 2)}
DEFAULT_PRESET = "k4v4"
FORMAT_NAMES = ("bf16", "fp8", *COMPRESSED_PRESETS)


def get_format(name: str, **kwargs) -> KVFormat:
    """Format by name (``FORMAT_NAMES``); ``kwargs`` go to the format (e.g. ``scale`` for fp8).

    Raises:
        ValueError: unknown name (the message lists the allowed names).
    """
    if name == "bf16":
        return BF16Format(**kwargs)
    if name == "fp8":
        return FP8Format(**kwargs)
    if name in COMPRESSED_PRESETS:
        kb, vb = COMPRESSED_PRESETS[name]
        return CompressedFormat(name, kb, vb, **kwargs)
    raise ValueError(f"unknown KV format {name!r}; allowed: {', '.join(FORMAT_NAMES)}")


__all__ = ["KVFormat", "KVPool", "PageLayout", "CompressedFormat", "BF16Format", "FP8Format",
           "COMPRESSED_PRESETS", "DEFAULT_PRESET", "FORMAT_NAMES", "get_format"]
