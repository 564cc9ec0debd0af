"""kvrepro's CUDA decode attention kernels for k4v4, k8v4, k4v2 and k5v4 pages at run time: where they apply, how they are
loaded and launched, and how they split the context.

``kvrepro.ops.decode_attention(impl="cuda")`` runs them (its default where they apply, see ``unsupported_reason``).
The committed fatbin ``cuda/decode.fatbin`` (built from ``cuda/decode.cu`` by ``python -m kvrepro.ops.cuda_build``;
flags and hashes in ``cuda/decode.json``) is loaded once per device through the CUDA driver API (``ctypes``,
``libcuda.so.1``: no PyTorch extension build, no nvcc at run time) and launched with ``cuLaunchKernel`` on PyTorch's
current stream, so CUDA graphs capture it.

The kernel (design: notes/kernels.md, "Decode: the CUDA kernel"): one CTA of 4 warps per (sequence,
KV head, split), each warp walking its own pages through a ``cp.async`` ring (4-deep for k4v4 and k5v4, 3-deep for
k8v4, 6-deep for k4v2); keys through int8 tensor cores (``mma.m16n8k32.s8``: 4-bit keys as 16 (code - 8), 8-bit keys as
code - 128, k5v4's 5-bit keys as their 4-bit high plane 16 (hi - 8) plus their 1-bit low plane 8 lo; the query as two int8 digits as in the Triton int8 key path; method after SageAttention, Zhang et al.
2024), values through ``mma.m16n8k16.f16`` (4-bit or 2-bit codes turned into float16 by the magic-number trick,
code | 0x6400 = 1024 + code) with tokens x GQA heads as the MMA shape. It writes the same split-K partials as the
Triton kernel, but does the query rotation (a fast Walsh-Hadamard transform: the rotation is ``diag(s) H / sqrt(D)``)
and the log-sum-exp split merge (FlashDecoding, Dao et al. 2023; the last CTA of each (sequence, KV head) to count
itself in merges: a release / acquire count-in, as CUTLASS's split-K semaphore) in the same launch, where the Triton
path launches three kernels.

The page layout the kernels read is ``kvrepro.formats.layout.PageLayout`` of each preset at head_dim 128 and block
16 (``LAYOUTS``); ``cuda/page_layout.h`` holds the same numbers for the kernel, generated from it by
``kvrepro.ops.cuda_build``.

Which GPUs: the fatbin's manifest lists the code it holds (SASS per target, PTX of the oldest and newest); a GPU runs
``fatbin_code_for`` its compute capability, and one the fatbin holds nothing for is refused before the driver is
asked (``fatbin_gap``). How many CTAs of a kernel an SM holds at once (``resident_ctas``: the driver's occupancy
query of the loaded kernel, or the arithmetic model ``kvrepro.ops.occupancy`` where no GPU can be asked) sets the
split rule's one wave (``kvrepro.ops.decode.default_num_splits``) and the rank skew (``rank_args``).
"""
from __future__ import annotations

import ctypes
import itertools
import json
import os
import re
import weakref

import torch

from kvrepro.formats import COMPRESSED_PRESETS, get_format, preset_of
from kvrepro.formats.layout import PageLayout
from kvrepro.ops.common import described, sm_count

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda")
FATBIN = os.path.join(HERE, "decode.fatbin")
MANIFEST = os.path.join(HERE, "decode.json")
HEAD_DIM, BLOCK_SIZE = 128, 16  # what the kernels are written for (decode.cu: D, BS)
# The presets with a kernel, keyed by (key_bits, value_bits): one entry point each (decode.cu instantiates one body
# three times), and the page layout it reads, kvrepro.formats' layout of the preset.
PRESETS = {COMPRESSED_PRESETS[name]: name for name in ("k4v4", "k8v4", "k4v2", "k5v4")}
KERNELS = {bits: f"kvrepro_decode_{name}" for bits, name in PRESETS.items()}
# The same kernels with the key offset rope-mean's score correction (decode.cu decode_step's ROPE, rope_add): each paged
# key's logit gets sum_i A_i cos(j theta_i) + B_i sin(j theta_i) back, over ROPE_PAIRS pairs per KV head
# (kvrepro.formats.offset.RopeMean; the rope_bias argument of kvrepro.ops.decode_attention).
ROPE_KERNELS = {bits: f"{name}_rope" for bits, name in KERNELS.items()}
ROPE_PAIRS = 8                  # decode.cu RPAIRS = kvrepro.formats.offset.MAX_PAIRS
ALL_KERNELS = [*KERNELS.values(), *ROPE_KERNELS.values()]   # every entry point of the fatbin (manifest "kernels")
LAYOUTS = {bits: get_format(name).layout(HEAD_DIM, BLOCK_SIZE) for bits, name in PRESETS.items()}
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8   # cuda.h CUfunction_attribute
CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9
FUNC_ATTRIBUTES = {"max_threads_per_block": 0, "smem_static": 1, "local_bytes": 3, "registers": 4, "ptx_version": 5,
                   "binary_version": 6}                  # cuda.h CUfunction_attribute, by what they report
WARPS = 4                       # threads per CTA = 32 * WARPS (the kernel's __launch_bounds__)
MIN_CAPABILITY = (8, 0)         # cp.async, mma.m16n8k32.s8, movmatrix (PTX ISA 7.8) need sm_80+
MAX_GROUP = 8                   # GQA query heads per KV head: the MMA's N = 8
MERGE_MAX = 4096                # num_splits x group that the in-kernel split merge holds (decode.cu MERGE_MAX)
LAUNCH_BOUNDS_CTAS = 4          # __launch_bounds__(128, 4): ptxas keeps every kernel at <= 128 registers, so that 4
                                # CTAs fit an SM's 64 K registers. Shared memory may hold fewer (36,480 / 40,192 /
                                # 41,344 / 39,808 static bytes for k4v4 / k8v4 / k4v2 / k5v4, 2,816 more with the
                                # rope-mean correction: 3 CTAs of k8v4, k4v2 and k5v4 on an A100, 2 of any on 100 KB
                                # SMs): the split rule reads resident_ctas, never this figure.
