"""``decode_attention``: one query token per sequence over compressed pages, split-K."""
from __future__ import annotations

import warnings

import torch

from kvrepro.formats.layout import PageLayout
from kvrepro.ops import cuda_decode
from kvrepro.ops.common import (check_block_n, check_block_tables, check_float, check_heads, check_int,
                                check_launch, check_pool, check_rotation, check_scale, check_triton_device, described,
                                next_pow2, page_constexprs, pool_tensor, sm_count, want_checks)
from kvrepro.ops.triton.attention import paged_attn_kernel
from kvrepro.ops.triton.rotate import merge_splits_kernel, rotate_query_kernel

LOG2E = 1.4426950408889634
# Launch of the float16 key path: block_n 256 with 2 warps was the best of the block_n x warps sweeps on the H200 for
# both dequant modes.
DECODE_BLOCK_N = 256
DECODE_WARPS = 2
DECODE_STAGES = 1
PROGRAMS_PER_SM = 32   # the Triton split rule targets ~32 programs per SM (4x fewer was 15% slower on the H200)
DEQUANT_MODES = ("triton", "asm")
KEY_MMAS = ("f16", "int8")
# Keys through int8 tensor cores: the same error as "f16" at full size on the H200 (relerr 2.2e-4 fp16 / 1.7e-3 bf16
# vs float64, every preset; 3.8e-4 with one 128K split) and 8-12% faster for k4v4 at 128K.
DEFAULT_KEY_MMA = "int8"
# Launch (block_n, num_warps) of the int8 key path per key width, from launch sweeps on the H200:
# 4-bit keys: block_n 256 with 4 warps, 0.90x the time of 2 warps at 128K x 13 and 0.955x at 128K x 3;
# 8-bit keys (k8v4): block_n 256 spills 160 B of stack, block_n 128 with 2 warps was 14-18% faster
# than 256 and 6% faster than 128 with 4 warps. 5-bit keys (k5v4, 128K x 1 / 3 / 12, CUDA graphs): block_n 128 with
# 2 warps 5-8% faster than 4-bit keys' 256 / 4, as fast as 64 / 1 (within 2%), 256 / 8 and 64 / 2 15-50% slower.
DECODE_LAUNCH_I8 = {4: (256, 4), 5: (128, 2), 8: (128, 2)}


def default_dequant(device: torch.device) -> str:
    """``"asm"`` on CUDA, ``"triton"`` elsewhere (the CPU interpreter cannot run inline PTX).
    ``"asm"`` (inline PTX: prmt/lop3/sub.f16x2, centred value planes) matches float64 on the H200 as the
    triton dequantization does (relerr 3.7e-4 fp16 / 1.7e-3 bf16 at 128K with one split) and was 7-8% faster
    there at 128K."""
    return "asm" if device.type == "cuda" else "triton"


def resolve_dequant(dequant: str | None, device: torch.device) -> str:
    """``dequant``, or ``default_dequant(device)`` for None. Raises ValueError unless it is one of
    ``DEQUANT_MODES``, or for ``"asm"`` on a device that is not CUDA."""
    dequant = default_dequant(device) if dequant is None else dequant
    if dequant not in DEQUANT_MODES:
        raise ValueError(f"dequant={dequant!r}; allowed: {DEQUANT_MODES}")
    if dequant == "asm" and device.type != "cuda":
        raise ValueError("dequant='asm' is inline PTX and needs a CUDA device; use dequant='triton'")
    return dequant


I8_KEY_BITS = (4, 5, 8)   # key code widths the int8 key path implements


def resolve_key_mma(key_mma: str | None, key_bits: int) -> str:
    """``key_mma``, or the default: ``DEFAULT_KEY_MMA`` for 4-, 5- or 8-bit keys, else "f16"."""
    if key_mma is not None:
        return key_mma
    return DEFAULT_KEY_MMA if key_bits in I8_KEY_BITS else "f16"


def default_launch(key_bits: int, key_mma: str) -> tuple[int, int]:
    """``(block_n, num_warps)`` of the decode launch: ``DECODE_LAUNCH_I8`` for the int8 key path,
    else ``(DECODE_BLOCK_N, DECODE_WARPS)`` (the float16 key path's)."""
    if key_mma == "int8" and key_bits in DECODE_LAUNCH_I8:
        return DECODE_LAUNCH_I8[key_bits]
    return DECODE_BLOCK_N, DECODE_WARPS


