"""Checks shared by the host wrappers. None of them reads device memory (no host sync)."""
from __future__ import annotations

import functools
import os

import torch

from kvrepro.formats.base import is_positive_finite
from kvrepro.formats.layout import PageLayout

MAX_GROUP = 32  # query heads per KV head the attention kernels are built for
FLOAT_DTYPES = (torch.bfloat16, torch.float16)


def next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def pool_tensor(pool) -> torch.Tensor:
    """The uint8 page tensor of ``pool`` (a tensor, or a ``CompressedPool``)."""
    t = pool if isinstance(pool, torch.Tensor) else getattr(pool, "data", None)
    if not isinstance(t, torch.Tensor):
        raise ValueError("pool must be a uint8 tensor [num_blocks, num_kv_heads, page_bytes] or a CompressedPool")
    return t


def check_pool(pool: torch.Tensor, layout: PageLayout, triton: bool = True) -> tuple[int, int]:
    """Return ``(num_blocks, num_kv_heads)``; raise ``ValueError`` on a mismatch. ``triton``: also
    :func:`check_triton_device` (a caller that may run another kernel checks it once that kernel is chosen)."""
    if not isinstance(layout, PageLayout):
        raise ValueError(f"layout must be a kvrepro.formats.layout.PageLayout, got {type(layout).__name__}")
    if pool.dtype != torch.uint8 or pool.dim() != 3 or pool.shape[2] != layout.page_bytes:
        raise ValueError(
            f"pool must be uint8 [num_blocks, num_kv_heads, {layout.page_bytes}] for {layout}, "
            f"got {pool.dtype} {tuple(pool.shape)}")
    if not pool.is_contiguous():
        raise ValueError("pool must be contiguous")
    if triton:
        check_triton_device(pool.device)
    return pool.shape[0], pool.shape[1]


def check_triton_device(device: torch.device, name: str = "pool") -> None:
    """Raise ``ValueError`` unless kvrepro's Triton kernels can read tensors on ``device``: compiled kernels take CUDA
    tensors only; tensors elsewhere run only under Triton's interpreter (``TRITON_INTERPRET=1`` before triton is
    imported), without which the launch fails deep in the launcher with an unnamed "Pointer argument ... cannot be
    accessed from Triton (cpu tensor?)". Every wrapper that launches a kernel on a pool calls it (via
    :func:`check_pool`); the other tensors are checked against the pool's device. ``name``: the argument whose device
    the message names."""
    if device.type == "cuda":
        return
    import triton

    if not triton.knobs.runtime.interpret:
        raise ValueError(f"{name} is on {device}: kvrepro's Triton kernels need CUDA tensors (every tensor on the "
                         f"{name}'s device); tensors on the CPU run only under Triton's interpreter, TRITON_INTERPRET=1 "
                         "set before triton is imported")


def check_rotation(rotation: torch.Tensor, layout: PageLayout, device: torch.device) -> None:
    d = layout.head_dim
    if rotation.shape != (d, d) or rotation.dtype != torch.float32 or not rotation.is_contiguous():
        raise ValueError(f"rotation must be a contiguous float32 [{d}, {d}] tensor "
                         f"(kvrepro.formats.hadamard.rotation_matrix), got {rotation.dtype} {tuple(rotation.shape)}")
    if rotation.device != device:
        raise ValueError(f"rotation is on {rotation.device}, the pool on {device}")


