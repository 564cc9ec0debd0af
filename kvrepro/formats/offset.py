"""Key offset: a constant per (layer, KV head) subtracted from every key before it is compressed.

Method. Attention weights are ``softmax_j(q . k_j * scale)``. Subtracting one vector ``c`` from every key a query
sees shifts each of its logits by the same ``-q . c * scale``, and softmax is invariant to a shift common to all its
inputs, so attention over ``k_j - c`` equals attention over ``k_j`` exactly: nothing is added back, no kernel changes,
no byte is stored per token. What changes is what the quantizer sees. Keys carry a large mean in a few channels (a
key-projection bias, or the learned mean of ``W_k x``; after RoPE it stays nearly constant in the slowest-turning
channel pairs, where models' massive key values sit: Jin et al., 2025, arXiv:2502.01563), and a per-token quantizer
spends its range on that mean. Removing it leaves the small per-token part, the part that decides attention, to the
codes. Smoothing K by its mean over tokens is SageAttention's (Zhang et al., 2024, arXiv:2410.02367, section 3.2).

The shift is exact only if every key a query attends was stored with the same ``c``: one ``c`` per layer and KV head
for the engine's lifetime, shared by every request (prefix-cache pages are shared across requests). kvrepro takes it
from the first prefill the engine runs (``calibrate``, once; the pattern of vLLM's ``calculate_kv_scales``, which
sets fp8 scales from the first forward pass): the mean over that prefill's keys, per KV head and channel. Before
calibration ``c = 0``. Attention-logit soft-capping (``tanh``) is not shift-invariant: the vLLM backend refuses such
layers already.

Pages written with one ``c`` are only valid with that ``c``: pages moved between engines (KV transfer, offloading)
need the same offsets, which kvrepro does not export.
"""
from __future__ import annotations

import torch

MODES = ("first-prefill", "off")


def check_mode(mode: str) -> str:
    """``mode`` if it is one of ``MODES``; ValueError naming ``key_offset`` and the allowed values otherwise."""
    if mode not in MODES:
        raise ValueError(f"key_offset={mode!r}; allowed: {', '.join(MODES)}")
    return mode


class KeyOffset:
    """The offset ``c`` of one layer: float32 ``[num_kv_heads, head_dim]``, zero until :meth:`calibrate`.

    Args:
        num_kv_heads, head_dim: the layer's KV geometry (positive ints).
        device: where ``c`` lives (a persistent buffer: CUDA graphs captured before calibration read the
            calibrated values, because :meth:`calibrate` copies in place).

    Attributes:
        offset: the float32 ``[num_kv_heads, head_dim]`` buffer ``c``.
        calibrated: whether :meth:`calibrate` ran.
        tokens: how many keys the calibration averaged (0 before).
    """

    def __init__(self, num_kv_heads: int, head_dim: int, device: torch.device | str = "cpu") -> None:
        for name, v in (("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.offset = torch.zeros(num_kv_heads, head_dim, dtype=torch.float32, device=device)
        self._cast: dict[torch.dtype, torch.Tensor] = {}   # c in each key dtype seen: one subtraction kernel per call
        self.calibrated = False
        self.tokens = 0

    def to(self, device: torch.device | str) -> "KeyOffset":
        """Move ``c`` to ``device`` (before any CUDA-graph capture that reads it)."""
        self.offset = self.offset.to(device)
        self._cast = {}
        return self

    def calibrate(self, key: torch.Tensor) -> None:
        """Set ``c`` to the mean of ``key`` ``[T, num_kv_heads, head_dim]`` over its ``T >= 1`` tokens (float32),
        in place; later calls do nothing (one ``c`` for the engine's lifetime).

        Raises:
            ValueError: a shape other than ``[T >= 1, num_kv_heads, head_dim]``.
        """
        if self.calibrated:
            return
        h, d = self.offset.shape
        if key.dim() != 3 or key.shape[1:] != (h, d) or key.shape[0] < 1:
            raise ValueError(f"key must be [T >= 1, {h}, {d}], got {tuple(key.shape)}")
        self.offset.copy_(key.float().mean(0))
        for c in self._cast.values():   # in place: graphs captured before calibration read these buffers
            c.copy_(self.offset)
        self.calibrated = True
        self.tokens = int(key.shape[0])

    def apply(self, key: torch.Tensor) -> torch.Tensor:
        """``key - c`` (``key``: ``[T, num_kv_heads, head_dim]`` on ``c``'s device), in ``key``'s dtype with ``c``
        rounded to it: one kernel, and any constant keeps the shift exact."""
        c = self._cast.get(key.dtype)
        if c is None:
            c = self._cast[key.dtype] = self.offset.to(key.dtype).clone()
        return key - c