CTAS_PER_SM = LAUNCH_BOUNDS_CTAS  # the same figure under its former name, for scripts that plan waves of the H200's
                                  # residency (benchmarks/decode_splits.py)
CPU_CAPABILITY = (9, 0)         # the GPU the split rule is modelled for without a CUDA device: H100 / H200 (sm_count
                                # counts 132 SMs there)
# Split weights by round of placement (decode.cu split_weight_prefix): split s weighs 1024 - RANK_SKEW x round,
# round = min(linear block index // SMs, 3), for grids of at most one wave. Why: on the H200 the warp schedulers favour
# a SM's older CTAs, so CTAs placed in round 0 / 1 / 2 / 3 streamed their pages at 1, 0.955, 0.905, 0.862 of round
# 0's speed (a %globaltimer trace, batch 3, 22 equal splits); RANK_SKEW 48 gives weights 1, 0.953, 0.906, 0.859.
# Timed against skews 0 to 128: every skew up to 96 within ~1% at batch 1 and 3, 48 or 64 fastest at batch 6 and 13
# (1-5% over equal splits), 96 and above slower at larger batches. A mild effect (the per-SM spread, some SMs
# streaming ~15% slower, dominates what remains), measured on the H200 only: applied on compute capability 9.x
# only (rank_args).
RANK_SKEW = 48


def unsupported_reason(layout, group: int, device: torch.device) -> str | None:
    """Why the CUDA kernel cannot serve this call (None = it can).

    Args:
        layout: the pool's ``PageLayout``; the kernels hard-code ``LAYOUTS`` (k4v4, k8v4, k4v2 or k5v4, head_dim
            128, block 16); a preset without a kernel would be refused by name.
        group: GQA group size (query heads per KV head); the kernel takes 1..``MAX_GROUP``.
        device: the pool's device; a CUDA device of compute capability >= ``MIN_CAPABILITY``.
    """
    device = torch.device(device)
    reason = shape_reason(layout, group)
    if reason:
        return reason
    if device.type != "cuda":
        return f"the CUDA decode kernel needs a CUDA device, got {device}"
    if torch.version.hip:
        return f"the CUDA decode kernel is built for NVIDIA GPUs, this PyTorch runs ROCm/HIP {torch.version.hip}"
    if not torch.cuda.is_available():
        return f"the CUDA decode kernel needs a CUDA device, this PyTorch sees none ({device} requested)"
    reason = capability_reason(tuple(torch.cuda.get_device_capability(device)))
    return f"{reason} on {device}" if reason else None


def capability_reason(capability) -> str | None:
    """Why the CUDA kernel cannot run on a GPU of compute capability ``(major, minor)`` (None = it can: >=
    ``MIN_CAPABILITY``)."""
    cap = tuple(capability)
    if cap < MIN_CAPABILITY:
        return (f"the CUDA decode kernel needs compute capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}, "
                f"got {cap[0]}.{cap[1]}")
    return None


def shape_reason(layout, group: int) -> str | None:
    """Why the CUDA kernel cannot serve pages of ``layout`` with GQA groups of ``group`` query heads, whatever the
    device (None = it can; ``unsupported_reason`` without the device checks). Raises ValueError if ``layout`` is not a
    ``PageLayout``."""
    if not isinstance(layout, PageLayout):
        raise ValueError(f"layout must be a kvrepro PageLayout (kvrepro.formats.layout), got {type(layout).__name__}")
    if layout not in LAYOUTS.values():
        names = list(PRESETS.values())
        has = f"{', '.join(names[:-1])} and {names[-1]}"
        preset = preset_of(layout)
        if preset is not None and preset not in names:        # a preset added without a CUDA kernel
            return (f"the CUDA decode kernel has no kernel for {preset} pages: it has {has} only (head_dim 128, "
                    f"block_size 16); {preset} decodes with the Triton kernel")
        return (f"the CUDA decode kernel supports {has} pages with head_dim 128 and block_size 16 only, "
                f"got key_bits={layout.key_bits}, value_bits={layout.value_bits}, head_dim={layout.head_dim}, "
                f"block_size={layout.block_size}")
    if not _is_int(group) or not 1 <= group <= MAX_GROUP:
        return f"the CUDA decode kernel supports GQA groups of 1..{MAX_GROUP} query heads, got {group}"
    return None


_ERRORS = {200: "CUDA_ERROR_INVALID_IMAGE", 209: "CUDA_ERROR_NO_BINARY_FOR_GPU", 218: "CUDA_ERROR_INVALID_PTX",
           222: "CUDA_ERROR_UNSUPPORTED_PTX_VERSION", 500: "CUDA_ERROR_NOT_FOUND"}