def check_key_mma(key_mma: str, key_bits: int | None = None) -> None:
    """ValueError unless ``key_mma`` is one of ``KEY_MMAS`` and, for ``"int8"``, ``key_bits`` (when given) is one
    of ``I8_KEY_BITS``."""
    if key_mma not in KEY_MMAS:
        raise ValueError(f"key_mma={key_mma!r}; allowed: {KEY_MMAS}")
    if key_mma == "int8" and key_bits is not None and key_bits not in I8_KEY_BITS:
        raise ValueError(f"key_mma='int8' needs key_bits in {I8_KEY_BITS}, got key_bits={key_bits}; use key_mma='f16'")


def decode_constexprs(layout: PageLayout, num_kv_heads: int, group: int, block_n: int,
                      key_mma: str | None = None) -> dict:
    """The constexprs ``decode_attention`` launches ``paged_attn_kernel`` with, besides ``DEQ_ASM``: one query
    token per sequence, the GQA group padded to a power of two and to >= 16 rows for ``tl.dot``, split output, and
    ``KEY_I8`` for ``key_mma="int8"``. ``key_mma`` None = ``resolve_key_mma`` (int8 for 4-, 5- and 8-bit keys, else
    f16). Raises ValueError as ``check_key_mma``."""
    key_mma = resolve_key_mma(key_mma, layout.key_bits)
    check_key_mma(key_mma, layout.key_bits)
    gp = next_pow2(group)
    return dict(G=group, GP=gp, **page_constexprs(layout, num_kv_heads), BLOCK_Q=1, BLOCK_M=max(16, gp),
                BLOCK_N=block_n, HAS_FRESH=False, SPLIT_OUT=True, IS_DECODE=True, KEY_I8=key_mma == "int8")


def _rope_bias_args(rope_bias, npairs: int, scale: float) -> dict:
    """``paged_attn_kernel``'s keyword arguments for ``rope_bias`` (none without it: the kernel as before)."""
    if not npairs:
        return {}
    return dict(rb_ptr=rope_bias[0], rf_ptr=rope_bias[1], rb_scale=float(scale) * LOG2E, NPAIRS=npairs)


def check_rope_bias(rope_bias, rows: int, hq: int, hkv: int, dev: torch.device) -> int:
    """The pair count ``NPAIRS`` of a ``rope_bias = (terms, inv_freq)`` argument (0 for None): ``terms`` float32
    ``[rows, Hq, 2 NPAIRS]`` contiguous (``A`` then ``B`` of ``offset.RopeMean.score_terms``), ``inv_freq`` float32
    ``[Hkv, NPAIRS]`` contiguous (``RopeMean.inv_freq``), both on ``dev``, ``NPAIRS`` a power of two >= 8.

    Raises:
        ValueError: anything else (naming ``rope_bias`` and the expected shapes).
    """
    if rope_bias is None:
        return 0
    if not isinstance(rope_bias, (tuple, list)) or len(rope_bias) != 2:
        raise ValueError(f"rope_bias must be None or (terms [rows, Hq, 2 NPAIRS], inv_freq [Hkv, NPAIRS]), got "
                         f"{type(rope_bias).__name__}"
                         + (f" of length {len(rope_bias)}" if isinstance(rope_bias, (tuple, list)) else ""))
    terms, freq = rope_bias
    npairs = freq.shape[-1] if isinstance(freq, torch.Tensor) and freq.dim() == 2 else 0
    ok = (npairs >= 8 and npairs & (npairs - 1) == 0 and tuple(freq.shape) == (hkv, npairs)
          and isinstance(terms, torch.Tensor) and tuple(terms.shape) == (rows, hq, 2 * npairs))
    ok = ok and all(x.dtype == torch.float32 and x.device == dev and x.is_contiguous() for x in (terms, freq))
    if not ok:
        raise ValueError(f"rope_bias must be (terms float32 [{rows}, {hq}, 2 NPAIRS], inv_freq float32 "
                         f"[{hkv}, NPAIRS]), contiguous on {dev}, NPAIRS a power of two >= 8; got "
                         f"{described(rope_bias)}")
    return npairs