def check_heads(num_q_heads: int, num_kv_heads: int, head_dim: int, layout: PageLayout) -> int:
    """Return the GQA group size; refuse shapes the kernels are not built for."""
    if head_dim != layout.head_dim:
        raise ValueError(f"head_dim={head_dim} does not match layout.head_dim={layout.head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads={num_q_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    group = num_q_heads // num_kv_heads
    if group > MAX_GROUP:
        raise ValueError(f"GQA group size {group} (num_q_heads={num_q_heads} / num_kv_heads={num_kv_heads}) "
                         f"is not supported; supported group sizes: 1..{MAX_GROUP}, head_dim 64 or 128")
    return group


def check_float(name: str, x: torch.Tensor, shape: tuple, device: torch.device) -> None:
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be bfloat16 or float16, got {x.dtype}")
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {list(shape)}, got {list(x.shape)}")
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, the pool on {device}")


def check_int(name: str, x: torch.Tensor, dim: int, device: torch.device) -> None:
    if x.dtype != torch.int32 or x.dim() != dim:
        raise ValueError(f"{name} must be an int32 tensor with {dim} dimension(s), got {x.dtype} {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, the pool on {device}")
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension")


def described(xs) -> list | str:
    """What an error message shows of a tensor argument, or of each of a list or tuple of them: ``(shape, dtype,
    device, "contiguous" | "not contiguous")``, or the type name of anything that is not a tensor."""
    def one(x):
        if not isinstance(x, torch.Tensor):
            return type(x).__name__
        return tuple(x.shape), x.dtype, str(x.device), "contiguous" if x.is_contiguous() else "not contiguous"
    return [one(x) for x in xs] if isinstance(xs, (tuple, list)) else one(xs)


def page_constexprs(layout: PageLayout, num_kv_heads: int) -> dict:
    """The page geometry every kernel over compressed pages takes as constexprs (``PageLayout``): sizes, bits,
    region offsets and the metadata scheme, ``KSYM`` (``key_symmetric``: 5-bit keys, a float16 scale of 2 bytes per
    token) and ``VLOG`` (``value_log_scale``: a uint8 log2 value scale of 1 byte per token); both False for k4v4,
    k8v4 and k4v2 (float16 scale and zero for keys, 4 bytes; float16 value scale, 2 bytes)."""
    return dict(NUM_KV_HEADS=num_kv_heads, D=layout.head_dim, BS=layout.block_size,
                PAGE_BYTES=layout.page_bytes, KBITS=layout.key_bits, VBITS=layout.value_bits,
                V_CODE_OFF=layout.v_code_offset, K_META_OFF=layout.k_meta_offset,
                V_META_OFF=layout.v_meta_offset, KSYM=layout.key_symmetric, VLOG=layout.value_log_scale)


BLOCK_NS = (16, 32, 64, 128, 256)      # keys per tile of the Triton attention kernels (tl.arange needs a power of two)


def check_block_n(block_n) -> None:
    """ValueError unless ``block_n`` is an int in :data:`BLOCK_NS`."""
    if not isinstance(block_n, int) or isinstance(block_n, bool) or block_n not in BLOCK_NS:
        raise ValueError(f"block_n={block_n}; allowed: {', '.join(map(str, BLOCK_NS))}")


def check_launch(num_warps, num_stages, max_registers=None) -> None:
    """Triton launch options: ``num_warps`` in 1, 2, 4, 8, 16; ``num_stages`` a positive int;
    ``max_registers`` (Triton's ``maxnreg``) None or a multiple of 8 in [32, 248]."""
    if num_warps not in (1, 2, 4, 8, 16) or isinstance(num_warps, bool):
        raise ValueError(f"num_warps={num_warps!r}; allowed: 1, 2, 4, 8, 16")
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise ValueError(f"num_stages={num_stages!r}; allowed: a positive int")
    if max_registers is not None and (not isinstance(max_registers, int) or isinstance(max_registers, bool)
                                      or not 32 <= max_registers <= 248 or max_registers % 8):
        raise ValueError(f"max_registers={max_registers!r}; allowed: None or a multiple of 8 in [32, 248]")


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; 132 for CPU (interpreter), the H100/H200 count."""
    if device.type == "cuda":
        return num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 132


def _interpreter_index_fix() -> None:
    """Under ``TRITON_INTERPRET=1``, triton 3.6's interpreter converts loop bounds with
    ``int(array)`` on 1-element arrays, which NumPy >= 2.4 rejects ("only 0-dimensional arrays
    can be converted"). Wrap its tensor patch so ``__index__`` reads the single element (and still
    refuses tensors of several elements).
    Affects only the interpreter (CPU tests); compiled GPU kernels are untouched."""
    from triton.runtime import interpreter as interp

    orig = interp._patch_lang_tensor
    if getattr(orig, "_kvrepro_fixed", False):
        return

    def index(self):
        data = self.handle.data
        if data.size != 1:
            raise TypeError(f"only single-element tensors can be used as an index, got shape {data.shape}")
        return int(data.reshape(-1)[0])

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", index)

    patched._kvrepro_fixed = True
    interp._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _interpreter_index_fix()


def want_checks(validate: bool | None, device: torch.device) -> bool:
    """Value checks of indices need the data on the host: on by default for CPU tensors (the
    Triton interpreter would read or write out of bounds), opt-in on CUDA (a host sync per call
    would break CUDA-graph capture and cost time on the decode hot path). Raises ValueError for a ``validate`` that
    is not None, True or False (a string such as ``"no"`` would otherwise read as true)."""
    if validate is not None and not isinstance(validate, bool):
        raise ValueError(f"validate must be None, True or False, got {validate!r}")
    return device.type != "cuda" if validate is None else validate


def check_scale(scale: float) -> None:
    """Raise ``ValueError`` unless the softmax scale is a finite positive number."""
    if not is_positive_finite(scale):
        raise ValueError(f"scale must be a finite positive float, got {scale!r}")


def check_slots(slot_mapping: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """Raise ``ValueError`` unless every slot is -1 (padding) or in ``[0, num_blocks * block_size)``."""
    if slot_mapping.numel():
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < -1 or hi >= num_blocks * block_size:
            raise ValueError(f"slot_mapping values must be -1 or in [0, {num_blocks * block_size}) "
                             f"(num_blocks x block_size), got min {lo}, max {hi}")


def check_block_tables(block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int,
                       block_size: int) -> None:
    """Raise ``ValueError`` unless ``seq_lens >= 0``, each row has ``ceil(seq_len / block_size)``
    blocks, and the blocks a sequence uses are in ``[0, num_blocks)``."""
    lens = seq_lens.to(torch.int64).cpu()
    if lens.numel() and int(lens.min()) < 0:
        raise ValueError(f"seq_lens must be >= 0, got {int(lens.min())}")
    need = (lens + block_size - 1) // block_size
    if need.numel() and int(need.max()) > block_tables.shape[1]:
        raise ValueError(f"seq_lens needs {int(need.max())} blocks but block_tables has "
                         f"{block_tables.shape[1]} columns")
    bt = block_tables.to(torch.int64).cpu()
    used = torch.arange(bt.shape[1])[None, :] < need[:, None]
    ids = bt[used]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise ValueError(f"block_tables holds block ids outside [0, {num_blocks}) "
                         f"(min {int(ids.min())}, max {int(ids.max())})")