class _Module:
    """The fatbin loaded into one device's primary context (PyTorch's), and its kernels (``kernels``: (key bits,
    value bits) -> entry-point name, default ``KERNELS``; benchmarks load older builds with fewer kernels by passing
    a subset; then the rope-mean kernels ``ROPE_KERNELS`` are loaded only if ``rope_kernels`` names them, by default
    they are). A kernel whose ring lives in dynamic shared memory says how much in ``<name>_dyn_smem`` (a ``__device__``
    int, read once here with a synchronous copy: load before CUDA-graph capture): the loader raises the kernel's limit
    to that and every launch asks for it. Builds older than that symbol (none has a dynamic ring) count as 0 only when
    ``kernels`` is given; the default ``KERNELS`` must come from this source, so a missing symbol is an error."""

    def __init__(self, device: torch.device, path: str, kernels: dict[tuple[int, int], str] | None = None,
                 rope_kernels: dict[tuple[int, int], str] | None = None):
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise RuntimeError(f"kvrepro CUDA decode kernel: cannot open the CUDA driver library libcuda.so.1 ({e}); "
                               f"use impl='triton' (vLLM backend: KVREPRO_DECODE_IMPL=triton)") from None
        self.lib.cuLaunchKernel.argtypes = [ctypes.c_void_p, *[ctypes.c_uint] * 7, ctypes.c_void_p,
                                            ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        self.index = torch.device(device).index
        with torch.cuda.device(device):
            torch.cuda.init()
            torch.empty(1, device=device)            # makes the device's primary context current
            with open(path, "rb") as f:
                self.image = f.read()                 # kept alive while the module is loaded
            self.module = ctypes.c_void_p()
            rc = self.lib.cuModuleLoadData(ctypes.byref(self.module), ctypes.c_char_p(self.image))
            if rc:
                raise RuntimeError(
                    f"kvrepro CUDA decode kernel: cuModuleLoadData({path}) failed with {self.error(rc)} on "
                    f"{torch.cuda.get_device_name(device)}. The fatbin was built by {built_by()} (decode.json) "
                    f"and needs a driver for that CUDA version or newer; rebuild it with your nvcc "
                    f"(python -m kvrepro.ops.cuda_build) or use impl='triton' (vLLM backend: "
                    f"KVREPRO_DECODE_IMPL=triton)")
            self.fns = {}                             # (key bits, value bits) -> CUfunction
            self.smem = {}                            # (key bits, value bits) -> dynamic shared memory bytes
            self.rope_fns, self.rope_smem = {}, {}    # the same for the rope-mean kernels
            if rope_kernels is None:
                rope_kernels = ROPE_KERNELS if kernels is None else {}
            todo = [(bits, name, self.fns, self.smem) for bits, name in (KERNELS if kernels is None else kernels).items()]
            todo += [(bits, name, self.rope_fns, self.rope_smem) for bits, name in rope_kernels.items()]
            for bits, name, fns, smems in todo:
                fn = ctypes.c_void_p()
                rc = self.lib.cuModuleGetFunction(ctypes.byref(fn), self.module, name.encode())
                if rc:
                    raise RuntimeError(f"kvrepro CUDA decode kernel: {name} not found in {path} ({self.error(rc)})")
                fns[bits] = fn
                smems[bits] = smem = self._dyn_smem(name, missing_ok=kernels is not None)
                if smem:
                    rc = self.lib.cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                                     ctypes.c_int(smem))
                    if rc:
                        raise RuntimeError(f"kvrepro CUDA decode kernel: {name} needs {smem} bytes of dynamic shared "
                                           f"memory, which {torch.cuda.get_device_name(device)} refuses "
                                           f"({self.error(rc)}); use impl='triton' (vLLM backend: "
                                           f"KVREPRO_DECODE_IMPL=triton)")

    def _dyn_smem(self, name: str, missing_ok: bool) -> int:
        """The value of the module's ``<name>_dyn_smem``; 0 if the build has none and ``missing_ok`` (an older build
        loaded by a benchmark), else RuntimeError, as for a symbol that is not a 4-byte int or cannot be read."""
        ptr, size = ctypes.c_uint64(), ctypes.c_size_t()
        sym = f"{name}_dyn_smem"
        rc = self.lib.cuModuleGetGlobal_v2(ctypes.byref(ptr), ctypes.byref(size), self.module, sym.encode())
        if rc == 500 and missing_ok:                  # CUDA_ERROR_NOT_FOUND: a build older than the symbol
            return 0
        if rc:
            raise RuntimeError(f"kvrepro CUDA decode kernel: {sym} not found in the fatbin ({self.error(rc)}); "
                               f"rebuild it (python -m kvrepro.ops.cuda_build)")
        if size.value != 4:
            raise RuntimeError(f"kvrepro CUDA decode kernel: {sym} is {size.value} bytes, expected a 4-byte int")
        val = ctypes.c_int()
        rc = self.lib.cuMemcpyDtoH_v2(ctypes.byref(val), ptr, ctypes.c_size_t(4))
        if rc:
            raise RuntimeError(f"kvrepro CUDA decode kernel: cannot read {sym} ({self.error(rc)})")
        return val.value

    def _entry_points(self, bits: tuple[int, int]) -> list:
        """``[(CUfunction, dynamic shared memory, name)]`` of the kernel of ``bits`` and, where loaded, its rope-mean
        variant: the entry points a preset's launches may run."""
        return [(fns[bits], smem[bits], name) for fns, smem, name in
                ((self.fns, self.smem, KERNELS[bits]), (self.rope_fns, self.rope_smem, ROPE_KERNELS[bits]))
                if bits in fns]

    def occupancy(self, bits: tuple[int, int]) -> int:
        """Resident CTAs per SM of the kernels of ``bits``, from the driver (``cuOccupancyMaxActiveBlocksPerMultiprocessor``
        with the launch's block and dynamic shared memory; it counts the kernels' carveout preference): the fewer of
        the kernel and its rope-mean variant where that is loaded, since a preset's launches run either (the key
        offset decides per engine) and a split rule planned for the larger count would launch a partial second wave
        with the other. Raises RuntimeError if the driver refuses or answers less than 1."""
        out = []
        for fn, smem, name in self._entry_points(bits):
            n = ctypes.c_int()
            rc = self.lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), fn, ctypes.c_int(WARPS * 32),
                                                                      ctypes.c_size_t(smem))
            if rc or n.value < 1:
                raise RuntimeError(f"kvrepro CUDA decode kernel: the driver's occupancy query for {name} "
                                   f"{'failed with ' + self.error(rc) if rc else f'answered {n.value} CTAs per SM'}; "
                                   f"the split rule needs it (set KVREPRO_NUM_SPLITS, or KVREPRO_DECODE_IMPL=triton)")
            out.append(n.value)
        return min(out)

    def attribute(self, bits: tuple[int, int], name: str) -> int:
        """The driver's ``cuFuncGetAttribute`` of the kernel of ``bits``: ``name`` one of ``FUNC_ATTRIBUTES``
        (``registers`` per thread, ``smem_static`` bytes, ``binary_version`` 90 for sm_90 SASS, ...). Raises
        ValueError for another name, RuntimeError if the driver refuses."""
        if name not in FUNC_ATTRIBUTES:
            raise ValueError(f"name must be one of {', '.join(FUNC_ATTRIBUTES)}, got {name!r}")
        v = ctypes.c_int()
        rc = self.lib.cuFuncGetAttribute(ctypes.byref(v), FUNC_ATTRIBUTES[name], self.fns[bits])
        if rc:
            raise RuntimeError(f"kvrepro CUDA decode kernel: cuFuncGetAttribute({name}) of {KERNELS[bits]} failed "
                               f"with {self.error(rc)}")
        return v.value

    def set_carveout(self, bits: tuple[int, int], percent: int) -> None:
        """Set the kernel's preferred shared-memory carveout (``CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT``:
        percent of the SM's largest shared memory, -1 = no preference, the default): caps the shared memory per SM
        the kernel runs with, e.g. to an A100's or an Ada GPU's budget on an H200 (``occupancy.carveout_for``). Forgets
        the residency cached for this device. Raises ValueError for a percent outside -1..100, RuntimeError if the
        driver refuses."""
        if not _is_int(percent) or not -1 <= percent <= 100:
            raise ValueError(f"percent must be an int in -1..100 (-1: no preference), got {percent!r}")
        for fn, _, name in self._entry_points(bits):     # both, as occupancy() asks both
            rc = self.lib.cuFuncSetAttribute(fn, CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
                                             ctypes.c_int(percent))
            if rc:
                raise RuntimeError(f"kvrepro CUDA decode kernel: setting the carveout of {name} to {percent} % "
                                   f"failed with {self.error(rc)}")
        for key in [k for k in _RESIDENT if k[0] == self.index]:
            del _RESIDENT[key]

    def error(self, rc: int) -> str:
        """``CUDA error <rc> (<name>)`` from the driver's cuGetErrorName."""
        name = ctypes.c_char_p()
        if self.lib.cuGetErrorName(rc, ctypes.byref(name)) == 0 and name.value:
            return f"CUDA error {rc} ({name.value.decode()})"
        return f"CUDA error {rc} ({_ERRORS.get(rc, 'see cuda.h')})"

    def launch(self, grid: tuple[int, int, int], args: list, stream: int, bits: tuple[int, int],
               rope: bool = False) -> None:
        """Launch the kernel of ``bits`` = (key bits, value bits) with ``args`` on ``stream`` (``rope``: its rope-mean
        variant, ``ROPE_KERNELS``, which takes three more arguments)."""
        vals = [ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor)
                else a if isinstance(a, ctypes._SimpleCData) else ctypes.c_int(int(a)) for a in args]
        ptrs = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in vals])
        fns, smem = (self.rope_fns, self.rope_smem) if rope else (self.fns, self.smem)
        if bits not in fns:
            raise ValueError(f"this fatbin holds the {'rope-mean ' if rope else ''}kernels for (key_bits, value_bits) "
                             f"{sorted(fns)}, got {bits}")
        rc = self.lib.cuLaunchKernel(fns[bits], *grid, WARPS * 32, 1, 1, smem[bits],
                                     ctypes.c_void_p(stream), ptrs, None)
        if rc:
            raise RuntimeError(f"kvrepro CUDA decode kernel: cuLaunchKernel failed with {self.error(rc)} "
                               f"(grid {grid}, block {WARPS * 32})")


