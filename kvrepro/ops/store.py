"""``store_kv``: write new K/V into compressed pages (vLLM's cache-write step)."""
from __future__ import annotations

import torch
import triton

from kvrepro.formats.compressed import FP16_MAX
from kvrepro.formats.layout import PageLayout
from kvrepro.formats.base import check_finite
from kvrepro.ops.common import (check_float, check_pool, check_rotation, check_slots, page_constexprs,
                                pool_tensor, want_checks)
from kvrepro.ops.triton.store import store_kv_kernel

STORE_BLOCK_T = 16


ROTATE_MODES = ("kernel", "torch")
ROTATE_PIECE = 4096  # rotate="torch": tokens rotated per float32 temporary (4096 x Hkv x D x 8 B)


def store_kv(key: torch.Tensor, value: torch.Tensor, pool, slot_mapping: torch.Tensor,
             layout: PageLayout, rotation: torch.Tensor, *, rotate: str = "torch",
             validate: bool | None = None) -> None:
    """Rotate, quantize and pack ``key``/``value`` into their slots of ``pool`` (in place).

    Same bytes as ``CompressedPool.write`` (``kvrepro.formats.compressed``), except that a code
    may differ by one where ``x @ R`` lands on an exact rounding tie (float32 summation order).

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]`` bfloat16/float16, last dim contiguous.
        pool: uint8 ``[num_blocks, num_kv_heads, layout.page_bytes]`` (contiguous) or a ``CompressedPool``.
        slot_mapping: int32 or int64 ``[num_tokens]``; ``slot = block_id * block_size + offset``;
            ``-1`` = padding, skipped.
        layout: the pool's ``PageLayout``.
        rotation: float32 ``[head_dim, head_dim]`` (``rotation_matrix(head_dim, seed)``), same device.
        rotate: ``"torch"`` (default: ``x.float() @ R`` through PyTorch in pieces of
            ``ROTATE_PIECE`` tokens, then the kernel quantizes; the same op as the reference;
            0.22 ms per 8K tokens x 8 heads x 128 on the H200) or ``"kernel"`` (rotation
            inside the Triton kernel: 2.50 ms there, and its float32 ``[D, D]`` operand spills to a
            6,792 B stack per thread, for which the CUDA driver reserves ~1.7 GiB of local memory
            at the first launch, notes/vllm.md, "Memory accounting: what was learned").

        validate: check slot range and finite K/V on the host (default: on for CPU tensors,
            off on CUDA, where it would need a host sync and break CUDA-graph capture).

    Preconditions (checked only when ``validate``): slots in ``[-1, num_blocks * block_size)``,
    K/V finite with magnitudes within float16 range after rotation. Without ``validate``: no host
    sync; CUDA-graph capturable. Page offsets are int64.

    Raises:
        ValueError: wrong shapes, dtypes, devices or layout, or ``rotate`` not in ``ROTATE_MODES``; with
            ``validate``, bad slots or non-finite K/V (or K/V beyond the float16 range after rotation).
    """
    data = pool_tensor(pool)
    _, hkv = check_pool(data, layout)
    dev = data.device
    t = key.shape[0] if key.dim() == 3 else -1
    check_float("key", key, (t, hkv, layout.head_dim), dev)
    check_float("value", value, (t, hkv, layout.head_dim), dev)
    if slot_mapping.dtype not in (torch.int32, torch.int64) or tuple(slot_mapping.shape) != (t,):
        raise ValueError(f"slot_mapping must be int32/int64 [num_tokens={t}], got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if slot_mapping.device != dev or slot_mapping.stride(0) != 1:
        raise ValueError(f"slot_mapping must be contiguous and on {dev}")
    check_rotation(rotation, layout, dev)
    if rotate not in ROTATE_MODES:
        raise ValueError(f"rotate={rotate!r}; allowed: {ROTATE_MODES}")
    if want_checks(validate, dev):
        check_slots(slot_mapping, data.shape[0], layout.block_size)
        check_finite(key, value)
        for p0 in range(0, t, ROTATE_PIECE):   # the reference's range check (formats.compressed)
            for x in (key[p0:p0 + ROTATE_PIECE], value[p0:p0 + ROTATE_PIECE]):
                if float((x.float() @ rotation).abs().max()) > FP16_MAX:
                    raise ValueError(f"K/V magnitude after rotation exceeds the float16 range ({FP16_MAX}) "
                                     "of the stored scale/zero; refusing to store them")
    if t == 0:
        return
    if rotate == "kernel":
        _launch(key, value, data, slot_mapping, rotation, layout, hkv, True)
        return
    for p0 in range(0, t, ROTATE_PIECE):
        p1 = min(t, p0 + ROTATE_PIECE)
        _launch(key[p0:p1].float() @ rotation, value[p0:p1].float() @ rotation, data, slot_mapping[p0:p1],
                rotation, layout, hkv, False)


def _launch(key, value, data, slot_mapping, rotation, layout, hkv, rotate_here):
    t = key.shape[0]
    grid = (triton.cdiv(t, STORE_BLOCK_T), hkv)
    store_kv_kernel[grid](
        key, value, data, slot_mapping, rotation, t,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        **page_constexprs(layout, hkv), BLOCK_T=STORE_BLOCK_T,
        ROTATE=rotate_here,
    )
