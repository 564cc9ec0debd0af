"""KV-cache formats. ``get_format(name)`` returns one; ``FORMAT_NAMES`` lists them all.

| name  | what                                                               | B/token/head at head_dim 128 |
| ----- | ------------------------------------------------------------------ | ---------------------------- |
| bf16  | 16-bit KV in the model dtype (vLLM ``auto``)                       | 512 |
| fp8   | E4M3, per-layer scale (vLLM ``fp8``)                               | 256 |
| k8v4  | compressed: 8-bit K, 4-bit V                                       | 198 |
| k4v4  | compressed: 4-bit K, 4-bit V (capacity and speed: CUDA kernel)     | 134 |
| k4v2  | compressed: 4-bit K, 2-bit V (sub-4-bit: 3 b/elem)                 | 102 |
| k5v4  | compressed: 5-bit symmetric K, 4-bit V with a one-byte log2 scale  | 147 |
|       | (kvrepro's default: closest to fp8 at 12 users, notes/accuracy.md) |     |

Every compressed preset stores keys minus a per-layer constant (``kvrepro.formats.offset``).
"""
from __future__ import annotations

from kvrepro.formats.base import KVFormat, KVPool
from kvrepro.formats.compressed import CompressedFormat
from kvrepro.formats.dense import BF16Format, FP8Format
from kvrepro.formats.layout import PageLayout

# preset -> (key bits, value bits); the quantization scheme where it is not the default (asymmetric keys, float16
# value scale) in PRESET_SCHEMES (CompressedFormat's keyword arguments).
COMPRESSED_PRESETS = {"k4v4": (4, 4), "k8v4": (8, 4), "k4v2": (4, 2), "k5v4": (5, 4)}
PRESET_SCHEMES = {"k5v4": {"key_symmetric": True, "value_log_scale": True}}
DEFAULT_PRESET = "k5v4"
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
        return CompressedFormat(name, kb, vb, **{**PRESET_SCHEMES.get(name, {}), **kwargs})
    raise ValueError(f"unknown KV format {name!r}; allowed: {', '.join(FORMAT_NAMES)}")


def preset_of(layout: PageLayout) -> str | None:
    """The compressed preset whose pages ``layout`` describes (bits and scheme; any head_dim / block size), or None."""
    for name, (kb, vb) in COMPRESSED_PRESETS.items():
        scheme = PRESET_SCHEMES.get(name, {})
        if (layout.key_bits, layout.value_bits, layout.key_symmetric, layout.value_log_scale) == (
                kb, vb, scheme.get("key_symmetric", False), scheme.get("value_log_scale", False)):
            return name
    return None


__all__ = ["KVFormat", "KVPool", "PageLayout", "CompressedFormat", "BF16Format", "FP8Format",
           "COMPRESSED_PRESETS", "PRESET_SCHEMES", "DEFAULT_PRESET", "FORMAT_NAMES", "get_format", "preset_of"]