DECODE_IMPLS = ("triton", "cuda")
_WARNED_LOAD: set = set()
# decode_attention's arguments that only the Triton kernel takes (setting one selects it, see resolve_impl); rope_bias
# counts as one only with a pair count other than the CUDA kernel's cuda_decode.ROPE_PAIRS
TRITON_OPTIONS = ("block_n", "num_warps", "num_stages", "dequant", "key_mma", "max_registers")


def resolve_impl(impl: str | None, layout: PageLayout, group: int, device: torch.device,
                 triton_options: tuple[str, ...] = ()) -> str:
    """Which decode kernel runs: ``impl`` if given; for None or ``"auto"``, ``"cuda"`` where
    ``cuda_decode.unsupported_reason`` finds nothing to refuse (any preset, head_dim 128, block 16, GQA group
    <= 8, an NVIDIA GPU of compute capability >= 8.0), no Triton-only option was passed and its fatbin loads
    (``cuda_decode.load_error``), else ``"triton"``; when only the load fails, a RuntimeWarning says why, once per
    device (e.g. a driver older than the fatbin's CUDA 13.0). ``impl="cuda"`` never falls back: a load failure is a
    RuntimeError at the launch (or at engine start in the vLLM backend).

    Why ``"cuda"`` by default there: on the H200 at 128K context it takes about half the Triton kernel's time or less
    at every batch and preset, with the same error vs float64 (relerr 2.3e-4 with float16 queries, 1.7e-3 with
    bfloat16); ``benchmarks/results/decode_side_by_side.json`` holds the current figures.

    Args:
        triton_options: names of the Triton-only arguments the caller set (``block_n``, ``num_warps``, ...).

    Raises:
        ValueError: ``impl`` not None, ``"auto"`` or one of ``DECODE_IMPLS``; ``impl="cuda"`` where the CUDA kernel does
            not apply (the message says why) or together with Triton-only options.
    """
    if impl is None or impl == "auto":
        if triton_options or cuda_decode.unsupported_reason(layout, group, device) is not None:
            return "triton"
        why = cuda_decode.load_error(device)
        if why is None:
            return "cuda"
        if device.index not in _WARNED_LOAD:        # said once per device, and recorded by the vLLM backend
            _WARNED_LOAD.add(device.index)
            warnings.warn(f"kvrepro decode_attention: the default would run the CUDA kernel here, but {why}; "
                          f"running the Triton kernel instead (impl='triton' / KVREPRO_DECODE_IMPL=triton says so "
                          f"explicitly and silences this)", RuntimeWarning, stacklevel=3)
        return "triton"
    if impl not in DECODE_IMPLS:
        raise ValueError(f"impl={impl!r}; allowed: None or 'auto', {', '.join(repr(x) for x in DECODE_IMPLS)}")
    if impl == "cuda":
        reason = cuda_decode.unsupported_reason(layout, group, device)
        if reason:
            raise ValueError(f"impl='cuda': {reason}; use impl='triton'")
        if triton_options:
            raise ValueError(f"impl='cuda' takes no Triton launch options, got {', '.join(triton_options)}; "
                             f"use impl='triton' with them")
    return impl


MIN_TOKENS_PER_SPLIT = 256


# CUDA kernel (impl="cuda"). For a launch of exactly ``batch`` live rows: the fewest whole waves of the kernel's
# resident CTAs (cuda_decode.resident_ctas: the driver's occupancy query on a GPU; 4 on the H200, where registers bind;
# fewer where shared memory binds: 3 CTAs of k8v4, k4v2 or k5v4 on an A100, 2 of any kernel on 100 KB SMs) that fill
# the SM slots to >= WAVE_FILL (fill = CTAs / (ceil(waves) x slots)), any integer count. Why: the last wave of a launch idles the slots it
# leaves empty while the others stream. Where one wave fills the slots it is as fast as any count, within the timing
# noise; where it leaves a fifth of them empty (few resident CTAs, a large batch) the 2- or 3-wave count that fills
# them is faster. Measured: benchmarks/results/decode_splits.json and results/reach/carveout_splits_h200.json
# (the A100 and Ada shared-memory budgets emulated on the H200 by the carveout; kvrepro.reach.carveout_table).
# For a CUDA graph replayed for a range of batches (``padded=True``, vLLM's capture sizes: the batch given is the
# smallest of the range), rows past the real batch are padding and one wave would leave SMs idle: there a many-wave
# rule (at most CUDA_PROGRAMS_PER_SM CTAs per SM, a power of two, at least CUDA_MIN_SPLITS), under which the
# committed capacity results were measured.
WAVE_FILL = 0.95
MAX_WAVES = 3
CUDA_PROGRAMS_PER_SM = 12
CUDA_MIN_SPLITS = 32


