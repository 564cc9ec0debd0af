"""What the vLLM impl does per layer, without vLLM: slicing a vLLM batch and calling ``kvrepro.ops``.

Kept apart from ``backend.py`` so that it is tested on CPU (kernels under ``TRITON_INTERPRET=1``)
against ``kvrepro.reference.paged_attention_ref`` with vLLM's own batch conventions.
"""
from __future__ import annotations

import torch

from kvrepro.formats import get_format
from kvrepro.formats.hadamard import rotation_matrix
from kvrepro.formats.offset import KeyOffset, RopeMean, check_mode, mode_channels
from kvrepro.ops.offset import rope_offset, rope_terms
from kvrepro.settings import STORE_ROTATE_MODES

_ROTATIONS: dict[tuple[int, int, str], torch.Tensor] = {}
# One split-K decode workspace per device, shared by every layer (layers run one after another on
# one stream). Every tensor ever handed out stays referenced here: a captured CUDA graph keeps the
# address it was captured with, so a workspace must never be freed once a graph may use it.
_WORKSPACES: dict[str, list[torch.Tensor]] = {}
# The decode kernel each layer geometry resolved to in this process, e.g. {"k4v4 32q/8kv d128 bs16": "cuda"}
# (kvrepro.ops.decode.resolve_impl), read by settings_record for the provenance of result rows.
DECODE_IMPL_USED: dict[str, str] = {}
# Key-offset calibrations seen in this process, one entry per layer: ({"tokens": n}); the first is logged.
OFFSET_CALIBRATIONS: list[dict] = []
MIN_TOKENS_PER_SPLIT = 256   # as kvrepro.ops.decode
MAX_SPLITS = 256


def smallest_padded_batch(batch: int, graph_sizes=()) -> int:
    """The smallest real decode batch that vLLM pads to ``batch``.

    vLLM runs a pure-decode batch of ``n`` requests in the CUDA graph of the smallest capture size
    ``>= n`` (``graph_sizes``, vLLM's ``compilation_config.cudagraph_capture_sizes``); padded rows have
    seq_len 0 and cost nothing. For a capture size ``s`` that follows ``p`` in the sorted sizes, the
    real batch is anywhere in ``p + 1 .. s``; returns ``p + 1`` (1 for the smallest size). A batch
    that is not a capture size is taken as real (eager runs are not padded).
    """
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    sizes = sorted({int(s) for s in graph_sizes})
    if batch not in sizes:
        return batch
    i = sizes.index(batch)
    return sizes[i - 1] + 1 if i else 1


