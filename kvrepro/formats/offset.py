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
them (it is rotated away there, and subtracting it can double that pair's mean instead of removing it).
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

``rope-mean`` (:class:`RopeMean`, the compressed presets' default): a per-position offset for a bias added *before*
RoPE, as models add their key-projection bias. After RoPE such a bias is ``R(p) b`` at position ``p``: in the fast
pairs it turns by up to ~1 rad per position, so no constant removes it. Un-rotating each calibration key by its position gives the pre-RoPE
mean ``b_hat = mean_p R(p)^-1 k_p`` per KV head (KVQuant quantizes keys before RoPE for this reason: Hooper et al.
2024, arXiv:2401.18079, section 3.2; the large means sit in few pairs, mostly low-frequency ones: Jin et al. 2025,
arXiv:2502.01563). The store keeps ``k_p - R(p) b_hat`` in the kept pairs; the read adds ``q . R(j) b_hat`` back to
each paged key's score (``A_i cos(j theta_i) + B_i sin(j theta_i)``, :meth:`RopeMean.score_terms`), so the scores are
those of the exact keys (to float32 rounding), in every pair, at every position: no softmax invariance is needed and a
prefill chunk's own keys are attended unshifted. Angles are the exact products ``position x inv_freq`` (float64:
an int below 2^24 times a float32 frequency), with ``inv_freq = 1 / theta^(arange(0, rotary_dim, 2) / rotary_dim)`` in
float32 as vLLM's ``RotaryEmbedding`` and transformers' default RoPE compute it, and their cos / sin rounded once to
float32. Exact angles make the correction separable by angle addition (``j = n0 + t``: a table of ``t theta_i`` per
kernel and one turn per key tile, no trigonometry per key: ``kvrepro.ops.triton.attention``); the models' own cos/sin
caches round the angle to float32 first, so at position ``p`` the removed ``R(p) b_hat`` is off the model's rotation
by at most half a float32 ulp of ``p theta_i`` (2^-24 of the angle: 2^-8 rad in the fastest pair at 131,071), and at
most that fraction of ``|b_hat|`` stays in the stored residual, never in the scores. The scores are exact whatever frequencies are used, since the store and the read use the same ones;
a model whose RoPE is scaled (e.g. Llama 3.1's) gets a less effective offset, never a wrong score. The correction costs
decode time (``benchmarks/results/decode_rope_mean.json``): per key tile in the Triton kernel, per page in the CUDA
kernels (the same angle addition: a sine and a cosine of the page's start angle per pair); ``slow-pairs`` costs none.
"""
from __future__ import annotations

import math
import numbers

import torch

MODES = ("slow-pairs", "first-prefill", "off", "rope-mean")
MAX_ANGLE = math.pi / 4   # radians a pair may turn over the longest context and still count as constant
MAX_PAIRS = 8             # rope-mean: pairs kept per (layer, KV head); the kernels' fixed (constexpr) slot count
KEEP_RATIO = 1.0          # rope-mean: a pair is kept when |b_hat pair| > KEEP_RATIO x the keys' RMS pair spread


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


ROPE_KEYS = ("rope_theta", "rotary_dim", "neox", "head_dim", "max_positions")   # what rope_of_config (+ neox) gives
INT_DTYPES = (torch.int32, torch.int64)


def check_rope(rope, head_dim: int) -> dict:
    """``rope`` if it is a RoPE description :class:`RopeMean` can use: a dict of ``ROPE_KEYS`` only, ``rope_theta`` a
    positive finite number, ``rotary_dim`` None or an even int in (0, ``head_dim``], ``neox`` True, False or None.

    Raises:
        ValueError: naming the field and what it may be (a typo'd key, a theta given as a string, a zero rotary_dim
            would otherwise be ignored or coerced).
    """
    if not isinstance(rope, dict):
        raise ValueError(f"rope must be a dict with keys from {ROPE_KEYS} (rope_theta required), got "
                         f"{type(rope).__name__}")
    unknown = sorted(set(rope) - set(ROPE_KEYS))
    if unknown:
        raise ValueError(f"rope has unknown keys {unknown}; allowed: {', '.join(ROPE_KEYS)}")
    if rope.get("rope_theta") is None:
        raise ValueError("key_offset='rope-mean' needs the model's RoPE (rope_theta; offset.rope_of_config)")
    theta = rope["rope_theta"]
    if isinstance(theta, bool) or not isinstance(theta, numbers.Real) or not math.isfinite(theta) or theta <= 0:
        raise ValueError(f"rope['rope_theta'] must be a positive finite number, got {theta!r}")
    rotary = rope.get("rotary_dim")
    if rotary is not None and (isinstance(rotary, bool) or not isinstance(rotary, numbers.Integral)):
        raise ValueError(f"rope['rotary_dim'] must be an int or None (= head_dim), got {rotary!r}")
    rope_pairs(head_dim, head_dim if rotary is None else int(rotary), True)        # even, in (0, head_dim]
    if rope.get("neox") is not None and not isinstance(rope.get("neox"), bool):
        raise ValueError(f"rope['neox'] must be True, False or None (read at calibration), got {rope['neox']!r}")
    return rope


def check_rows(name: str, t, heads: int, head_dim: int) -> int:
    """The row count ``n`` of ``t`` if it is a tensor ``[n, heads, head_dim]``; ValueError naming ``name`` and the
    expected shape otherwise (a head count of 1 or a wrong one would broadcast or leave heads untouched silently)."""
    if not isinstance(t, torch.Tensor) or t.dim() != 3 or tuple(t.shape[1:]) != (heads, head_dim):
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be [n, num_kv_heads={heads}, head_dim={head_dim}], got {got}")
    return int(t.shape[0])


def check_positions(pos, n: int | None = None) -> None:
    """ValueError unless ``pos`` is an int32 / int64 tensor ``[n]`` (any length if ``n`` is None). Its values (>= 0,
    below 2^24) are the caller's: checking them would sync the host on every store."""
    if not isinstance(pos, torch.Tensor) or pos.dtype not in INT_DTYPES or pos.dim() != 1 or (
            n is not None and pos.shape[0] != n):
        got = f"{pos.dtype} {tuple(pos.shape)}" if isinstance(pos, torch.Tensor) else type(pos).__name__
        want = f"[{n}]" if n is not None else "[n]"
        raise ValueError(f"pos must be an int32 or int64 tensor {want} (token positions), got {got}")


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
        rounded to it: one kernel, and any constant keeps the shift exact. ValueError for another shape."""
        check_rows("key", key, *self.offset.shape)
        c = self._cast.get(key.dtype)
        if c is None:
            c = self._cast[key.dtype] = self.offset.to(key.dtype).clone()
        return key - c


def rope_inv_freq(rotary_dim: int, rope_theta: float) -> torch.Tensor:
    """float32 ``[rotary_dim / 2]``: ``1 / rope_theta^(arange(0, rotary_dim, 2) / rotary_dim)`` computed in float32 on
    the CPU, the expression of vLLM's ``RotaryEmbedding._compute_inv_freq`` and transformers'
    ``_compute_default_rope_parameters`` (Su et al. 2021, arXiv:2104.09864), so that angles ``position x inv_freq``
    round as the model's do.

    Raises:
        ValueError: ``rotary_dim`` not a positive even int, or ``rope_theta`` not > 0.
    """
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even int, got {rotary_dim!r}")
    if not float(rope_theta) > 0:
        raise ValueError(f"rope_theta must be > 0, got {rope_theta!r}")
    return 1.0 / (float(rope_theta) ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))


def rope_pairs(head_dim: int, rotary_dim: int, neox: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 ``(x, y)``, each ``[head_dim // 2]``: the channel pairs RoPE rotates (``neox`` True: half-split ``(i, i +
    rotary_dim / 2)``; False: interleaved ``(2i, 2i + 1)``), then the unrotated tail beyond ``rotary_dim`` as pairs
    ``(r, r + 1)`` (their frequency is 0: a constant there). An odd last tail channel is left out.

    Raises:
        ValueError: ``neox`` not a bool (the pair layout must be known), ``rotary_dim`` odd or above ``head_dim``.
    """
    if not isinstance(neox, bool):
        raise ValueError(f"key_offset='rope-mean' needs the RoPE pair layout (neox True = half-split, False = "
                         f"interleaved), got {neox!r}")
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}")
    half = rotary_dim // 2
    i = torch.arange(half)
    x, y = (i, i + half) if neox else (2 * i, 2 * i + 1)
    tail = torch.arange(rotary_dim, max(rotary_dim, head_dim - 1), 2)
    return torch.cat([x, tail]), torch.cat([y, tail + 1])


# query dtypes the score terms take: the model's (bf16, fp16, fp32) and float64 for references
QUERY_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


class RopeMean:
    """The per-position key offset ``R(p) b_hat`` of one layer (``key_offset="rope-mean"``; module docstring).

    Pairs are those of :func:`rope_pairs`; per KV head up to ``MAX_PAIRS`` of them are kept, in slots
    (unused slots: bias 0, frequency 0, channel 0, so they add nothing).

    Rule (:meth:`calibrate`): ``b_hat`` = the mean over the calibration keys of ``R(p)^-1 k_p``; pair ``i`` is kept when
    ``|b_hat_i| > KEEP_RATIO x s`` with ``s`` the RMS over tokens and pairs of ``|R(p)^-1 k_p,i - b_hat_i|`` (the
    typical per-token spread of one pair: below it the quantizer's range is not spent on the mean), the
    ``MAX_PAIRS`` largest if more qualify.

    Args:
        num_kv_heads, head_dim: the layer's KV geometry (positive ints).
        rope: ``{"rope_theta", "rotary_dim" (default head_dim), "neox"}`` (``rope_of_config`` plus the pair layout:
            True / False, or None until :meth:`calibrate`, which needs it: the vLLM backend reads it from vLLM's rotary
            embeddings then; ``self.rope`` may be updated before).
        device: where the buffers live (persistent: :meth:`calibrate` copies in place, so CUDA graphs captured
            before it read the calibrated values). Every tensor passed to a method must be on this device (:meth:`to`
            moves the buffers): a ValueError names the one that is not, where a silent copy would hide a misplaced
            tensor, sync the host and fail under CUDA-graph capture.

    Attributes:
        x_ch, y_ch: int64 ``[num_kv_heads, MAX_PAIRS]`` the channels of each slot's pair.
        inv_freq: float32 ``[num_kv_heads, MAX_PAIRS]`` each slot's RoPE frequency (radians per position).
        bias: float32 ``[num_kv_heads, MAX_PAIRS, 2]`` ``b_hat`` of each slot's pair (x, y components).
            These four are written by :meth:`set_slots` only (it repacks the copies each step reads).
        pair_idx, term_coef, rot_coef, xy_ch: those slots packed for :meth:`packed_terms` and :meth:`remove`.
        calibrated, tokens: whether :meth:`calibrate` ran and on how many keys; kept: pairs kept per KV head.

    Raises:
        ValueError: bad geometry, a ``rope`` that :func:`check_rope` refuses, a CUDA ``device`` this PyTorch does not
            see; in the methods, a tensor argument on another device than the buffers, keys not ``[n, num_kv_heads,
            head_dim]`` (:func:`check_rows`), a query not ``[T, Hq, head_dim]`` with Hq a multiple of
            ``num_kv_heads``, positions not an int tensor ``[n]`` (:func:`check_positions`).
    """

    def __init__(self, num_kv_heads: int, head_dim: int, rope: dict, device: torch.device | str = "cpu") -> None:
        for name, v in (("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        check_rope(rope, head_dim)
        if torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={device!r}: this PyTorch sees no CUDA device (use 'cpu')")
        self.num_kv_heads, self.head_dim, self.rope = num_kv_heads, head_dim, dict(rope)
        self.x_ch = torch.zeros(num_kv_heads, MAX_PAIRS, dtype=torch.int64, device=device)
        self.y_ch = torch.zeros_like(self.x_ch)
        self.inv_freq = torch.zeros(num_kv_heads, MAX_PAIRS, dtype=torch.float32, device=device)
        self.bias = torch.zeros(num_kv_heads, MAX_PAIRS, 2, dtype=torch.float32, device=device)
        # The same slots packed for one gather and one multiply per call (what runs every decode step), derived from
        # x_ch, y_ch and bias by _pack, in place; set_slots is the one writer of the slots, so they never disagree.
        self.pair_idx = torch.zeros(num_kv_heads, 4 * MAX_PAIRS, dtype=torch.int64, device=device)
        self.term_coef = torch.zeros(num_kv_heads, 2, 2 * MAX_PAIRS, dtype=torch.float32, device=device)
        self.rot_coef = torch.zeros(num_kv_heads, 2, 2, MAX_PAIRS, dtype=torch.float32, device=device)
        self.xy_ch = torch.zeros(num_kv_heads, 2 * MAX_PAIRS, dtype=torch.int64, device=device)
        self._pack()          # now, not at a first call that may fall inside a CUDA-graph capture
        self.calibrated = False
        self.tokens = 0
        self.kept: list[int] = [0] * num_kv_heads

    def set_slots(self, x_ch: torch.Tensor, y_ch: torch.Tensor, inv_freq: torch.Tensor, bias: torch.Tensor) -> None:
        """Write the kept pairs (``x_ch``, ``y_ch`` int ``[H, MAX_PAIRS]``, ``inv_freq`` float32 ``[H, MAX_PAIRS]``,
        ``bias`` float32 ``[H, MAX_PAIRS, 2]``; unused slots: 0) in place and repack; the one way to change them after
        construction (:meth:`calibrate` uses it), so the packed copies that every step reads never go stale.

        Raises:
            ValueError: a shape other than those.
        """
        h = self.num_kv_heads
        for name, t, shape in (("x_ch", x_ch, (h, MAX_PAIRS)), ("y_ch", y_ch, (h, MAX_PAIRS)),
                               ("inv_freq", inv_freq, (h, MAX_PAIRS)), ("bias", bias, (h, MAX_PAIRS, 2))):
            if tuple(t.shape) != shape:
                raise ValueError(f"RopeMean.set_slots: {name} must be {list(shape)}, got {list(t.shape)}")
        for name, t in (("x_ch", x_ch), ("y_ch", y_ch)):
            if t.dtype.is_floating_point or t.dtype == torch.bool or bool(((t < 0) | (t >= self.head_dim)).any()):
                raise ValueError(f"RopeMean.set_slots: {name} must hold integer channels in [0, head_dim="
                                 f"{self.head_dim})")
        for name, t in (("inv_freq", inv_freq), ("bias", bias)):
            if not bool(torch.isfinite(t).all()) or (name == "inv_freq" and bool((t < 0).any())):
                raise ValueError(f"RopeMean.set_slots: {name} must be finite" + (" and >= 0" if name == "inv_freq"
                                                                                  else ""))
        self.x_ch.copy_(x_ch)
        self.y_ch.copy_(y_ch)
        self.inv_freq.copy_(inv_freq)
        self.bias.copy_(bias)
        self._pack()

    def _pack(self) -> None:
        """Refresh the packed buffers from ``x_ch``, ``y_ch`` and ``bias``, in place (CUDA graphs captured before read
        the new values):

        - ``pair_idx`` ``[H, 4M]``: channels ``x, y, y, x`` of the slots (one gather of the query);
        - ``term_coef`` ``[H, 2, 2M]``: ``[[bx, bx], [by, -by]]``, so that gathered ``[qx, qy]`` x row 0 plus
          gathered ``[qy, qx]`` x row 1 is ``[A, B]`` (:meth:`score_terms`), each term one product pair as before;
        - ``rot_coef`` ``[H, 2, 2, M]``: ``[[-bx, -by], [by, -bx]]``: ``[cos, sin]`` x it, summed over the first axis,
          is ``-R(p) b_hat`` per pair, (x, y) (:meth:`remove` adds it to the key);
        - ``xy_ch`` ``[H, 2M]``: channels ``x, y`` of the slots (one scatter)."""
        bx, by = self.bias[..., 0], self.bias[..., 1]
        self.pair_idx.copy_(torch.cat([self.x_ch, self.y_ch, self.y_ch, self.x_ch], 1))
        self.term_coef.copy_(torch.stack([torch.cat([bx, bx], 1), torch.cat([by, -by], 1)], 1))
        self.rot_coef.copy_(torch.stack([torch.stack([-bx, -by], 1), torch.stack([by, -bx], 1)], 1))
        self.xy_ch.copy_(torch.cat([self.x_ch, self.y_ch], 1))

    def check_device(self, **tensors: torch.Tensor) -> None:
        """ValueError naming the first of ``tensors`` (name=tensor) that is not on the buffers' device."""
        dev = self.bias.device
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"RopeMean: {name} must be a tensor, got {type(t).__name__}")
            if t.device != dev:
                raise ValueError(f"RopeMean: {name} is on {t.device}, the offset's buffers on {dev} (every argument on "
                                 "one device; RopeMean.to(device) moves the buffers)")

    def check_query(self, query: torch.Tensor, dtypes: tuple[torch.dtype, ...] | None = None,
                    contiguous_last: bool = False) -> None:
        """ValueError unless ``query`` is ``[T, Hq, head_dim]`` with ``Hq`` a multiple of ``num_kv_heads`` (query
        head ``h`` reads KV head ``h // (Hq / num_kv_heads)``), of one of ``dtypes`` (None: any) and, with
        ``contiguous_last``, with a contiguous last dimension (what a kernel reading it by strides needs)."""
        h = self.num_kv_heads
        if query.dim() != 3 or query.shape[2] != self.head_dim or query.shape[1] < h or query.shape[1] % h \
                or (dtypes is not None and query.dtype not in dtypes) or (contiguous_last and query.stride(-1) != 1):
            kinds = "" if dtypes is None else " " + ", ".join(str(d).replace("torch.", "") for d in dtypes)
            last = " with a contiguous last dimension" if contiguous_last else ""
            raise ValueError(f"query must be [T, Hq, head_dim={self.head_dim}]{kinds}{last} with Hq a multiple of "
                             f"num_kv_heads={h}, got {tuple(query.shape)} {query.dtype} with last-dimension stride "
                             f"{query.stride(-1) if query.dim() else None}")

    def all_pairs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(x channels, y channels, float32 frequencies)`` of every pair (:func:`rope_pairs`, frequency-0 tail), on
        the buffers' device (the frequencies computed on the CPU, as the models compute theirs, then moved).

        Raises:
            ValueError: ``rope["neox"]`` is not a bool (the layout is still unknown).
        """
        rotary = self.rope.get("rotary_dim")
        rotary = self.head_dim if rotary is None else int(rotary)
        x, y = rope_pairs(self.head_dim, rotary, self.rope.get("neox"))
        inv = torch.cat([rope_inv_freq(rotary, self.rope["rope_theta"]), torch.zeros(x.numel() - rotary // 2)])
        dev = self.bias.device
        return x.to(dev), y.to(dev), inv.to(dev)

    def to(self, device: torch.device | str) -> "RopeMean":
        """Move the buffers to ``device`` (before any CUDA-graph capture that reads them)."""
        for name in ("x_ch", "y_ch", "inv_freq", "bias", "pair_idx", "term_coef", "rot_coef", "xy_ch"):
            setattr(self, name, getattr(self, name).to(device))
        return self

    @staticmethod
    def angles(pos: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
        """float64 ``pos[:, None, ...] x inv_freq[None]`` (``pos`` int ``[n]``, below 2^24; ``inv_freq`` float32): the
        exact product, which the kernels' angle addition reproduces (module docstring). ValueError if ``pos`` and
        ``inv_freq`` are on different devices."""
        if pos.device != inv_freq.device:
            raise ValueError(f"RopeMean.angles: pos is on {pos.device}, inv_freq on {inv_freq.device}")
        check_positions(pos)
        p = pos.to(dtype=torch.float64)
        return p.view(-1, *([1] * inv_freq.dim())) * inv_freq.to(torch.float64).unsqueeze(0)

    @staticmethod
    def cos_sin(pos: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``(cos, sin)`` of :meth:`angles`, each computed in float64 and rounded once."""
        a = RopeMean.angles(pos, inv_freq)
        return a.cos().to(torch.float32), a.sin().to(torch.float32)

    def calibrate(self, key: torch.Tensor, pos: torch.Tensor) -> None:
        """Set ``b_hat`` and the kept pairs from ``key`` ``[T >= 1, num_kv_heads, head_dim]`` at positions ``pos``
        (int ``[T]``), in place; later calls do nothing (one offset for the engine's lifetime).

        Raises:
            ValueError: a shape other than ``[T >= 1, num_kv_heads, head_dim]``, ``pos`` not int ``[T]``, ``key`` or
                ``pos`` not on the buffers' device, a NaN or infinity in ``key`` (the mean, and with it every kept
                pair, would be undefined: nothing is kept silently instead), or the pair layout still unknown
                (``rope["neox"]`` None).
        """
        if self.calibrated:
            return
        h, d = self.num_kv_heads, self.head_dim
        if key.dim() != 3 or tuple(key.shape[1:]) != (h, d) or key.shape[0] < 1:
            raise ValueError(f"key must be [T >= 1, {h}, {d}], got {tuple(key.shape)}")
        if pos.dim() != 1 or pos.shape[0] != key.shape[0]:
            raise ValueError(f"pos must be [T={key.shape[0]}], got {tuple(pos.shape)}")
        self.check_device(key=key, pos=pos)
        check_positions(pos)
        if not bool(torch.isfinite(key).all()):     # calibration runs once and syncs anyway (kept, below)
            raise ValueError("RopeMean.calibrate: key holds NaN or infinite values; the offset is calibrated once "
                             "from finite keys")
        dev = key.device
        ax, ay, inv = self.all_pairs()
        c, s = self.cos_sin(pos, inv)
        c, s = c[:, None], s[:, None]                           # [T, 1, P]
        x, y = key.float()[..., ax], key.float()[..., ay]       # [T, H, P]
        x0, y0 = x * c + y * s, y * c - x * s                   # R(p)^-1 k_p, pair by pair
        bx, by = x0.mean(0), y0.mean(0)                         # [H, P]
        spread = ((x0 - bx) ** 2 + (y0 - by) ** 2).mean((0, 2)).sqrt()      # [H]
        norm = (bx ** 2 + by ** 2).sqrt()
        k = min(MAX_PAIRS, norm.shape[1])
        top = norm.topk(k, dim=1)
        keep = top.values > KEEP_RATIO * spread[:, None]        # [H, k]
        idx = top.indices
        z = torch.zeros(h, MAX_PAIRS, dtype=torch.float32, device=dev)
        zi = torch.zeros(h, MAX_PAIRS, dtype=torch.int64, device=dev)
        xs, ys, fs, bxs, bys = zi.clone(), zi.clone(), z.clone(), z.clone(), z.clone()
        xs[:, :k] = torch.where(keep, ax[idx], 0)
        ys[:, :k] = torch.where(keep, ay[idx], 0)
        fs[:, :k] = torch.where(keep, inv[idx], 0.0)
        bxs[:, :k] = torch.where(keep, bx.gather(1, idx), 0.0)
        bys[:, :k] = torch.where(keep, by.gather(1, idx), 0.0)
        self.set_slots(xs, ys, fs, torch.stack([bxs, bys], -1))
        self.kept = [int(v) for v in keep.sum(1).tolist()]
        self.calibrated = True
        self.tokens = int(key.shape[0])

    def _add_offset(self, base: torch.Tensor, pos: torch.Tensor, sign: int) -> torch.Tensor:
        """float32 copy of ``base`` ``[n, num_kv_heads, head_dim]`` plus ``sign`` x ``R(p) b_hat`` at positions
        ``pos`` (int ``[n]``) in the kept channels: per pair ``(bx cos - by sin, bx sin + by cos)``, each component
        one product pair rounded in float32 (from ``rot_coef``), added with one scatter (unused slots add 0 to
        channel 0)."""
        self.check_device(base=base, pos=pos)
        n, h = check_rows("key", base, self.num_kv_heads, self.head_dim), self.num_kv_heads
        check_positions(pos, n)
        cs = torch.stack(self.cos_sin(pos, self.inv_freq), 2)                    # [n, H, 2, M]
        neg = (cs.unsqueeze(3) * self.rot_coef).sum(2).reshape(n, h, 2 * MAX_PAIRS)   # -(ox, oy)
        out = base.to(torch.float32, copy=True)                                 # never the caller's tensor
        out.scatter_add_(2, self.xy_ch.expand(n, h, -1), neg if sign < 0 else -neg)
        return out

    def offset(self, pos: torch.Tensor) -> torch.Tensor:
        """float32 ``[n, num_kv_heads, head_dim]``: ``R(p) b_hat`` at positions ``pos`` (int ``[n]``) in the kept
        pairs, 0 elsewhere."""
        self.check_device(pos=pos)
        check_positions(pos)
        zero = torch.zeros(pos.shape[0], self.num_kv_heads, self.head_dim, device=self.bias.device)
        return self._add_offset(zero, pos, +1)

    def remove(self, key: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """``key - R(p) b_hat`` (``key`` ``[n, num_kv_heads, head_dim]``, ``pos`` int ``[n]``), in ``key``'s dtype:
        what the pages store. The vLLM runtime stores through ``kvrepro.ops.offset.rope_offset`` (one launch, the same
        sum); this is its PyTorch reference and the CPU formats' path."""
        self.check_device(key=key)
        return self._add_offset(key, pos, -1).to(key.dtype)

    def restore(self, key: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """float32 ``key + R(p) b_hat``: keys read from the pages put back where the model had them."""
        self.check_device(key=key)
        return self._add_offset(key, pos, +1)

    def score_terms(self, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``(A, B)``, each ``[T, Hq, MAX_PAIRS]``, of ``query`` ``[T, Hq, head_dim]`` (query head ``h`` reads
        KV head ``h // (Hq / num_kv_heads)``): ``A_i = q_i . b_i``, ``B_i = q_i x b_i = q_y b_x - q_x b_y`` per kept
        pair, so that ``q . R(j) b_hat = sum_i A_i cos(j theta_i) + B_i sin(j theta_i)``."""
        ab = self.packed_terms(query)
        return ab[..., :MAX_PAIRS], ab[..., MAX_PAIRS:]

    def packed_terms(self, query: torch.Tensor) -> torch.Tensor:
        """float32 ``[T, Hq, 2 MAX_PAIRS]`` contiguous: ``A`` then ``B`` of :meth:`score_terms` (the kernels'
        ``rope_bias`` terms), from one gather, one multiply and one two-term sum, with the roundings of
        ``qx * bx + qy * by`` and ``qy * bx - qx * by``. The vLLM runtime computes them with
        ``kvrepro.ops.offset.rope_terms`` (one launch); this is its PyTorch reference."""
        self.check_device(query=query)
        self.check_query(query, QUERY_DTYPES)
        h = self.num_kv_heads
        t, hq, d = query.shape
        g = hq // h
        qv = query.reshape(t, h, g, d)
        q2 = qv.gather(3, self.pair_idx[None, :, None, :].expand(t, h, g, 4 * MAX_PAIRS))   # [qx, qy | qy, qx]
        ab = (q2.view(t, h, g, 2, 2 * MAX_PAIRS) * self.term_coef[None, :, None]).sum(3)     # float32, as term_coef
        return ab.view(t, hq, 2 * MAX_PAIRS)

    def score_correction(self, query: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """float32 ``[T, Hq, n]``: ``q . R(j) b_hat`` for keys at positions ``pos`` (int ``[n]``), from
        :meth:`score_terms` (what the kernels add to each paged key's score)."""
        self.check_device(pos=pos)
        check_positions(pos)
        a_, b_ = self.score_terms(query)
        g = query.shape[1] // self.num_kv_heads
        c, s = (x.repeat_interleave(g, 1) for x in self.cos_sin(pos, self.inv_freq))     # [n, Hq, M]
        return torch.einsum("thm,nhm->thn", a_, c) + torch.einsum("thm,nhm->thn", b_, s)