def default_num_splits(batch: int, num_kv_heads: int, max_context: int, device: torch.device,
                       impl: str = "triton", padded: bool = False, kernel: tuple[int, int] | None = None) -> int:
    """Splits per (sequence, KV head), each split >= 256 tokens (``MIN_TOKENS_PER_SPLIT``), at most 256:
    ``impl="triton"``: ~``PROGRAMS_PER_SM`` programs per SM, a power of two rounded up; ``impl="cuda"``: whole waves,
    :func:`wave_splits` with ``slots`` = resident CTAs per SM x SMs, the resident CTAs of the CUDA kernel of ``kernel``
    = (key bits, value bits) on ``device`` (``cuda_decode.resident_ctas``; None: the fewest of every kernel), i.e. the
    fewest waves ``w`` (1, 2, 3) whose count ``floor(w x slots / (batch x num_kv_heads))`` fills the slots to >=
    ``WAVE_FILL``; or with ``padded`` (a CUDA graph that serves any batch from ``batch`` up to its capture size) at
    most ``CUDA_PROGRAMS_PER_SM`` CTAs per SM, a power of two rounded down, at least ``CUDA_MIN_SPLITS`` (the comment
    above says why; source of the wave rule: the H200 timings of results/reach/carveout_splits_h200.json, including
    the A100 and Ada shared-memory budgets emulated by the carveout, and the wave-quantization argument).

    Depends only on shapes (batch, heads, block-table width) and the device, never on ``seq_lens`` values, so
    the launch grid is fixed per batch size (CUDA-graph capturable). Raises ValueError for another ``impl``, a
    negative / non-int size or a ``kernel`` without a CUDA kernel; RuntimeError where the driver's occupancy query
    fails on a GPU whose fatbin loaded.
    """
    if impl not in DECODE_IMPLS:
        raise ValueError(f"impl={impl!r}; allowed: {', '.join(repr(x) for x in DECODE_IMPLS)}")
    if not isinstance(padded, bool):
        raise ValueError(f"padded must be True or False, got {padded!r}")
    for name, v, least, kind in (("batch", batch, 0, "non-negative"), ("num_kv_heads", num_kv_heads, 1, "positive"),
                                 ("max_context", max_context, 0, "non-negative")):
        if not isinstance(v, int) or isinstance(v, bool) or v < least:
            raise ValueError(f"{name} must be a {kind} int, got {v!r}")
    cap = min(max(1, max_context // MIN_TOKENS_PER_SPLIT), 256)
    if impl == "cuda" and not padded:
        slots = cuda_decode.ctas_per_sm(device, kernel) * sm_count(device)
        return wave_splits(max(1, batch * num_kv_heads), slots, cap)
    if impl == "cuda":
        most = max(1, (CUDA_PROGRAMS_PER_SM * sm_count(device)) // max(1, batch * num_kv_heads))
        want = max(next_pow2(most + 1) // 2, CUDA_MIN_SPLITS)          # largest power of two <= most
    else:
        want = next_pow2(max(1, (PROGRAMS_PER_SM * sm_count(device)) // max(1, batch * num_kv_heads)))
    return max(1, min(want, cap))


def wave_splits(pairs: int, slots: int, cap: int = 256) -> int:
    """The CUDA kernel's split count for ``pairs`` (sequence, KV head) pairs on ``slots`` resident CTA slots (CTAs
    per SM x SMs), at most ``cap`` splits: for waves ``w`` = 1 .. ``MAX_WAVES`` the count ``s_w = max(1, min(floor(w x
    slots / pairs), cap))`` and its fill ``pairs x s_w / (ceil(pairs x s_w / slots) x slots)`` (the share of the
    launched waves' slots that hold a CTA); the first ``s_w`` whose fill is >= ``WAVE_FILL``, else the ``s_w`` of the
    best fill (the fewest waves on a tie). E.g. an H200 (4 x 132 slots), 13 x 8 pairs: 5 (one wave, fill 0.985); an
    A100's k4v2 budget (3 x 132), 13 x 8: 3 fills 0.79, 7 0.92, 11 0.96 -> 11. Raises ValueError unless all three are
    ints >= 1."""
    for name, v in (("pairs", pairs), ("slots", slots), ("cap", cap)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    best, best_fill = None, -1.0
    for w in range(1, MAX_WAVES + 1):
        s = max(1, min(w * slots // pairs, cap))
        ctas = pairs * s
        fill = ctas / (-(-ctas // slots) * slots)
        if fill >= WAVE_FILL:
            return s
        if fill > best_fill:
            best, best_fill = s, fill
    return best


def decode_workspace_numel(batch: int, num_q_heads: int, head_dim: int, num_splits: int) -> int:
    """float32 elements of the split-K workspace: partial outputs ``[B, Hq, S, D]``, log-sum-exps
    ``[B, Hq, S]`` and the rotated float16 query ``[B, Hq, D]`` (about
    3.5 MB at batch 13, 32 query heads, head_dim 128, 16 splits)."""
    return batch * num_q_heads * num_splits * (head_dim + 1) + batch * num_q_heads * head_dim // 2


def decode_attention(query: torch.Tensor, pool, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     layout: PageLayout, rotation: torch.Tensor, scale: float,
                     out: torch.Tensor | None = None, num_splits: int | None = None,
                     workspace: torch.Tensor | None = None, *, block_n: int | None = None,
                     num_warps: int | None = None, num_stages: int | None = None,
                     dequant: str | None = None, key_mma: str | None = None,
                     max_registers: int | None = None, impl: str | None = None,
                     validate: bool | None = None, rope_bias=None) -> torch.Tensor:
    """Decode attention (one new token per sequence) over compressed KV pages.

    Each page is read once per KV head for all query heads of its GQA group; the context is cut
    into ``num_splits`` splits per (sequence, KV head) and merged with a log-sum-exp (FlashDecoding).
    Two kernels compute it: kvrepro's CUDA kernel (``impl="cuda"``, ``kvrepro.ops.cuda_decode``; the default
    for every preset / head_dim 128 / block 16 / GQA group <= 8 on CUDA devices of compute capability >= 8.0, see
    ``resolve_impl``) and the Triton kernel (``impl="triton"``: every preset and shape, and the CPU interpreter).

    Args:
        query: ``[B, Hq, D]`` bfloat16/float16, last dim contiguous.
        pool: uint8 ``[num_blocks, Hkv, layout.page_bytes]`` or a ``CompressedPool``; must already
            hold every token of every sequence, the current one included (run ``store_kv`` first).
        block_tables: int32 ``[B, max_blocks]``; entries past a sequence's length are not read.
        seq_lens: int32 ``[B]`` tokens in cache per sequence; ``0`` = CUDA-graph padding row
            (output zeros, nothing read).
        layout, rotation: the pool's ``PageLayout`` and float32 ``[D, D]`` rotation.
        scale: softmax scale (usually ``D ** -0.5``).
        out: optional ``[B, Hq, D]`` output (query dtype); written in place.
        num_splits: splits per sequence, 1..65535 // Hkv; default ``default_num_splits`` for the kernel that
            runs (shape-only).
        workspace: optional float32 tensor of >= ``decode_workspace_numel(B, Hq, D, S)`` elements.
        impl: ``"cuda"``, ``"triton"``, or None / ``"auto"`` (default: ``resolve_impl``, i.e. ``"cuda"`` where
            it applies and no Triton-only option below is set, else ``"triton"``). The options from
            ``block_n`` to ``max_registers`` are the Triton kernel's; setting one selects it.
        block_n, num_warps, num_stages: tiling (tokens per step) and Triton launch options;
            ``block_n`` / ``num_warps`` default to ``default_launch(layout.key_bits, key_mma)``,
            ``num_stages`` to ``DECODE_STAGES``.
        dequant: ``"triton"`` (portable, runs under the interpreter) or ``"asm"`` (inline PTX,
            CUDA only); default ``default_dequant(device)``.
        max_registers: registers per thread the attention kernel may use (Triton's ``maxnreg``,
            ptxas ``--maxrregcount``); None (default) = the compiler's choice. A cap trades spills
            for resident warps: 128 lets 4 programs of 4 warps share an H200 SM instead of 3
            (the default launch measured 2.7-3.4% slower for k4v4 and 37-39% slower for k8v4 at 128K
            on the H200; no cap is the default).
        key_mma: ``"int8"`` (default for 4-, 5- or 8-bit keys: key codes stay integers and go through int8
            tensor cores, IMMA, int32 sums) or ``"f16"`` (key codes -> float16, HMMA; the default for
            2-bit keys). For ``"int8"`` each program
            quantizes its rotated, scaled float16 query rows ``[M, D]`` to ``qi = round(q / S_q)``,
            ``S_q = max|q| / 16255`` per query head (and sequence and split), held as two int8 digits
            ``qi = 128 qh + ql``; the keys are their exact centred codes (4-bit: ``16 (code - 8)``,
            5-bit: ``8 (code - 16)``, 8-bit: ``code - 128``), so the int32 logits are exact for the ~14-bit
            query (absolute error per q element <= 2**-15 of that head's max |q|; float16 rounds each element to
            2**-11 of itself, so elements below ~1/16 of the head's max keep fewer bits than in
            float16). Method: SageAttention (Zhang et al. 2024, 2025) quantizes Q and K to int8 for
            attention; here only q is quantized. Values are unchanged.
        rope_bias: None, or ``(terms, inv_freq)`` (``check_rope_bias``) for pages stored under the key offset
            rope-mean: each paged key's logit gets ``sum_i A_i cos(j theta_i) + B_i sin(j theta_i)`` back (both
            kernels; the CUDA kernel takes ``cuda_decode.ROPE_PAIRS`` pairs, another count selects Triton).

    Returns:
        ``out`` ``[B, Hq, D]`` in the query dtype. A query head whose softmax meets a NaN (in its query
        or in a cached value it attends to) comes out NaN, as in float64 attention, never as a finite
        number.

    No host sync and a launch grid fixed by ``(B, Hkv, num_splits)``: CUDA-graph capturable.
    With ``impl="cuda"`` one launch does the query rotation (a Walsh-Hadamard transform: ``rotation`` must be
    ``kvrepro.formats.hadamard.rotation_matrix``'s form), the split-K attention and the split merge (the last CTA of
    each sequence and KV head); ``num_splits x group`` may not exceed ``cuda_decode.MERGE_MAX``. The Triton path
    launches three kernels (rotation, attention, merge).
    Precision: q is rotated and scaled in float32, then rounded to float16 (needs
    ``|q @ R| * scale * 1.4427 < 65504``); softmax and accumulation in float32.

    ``validate`` (default: on for CPU tensors, off on CUDA where it needs a host sync) checks
    on the host that ``seq_lens >= 0``, the block table covers them and its block ids are in the
    pool; without it, out-of-range indices are undefined behaviour (as in vLLM's kernels).

    Raises:
        ValueError: wrong shapes/dtypes/devices, unsupported head_dim or GQA group size, a scale
            that is not finite and positive; with ``validate``, bad seq_lens or block ids;
            ``dequant`` not in ``DEQUANT_MODES`` (or ``"asm"`` off CUDA); ``key_mma`` not in ``KEY_MMAS``,
            or ``"int8"`` with keys other than 4 / 5 / 8 bits; ``max_registers`` not None or a multiple of 8 in
            [32, 248];
            ``impl`` as ``resolve_impl``; with ``impl="cuda"``: ``num_splits x group > cuda_decode.MERGE_MAX`` or a
            rotation that is not ``diag(s) H / sqrt(D)``.
        RuntimeError: ``impl="cuda"`` and the CUDA driver cannot load the kernel's fatbin (the message says
            what to do); a rotation not seen before, or more split counters than allocated, inside CUDA-graph
            capture (run one eager call first).
    """
    data = pool_tensor(pool)
    _, hkv = check_pool(data, layout, triton=False)     # the Triton kernels' device check once impl says Triton runs
    dev = data.device
    if query.dim() != 3:
        raise ValueError(f"query must be [B, Hq, D], got {tuple(query.shape)}")
    b, hq, d = query.shape
    group = check_heads(hq, hkv, d, layout)
    check_float("query", query, (b, hq, d), dev)
    check_int("block_tables", block_tables, 2, dev)
    check_int("seq_lens", seq_lens, 1, dev)
    if block_tables.shape[0] != b or seq_lens.shape[0] != b:
        raise ValueError(f"block_tables {tuple(block_tables.shape)} and seq_lens {tuple(seq_lens.shape)} "
                         f"must have B={b} rows")
    check_rotation(rotation, layout, dev)
    check_scale(scale)
    if want_checks(validate, dev):
        check_block_tables(block_tables, seq_lens, data.shape[0], layout.block_size)
    if out is None:
        out = torch.empty_like(query)
    else:
        check_float("out", out, (b, hq, d), dev)
    npairs = check_rope_bias(rope_bias, b, hq, hkv, dev)
    options = dict(zip(TRITON_OPTIONS, (block_n, num_warps, num_stages, dequant, key_mma, max_registers)))
    if npairs and npairs != cuda_decode.ROPE_PAIRS:
        options["rope_bias"] = rope_bias       # the CUDA kernel's rope-mean variant takes ROPE_PAIRS pairs only
    impl = resolve_impl(impl, layout, group, dev, tuple(k for k, v in options.items() if v is not None))
    if impl == "triton":
        check_triton_device(dev)
    num_stages = DECODE_STAGES if num_stages is None else num_stages
    key_mma = resolve_key_mma(key_mma, layout.key_bits)
    check_key_mma(key_mma, layout.key_bits)
    launch = default_launch(layout.key_bits, key_mma)
    block_n = launch[0] if block_n is None else block_n
    num_warps = launch[1] if num_warps is None else num_warps
    check_block_n(block_n)
    dequant = resolve_dequant(dequant, dev)
    if num_splits is None:
        num_splits = default_num_splits(b, hkv, block_tables.shape[1] * layout.block_size, dev, impl,
                                        kernel=(layout.key_bits, layout.value_bits) if impl == "cuda" else None)
    max_splits = 65535 // hkv       # the launch grid's second / third dimension holds Hkv x num_splits
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or not 1 <= num_splits <= max_splits:
        raise ValueError(f"num_splits must be an int in 1..{max_splits} (65535 // num_kv_heads), got {num_splits!r}")
    if impl == "cuda":
        cuda_decode.check_splits(num_splits, group)
    check_launch(num_warps, num_stages, max_registers)
    launch_opts = {} if max_registers is None else {"maxnreg": max_registers}
    if b == 0:
        return out
    need = decode_workspace_numel(b, hq, d, num_splits)
    if workspace is None:
        workspace = torch.empty(need, dtype=torch.float32, device=dev)
    elif workspace.dtype != torch.float32 or workspace.numel() < need or workspace.device != dev:
        raise ValueError(f"workspace must be float32 on {dev} with >= {need} elements")
    n_o = b * hq * num_splits * d
    part_o = workspace[:n_o]
    part_lse = workspace[n_o:n_o + b * hq * num_splits]
    q16 = workspace[n_o + b * hq * num_splits:need].view(torch.float16)[: b * hq * d]

    if impl == "cuda":      # one launch: query rotation, attention and split merge
        cuda_decode.launch(query, rotation, data, block_tables, seq_lens, part_o, part_lse, out, scale, num_splits,
                           hkv, group, key_bits=layout.key_bits, value_bits=layout.value_bits, rope_bias=rope_bias)
        return out
    rotate_query_kernel[(b * hq,)](query, rotation, q16, query.stride(0), query.stride(1),
                                   float(scale) * LOG2E, HQ=hq, D=d)
    paged_attn_kernel[(b, 1, hkv * num_splits)](
        q16, data, block_tables, seq_lens, seq_lens, q16, q16, part_o, part_lse, rotation,
        block_tables.stride(0), NUM_SPLITS=num_splits, **decode_constexprs(layout, hkv, group, block_n, key_mma),
        DEQ_ASM=dequant == "asm", num_warps=num_warps, num_stages=num_stages, **launch_opts,
        **_rope_bias_args(rope_bias, npairs, scale),
    )
    merge_splits_kernel[(b * hq,)](part_o, part_lse, rotation, out, out.stride(0), out.stride(1),
                                   HQ=hq, D=d, NUM_SPLITS=num_splits, SP=next_pow2(num_splits))
    return out