_MODULES: dict[int, _Module] = {}
_LOAD_ERRORS: dict[int, str] = {}


def load_error(device: torch.device) -> str | None:
    """None if the fatbin loads on ``device`` (it is then loaded, once per device), else why not (the load's
    RuntimeError text, remembered per device so that the attempt is made once); for a device that is not CUDA, says
    so."""
    if torch.device(device).type != "cuda":
        return f"the CUDA decode kernel needs a CUDA device, got {device}"
    if not torch.cuda.is_available():
        return f"the CUDA decode kernel needs a CUDA device, this PyTorch sees none ({device} requested)"
    idx = torch.device(device).index
    idx = torch.cuda.current_device() if idx is None else idx
    if idx in _MODULES:
        return None
    if idx not in _LOAD_ERRORS:
        try:
            load(torch.device("cuda", idx))
        except RuntimeError as e:
            _LOAD_ERRORS[idx] = str(e)
    return _LOAD_ERRORS.get(idx)


def _arch(code: str) -> tuple[int, int]:
    """``"sm_90"`` / ``"compute_120"`` -> ``(9, 0)`` / ``(12, 0)``."""
    m = re.fullmatch(r"(?:sm|compute)_(\d\d+)", code)
    if not m:
        raise ValueError(f"code must be sm_XY or compute_XY, got {code!r}")
    return int(m.group(1)[:-1]), int(m.group(1)[-1])


def fatbin_code_for(capability, manifest: dict | None = None) -> str | None:
    """Which code of the fatbin a GPU of compute capability ``(major, minor)`` runs (the CUDA binary compatibility
    rules): the SASS ``sm_XY`` of the same major with the highest minor <= the GPU's; else the PTX ``compute_XY`` of
    the highest capability <= the GPU's, which the driver compiles at load; None if neither exists. ``manifest``
    default: the committed one (its ``entries``, the code the fatbin holds).

    Raises:
        ValueError: ``capability`` not a pair of ints >= 0; a manifest without ``entries``.
    """
    if not (isinstance(capability, (tuple, list)) and len(capability) == 2 and all(_is_int(c) and c >= 0
                                                                                  for c in capability)):
        raise ValueError(f"capability must be (major, minor), two ints >= 0, got {capability!r}")
    cap = tuple(capability)
    info = read_manifest() if manifest is None else manifest
    if "entries" not in info:
        raise ValueError("the manifest lists no entries (built before they were recorded): rebuild the fatbin "
                         "(python -m kvrepro.ops.cuda_build)")
    codes = [e["code"] for e in info["entries"]]
    sass = [c for c in codes if c.startswith("sm_") and _arch(c)[0] == cap[0] and _arch(c) <= cap]
    if sass:
        return max(sass, key=_arch)
    ptx = [c for c in codes if c.startswith("compute_") and _arch(c) <= cap]
    return max(ptx, key=_arch) if ptx else None


def fatbin_gap(capability, manifest: dict | None = None) -> str | None:
    """Why the fatbin holds no code a GPU of compute capability ``capability`` can run (None: it does; see
    ``fatbin_code_for``). Raises as ``fatbin_code_for``."""
    if fatbin_code_for(capability, manifest) is not None:
        return None
    info = read_manifest() if manifest is None else manifest
    codes = [e["code"] for e in info["entries"]]
    return (f"the committed fatbin holds no code for compute capability {capability[0]}.{capability[1]} (SASS "
            f"{', '.join(c for c in codes if c.startswith('sm_')) or 'none'}; PTX "
            f"{', '.join(c for c in codes if c.startswith('compute_')) or 'none'}); add its target to "
            f"kvrepro.ops.cuda_build.GENCODE and rebuild (python -m kvrepro.ops.cuda_build), or use impl='triton' "
            f"(vLLM backend: KVREPRO_DECODE_IMPL=triton)")