def decode_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device, graph_sizes=(),
                  rule=None) -> int:
    """Split-K count for a decode launch of ``batch`` rows (shape-only, so CUDA-graph safe).

    The kernel's own rule (``rule``, default ``kvrepro.ops.default_num_splits``: a target number of
    programs per SM, each split >= 256 tokens, a power of two <= 256), counted for the *smallest*
    real batch that vLLM pads to ``batch`` (:func:`smallest_padded_batch`) instead of the padded
    one: counted for the padded batch, 9 users in graph size 16 got 8 splits (576 live programs,
    4.4 per SM on 132 SMs) and the step took 64.8 ms vs 47.7 ms at 8 users (notes/vllm.md, CUDA graphs). This way
    every real batch gets at least the kernel's target of live programs.

    Args:
        batch: rows of the launch (padded graph batch or real eager batch), >= 1.
        num_kv_heads: KV heads per layer (programs per row and split).
        max_context: block-table width x block size (tokens; shape-only upper bound of seq_lens).
        device: the launch device (its SM count; CPU counts as 132 SMs, as in ``kvrepro.ops``).
        graph_sizes: vLLM's CUDA-graph capture sizes (empty: no padding).
        rule: ``(batch, num_kv_heads, max_context, device) -> splits``.
    """
    for name, v in (("num_kv_heads", num_kv_heads), ("max_context", max_context)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if rule is None:
        from kvrepro.ops.decode import default_num_splits as rule
    return rule(smallest_padded_batch(batch, graph_sizes), num_kv_heads, max_context, torch.device(device))


def decode_workspace(device: torch.device, numel: int) -> torch.Tensor:
    """A float32 workspace of >= ``numel`` elements on ``device``, shared by all layers.

    Returns the current one when it is large enough. Otherwise allocates a larger one, except while
    the current CUDA stream is capturing a graph (an allocation there would go into vLLM's graph
    memory pool and be counted again for every captured size): then raises RuntimeError, since
    :meth:`LayerRuntime.prepare` reserves the largest size any captured batch needs beforehand.
    """
    key = str(torch.device(device))
    held = _WORKSPACES.setdefault(key, [])
    if held and held[-1].numel() >= numel:
        return held[-1]
    if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
        have = held[-1].numel() if held else 0
        raise RuntimeError(f"kvrepro decode workspace: {numel} float32 elements needed inside CUDA-graph "
                           f"capture, {have} reserved; LayerRuntime.prepare(max_batch=...) must cover "
                           "the largest captured decode batch")
    held.append(torch.empty(numel, dtype=torch.float32, device=device))
    return held[-1]


def shared_rotation(head_dim: int, seed: int, device: torch.device) -> torch.Tensor:
    """One float32 ``[head_dim, head_dim]`` rotation per (head_dim, seed, device), shared by all layers."""
    key = (head_dim, seed, str(device))
    if key not in _ROTATIONS:
        _ROTATIONS[key] = rotation_matrix(head_dim, seed, device).contiguous()
    return _ROTATIONS[key]


def token_positions(seq_lens: torch.Tensor, query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """int64 ``[num_tokens]``: the position of each token row of a vLLM batch (vLLM v1 keeps a request's KV token
    ``j`` at position ``j``): for row ``t`` of request ``r``, ``seq_lens[r] - q_len[r] + (t - query_start_loc[r])``.
    Rows past ``query_start_loc[-1]`` (padding, slot -1) get position 0. No host sync (CUDA-graph safe)."""
    qsl = query_start_loc.to(torch.int64)
    t = torch.arange(num_tokens, device=qsl.device)
    r = torch.searchsorted(qsl[1:], t, right=True).clamp(max=max(qsl.shape[0] - 2, 0))
    pos = seq_lens.to(torch.int64)[r] - (qsl[r + 1] - qsl[r]) + t - qsl[r]
    return torch.where(t < qsl[-1], pos, 0).clamp(min=0)


def log_calibration(rt: "LayerRuntime", tokens: int) -> None:
    """Record a layer's key-offset calibration; log the first of the process (one line, not one per layer)."""
    if isinstance(rt.key_offset, RopeMean):
        n = 2 * max(rt.key_offset.kept)
    else:
        ch = rt.key_offset.channels
        n = rt.head_size if ch is None else int(ch.sum())
    OFFSET_CALIBRATIONS.append({"tokens": int(tokens), "channels": n})
    if len(OFFSET_CALIBRATIONS) == 1:
        import logging

        from kvrepro.vllm_backend.config import LOGGER_NAME

        r = rt.rope or {}
        layout = {True: "half-split", False: "interleaved"}.get(r.get("neox"), "layout unknown: slow in both")
        if rt.key_offset_mode == "rope-mean":
            which = (f"pre-RoPE mean, per position, in up to {n // 2} pairs per KV head (kept per KV head: "
                     f"{rt.key_offset.kept}; {layout} pairs, theta {r.get('rope_theta')}); scores restored exactly")
        elif rt.key_offset_mode == "slow-pairs":
            which = (f"{n} of {rt.head_size} channels: RoPE pairs turning < pi/4 over {r.get('max_positions')} "
                     f"positions (theta {r.get('rope_theta')}, {layout} pairs)")
        else:
            which = f"all {n} channels"
        logging.getLogger(LOGGER_NAME).info(
            "kvrepro key offset (%s): calibrated on the first prefill (%d tokens; one constant per layer and KV head, "
            "fixed from now on; %s)", rt.key_offset_mode, tokens, which)


class LayerRuntime:
    """Per-layer state and calls of the kvrepro backend.

    Args:
        preset: compressed preset name (``k4v4``, ``k8v4``, ``k4v2``).
        num_heads, num_kv_heads, head_size: attention geometry (GQA: num_heads % num_kv_heads == 0).
        scale: softmax scale.
        num_splits: fixed decode split-K count (``KVREPRO_NUM_SPLITS``), or None for
            :func:`decode_splits` (shape-only; both keep the launch grid fixed per batch size, as
            CUDA graphs need).
        ops: module with ``store_kv``, ``decode_attention``, ``prefill_attention`` (default ``kvrepro.ops``).
        prefill: callable replacing ``ops.prefill_attention`` (same arguments), e.g.
            ``fa_prefill.FlashPrefill``; default None = kvrepro's Triton prefill kernel.
        graph_sizes: vLLM's CUDA-graph capture sizes (for the split rule; empty = no padding).
        max_batch: largest decode batch (vLLM's ``max_num_seqs``, or the largest capture size if
            larger); :meth:`prepare` reserves the decode workspace for it so that no captured forward
            allocates. None = no reservation (grown on demand outside capture).
        store_rotate: ``store_kv``'s ``rotate`` (``"kernel"``: the rotation inside the store kernel, the default;
            ``"torch"``: two float32 GEMMs before it; ``KVREPRO_STORE_ROTATE`` in ``kvrepro.settings``).
        decode_impl: ``decode_attention``'s ``impl`` (``"cuda"``, ``"triton"``, or None = its default
            ``kvrepro.ops.decode.resolve_impl``; ``Settings.decode_impl_arg``).
        key_offset: ``"slow-pairs"`` or ``"first-prefill"``: every stored key and
            every prefill chunk's own keys minus the constant ``kvrepro.formats.offset.KeyOffset`` that the first
            :meth:`store` with ``calibrate`` sets (in RoPE's slow pairs, or in every channel); ``"rope-mean"``: every
            stored key minus ``R(p) b_hat`` at its position (``offset.RopeMean``, calibrated by the first :meth:`store`
            with ``calibrate``; :meth:`store` then needs ``positions``), added back to the scores by the decode
            kernels (Triton and CUDA) and the Triton prefill (``rope_bias``) or to the dequantized context by
            ``prefill`` (its ``key_restore``); the chunk's own keys stay unshifted (the backend's default setting,
            ``KVREPRO_KEY_OFFSET``). ``"off"`` (the default here: the backend passes the engine's setting).
        rope: the model's RoPE for ``"slow-pairs"`` / ``"rope-mean"`` (``offset.rope_of_config`` with
            ``max_positions`` = the longest context, plus ``"neox"``: True / False / None = unknown, read at
            calibration, so it may be set later; rope-mean refuses to calibrate while it is None).

    Raises:
        ValueError: a bad ``max_batch``, ``store_rotate``, ``decode_impl`` or ``key_offset`` (naming it and the
            allowed values); ``"slow-pairs"`` / ``"rope-mean"`` without ``rope``; ``"rope-mean"`` with a ``prefill``
            without a ``key_restore`` attribute.
    """

    def __init__(self, preset: str, num_heads: int, num_kv_heads: int, head_size: int, scale: float,
                 num_splits: int | None = None, ops=None, prefill=None, graph_sizes=(),
                 max_batch: int | None = None, store_rotate: str = "kernel", decode_impl: str | None = None,
                 key_offset: str = "off", rope: dict | None = None) -> None:
        self.fmt = get_format(preset)
        self.key_offset_mode = check_mode(key_offset)
        if key_offset in ("slow-pairs", "rope-mean") and rope is None:
            raise ValueError(f"key_offset={key_offset!r} needs the model's RoPE (rope=offset.rope_of_config(...)); "
                             "or KVREPRO_KEY_OFFSET=first-prefill / off")
        if key_offset == "rope-mean" and prefill is not None and not hasattr(prefill, "key_restore"):
            raise ValueError(f"KVREPRO_KEY_OFFSET=rope-mean: the prefill path {type(prefill).__name__} cannot add "
                             "R(p) b_hat back to the context keys; use KVREPRO_PREFILL=triton, fa, fa-pages or "
                             "fa-sliced, or KVREPRO_KEY_OFFSET=slow-pairs to keep this prefill")
        self.rope = rope
        self.key_offset: KeyOffset | RopeMean | None = None
        if key_offset == "rope-mean":
            self.key_offset = RopeMean(num_kv_heads, head_size, rope)
            if prefill is not None:
                prefill.key_restore = self.restore_keys
        elif key_offset != "off":
            self.key_offset = KeyOffset(num_kv_heads, head_size)
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.scale = scale
        self.num_splits = num_splits
        self._ops = ops
        self.prefill = prefill
        self.graph_sizes = tuple(sorted({int(x) for x in graph_sizes}))
        if max_batch is not None and (not isinstance(max_batch, int) or max_batch < 1):
            raise ValueError(f"max_batch must be a positive int or None, got {max_batch!r}")
        self.max_batch = max_batch
        if store_rotate not in STORE_ROTATE_MODES:
            raise ValueError(f"store_rotate={store_rotate!r}; allowed: {', '.join(STORE_ROTATE_MODES)}")
        self.store_rotate = store_rotate
        if decode_impl not in (None, "cuda", "triton"):
            raise ValueError(f"decode_impl={decode_impl!r}; allowed: None (auto), 'cuda', 'triton'")
        self.decode_impl = decode_impl
        self.impl_used: str | None = None   # the decode kernel record_impl resolved (None: not yet)
        self._layouts: dict[int, object] = {}
        self.rotation: torch.Tensor | None = None
        self._cuda_ready: torch.device | None = None   # device where the CUDA kernel's check and counters are done

    @property
    def ops(self):
        if self._ops is None:
            import kvrepro.ops as ops  # Triton; imported on first use

            self._ops = ops
        return self._ops

    def splits(self, batch: int, max_context: int, device: torch.device, impl: str | None = None) -> int:
        """Decode split count for ``batch`` rows: ``num_splits`` if fixed, else :func:`decode_splits` with the
        split rule of the decode kernel (``impl``, default the one :meth:`record_impl` resolved, else "triton"); the
        CUDA kernel's one wave counts the resident CTAs of this preset's own kernel (``kernel=(key_bits,
        value_bits)``: an A100 holds 4 CTAs of k4v4 but 3 of k4v2), not the fewest of all kernels."""
        if self.num_splits is not None:
            return self.num_splits
        from kvrepro.ops import cuda_decode
        from kvrepro.ops.decode import default_num_splits

        impl = impl or self.impl_used or "triton"
        bits = (self.fmt.key_bits, self.fmt.value_bits)
        kernel = bits if impl == "cuda" and bits in cuda_decode.KERNELS else None
        padded = smallest_padded_batch(batch, self.graph_sizes) != batch   # a graph serving a range of batches
        return decode_splits(batch, self.num_kv_heads, max_context, device, self.graph_sizes,
                             rule=lambda *a: default_num_splits(*a, impl=impl, padded=padded, kernel=kernel))

    def workspace_numel(self, batch: int, num_splits: int) -> int:
        """float32 elements of the decode workspace for ``batch`` rows and ``num_splits`` splits
        (``kvrepro.ops.decode_workspace_numel``)."""
        from kvrepro.ops.decode import decode_workspace_numel

        return decode_workspace_numel(batch, self.num_heads, self.head_size, num_splits)

    def reserve_numel(self, device: torch.device) -> int:
        """Workspace elements that cover every decode batch ``1..max_batch`` at any context length
        (split counts taken without the context cap and under both kernels' split rules: an upper bound);
        0 without ``max_batch``."""
        if not self.max_batch:
            return 0
        no_cap = MAX_SPLITS * MIN_TOKENS_PER_SPLIT
        return max(self.workspace_numel(b, self.splits(b, no_cap, device, impl))
                   for b in range(1, self.max_batch + 1) for impl in ("triton", "cuda"))

    def prepare(self, device: torch.device) -> torch.Tensor:
        """Put the rotation on ``device`` and reserve the shared decode workspace for ``max_batch``, the store
        kernel's rotation operands (``store_rotate="kernel"``) and, for the CUDA decode kernel, its split counters
        and rotation check (call before CUDA-graph capture and before
        vLLM's memory profiling); returns the rotation."""
        if self.rotation is None or self.rotation.device != torch.device(device):
            self.rotation = shared_rotation(self.head_size, self.fmt.seed, torch.device(device))
            if self.key_offset is not None:
                self.key_offset.to(self.rotation.device)
            if self.max_batch:
                decode_workspace(device, self.reserve_numel(device))
        if self.store_rotate == "kernel" and self.rotation.is_cuda:
            from kvrepro.ops.store import hadamard_operand     # its rotation check (a sync once), not in capture
            hadamard_operand(self.rotation)
        if self.impl_used == "cuda" and self.rotation.is_cuda and self._cuda_ready != self.rotation.device:
            from kvrepro.ops import cuda_decode   # one-launch kernel: its rotation check (a sync) and split counters
            cuda_decode.rotation_signs(self.rotation)             # now, not inside graph capture
            cuda_decode.split_counters(self.rotation.device, (self.max_batch or 1) * self.num_kv_heads)
            self._cuda_ready = self.rotation.device
        return self.rotation

    def warmup(self, device: torch.device, dtype: torch.dtype, block_size: int, max_context: int) -> list[int]:
        """Compile and load every decode-kernel variant this layer can launch (one per split count over
        batches ``1..max_batch``) and the store kernel, on a throw-away pool, before vLLM profiles
        memory and captures graphs; returns the split counts warmed. Nothing stays allocated but the
        shared workspace. ``max_context``: block-table width x block size as vLLM will pass it."""
        if not self.max_batch:
            raise ValueError("warmup needs max_batch")
        rot = self.prepare(device)
        layout = self.fmt.layout(self.head_size, block_size)
        width = max(1, -(-max_context // block_size))
        self.record_impl(layout, device)             # the split rule depends on the kernel
        by_splits: dict[int, int] = {}
        for b in range(1, self.max_batch + 1):
            by_splits.setdefault(self.splits(b, width * block_size, device), b)
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_size
        pool = torch.zeros(2, hkv, layout.page_bytes, dtype=torch.uint8, device=device)
        kv = torch.zeros(1, hkv * d, dtype=dtype, device=device)
        self.ops.store_kv(kv.view(1, hkv, d), kv.view(1, hkv, d), pool, torch.zeros(1, dtype=torch.int64,
                          device=device), layout, rot, rotate=self.store_rotate)
        for s, b in sorted(by_splits.items()):
            q = torch.zeros(b, hq, d, dtype=dtype, device=device)
            bt = torch.zeros(b, width, dtype=torch.int32, device=device)
            lens = torch.ones(b, dtype=torch.int32, device=device)
            ws = decode_workspace(device, self.workspace_numel(b, s))
            self.ops.decode_attention(q, pool, bt, lens, layout, rot, self.scale, out=torch.empty_like(q),
                                      num_splits=s, workspace=ws, impl=self.impl_used, **self.rope_bias(q))
        return sorted(by_splits)

    def rope_bias(self, query: torch.Tensor) -> dict:
        """``{"rope_bias": (terms, inv_freq)}`` of ``query`` ``[T, Hq, D]`` for the kernels under rope-mean
        (``RopeMean.score_terms`` in one launch, ``kvrepro.ops.offset.rope_terms``: zeros before calibration), else
        ``{}``."""
        if not isinstance(self.key_offset, RopeMean):
            return {}
        return {"rope_bias": (rope_terms(query, self.key_offset), self.key_offset.inv_freq)}

    def restore_keys(self, key: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """rope-mean: ``key + R(p) b_hat`` (``key`` ``[n, Hkv, D]`` read from the pages, ``pos`` int ``[n]``) in
        ``key``'s dtype, one launch (``kvrepro.ops.offset.rope_offset``): the ``key_restore`` of the prefill paths."""
        return rope_offset(key, pos, self.key_offset, sign=+1)

    def record_impl(self, layout, device: torch.device) -> str:
        """Resolve and record in ``DECODE_IMPL_USED`` which decode kernel this layer runs on ``device``."""
        from kvrepro.ops.decode import resolve_impl

        key = f"{self.fmt.name} {self.num_heads}q/{self.num_kv_heads}kv d{self.head_size} bs{layout.block_size}"
        # rope-mean's rope_bias (offset.MAX_PAIRS pairs) runs on both kernels: it selects neither
        self.impl_used = resolve_impl(self.decode_impl, layout, self.num_heads // self.num_kv_heads,
                                      torch.device(device))
        DECODE_IMPL_USED[key] = self.impl_used
        return self.impl_used

    def check_decode_impl(self, block_size: int, device: torch.device) -> str:
        """At engine start: resolve and record (:meth:`record_impl`) the decode kernel this layer will run on
        ``device``: ``decode_impl``, or the default rule for None (which loads the CUDA kernel's fatbin where the
        kernel applies and takes Triton, with a RuntimeWarning, if the driver cannot load it). Returns the kernel.

        Raises:
            ValueError: ``decode_impl="cuda"`` where the kernel does not apply (names KVREPRO_DECODE_IMPL and why).
            RuntimeError: ``decode_impl="cuda"`` and the driver cannot load the fatbin.
        """
        from kvrepro.ops import cuda_decode

        layout, device = self.fmt.layout(self.head_size, block_size), torch.device(device)
        try:
            impl = self.record_impl(layout, device)
        except ValueError as e:
            raise ValueError(f"kvrepro attention backend (CUSTOM) refuses this layer: KVREPRO_DECODE_IMPL=cuda: {e}; "
                             f"set KVREPRO_DECODE_IMPL=triton or auto") from None
        if impl == "cuda" and self.decode_impl == "cuda":     # auto has loaded it already, or chose Triton
            try:
                cuda_decode.load(device)
            except RuntimeError as e:
                raise RuntimeError(f"kvrepro attention backend (CUSTOM): KVREPRO_DECODE_IMPL=cuda, but the CUDA "
                                   f"decode kernel cannot load here: {e}") from None
        return impl

    def layout(self, pool: torch.Tensor):
        """Page layout of ``pool`` (uint8 ``[num_blocks, Hkv, page_bytes]``); block_size = page_bytes
        / bytes_per_token. Raises ValueError if the pool does not match this preset and geometry."""
        page_bytes = pool.shape[-1]
        if page_bytes not in self._layouts:
            per_token = self.fmt.layout(self.head_size, 16).bytes_per_token
            bs = page_bytes // per_token
            layout = self.fmt.layout(self.head_size, bs) if page_bytes % per_token == 0 else None
            if layout is None or layout.page_bytes != page_bytes or pool.dim() != 3 \
                    or pool.shape[1] != self.num_kv_heads or pool.dtype != torch.uint8:
                raise ValueError(
                    f"KV cache {pool.dtype} {tuple(pool.shape)} does not match preset {self.fmt.name} "
                    f"(uint8 [num_blocks, {self.num_kv_heads}, block_size x {per_token}])")
            self._layouts[page_bytes] = layout
        return self._layouts[page_bytes]

    def store(self, key: torch.Tensor, value: torch.Tensor, pool: torch.Tensor, slot_mapping: torch.Tensor,
              calibrate: tuple[int, int] | None = None, positions: torch.Tensor | None = None) -> None:
        """Compress this step's K/V (``[>= num_tokens, Hkv * D]`` or ``[.., Hkv, D]``) into ``pool``;
        ``slot_mapping`` ``[num_tokens]`` (-1 = padding). ``calibrate = (start, end)``: the token rows of a real
        prefill in this step; the first such call sets the key offset from them (no host sync). ``positions``: int
        ``[>= num_tokens]`` position of each row (:func:`token_positions`), needed under rope-mean.

        Raises:
            ValueError: rope-mean without ``positions``, or with them on another device than ``pool``; its calibration
                while the pair layout is unknown.
        """
        n = slot_mapping.shape[0]
        if n == 0:
            return
        k = key[:n].view(n, self.num_kv_heads, self.head_size)
        v = value[:n].view(n, self.num_kv_heads, self.head_size)
        rot = self.prepare(pool.device)
        if isinstance(self.key_offset, RopeMean):
            if positions is None:
                raise ValueError("key_offset='rope-mean' stores keys at their positions: store(..., positions=...)")
            if positions.device != pool.device:
                raise ValueError(f"positions is on {positions.device}, the pool on {pool.device}")
            pos = positions[:n]
            if calibrate is not None and not self.key_offset.calibrated and calibrate[1] > calibrate[0]:
                self.key_offset.rope["neox"] = self.rope.get("neox")
                self.key_offset.calibrate(k[calibrate[0]:calibrate[1]], pos[calibrate[0]:calibrate[1]])
                log_calibration(self, calibrate[1] - calibrate[0])
            k = rope_offset(k, pos, self.key_offset, sign=-1)
        elif self.key_offset is not None:
            if calibrate is not None and not self.key_offset.calibrated and calibrate[1] > calibrate[0]:
                self.key_offset.channels = mode_channels(self.key_offset_mode, self.head_size, self.rope)
                self.key_offset.calibrate(k[calibrate[0]:calibrate[1]])
                log_calibration(self, calibrate[1] - calibrate[0])
            k = self.key_offset.apply(k)
        self.ops.store_kv(k, v, pool, slot_mapping, self.layout(pool), rot, rotate=self.store_rotate)

    def offset_keys(self, key: torch.Tensor) -> torch.Tensor:
        """``key`` ``[T, Hkv, D]`` as the prefill kernels take the chunk's own keys: minus the constant key offset
        (softmax-invariant only if every key a query sees has it); unchanged when it is off or rope-mean (whose
        scores the kernels restore, so the chunk's keys are attended exact)."""
        return key if not isinstance(self.key_offset, KeyOffset) else self.key_offset.apply(key)

    def attend(self, query, key, value, pool, block_table, seq_lens, query_start_loc, num_actual_tokens: int,
               num_decodes: int, num_decode_tokens: int, out: torch.Tensor,
               max_query_len: int | None = None) -> torch.Tensor:
        """Attention of a vLLM batch ordered ``[decodes | prefills]``; writes ``out[:num_actual_tokens]``.

        Args:
            query: ``[>= T, Hq, D]`` (or ``[>= T, Hq * D]``); key, value: ``[>= T, Hkv, D]``.
            pool: this layer's uint8 pages (the step's tokens already stored).
            block_table ``[R, max_blocks]``, seq_lens ``[R]``, query_start_loc ``[R + 1]``: int32, R requests.
            num_actual_tokens: T (host int); num_decodes / num_decode_tokens: the decode prefix (host ints).
            out: ``[>= T, Hq, D]`` in the query dtype.
            max_query_len: longest query (host int, avoids a host sync in the prefill kernel).

        Raises:
            ValueError: the decode prefix is not one token per request.
        """
        t, nd, ndt = num_actual_tokens, num_decodes, num_decode_tokens
        if t == 0:
            return out
        if nd != ndt:
            raise ValueError(f"kvrepro backend expects one token per decode request, got {nd} requests, "
                             f"{ndt} tokens")
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_size
        q = query[:t].view(t, hq, d)
        layout, rot = self.layout(pool), self.prepare(pool.device)
        if nd:
            if self.impl_used is None:
                self.record_impl(layout, pool.device)
            splits = self.splits(nd, block_table.shape[1] * layout.block_size, pool.device)
            ws = decode_workspace(pool.device, self.workspace_numel(nd, splits))
            self.ops.decode_attention(q[:nd], pool, block_table[:nd], seq_lens[:nd], layout, rot, self.scale,
                                      out=out[:nd], num_splits=splits, workspace=ws, impl=self.impl_used,
                                      **self.rope_bias(q[:nd]))
        if ndt < t:
            k = self.offset_keys(key[:t].view(t, hkv, d)[ndt:])
            v = value[:t].view(t, hkv, d)[ndt:]
            qsl = query_start_loc[nd:] - ndt if nd else query_start_loc
            extra = self.rope_bias(q[ndt:]) if self.prefill is None else {}   # prefill objects restore the keys
            (self.prefill or self.ops.prefill_attention)(q[ndt:], k, v, pool, block_table[nd:], seq_lens[nd:], qsl, layout, rot,
                                       self.scale, out=out[ndt:t], max_query_len=max_query_len, **extra)
        return out


def reference_attend(rt: LayerRuntime, query, key, value, pool: torch.Tensor, block_table, seq_lens,
                     query_start_loc, num_actual_tokens: int, num_decodes: int,
                     dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """What :meth:`LayerRuntime.attend` must compute, in PyTorch (``dtype``, default float64):
    decode rows attend to their dequantized pages (``kvrepro.formats.compressed``); prefill rows to
    the dequantized context pages plus the chunk's own K/V unquantized (under rope-mean the pages' keys plus
    ``R(p) b_hat`` at positions ``0 .. n - 1``). Returns ``[T, Hq, D]``."""
    from kvrepro.reference import attention_ref

    t, hq, hkv, d = num_actual_tokens, rt.num_heads, rt.num_kv_heads, rt.head_size
    layout = rt.layout(pool)
    ref_pool = rt.fmt.new_pool(1, hkv, d, layout.block_size, device=pool.device)
    ref_pool.data = pool
    q = query[:t].reshape(t, hq, d)
    k = rt.offset_keys(key[:t].reshape(t, hkv, d))   # the chunk's own keys as the pages hold them
    v = value[:t].reshape(t, hkv, d)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    out = torch.zeros(t, hq, d, dtype=dtype, device=query.device)
    for b in range(len(lens)):
        qs, qe, s = qsl[b], qsl[b + 1], lens[b]
        if qe <= qs or s == 0:
            continue
        restore = rt.key_offset.restore if isinstance(rt.key_offset, RopeMean) else (lambda x, p: x)
        if b < num_decodes:
            kc, vc = ref_pool.gather(block_table[b], s)
            kc = restore(kc, torch.arange(s, device=kc.device))
        else:
            ctx = s - (qe - qs)
            kc, vc = k[qs:qe].to(dtype), v[qs:qe].to(dtype)
            if ctx:
                kp, vp = ref_pool.gather(block_table[b], ctx)
                kp = restore(kp, torch.arange(ctx, device=kp.device))
                kc, vc = torch.cat([kp.to(dtype), kc]), torch.cat([vp.to(dtype), vc])
        out[qs:qe] = attention_ref(q[qs:qe], kc, vc, rt.scale, dtype)
    return out


CHECKS: list[dict] = []  # filled by the backend when KVREPRO_DEBUG_CHECK=1 (in-process engines)


def record_check(rt: LayerRuntime, out, *args) -> dict:
    """Compare ``out`` (``[T, Hq, D]``) with :func:`reference_attend` (``args`` = its arguments after
    ``rt``: query, key, value, pool, block_table, seq_lens, query_start_loc, num_actual_tokens,
    num_decodes); append the error to ``CHECKS``.

    ``rel_err`` = max |out - ref| / max |ref|.
    """
    t = args[7]
    try:
        ref = reference_attend(rt, *args, dtype=torch.float32)
    except (ValueError, RuntimeError) as e:  # e.g. vLLM's dummy capture batches with invalid lengths
        entry = {"tokens": t, "num_decodes": args[8], "rel_err": None, "error": str(e)[:200]}
        CHECKS.append(entry)
        return entry
    err = (out[:t].float() - ref).abs().max().item()
    scale = ref.abs().max().item() or 1.0
    entry = {"tokens": t, "num_decodes": args[8], "rel_err": err / scale, "max_ref": scale}
    CHECKS.append(entry)
    return entry


def settings_record(dequant: str | None = None) -> dict:
    """What the backend runs with in this process, for the provenance of result rows (``kvrepro_settings``).

    The engine's :class:`kvrepro.settings.Settings` (``config.settings_for_engine``: the object the layers use;
    ``Settings.as_dict`` fields) with ``decode_impl`` replaced by the kernel each layer geometry resolved to
    (``DECODE_IMPL_USED``, e.g. ``{"k4v4 32q/8kv d128 bs16": "cuda"}``; the setting itself in
    ``decode_impl_setting``), plus: ``cuda_fatbin_sha256`` (the CUDA kernels' binary, ``kvrepro/ops/cuda``);
    for layers that run the Triton decode kernel, its dequant mode (``decode_dequant``:
    ``kvrepro.ops.decode.default_dequant`` of a CUDA device, or ``dequant``), key path and launch
    (``decode_key_mma``, ``decode_block_n``, ``decode_num_warps``: its defaults for the preset, as the backend
    passes no tiling); ``kvrepro_src_sha256`` (``kvrepro.provenance.src_sha256``: identifies the code even off a
    git checkout).

    Raises:
        ValueError: ``dequant`` not one of ``kvrepro.ops.decode.DEQUANT_MODES``.
    """
    from kvrepro.formats import get_format
    from kvrepro.ops import cuda_decode, decode
    from kvrepro.provenance import src_sha256
    from kvrepro.vllm_backend.config import settings_for_engine

    s = settings_for_engine()
    dq = decode.default_dequant(torch.device("cuda")) if dequant is None else dequant
    if dq not in decode.DEQUANT_MODES:
        raise ValueError(f"dequant={dq!r}; allowed: {decode.DEQUANT_MODES}")
    key_bits = get_format(s.preset).key_bits
    mma = decode.resolve_key_mma(None, key_bits)     # the backend passes no key path: the kernel's default
    block_n, warps = decode.default_launch(key_bits, mma)
    impl = dict(DECODE_IMPL_USED) or f"{s.decode_impl} (no layer resolved it yet)"
    return {**s.as_dict(), "decode_impl": impl, "decode_impl_setting": s.decode_impl,
            "cuda_fatbin_sha256": cuda_decode.read_manifest()["fatbin_sha256"], "decode_dequant": dq,
            "decode_key_mma": mma, "decode_block_n": block_n, "decode_num_warps": warps,
            "kvrepro_src_sha256": src_sha256()}
