"""Recent-token window (opt-in, an experiment): exact K/V of each request's last ``W`` tokens beside the compressed
pages, read by decode steps in place of their 4-bit copies.

Why. On the CPU path the k4v4 miss at 8,184 tokens / depth 0.33 (SmolLM2, read as vLLM serves it) answers right when
the last 16-128 tokens' K/V are exact (notes/accuracy.md); keeping recent tokens in full precision is KIVI's residual
(Liu et al. 2024, arXiv:2402.02750, Sec. 3.3). Here it is measured through vLLM (``KVREPRO_RECENT_WINDOW``).

What is stored. A side cache of ``E`` entries per layer (``k``, ``v``: ``[E + 1, Hkv, D]`` in the model dtype,
unrotated, exactly as the model computed them; row ``E`` is a sink for padding), addressed by the token's KV-cache
slot (``slot % E``) and tagged with that slot (``tag``, int64 ``[E + 1]``, -1 = empty). vLLM hands the attention
backend block tables, not request ids, and reorders batch rows between steps, so the physical slot is the one
address a token keeps. Every step (:meth:`RecentWindow.update`):
  1. every token the step stores into the pages clears an entry tagged with its slot (a freed and reused block, or a
     prefix-cache block another request reads, can never serve an older token's K/V);
  2. the last ``W`` tokens of each request's chunk claim their entries; where two claim one entry in the same step
     the larger slot wins (a deterministic ``scatter_reduce`` max), and the winners write K, V and tag.
An entry taken by another token later is a miss, never a wrong value: a read checks the tag and takes the token's
page bytes (dequantized) instead.

Where it is read (:meth:`RecentWindow.attend_decode`). A decode row of ``L`` tokens attends positions
``[0, L - W)`` through the decode kernel (its ``seq_lens`` lowered by ``W``) and positions ``[L - W, L)`` here, in
float32: K/V from the window on a tag hit, from the pages otherwise; the two softmax partials are merged by their
log-sum-exps (FlashDecoding's merge, Dao et al. 2023). Prefill chunks are unchanged (their own K/V are exact; the
context they read stays in pages). Every position ``>= L - W`` of a decode row that the request stored itself was
among the last ``W`` tokens of the step that stored it, so without collisions those reads hit; positions it shares
through prefix caching may miss (read from the pages). Every page write must go through the backend's store (as it
does in vLLM 0.20.2 without KV connectors): a write that bypassed it would leave a stale tag behind.

All of it is PyTorch tensor ops with shapes fixed by the batch (no host sync): CUDA-graph capturable.
"""
from __future__ import annotations

import math

import torch

MAX_WINDOW = 256
LN2 = math.log(2.0)


MAX_ENTRIES = 1 << 20
MAX_LAYER_BYTES = 1 << 30      # per layer; above it the side cache is refused (it is allocated beside the KV cache)


def default_entries(window: int, max_batch: int | None) -> int:
    """Side-cache entries for ``window`` tokens x ``max_batch`` requests at a load of at most 1/16 (few collisions):
    the next power of two >= ``16 x window x max_batch``, at least 4096. Raises ValueError above ``MAX_ENTRIES``
    (2**20: 4 GiB per layer for 8 KV heads of head_dim 128 in bfloat16), naming both numbers."""
    need = 16 * window * max(1, max_batch or 1)
    if need > MAX_ENTRIES:
        raise ValueError(f"recent-token window: 16 x window ({window}) x max_num_seqs ({max_batch}) = {need} side-cache "
                         f"entries per layer, more than {MAX_ENTRIES}; lower KVREPRO_RECENT_WINDOW or max_num_seqs")
    return max(4096, 1 << (need - 1).bit_length())