def read_manifest(manifest: str = MANIFEST) -> dict:
    """The fatbin's manifest (``build``'s output: nvcc version, flags, SHA-256 of source and fatbin).
    Raises OSError / ValueError if it is missing or not JSON."""
    with open(manifest) as f:
        return json.load(f)


def built_by(manifest: str = MANIFEST) -> str:
    """The nvcc release that built the committed fatbin, from its manifest (e.g. ``"CUDA 13.0"``)."""
    try:
        version = read_manifest(manifest).get("nvcc_version", "")
    except (OSError, ValueError):
        return "an unknown nvcc (manifest unreadable)"
    m = re.search(r"cuda_(\d+\.\d+)", version)
    return f"CUDA {m.group(1)}" if m else (version or "an unknown nvcc")


def load(device: torch.device, path: str = FATBIN) -> _Module:
    """The kernel loaded on ``device`` (loaded on first use, once per device and process; do it before CUDA-graph
    capture, e.g. by one eager call). Raises ValueError for a device that is not CUDA, RuntimeError if PyTorch sees
    no CUDA device or the driver cannot load the fatbin."""
    if torch.device(device).type != "cuda":
        raise ValueError(f"the CUDA decode kernel needs a CUDA device, got {device}")
    if not torch.cuda.is_available():
        raise RuntimeError(f"the CUDA decode kernel needs a CUDA device, this PyTorch sees none ({device} requested)")
    idx = torch.device(device).index
    idx = torch.cuda.current_device() if idx is None else idx
    if idx not in _MODULES:
        if path == FATBIN:       # the committed fatbin: refuse a GPU it holds no code for before the driver tries
            gap = fatbin_gap(tuple(torch.cuda.get_device_capability(idx)))
            if gap:
                raise RuntimeError(f"kvrepro CUDA decode kernel: {gap}")
        _MODULES[idx] = _Module(torch.device("cuda", idx), path)
    return _MODULES[idx]


_RESIDENT: dict[tuple[int, tuple[int, int]], tuple[int, str]] = {}   # (device index, bits) -> resident_ctas


def kernel_resources(bits: tuple[int, int], arch: str, manifest: dict | None = None, rope: bool = False):
    """``occupancy.KernelResources`` of the kernel of ``bits`` = (key bits, value bits) in the SASS of ``arch``
    (``"sm_90"``; ``rope``: its rope-mean variant, ``ROPE_KERNELS``): 128 threads, the registers and static shared
    memory ptxas reported (the manifest's ``resources``) and the dynamic shared memory its launch asks for (0: every
    ring fits the static limit).

    Raises:
        ValueError: ``bits`` without a kernel, an ``arch`` the fatbin has no SASS for (names the ones it has).
    """
    from kvrepro.ops.occupancy import KernelResources

    if bits not in KERNELS:
        raise ValueError(f"bits must be one of {sorted(KERNELS)} ((key_bits, value_bits) with a CUDA kernel), "
                         f"got {bits!r}")
    res = (read_manifest() if manifest is None else manifest).get("resources", {})
    name = (ROPE_KERNELS if rope else KERNELS)[bits]
    if arch not in res or name not in res[arch]:
        raise ValueError(f"arch must be one of {sorted(res)} (the fatbin's SASS targets), got {arch!r}")
    r = res[arch][name]
    return KernelResources(threads=WARPS * 32, registers=r["registers"], smem_static=r["smem_static"])


def modelled_ctas(bits: tuple[int, int], capability, carveout: int = -1) -> int:
    """Resident CTAs per SM of the kernels of ``bits`` on a GPU of compute capability ``capability`` by arithmetic
    (``kvrepro.ops.occupancy``, the limits of ``cuda/gpus.json``), from the resources of the SASS that GPU runs: the
    fewer of the kernel and its rope-mean variant, as ``_Module.occupancy``. ``carveout``: the shared-memory
    carveout preference (percent; -1 none). Raises ValueError for a capability with no row in gpus.json or no SASS
    in the fatbin."""
    from kvrepro.ops import occupancy

    sm = occupancy.limits(capability)
    code = fatbin_code_for(sm.capability)
    if code is None or not code.startswith("sm_"):
        raise ValueError(f"the fatbin has no SASS for compute capability {sm.capability} (it would run {code})")
    return min(occupancy.resident_ctas(kernel_resources(bits, code, rope=rope), sm, carveout) for rope in (False, True))


def resident_ctas(device: torch.device, bits: tuple[int, int] | None = None) -> tuple[int, str]:
    """``(CTAs per SM, source)``: how many CTAs of the kernel of ``bits`` (None: the fewest of every kernel) an SM of
    ``device`` holds at once, which sets the split rule's one wave.

    - a CUDA device where the fatbin loads: the driver's occupancy query of the loaded kernel (cached per device and
      kernel until ``_Module.set_carveout``); a failing query is a RuntimeError, never a guess;
    - a CUDA device where the fatbin does not load: no CUDA launch happens there (decode runs Triton); the kernel's
      ``LAUNCH_BOUNDS_CTAS``, an upper bound, sizes what callers reserve for both kernels;
    - no CUDA device (CPU tests): the arithmetic model for ``CPU_CAPABILITY`` (``modelled_ctas``).

    ``source`` says which of the three gave the number (for the engine-start log line). Raises ValueError for
    ``bits`` without a kernel."""
    if bits is not None and bits not in KERNELS:
        raise ValueError(f"bits must be None or one of {sorted(KERNELS)}, got {bits!r}")
    device = torch.device(device)
    kinds = sorted(KERNELS) if bits is None else [bits]
    if device.type != "cuda":
        n = min(modelled_ctas(b, CPU_CAPABILITY) for b in kinds)
        return n, (f"arithmetic model for compute capability {CPU_CAPABILITY[0]}.{CPU_CAPABILITY[1]} (no CUDA device "
                   f"to query)")
    why = load_error(device)
    if why is not None:
        return LAUNCH_BOUNDS_CTAS, f"the kernel's launch bounds (it cannot load here: {why})"
    idx = torch.device(device).index
    idx = torch.cuda.current_device() if idx is None else idx
    got = []
    for b in kinds:
        if (idx, b) not in _RESIDENT:
            _RESIDENT[idx, b] = (load(device).occupancy(b), "driver occupancy query")
        got.append(_RESIDENT[idx, b])
    return min(got)


