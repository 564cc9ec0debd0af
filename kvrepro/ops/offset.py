"""The rope-mean key offset's per-step work as one Triton launch each (``kvrepro.formats.offset.RopeMean``): what
the store subtracts from each new key (:func:`rope_offset`) and the decode query's score terms (:func:`rope_terms`).
``RopeMean.remove`` / ``restore`` / ``packed_terms`` compute the same in PyTorch (about a dozen small kernels per
call, most of a rope-mean decode step's "rest" in ``results/profile/``); they stay the reference the tests compare
with. No check here reads device memory (no host sync), except the CPU-only position check of ``validate``."""
from __future__ import annotations

import torch

from kvrepro.formats.offset import MAX_PAIRS, RopeMean, check_positions, check_rows
from kvrepro.ops.common import check_triton_device, described, next_pow2, want_checks
from kvrepro.ops.triton.offset import rope_offset_kernel, rope_terms_kernel

KEY_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_POSITION = 1 << 24    # RopeMean.angles: a position times a float32 frequency is exact in float64 below it


def _check_offset(off, name: str, x) -> None:
    """``x`` (the argument ``name``) a tensor on the device of ``off``'s buffers, where Triton can launch."""
    if not isinstance(off, RopeMean):
        raise ValueError(f"offset must be a kvrepro.formats.offset.RopeMean, got {type(off).__name__}")
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(x).__name__}")
    if off.bias.device != x.device:
        raise ValueError(f"{name} is on {x.device}, the offset's buffers on {off.bias.device} "
                         "(RopeMean.to(device) moves them)")
    check_triton_device(x.device, name)


def rope_offset(key: torch.Tensor, pos: torch.Tensor, offset: RopeMean, sign: int = -1,
                validate: bool | None = None) -> torch.Tensor:
    """``key + sign x R(p) b_hat`` in the offset's kept pairs, as a new tensor of ``key``'s dtype: ``sign = -1`` is
    what the store writes (``RopeMean.remove``), ``+1`` puts a stored key back (``RopeMean.restore``, which returns
    float32: pass a float32 ``key`` for that).

    Args:
        key: ``[n, num_kv_heads, head_dim]`` bfloat16, float16 or float32, last dimension contiguous.
        pos: int32 / int64 ``[n]``, each row's position (``0 <= p < 2^24``; checked on the CPU only, see ``validate``), any
            stride (a slice or an expand of a buffer reads the positions it shows).
        offset: the layer's ``RopeMean``, its buffers on ``key``'s device.
        sign: -1 or +1.
        validate: check the positions' values (host sync); default on for CPU tensors only (``want_checks``).

    Numerics: per pair ``(bx cos - by sin, bx sin + by cos)`` in float32, the angle ``p theta`` exact in float64 and
    reduced there, one float32 cosine (``kvrepro.ops.triton.attention._rope_cos``, absolute error ~1e-7): the rotation
    the decode kernels add back, where ``RopeMean`` rounds a float64 cosine (the two differ by ~1e-7 x ``|b_hat|``).

    Raises:
        ValueError: naming the argument: a key of another shape or dtype or a non-contiguous last dimension,
            positions not int ``[n]`` or (checked) outside ``[0, 2^24)``, ``sign`` not the int +1 / -1, an offset that is
            not a ``RopeMean``, a key or positions on another device than its buffers, a CPU key without Triton's
            interpreter.
    """
    _check_offset(offset, "key", key)
    n = check_rows("key", key, offset.num_kv_heads, offset.head_dim)
    if key.dtype not in KEY_DTYPES or key.stride(-1) != 1:
        raise ValueError(f"key must be bfloat16, float16 or float32 with a contiguous last dimension, got "
                         f"{described(key)}")
    check_positions(pos, n)
    offset.check_device(pos=pos)
    if isinstance(sign, bool) or not isinstance(sign, int) or sign not in (-1, 1):
        raise ValueError(f"sign must be the int -1 (remove) or +1 (restore), got {sign!r}")
    if want_checks(validate, key.device) and n and (int(pos.min()) < 0 or int(pos.max()) >= MAX_POSITION):
        raise ValueError(f"pos values must be in [0, 2^24), got min {int(pos.min())}, max {int(pos.max())}")
    out = torch.empty_like(key, memory_format=torch.contiguous_format)
    if n:
        bf16 = key.dtype == torch.bfloat16
        rope_offset_kernel[(n, offset.num_kv_heads)](
            key, out.view(torch.int16) if bf16 else out, pos, offset.xy_ch, offset.bias, offset.inv_freq,
            key.stride(0), key.stride(1), out.stride(0), out.stride(1), pos.stride(0), offset.head_dim, SIGN=sign,
            BLOCK_D=next_pow2(offset.head_dim), M=MAX_PAIRS, OUT_BF16=bf16)
    return out


def rope_terms(query: torch.Tensor, offset: RopeMean) -> torch.Tensor:
    """float32 ``[T, Hq, 2 MAX_PAIRS]`` contiguous: ``A`` then ``B`` of ``RopeMean.score_terms`` for ``query``
    ``[T, Hq, head_dim]`` (bfloat16, float16 or float32, last dimension contiguous; query head ``h`` reads KV head
    ``h // (Hq / num_kv_heads)``): ``A_i = qx bx + qy by``, ``B_i = qy bx - qx by`` per kept pair, in float32 (the
    ``rope_bias`` terms of ``kvrepro.ops.decode_attention``), one launch.

    Raises:
        ValueError: a query that is not a tensor, of another shape (Hq not a multiple of num_kv_heads) or dtype, a
            non-contiguous last dimension, an offset that is not a ``RopeMean``, a query on another device than its
            buffers, a CPU query without Triton's interpreter.
    """
    _check_offset(offset, "query", query)
    offset.check_query(query, KEY_DTYPES, contiguous_last=True)
    h = offset.num_kv_heads
    t, hq, _ = query.shape
    out = torch.empty(t, hq, 2 * MAX_PAIRS, dtype=torch.float32, device=query.device)
    if t:
        rope_terms_kernel[(t, hq)](query, out, offset.xy_ch, offset.bias, query.stride(0), query.stride(1), hq,
                                   hq // h, M=MAX_PAIRS)
    return out
