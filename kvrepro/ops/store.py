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
STORE_WARPS = {True: 8, False: 4}   # by in-kernel rotation: the fewest warps at which no preset's kernel spills (sm_80-90)


ROTATE_MODES = ("kernel", "torch")   # the default first
ROTATE_PIECE = 4096  # rotate="torch": tokens rotated per float32 temporary (4096 x Hkv x D x 8 B)


def store_kv(key: torch.Tensor, value: torch.Tensor, pool, slot_mapping: torch.Tensor,
             layout: PageLayout, rotation: torch.Tensor, *, rotate: str = "kernel",
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
        rotate: ``"kernel"`` (default: inside the Triton store kernel, as ``(x @ diag(s) H) / sqrt(head_dim)`` on
            the tensor cores, whose TF32 products are exact for bf16 / fp16 inputs and +-1, so only the float32 sums
            round; needs ``rotation`` of the form ``diag(s) H / sqrt(head_dim)``, checked on the host once per
            rotation tensor by :func:`hadamard_operand`, which must therefore run once outside CUDA-graph capture)
            or ``"torch"`` (``x.float() @ R`` through PyTorch in pieces of ``ROTATE_PIECE`` tokens, then the kernel
            quantizes: the reference's op, for any rotation; two casts and two float32 GEMMs more per call, which a
            decode step pays in every layer).
        validate: check slot range and finite K/V on the host (default: on for CPU tensors,
            off on CUDA, where it would need a host sync and break CUDA-graph capture).

    Preconditions (checked only when ``validate``): slots in ``[-1, num_blocks * block_size)``,
    K/V finite with magnitudes within float16 range after rotation. A slot out of range without ``validate`` writes
    outside the pool (on the CPU, under Triton's interpreter, that corrupts the process's memory).
    Without ``validate``: no host sync; CUDA-graph capturable. Page offsets are int64.

    Raises:
        ValueError: wrong shapes, dtypes, devices or layout, or ``rotate`` not in ``ROTATE_MODES``; ``rotate="kernel"``
            with a rotation not of the Hadamard form; with ``validate``, bad slots or non-finite K/V (or K/V beyond
            the float16 range after rotation).
        RuntimeError: ``rotate="kernel"`` with a rotation tensor not seen before, during CUDA-graph capture.
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
            for name, x in (("key", key[p0:p0 + ROTATE_PIECE]), ("value", value[p0:p0 + ROTATE_PIECE])):
                big = (x.float() @ rotation).abs().amax(dim=(1, 2)) > FP16_MAX
                if bool(big.any()):
                    raise ValueError(f"{name}: magnitude after rotation exceeds the float16 range ({FP16_MAX}) of the "
                                     f"stored scale/zero at token {p0 + int(big.nonzero()[0, 0])}; refusing to store "
                                     "K/V")
    pm = hadamard_operand(rotation) if rotate == "kernel" else None     # the form is checked for 0 tokens too
    if t == 0:
        return
    if rotate == "kernel":
        _launch(key, value, data, slot_mapping, pm, layout, hkv)
        return
    for p0 in range(0, t, ROTATE_PIECE):
        p1 = min(t, p0 + ROTATE_PIECE)
        _launch(key[p0:p1].float() @ rotation, value[p0:p1].float() @ rotation, data, slot_mapping[p0:p1],
                None, layout, hkv)


def hadamard_operand(rotation: torch.Tensor) -> torch.Tensor:
    """The +-1 matrix ``diag(s) H`` (float32 ``[D, D]``, on the rotation's device) of a rotation
    ``R = diag(s) H / sqrt(D)`` (``kvrepro.formats.hadamard.rotation_matrix``): the store kernel's operand
    (``rotate="kernel"``).

    The form is checked on the host once per rotation tensor and in-place version
    (:func:`kvrepro.ops.cuda_decode.rotation_signs`: one sync) and the result cached, so call it once outside
    CUDA-graph capture (``LayerRuntime.prepare`` does). Raises ValueError if ``rotation`` is not of that form,
    RuntimeError if an unchecked rotation reaches it during graph capture.
    """
    from kvrepro.ops.cuda_decode import rotation_signs

    capturing = rotation.is_cuda and torch.cuda.is_current_stream_capturing()
    try:
        signs = rotation_signs(rotation)
    except ValueError:
        raise ValueError("rotate='kernel' needs rotation = diag(s) H / sqrt(head_dim) with H the Sylvester Hadamard "
                         "matrix and s signs (kvrepro.formats.hadamard.rotation_matrix); use rotate='torch' for "
                         "another rotation") from None
    except RuntimeError:             # an unchecked rotation during capture: said below, naming store_kv
        if not capturing:
            raise
        signs = None
    pm = _OPERANDS.get(id(signs)) if signs is not None else None
    if pm is None and capturing:    # building the operand here would record it into the graph, empty until replay
        raise RuntimeError("kvrepro store_kv(rotate='kernel'): a rotation tensor not seen before reached it during "
                           "CUDA-graph capture; call kvrepro.ops.store.hadamard_operand(rotation) once eagerly first "
                           "(LayerRuntime.prepare does), or store_kv once outside capture")
    if pm is None:       # |R| is 1 / sqrt(D) to float32 rounding, so the product rounds to exactly +-1
        pm = _OPERANDS[id(signs)] = torch.round(rotation * rotation.shape[0] ** 0.5).contiguous()
    return pm


_OPERANDS: dict = {}     # id(sign vector of rotation_signs, which keeps it alive) -> +-1 [D, D] float32


def _launch(key, value, data, slot_mapping, pm, layout, hkv):
    t = key.shape[0]
    grid = (triton.cdiv(t, STORE_BLOCK_T), hkv)
    return store_kv_kernel[grid](
        key, value, data, slot_mapping, key if pm is None else pm, 1.0 / layout.head_dim ** 0.5, t,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        **page_constexprs(layout, hkv), BLOCK_T=STORE_BLOCK_T,
        ROTATE=pm is not None, num_warps=STORE_WARPS[pm is not None],
    )