def ctas_per_sm(device: torch.device, bits: tuple[int, int] | None = None) -> int:
    """The first element of ``resident_ctas(device, bits)``."""
    return resident_ctas(device, bits)[0]


def rotation_signs(rotation: torch.Tensor) -> torch.Tensor:
    """The sign vector ``s`` (float32 ``[D]``, +-1, on the rotation's device) of a rotation ``R = diag(s) H / sqrt(D)``
    (``kvrepro.formats.hadamard.rotation_matrix``), which the CUDA kernel applies as a fast Walsh-Hadamard transform.

    Checked on the host the first time a rotation tensor is seen (one sync; cached per tensor and in-place version),
    so call it once outside CUDA-graph capture (``decode_attention`` does; the vLLM backend's warm-up runs it before
    capture). Raises ValueError if ``rotation`` is not of that form (the kernel would compute another function),
    RuntimeError if an unchecked rotation reaches it during graph capture.
    """
    if not isinstance(rotation, torch.Tensor) or rotation.dim() != 2 or rotation.shape[0] != rotation.shape[1] \
            or rotation.dtype != torch.float32:
        raise ValueError(f"rotation must be a float32 [D, D] tensor, got "
                         f"{getattr(rotation, 'dtype', type(rotation).__name__)} {tuple(getattr(rotation, 'shape', ()))}")
    hit = _SIGNS.get(id(rotation))
    if hit is not None and hit[0]() is rotation and hit[1] == _version_of(rotation):
        return hit[2]
    if rotation.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("kvrepro CUDA decode kernel: a rotation tensor not seen before reached it during CUDA-graph "
                           "capture; run decode_attention once eagerly with it first (its Hadamard form is checked "
                           "on the host once)")
    from kvrepro.formats.hadamard import _sylvester

    d = rotation.shape[0]
    r = rotation.detach().double().cpu()
    s = torch.sign(r[:, 0])
    if not (s.abs() == 1).all() or not torch.allclose(r, s[:, None] * _sylvester(d) / d ** 0.5, rtol=0, atol=1e-6):
        raise ValueError("rotation must be diag(s) H / sqrt(head_dim) with H the Sylvester Hadamard matrix and s signs "
                         "(kvrepro.formats.hadamard.rotation_matrix) for impl='cuda'; use impl='triton' for another "
                         "rotation")
    signs = s.float().to(rotation.device)
    if len(_SIGNS) > 256:                     # drop entries whose rotation is gone
        for k in [k for k, v in _SIGNS.items() if v[0]() is None]:
            del _SIGNS[k]
    _SIGNS[id(rotation)] = (weakref.ref(rotation), _version_of(rotation), signs)
    _KEEP.append(signs)         # never freed: a graph captured with it keeps its address
    return signs


def _version_of(t: torch.Tensor) -> int | None:
    """``t``'s in-place version counter; None for an inference tensor (made under ``torch.inference_mode``), which has
    none and can be changed in place only inside inference mode, so its cache entry is kept by identity alone."""
    return None if t.is_inference() else t._version


def split_counters(device: torch.device, n: int) -> torch.Tensor:
    """The kernel's per-(sequence, KV head) arrival counters: int32 ``[>= n]`` on ``device``, zero, left zero by every
    launch (the last CTA resets its counter). One buffer per device, grown (a new zeroed buffer) when ``n`` exceeds
    it (never inside CUDA-graph capture: RuntimeError); calls on concurrent streams of one device must not share it
    (the vLLM backend runs one stream). Raises ValueError for a device that is not CUDA."""
    if torch.device(device).type != "cuda":
        raise ValueError(f"split_counters needs a CUDA device, got {device}")
    idx = torch.device(device).index
    idx = torch.cuda.current_device() if idx is None else idx
    buf = _COUNTERS.get(idx)
    if buf is None or buf.numel() < n:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"kvrepro CUDA decode kernel: {n} split counters needed inside CUDA-graph capture, "
                               f"{0 if buf is None else buf.numel()} allocated; run decode_attention once eagerly at the "
                               f"largest batch first (the vLLM backend's warm-up does)")
        buf = _COUNTERS[idx] = torch.zeros(max(n, 4096), dtype=torch.int32, device=torch.device("cuda", idx))
        _KEEP.append(buf)       # never freed: a graph captured with it keeps its address (as runtime._WORKSPACES)
    return buf


_SIGNS: dict = {}        # id(rotation) -> (weakref, in-place version, signs)
_COUNTERS: dict[int, torch.Tensor] = {}
_KEEP: list[torch.Tensor] = []   # every counter buffer and sign vector handed to a launch (small; see above)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_splits(num_splits: int, group: int) -> None:
    """Raise ValueError unless ``group`` is an int in 1..``MAX_GROUP``, ``num_splits`` an int >= 1 and ``num_splits x
    group <= MERGE_MAX`` (the weights the in-kernel merge holds)."""
    if not _is_int(group) or not 1 <= group <= MAX_GROUP:
        raise ValueError(f"group (GQA query heads per KV head) must be an int in 1..{MAX_GROUP} for impl='cuda', "
                         f"got {group!r}")
    if not _is_int(num_splits) or num_splits < 1:
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")
    if num_splits * group > MERGE_MAX:
        raise ValueError(f"num_splits must be <= {MERGE_MAX // group} ({MERGE_MAX} // GQA group {group}) for "
                         f"impl='cuda' (its split merge holds num_splits x group weights in shared memory), "
                         f"got {num_splits}")