class RecentWindow:
    """Per-layer side cache of recent exact K/V (module docstring).

    Args:
        window: W, the decode rows' last W positions read from here (1..``MAX_WINDOW``).
        entries: E side-cache entries (>= W).
        num_kv_heads, head_dim: the layer's KV geometry.
        dtype: the model's K/V dtype (bfloat16 / float16 / float32).
        device: where the buffers live.

    Memory: ``(E + 1) x Hkv x D x 2 x itemsize + 3 x (E + 1) x 8`` bytes (``nbytes``); for Qwen3-4B (8 KV heads,
    head_dim 128, bfloat16) 4 KiB per entry, e.g. 65,536 entries = 256 MiB per layer, 9 GiB over 36 layers.

    Raises:
        ValueError: window, entries, geometry or dtype out of range, or the K/V part above ``MAX_LAYER_BYTES``.
    """

    def __init__(self, window: int, entries: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        if not isinstance(window, int) or isinstance(window, bool) or not 1 <= window <= MAX_WINDOW:
            raise ValueError(f"window must be an int in 1..{MAX_WINDOW}, got {window!r}")
        if not isinstance(entries, int) or isinstance(entries, bool) or not window <= entries <= MAX_ENTRIES:
            raise ValueError(f"entries must be an int in window ({window})..{MAX_ENTRIES}, got {entries!r}")
        for name, v in (("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"dtype must be bfloat16, float16 or float32, got {dtype}")
        need = (entries + 1) * num_kv_heads * head_dim * 2 * torch.empty(0, dtype=dtype).element_size()
        if need > MAX_LAYER_BYTES:
            raise ValueError(f"recent-token window: {need / 2**30:.2f} GiB of side cache per layer ({entries} entries x "
                             f"{num_kv_heads} KV heads x head_dim {head_dim}), more than "
                             f"{MAX_LAYER_BYTES / 2**30:.0f} GiB; lower KVREPRO_RECENT_WINDOW or vLLM's max_num_seqs")
        self.window, self.entries = window, entries
        self.k = torch.zeros(entries + 1, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.tag = torch.full((entries + 1,), -1, dtype=torch.int64, device=device)
        self._claim = torch.empty_like(self.tag)
        self._clear = torch.empty_like(self.tag)
        self._shell = {}            # page layout -> a CompressedPool shell whose .data is set per call

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size() + 3 * self.tag.numel() * 8

    def _entry(self, slots: torch.Tensor) -> torch.Tensor:
        return torch.where(slots >= 0, slots % self.entries, self.entries)

    def update(self, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
               query_start_loc: torch.Tensor, num_tokens: int) -> None:
        """Record this step's tokens (steps 1-2 of the module docstring).

        Args:
            key, value: ``[>= T, Hkv, D]`` or ``[>= T, Hkv * D]`` this step's K/V (the window's dtype).
            slot_mapping: int ``[>= T]`` the slots the step stored them at (-1 = padding, ignored).
            query_start_loc: int ``[R + 1]`` vLLM's cumulative query lengths (each request's chunk).
            num_tokens: T (host int).
        """
        t = num_tokens
        if t == 0:
            return
        if key.dtype != self.k.dtype or value.dtype != self.v.dtype:
            raise ValueError(f"key/value must be {self.k.dtype} (the window's dtype), got {key.dtype} / {value.dtype}")
        if slot_mapping.dtype.is_floating_point or query_start_loc.dtype.is_floating_point:
            raise ValueError(f"slot_mapping and query_start_loc must be integer tensors, got {slot_mapping.dtype} / "
                             f"{query_start_loc.dtype}")
        hkv, d = self.k.shape[1], self.k.shape[2]
        k = key[:t].reshape(t, hkv, d)
        v = value[:t].reshape(t, hkv, d)
        slots = slot_mapping[:t].long()
        e = self._entry(slots)
        live = slots >= 0
        # 1. clear entries tagged with a slot stored again now
        self._clear.zero_()
        self._clear.scatter_reduce_(0, e, (live & (self.tag[e] == slots)).long(), "amax")
        self.tag.masked_fill_(self._clear.bool(), -1)
        # 2. the last W tokens of each request's chunk claim their entries; the larger slot wins a collision
        ends = query_start_loc[1:].long()
        idx = torch.arange(t, device=slots.device)
        req = torch.searchsorted(ends, idx, right=True).clamp(max=ends.numel() - 1)
        win = live & (idx >= ends[req] - self.window)
        self._claim.fill_(-1)
        self._claim.scatter_reduce_(0, e, torch.where(win, slots, -1), "amax")
        won = win & (self._claim[e] == slots)
        dst = torch.where(won, e, self.entries)           # everything else lands in the sink row
        self.k.index_copy_(0, dst, k)
        self.v.index_copy_(0, dst, v)
        self.tag.index_copy_(0, dst, torch.where(won, slots, -1))
        self.tag[self.entries:].fill_(-1)            # the sink row stays empty (fill_: no host copy, graph-safe)

    def page_kv(self, fmt, pool: torch.Tensor, layout, rotation: torch.Tensor, slots: torch.Tensor):
        """Dequantized, unrotated K/V (float32 ``[*slots.shape, Hkv, D]``) of the tokens at ``slots`` (int64, valid)
        in ``pool`` (uint8 pages of ``fmt``): the same values the decode kernels compute with."""
        from kvrepro.formats.compressed import dequantize_rotated

        key = (fmt.name, layout.head_dim, layout.block_size, pool.shape[1])
        shell = self._shell.get(key)
        if shell is None:             # regions() only reads the shell's layout and sizes
            shell = self._shell[key] = fmt.new_pool(1, pool.shape[1], layout.head_dim, layout.block_size, device="cpu")
        kc, vc, km, vm = shell.regions(pool)
        bs = layout.block_size
        blk, off = slots // bs, slots % bs
        k = dequantize_rotated(kc[blk, :, off], km[blk, :, off].contiguous().view(torch.float16), layout.key_bits)
        v = dequantize_rotated(vc[blk, :, off], vm[blk, :, off].contiguous().view(torch.float16), layout.value_bits)
        rt = rotation.T
        return k @ rt, v @ rt

    def attend_decode(self, fmt, query: torch.Tensor, pool: torch.Tensor, layout, rotation: torch.Tensor,
                      block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float, out_pages: torch.Tensor,
                      lse_pages: torch.Tensor, key_mean: torch.Tensor | None = None) -> torch.Tensor:
        """Decode rows' attention: the pages' partial over ``[0, L - W)`` merged with the window's over
        ``[L - W, L)``.

        Args:
            query: ``[B, Hq, D]`` the decode rows' queries.
            pool: the layer's uint8 pages; layout, rotation: its ``PageLayout`` and float32 ``[D, D]`` rotation.
            block_table: int32 ``[B, max_blocks]``; seq_lens: int ``[B]`` (0 = padding row).
            scale: softmax scale.
            out_pages: ``[B, Hq, D]`` attention over positions ``[0, L - W)`` (the decode kernel's output).
            lse_pages: float32 ``[B, Hq]`` its natural log-sum-exp (-inf where ``L <= W``).
            key_mean: float32 ``[Hkv, D]`` if the pages hold centered keys (``kvrepro.formats.centering``): the
                window's exact keys are shifted alike, so both partials share one logit offset.

        Returns:
            float32 ``[B, Hq, D]`` (zeros for padding rows; NaN where a NaN reached a head's softmax).
        """
        b, hq, d = query.shape
        hkv = self.k.shape[1]
        g = hq // hkv
        w = self.window
        lens = seq_lens[:b].long()
        pos = lens[:, None] - w + torch.arange(w, device=lens.device)[None, :]          # [B, W]
        valid = pos >= 0
        posc = pos.clamp(min=0)
        bs = layout.block_size
        blk = block_table[:b].long().gather(1, torch.minimum(posc // bs, torch.full_like(posc, block_table.shape[1] - 1)))
        slots = blk * bs + posc % bs
        e = self._entry(slots)
        hit = (valid & (self.tag[e] == slots))[..., None, None]
        kp, vp = self.page_kv(fmt, pool, layout, rotation, slots)                   # [B, W, Hkv, D]
        kx = self.k[e].float()
        if key_mean is not None:
            kx = kx - key_mean
        ok = valid[..., None, None]
        kk = torch.where(hit, kx, torch.where(ok, kp, 0.0))   # positions < 0 (a padding row's bytes) stay out: 0
        vv = torch.where(hit, self.v[e].float(), torch.where(ok, vp, 0.0))
        q = query.float().view(b, hkv, g, d)
        logits = torch.einsum("bhgd,bwhd->bhgw", q, kk) * scale
        logits = logits.masked_fill(~valid[:, None, None, :], float("-inf"))
        lse_w = torch.logsumexp(logits, dim=-1)                                      # [B, Hkv, G]
        lse_safe = torch.where(torch.isneginf(lse_w), torch.zeros_like(lse_w), lse_w)
        p = torch.exp(logits - lse_safe[..., None])
        o_w = torch.einsum("bhgw,bwhd->bhgd", p, vv).reshape(b, hq, d)
        lse_w = lse_w.reshape(b, hq)
        lp = torch.where((lens - w > 0)[:, None], lse_pages, torch.full_like(lse_pages, float("-inf")))
        m = torch.maximum(lp, lse_w)
        m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
        a, c = torch.exp(lp - m), torch.exp(lse_w - m)
        den = a + c
        o = (a[..., None] * out_pages.float() + c[..., None] * o_w) / torch.where(den > 0, den, torch.ones_like(den))[..., None]
        return o


def lse_from_workspace(workspace: torch.Tensor, batch: int, num_q_heads: int, head_dim: int,
                       num_splits: int) -> torch.Tensor:
    """Natural log-sum-exp ``[B, Hq]`` (float32) of a decode call's split partials in ``workspace`` (the layout of
    ``kvrepro.ops.decode_workspace_numel``: partial outputs, then log2 log-sum-exps ``[B, Hq, S]``)."""
    n_o = batch * num_q_heads * num_splits * head_dim
    part = workspace[n_o:n_o + batch * num_q_heads * num_splits].view(batch, num_q_heads, num_splits)
    return torch.logsumexp(part * LN2, dim=-1)
