"""What the vLLM impl does per layer, without vLLM: slicing a vLLM batch and calling ``kvrepro.ops``.

Kept apart from ``backend.py`` so that it is tested on CPU (kernels under ``TRITON_INTERPRET=1``)
against ``kvrepro.reference.paged_attention_ref`` with vLLM's own batch conventions.
"""
from __future__ import annotations

import torch

from kvrepro.formats import get_format
from kvrepro.formats.hadamard import rotation_matrix

_ROTATIONS: dict[tuple[int, int, str], torch.Tensor] = {}


def shared_rotation(head_dim: int, seed: int, device: torch.device) -> torch.Tensor:
    """One float32 ``[head_dim, head_dim]`` rotation per (head_dim, seed, device), shared by all layers."""
    key = (head_dim, seed, str(device))
    if key not in _ROTATIONS:
        _ROTATIONS[key] = rotation_matrix(head_dim, seed, device).contiguous()
    return _ROTATIONS[key]


class LayerRuntime:
    """Per-layer state and calls of the kvrepro backend.

    Args:
        preset: compressed preset name (``k4v4``, ``k8v4``, ``k4v2``).
        num_heads, num_kv_heads, head_size: attention geometry (GQA: num_heads % num_kv_heads == 0).
        scale: softmax scale.
        num_splits: decode split-K count, or None for the kernel's shape-only default (both keep
            the launch grid fixed per batch size, as CUDA graphs need).
        ops: module with ``store_kv``, ``decode_attention``, ``prefill_attention`` (default ``kvrepro.ops``).
        prefill: callable replacing ``ops.prefill_attention`` (same arguments), e.g.
            ``fa_prefill.FlashPrefill``; default None = kvrepro's Triton prefill kernel.
    """

    def __init__(self, preset: str, num_heads: int, num_kv_heads: int, head_size: int, scale: float,
                 num_splits: int | None = None, ops=None, prefill=None) -> None:
        self.fmt = get_format(preset)
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.scale = scale
        self.num_splits = num_splits
        self._ops = ops
        self.prefill = prefill
        self._layouts: dict[int, object] = {}
        self.rotation: torch.Tensor | None = None

    @property
    def ops(self):
        if self._ops is None:
            import kvrepro.ops as ops  # Triton; imported on first use

            self._ops = ops
        return self._ops

    def prepare(self, device: torch.device) -> torch.Tensor:
        """Put the rotation on ``device`` (before CUDA-graph capture); returns it."""
        if self.rotation is None or self.rotation.device != torch.device(device):
            self.rotation = shared_rotation(self.head_size, self.fmt.seed, torch.device(device))
        return self.rotation

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

    def store(self, key: torch.Tensor, value: torch.Tensor, pool: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Compress this step's K/V (``[>= num_tokens, Hkv * D]`` or ``[.., Hkv, D]``) into ``pool``;
        ``slot_mapping`` ``[num_tokens]`` (-1 = padding)."""
        n = slot_mapping.shape[0]
        if n == 0:
            return
        k = key[:n].view(n, self.num_kv_heads, self.head_size)
        v = value[:n].view(n, self.num_kv_heads, self.head_size)
        self.ops.store_kv(k, v, pool, slot_mapping, self.layout(pool), self.prepare(pool.device))

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
            self.ops.decode_attention(q[:nd], pool, block_table[:nd], seq_lens[:nd], layout, rot, self.scale,
                                      out=out[:nd], num_splits=self.num_splits)
        if ndt < t:
            k = key[:t].view(t, hkv, d)[ndt:]
            v = value[:t].view(t, hkv, d)[ndt:]
            qsl = query_start_loc[nd:] - ndt if nd else query_start_loc
            (self.prefill or self.ops.prefill_attention)(q[ndt:], k, v, pool, block_table[nd:], seq_lens[nd:], qsl, layout, rot,
                                       self.scale, out=out[ndt:t], max_query_len=max_query_len)
        return out


def reference_attend(rt: LayerRuntime, query, key, value, pool: torch.Tensor, block_table, seq_lens,
                     query_start_loc, num_actual_tokens: int, num_decodes: int,
                     dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """What :meth:`LayerRuntime.attend` must compute, in PyTorch (``dtype``, default float64):
    decode rows attend to their dequantized pages (``kvrepro.formats.compressed``); prefill rows to
    the dequantized context pages plus the chunk's own K/V unquantized. Returns ``[T, Hq, D]``."""
    from kvrepro.reference import attention_ref

    t, hq, hkv, d = num_actual_tokens, rt.num_heads, rt.num_kv_heads, rt.head_size
    layout = rt.layout(pool)
    ref_pool = rt.fmt.new_pool(1, hkv, d, layout.block_size, device=pool.device)
    ref_pool.data = pool
    q = query[:t].reshape(t, hq, d)
    k = key[:t].reshape(t, hkv, d)
    v = value[:t].reshape(t, hkv, d)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    out = torch.zeros(t, hq, d, dtype=dtype, device=query.device)
    for b in range(len(lens)):
        qs, qe, s = qsl[b], qsl[b + 1], lens[b]
        if qe <= qs or s == 0:
            continue
        if b < num_decodes:
            kc, vc = ref_pool.gather(block_table[b], s)
        else:
            ctx = s - (qe - qs)
            kc, vc = k[qs:qe].to(dtype), v[qs:qe].to(dtype)
            if ctx:
                kp, vp = ref_pool.gather(block_table[b], ctx)
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