def _check_rank(rank_div: int, rank_skew: int) -> None:
    """Raise ValueError unless ``1 <= rank_div <= 65535`` (an SM count; the kernel's split weights are 32-bit) and
    ``0 <= rank_skew <= 255`` (every split's weight stays >= 259 of 1024; past 341 a weight would reach zero and the
    kernel's page cut would divide by zero or go negative)."""
    if not (_is_int(rank_div) and 1 <= rank_div <= 65535):
        raise ValueError(f"rank_div must be an int in 1..65535 (an SM count; the kernel's split weights are 32-bit), "
                         f"got {rank_div!r}")
    if not (_is_int(rank_skew) and 0 <= rank_skew <= 255):
        raise ValueError(f"rank_skew must be an int in 0..255, got {rank_skew!r}")


def rank_args(device: torch.device, batch: int, num_kv_heads: int, num_splits: int,
              bits: tuple[int, int] | None = None) -> tuple[int, int]:
    """The kernel's ``(rank_div, rank_skew)`` for a launch of ``batch x num_kv_heads x num_splits`` CTAs of the kernel
    of ``bits`` (None: the fewest resident of every kernel) on ``device``.

    Returns ``rank_div`` = the SM count and ``rank_skew`` = ``RANK_SKEW`` for a grid of at most one wave (``<=
    resident_ctas x SMs`` CTAs, all placed at launch, round by round) on a GPU of compute capability 9.x (H100 / H200,
    where the skew was measured), else 0: equal splits (later waves start as earlier CTAs finish, so rounds mean
    nothing; on other GPUs the rounds differ). Raises ValueError if ``RANK_SKEW`` is outside 0..255, the SM count
    outside 1..65535, a size is not an int >= 1, or ``device`` is CUDA where PyTorch sees none."""
    for name, v in (("batch", batch), ("num_kv_heads", num_kv_heads), ("num_splits", num_splits)):
        if not _is_int(v) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"rank_args: {device} requested but this PyTorch sees no CUDA device")
    sms = sm_count(device)
    skew = RANK_SKEW
    if not _is_int(skew) or not 0 <= skew <= 255:
        raise ValueError(f"kvrepro.ops.cuda_decode.RANK_SKEW must be an int in 0..255, got {skew!r}")
    hopper = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
    one_wave = hopper and batch * num_kv_heads * num_splits <= ctas_per_sm(device, bits) * sms
    _check_rank(sms, skew)                   # the kernel's 32-bit split weights: an SM count in 1..65535
    return sms, (skew if one_wave and hopper else 0)


