"""Key offset: a constant per (layer, KV head) subtracted from every key before it is compressed.

Method. Attention weights are ``softmax_j(q . k_j * scale)``. Subtracting one vector ``c`` from every key a query
sees shifts each of its logits by the same ``-q . c * scale``, and softmax is invariant to a shift common to all its
inputs, so attention over ``k_j - c`` equals attention over ``k_j`` exactly: nothing is added back, no kernel changes,
no byte is stored per token. What changes is what the quantizer sees. Keys carry a large mean in a few channels (a
key-projection bias, or the learned mean of ``W_k x``; after RoPE it stays nearly constant in the slowest-turning
channel pairs, where models' massive key values sit: Jin et al., 2025, arXiv:2502.01563), and a per-token quantizer
spends its range on that mean. Removing it leaves the small per-token part, the part that decides attention, to the
codes. Smoothing K by its mean over tokens is SageAttention's (Zhang et al., 2024, arXiv:2410.02367, section 3.2).

Which channels. A key's mean is only constant over positions where RoPE barely turns it: in a channel pair that
turns by ``theta_i x position``, a mean taken over the first prefill's positions is the wrong constant far beyond
them (it is rotated away there, and subtracting it can double that pair's mean instead of removing it). The default
``slow-pairs`` therefore subtracts the mean only in the pairs that turn by less than ``MAX_ANGLE`` (pi / 4) over the
engine's longest context (``slow_channels``; RoPE frequencies ``theta^(-2i / rotary_dim)``, Su et al. 2021,
arXiv:2104.09864; context-extension scalings only slow the low frequencies down, so the unscaled ones are the safe
bound) and in channels RoPE does not rotate; there the constant is right at every position, whatever the first
prefill was. ``first-prefill`` subtracts the mean in every channel: best when the first prefill is as long as later
contexts, no better than ``off`` when it is short (a 256-token first prefill on SmolLM2: notes/accuracy.md).

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

import math

import torch

MODES = ("slow-pairs", "first-prefill", "off")
MAX_ANGLE = math.pi / 4   # radians a pair may turn over the longest context and still count as constant


def check_mode(mode: str) -> str:
    """``mode`` if it is one of ``MODES``; ValueError naming ``key_offset`` and the allowed values otherwise."""
    if mode not in MODES:
        raise ValueError(f"key_offset={mode!r}; allowed: {', '.join(MODES)}")
    return mode


def slow_channels(head_dim: int, rope_theta: float, max_positions: int, rotary_dim: int | None = None,
                  neox: bool | None = True, max_angle: float = MAX_ANGLE) -> torch.Tensor:
    """bool ``[head_dim]``: the channels whose RoPE pair turns by less than ``max_angle`` radians over
    ``max_positions`` positions (``theta_i = rope_theta^(-2i / rotary_dim)``), plus the channels beyond
    ``rotary_dim`` (not rotated). ``neox``: True = half-split pairs ``(i, i + rotary_dim / 2)`` (HF's
    ``rotate_half``, vLLM's ``is_neox_style``), False = interleaved pairs ``(2i, 2i + 1)``, None = unknown: only
    channels slow under both layouts.

    Raises:
        ValueError: a non-positive ``head_dim`` / ``max_positions`` / ``rope_theta``, or ``rotary_dim`` odd or above
            ``head_dim``.
    """
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    if head_dim < 1 or max_positions < 1 or not rope_theta > 0:
        raise ValueError(f"slow_channels needs head_dim, max_positions, rope_theta > 0, got {head_dim}, "
                         f"{max_positions}, {rope_theta}")
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}")
    half = rotary_dim // 2
    inv = float(rope_theta) ** (-torch.arange(half, dtype=torch.float64) * 2 / rotary_dim)
    slow = inv * max_positions < max_angle
    split = torch.cat([slow, slow])
    inter = slow.repeat_interleave(2)
    rot = split if neox is True else inter if neox is False else split & inter
    return torch.cat([rot, torch.ones(head_dim - rotary_dim, dtype=torch.bool)])


def mode_channels(mode: str, head_dim: int, rope: dict | None) -> torch.Tensor | None:
    """The ``channels`` of a :class:`KeyOffset` in ``mode``: ``slow_channels`` of ``rope`` (``rope_of_config``'s dict;
    its optional ``"neox"`` gives the pair layout, absent = unknown) for ``"slow-pairs"``, None (every channel)
    otherwise."""
    if mode != "slow-pairs":
        return None
    return slow_channels(head_dim, rope["rope_theta"], rope["max_positions"], rope.get("rotary_dim"),
                         neox=rope.get("neox"))


def rope_of_config(cfg, max_positions: int | None = None) -> dict:
    """``{"rope_theta", "rotary_dim", "head_dim", "max_positions"}`` of a Hugging Face model config (``rope_parameters``
    or ``rope_theta``, ``partial_rotary_factor``, ``head_dim`` or hidden_size / num_attention_heads,
    ``max_position_embeddings`` unless ``max_positions`` is given, e.g. vLLM's ``max_model_len``).

    Raises:
        ValueError: no RoPE theta or no max positions in ``cfg`` (naming the missing field).
    """
    rp = getattr(cfg, "rope_parameters", None) or {}
    if isinstance(rp, dict) and "rope_theta" not in rp and rp:   # per-layer-type parameters (e.g. full/sliding)
        rp = next((v for v in rp.values() if isinstance(v, dict) and "rope_theta" in v), {})
    theta = rp.get("rope_theta") if isinstance(rp, dict) else None
    theta = theta if theta is not None else getattr(cfg, "rope_theta", None)
    if theta is None:
        raise ValueError("key_offset='slow-pairs' needs the model's RoPE theta (rope_parameters['rope_theta'] or "
                         "rope_theta in its config); none found: set key_offset to 'first-prefill' or 'off'")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    n = max_positions or getattr(cfg, "max_position_embeddings", None)
    if not n:
        raise ValueError("key_offset='slow-pairs' needs the longest context (max_position_embeddings or "
                         "max_model_len)")
    rotary = int(head_dim * float(getattr(cfg, "partial_rotary_factor", 1.0) or 1.0)) // 2 * 2
    return {"rope_theta": float(theta), "rotary_dim": rotary, "head_dim": int(head_dim), "max_positions": int(n)}


class KeyOffset:
    """The offset ``c`` of one layer: float32 ``[num_kv_heads, head_dim]``, zero until :meth:`calibrate`.

    Args:
        num_kv_heads, head_dim: the layer's KV geometry (positive ints).
        device: where ``c`` lives (a persistent buffer: CUDA graphs captured before calibration read the
            calibrated values, because :meth:`calibrate` copies in place).
        channels: bool ``[head_dim]``, the channels the mean is subtracted in (``slow_channels``); None = all.

    Attributes:
        offset: the float32 ``[num_kv_heads, head_dim]`` buffer ``c``.
        calibrated: whether :meth:`calibrate` ran.
        tokens: how many keys the calibration averaged (0 before).
    """

    def __init__(self, num_kv_heads: int, head_dim: int, device: torch.device | str = "cpu",
                 channels: torch.Tensor | None = None) -> None:
        for name, v in (("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if channels is not None and (channels.dtype != torch.bool or tuple(channels.shape) != (head_dim,)):
            raise ValueError(f"channels must be a bool tensor of shape ({head_dim},), got {channels.dtype} "
                             f"{tuple(channels.shape)}")
        self.channels = None if channels is None else channels.cpu()
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
        """Set ``c`` to the mean of ``key`` ``[T, num_kv_heads, head_dim]`` over its ``T >= 1`` tokens (float32) in
        the selected ``channels`` (0 elsewhere), in place; later calls do nothing (one ``c`` for the engine's
        lifetime).

        Raises:
            ValueError: a shape other than ``[T >= 1, num_kv_heads, head_dim]``.
        """
        if self.calibrated:
            return
        h, d = self.offset.shape
        if key.dim() != 3 or key.shape[1:] != (h, d) or key.shape[0] < 1:
            raise ValueError(f"key must be [T >= 1, {h}, {d}], got {tuple(key.shape)}")
        mean = key.float().mean(0)
        if self.channels is not None:
            mean = mean * self.channels.to(mean.device)
        self.offset.copy_(mean)
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