def split_pages(seq_len: int, num_splits: int, b: int, kvh: int, batch: int, num_kv_heads: int, rank_div: int,
                rank_skew: int) -> list[tuple[int, int]]:
    """The kernel's partition of sequence ``b``'s pages for KV head ``kvh``: ``[(first_page, end_page)]`` per split
    (16-token pages, end exclusive; the last page may be partial), as ``split_weight_prefix`` in decode.cu computes
    it: split ``s`` (linear block index ``L = s x batch x num_kv_heads + kvh x batch + b``) weighs ``1024 - rank_skew x
    min(L // rank_div, 3)``, and the pages are cut at the integer floor of the weights' running share. Raises
    ValueError for ``rank_div`` outside 1..65535, ``rank_skew`` outside 0..255 (weights must stay positive),
    ``seq_len`` outside 0..2**31 - 16 (the kernel's int page count), ``num_splits`` outside 1..MERGE_MAX,
    ``batch`` / ``num_kv_heads < 1`` or ``b`` / ``kvh`` out of range."""
    _check_rank(rank_div, rank_skew)
    check_splits(num_splits, 1)              # num_splits in 1..MERGE_MAX, the in-kernel merge's limit
    for name, v, hi in (("batch", batch, None), ("num_kv_heads", num_kv_heads, None), ("b", b, batch),
                        ("kvh", kvh, num_kv_heads)):
        lo = 0 if hi is not None else 1
        if not _is_int(v) or v < lo or (hi is not None and v >= hi):
            allowed = ">= 1" if hi is None else f"in 0..{hi - 1}"
            raise ValueError(f"{name} must be an int {allowed}, got {v!r}")
    if not _is_int(seq_len) or not 0 <= seq_len <= 2 ** 31 - 16:
        raise ValueError(f"seq_len must be an int in 0..{2 ** 31 - 16} (the kernel's int page count), got {seq_len!r}")
    pages = -(-seq_len // BLOCK_SIZE)
    c, p = kvh * batch + b, batch * num_kv_heads
    w = [1024 - rank_skew * min((s * p + c) // rank_div, 3) for s in range(num_splits)]
    cum = [0, *itertools.accumulate(w)]
    return [(pages * cum[s] // cum[-1], pages * cum[s + 1] // cum[-1]) for s in range(num_splits)]


def launch(query: torch.Tensor, rotation: torch.Tensor, pool: torch.Tensor, block_tables: torch.Tensor,
           seq_lens: torch.Tensor, part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, scale: float,
           num_splits: int, num_kv_heads: int, group: int, *, key_bits: int, value_bits: int,
           rope_bias=None) -> None:
    """Run the kernel on the current stream (no host sync after the first call with a rotation): query rotation,
    split-K attention and the split merge in one launch. Shapes as ``decode_attention``'s:

    query ``[B, Hq, 128]`` bfloat16 / float16 (last dim contiguous, unrotated), rotation float32 ``[128, 128]`` of the
    form ``rotation_signs`` checks, pool uint8 ``[num_blocks, Hkv, page_bytes]`` with the page size of ``(key_bits,
    value_bits)``, which pick the kernel: 2144 for (4, 4) = k4v4, 3168 for (8, 4) = k8v4, 1632 for (4, 2) = k4v2,
    2352 for (5, 4) = k5v4
    (``LAYOUTS``; 16-byte aligned), block_tables int32
    ``[B, max_blocks]`` (last dim contiguous), seq_lens int32 ``[B]``, part_o float32 ``[B, Hq, S, 128]`` and part_lse
    float32 ``[B, Hq, S]`` (scratch: the split partials, log2), out ``[B, Hq, 128]`` bfloat16 / float16 (last dim
    contiguous), scale the softmax scale. ``rope_bias``: None, or ``(terms, inv_freq)`` for pages stored under the key
    offset rope-mean (``decode_attention``'s argument, ``check_rope_bias``): terms float32 ``[B, Hq, 2 x ROPE_PAIRS]``
    (A then B of each query head, ``RopeMean.score_terms``, unscaled), inv_freq float32 ``[Hkv, ROPE_PAIRS]``, both
    contiguous on the pool's device; it runs the ``ROPE_KERNELS`` variant, which adds ``scale x log2(e) x (sum_i A_i
    cos(j theta_i) + B_i sin(j theta_i))`` to the logit of the key at position ``j``, as the Triton kernel does. The
    caller (``decode_attention``) has checked shapes, dtypes and ``unsupported_reason``. Raises ValueError for ``(key_bits, value_bits)`` not in ``LAYOUTS``, a page size of
    another layout, a rotation that is not
    ``[128, 128]`` or not of the Hadamard form, a pool not on a CUDA device, ``group`` outside 1..8, ``num_splits <
    1`` or ``num_splits x group > MERGE_MAX``, a pool or workspace (``part_o``) that is not 16-byte aligned
    (``cp.async`` copies, ``float4`` merge reads), a ``rope_bias`` of another form (``check_rope_bias_cuda``); these are
    ``decode_attention``'s checks for ``impl="cuda"`` too (it calls this).
    """
    bits = (key_bits, value_bits)
    if bits not in LAYOUTS:
        allowed = ", ".join(f"{kb, vb} ({PRESETS[kb, vb]})" for kb, vb in LAYOUTS)
        raise ValueError(f"(key_bits, value_bits) must be one of {allowed} for the CUDA decode kernel, got "
                         f"({key_bits!r}, {value_bits!r})")
    if pool.shape[-1] != LAYOUTS[bits].page_bytes:
        raise ValueError(f"pool pages must be {LAYOUTS[bits].page_bytes} bytes for {PRESETS[bits]} (key_bits="
                         f"{key_bits}, value_bits={value_bits}, head_dim 128, block 16), got {pool.shape[-1]}")
    if not isinstance(rotation, torch.Tensor) or tuple(rotation.shape) != (HEAD_DIM, HEAD_DIM):
        raise ValueError(f"rotation must be a [{HEAD_DIM}, {HEAD_DIM}] tensor (head_dim {HEAD_DIM}), "
                         f"got {tuple(rotation.shape) if isinstance(rotation, torch.Tensor) else type(rotation).__name__}")
    if pool.device.type != "cuda":
        raise ValueError(f"pool must be on a CUDA device for the CUDA decode kernel, got {pool.device}")
    if pool.data_ptr() % 16:
        raise ValueError("pool must start on a 16-byte boundary for the CUDA decode kernel (cp.async)")
    check_splits(num_splits, group)
    if part_o.data_ptr() % 16:
        raise ValueError("workspace must start on a 16-byte boundary for the CUDA decode kernel (its merge reads the "
                         "partial outputs as float4)")
    b = block_tables.shape[0]
    rope_args = check_rope_bias_cuda(rope_bias, b, num_kv_heads * group, num_kv_heads, pool.device)
    if rope_bias is not None:
        rope_args = [*rope_args, ctypes.c_float(float(scale) * 1.4426950408889634)]   # the Triton path's rb_scale
    signs = rotation_signs(rotation)
    counters = split_counters(pool.device, b * num_kv_heads)
    rank_div, rank_skew = rank_args(pool.device, b, num_kv_heads, num_splits, bits)   # checked there
    flags = (1 if query.dtype == torch.bfloat16 else 0) | (2 if out.dtype == torch.bfloat16 else 0)
    qmul = float(scale) * 1.4426950408889634 / HEAD_DIM ** 0.5
    with torch.cuda.device(pool.device):      # the pool's device is current: its context, module and stream
        mod = load(pool.device)
        stream = torch.cuda.current_stream(pool.device).cuda_stream
        mod.launch((b, num_kv_heads * num_splits, 1),
                   [query, signs, pool, block_tables, seq_lens, part_o, part_lse, out, counters,
                    ctypes.c_longlong(query.stride(0)), ctypes.c_longlong(query.stride(1)),
                    ctypes.c_longlong(out.stride(0)), ctypes.c_longlong(out.stride(1)), ctypes.c_float(qmul), flags,
                    block_tables.stride(0), num_splits, num_kv_heads, group, rank_div, rank_skew, *rope_args], stream,
                   bits, rope=rope_bias is not None)


def check_rope_bias_cuda(rope_bias, batch: int, hq: int, hkv: int, device: torch.device) -> list:
    """The rope-mean kernel's tensor arguments ``[terms, inv_freq]`` of ``rope_bias`` (``[]`` for None): terms float32
    ``[batch, hq, 2 x ROPE_PAIRS]`` and inv_freq float32 ``[hkv, ROPE_PAIRS]``, contiguous, on ``device``
    (``kvrepro.ops.decode.check_rope_bias`` with the CUDA kernel's fixed pair count ``ROPE_PAIRS``). Raises ValueError
    naming ``rope_bias``, the shapes expected and those given."""
    if rope_bias is None:
        return []
    ok = isinstance(rope_bias, (tuple, list)) and len(rope_bias) == 2 and all(
        isinstance(x, torch.Tensor) and x.dtype == torch.float32 and x.device == torch.device(device)
        and x.is_contiguous() for x in rope_bias)
    ok = ok and tuple(rope_bias[0].shape) == (batch, hq, 2 * ROPE_PAIRS) and tuple(rope_bias[1].shape) == (hkv, ROPE_PAIRS)
    if not ok:
        got = described(rope_bias)
        raise ValueError(f"rope_bias must be (terms float32 [{batch}, {hq}, {2 * ROPE_PAIRS}], inv_freq float32 "
                         f"[{hkv}, {ROPE_PAIRS}]), contiguous on {device}, for the CUDA decode kernel (it takes "
                         f"{ROPE_PAIRS} pairs per KV head, kvrepro.formats.offset.MAX_PAIRS; use impl='triton' for "
                         f"another count); got {got}")
    return [rope_bias[0], rope_bias[1]]
