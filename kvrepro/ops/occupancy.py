"""Resident CTAs per SM by arithmetic: a kernel's registers, threads and shared memory against a GPU's per-SM limits.

This is the model the CUDA decode kernel's split rule falls back on where the driver cannot be asked
(``kvrepro.ops.cuda_decode.resident_ctas``: no CUDA device, e.g. the CPU tests); on a GPU the rule reads the driver's
occupancy query for the loaded kernel, and the GPU tests check that the two agree. The arithmetic is NVIDIA's
occupancy calculator (CUDA 13.0 ``include/cuda_occupancy.h``, ``cudaOccMaxActiveBlocksPerMultiprocessor``) for the
cases a CUDA kernel of compute capability 8.0-12.x meets, without partitioned global caching (a 6.x feature):

- warps: ``max_threads_per_sm / 32 // ceil(threads / 32)`` CTAs;
- registers: each warp gets ``ceil(registers x 32 / 256) x 256`` registers, in one of 4 sub-partitions of
  ``regs_per_sm / 4``: ``4 x (regs_per_sm / 4 // per_warp) // warps per CTA`` CTAs;
- shared memory: each CTA takes ``ceil((static + dynamic + 1 KB reserved by the driver) / 128) x 128`` bytes of the
  SM's configured capacity (the carveout: the preference rounded up to a capacity the SM supports, and never below
  one CTA's need): ``capacity // per CTA`` CTAs;
- the SM's own cap on resident CTAs (16 for 8.6, 24 for 8.9 and 12.x, 32 for 8.0, 9.0 and 10.0);

resident CTAs = the smallest of the four. (Barriers: every CTA gets at least one of its own, and the decode kernel
uses one, so they never bind.) The per-SM limits are data: ``cuda/gpus.json``, with its sources.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os

GPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda", "gpus.json")
WARP = 32
SMEM_GRANULARITY = 128          # bytes: shared-memory allocation unit per CTA (cuda_occupancy.h, 8.x-12.x)
REG_GRANULARITY = 256           # registers: allocation unit per warp (cuda_occupancy.h)
SUB_PARTITIONS = 4              # register-file partitions per SM (cuda_occupancy.h)
RESERVED_SMEM = 1024            # bytes of shared memory the driver reserves per CTA from 8.x on
CARVEOUT_DEFAULT = -1           # CU_SHAREDMEM_CARVEOUT_DEFAULT: no preference (the SM's largest capacity)


@dataclasses.dataclass(frozen=True)
class SMLimits:
    """The per-SM limits of one compute capability (one row of ``cuda/gpus.json``).

    Attributes:
        family: GPU family name (``"A100"``, ``"H100 / H200"``, ...).
        arch: ``"sm_80"``-style name of the compute capability.
        capability: ``(major, minor)``.
        gpus: product names of the family (as the driver reports them, without ``"NVIDIA "``).
        smem_configs: shared-memory capacities in bytes the SM can be configured to, ascending; the last is the
            SM's shared memory (the largest carveout).
        max_threads_per_sm, max_ctas_per_sm: resident threads and CTAs per SM.
        regs_per_sm: 32-bit registers per SM.
    """

    family: str
    arch: str
    capability: tuple[int, int]
    gpus: tuple[str, ...]
    smem_configs: tuple[int, ...]
    max_threads_per_sm: int
    max_ctas_per_sm: int
    regs_per_sm: int

    @property
    def smem_per_sm(self) -> int:
        """Bytes of shared memory per SM (the largest carveout)."""
        return self.smem_configs[-1]


@dataclasses.dataclass(frozen=True)
class KernelResources:
    """What one CTA of a kernel holds while resident.

    Attributes:
        threads: threads per CTA.
        registers: registers per thread (ptxas ``Used N registers``; the driver's ``CU_FUNC_ATTRIBUTE_NUM_REGS``).
        smem_static: bytes of static shared memory (ptxas ``N bytes smem``; ``CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES``).
        smem_dynamic: bytes of dynamic shared memory each launch asks for.
    """

    threads: int
    registers: int
    smem_static: int
    smem_dynamic: int = 0

    def __post_init__(self):
        for name in ("threads", "registers", "smem_static", "smem_dynamic"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (1 if name == "threads" else 0):
                raise ValueError(f"{name} must be an int >= {1 if name == 'threads' else 0}, got {v!r}")


@functools.lru_cache(maxsize=None)
def _families(path: str) -> tuple[SMLimits, ...]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return tuple(SMLimits(family=r["family"], arch=r["arch"], capability=tuple(r["capability"]), gpus=tuple(r["gpus"]),
                          smem_configs=tuple(kb * 1024 for kb in r["smem_configs_kb"]),
                          max_threads_per_sm=r["max_threads_per_sm"], max_ctas_per_sm=r["max_ctas_per_sm"],
                          regs_per_sm=r["regs_per_sm"]) for r in data["families"])


def families(path: str = GPUS) -> tuple[SMLimits, ...]:
    """Every row of ``cuda/gpus.json`` (ascending compute capability, as written there)."""
    return _families(os.path.abspath(path))


def limits(capability, path: str = GPUS) -> SMLimits:
    """The :class:`SMLimits` of compute capability ``(major, minor)``.

    Raises:
        ValueError: a capability with no row in ``cuda/gpus.json`` (the message lists the ones there).
    """
    cap = tuple(capability) if isinstance(capability, (tuple, list)) else capability
    for row in families(path):
        if row.capability == cap:
            return row
    known = ", ".join(f"{r.capability[0]}.{r.capability[1]}" for r in families(path))
    raise ValueError(f"capability must be one of {known} (cuda/gpus.json), got {capability!r}")


def configured_smem(sm: SMLimits, carveout: int = CARVEOUT_DEFAULT, need: int = 0) -> int:
    """Bytes of shared memory an SM is configured to for a kernel whose CTA needs ``need`` bytes (allocated, with the
    reserve) under the carveout preference ``carveout`` (percent of the SM's largest capacity, 0..100, or -1: none),
    as cuda_occupancy.h computes it: the preference rounded up to a capacity the SM supports; if that holds less than
    one CTA, the smallest capacity that holds one.

    Raises:
        ValueError: ``carveout`` not -1 or an int in 0..100; ``need`` larger than the SM's largest capacity.
    """
    if not isinstance(carveout, int) or isinstance(carveout, bool) or not (carveout == -1 or 0 <= carveout <= 100):
        raise ValueError(f"carveout must be -1 (no preference) or an int percent in 0..100, got {carveout!r}")
    if need > sm.smem_per_sm:
        raise ValueError(f"a CTA needing {need} bytes of shared memory does not fit the {sm.smem_per_sm} bytes of an "
                         f"SM of compute capability {sm.capability[0]}.{sm.capability[1]}")
    want = sm.smem_per_sm if carveout == CARVEOUT_DEFAULT else carveout * sm.smem_per_sm // 100
    pref = next(c for c in sm.smem_configs if c >= want)
    return pref if pref >= need else next(c for c in sm.smem_configs if c >= need)


def carveout_for(sm: SMLimits, capacity: int) -> int:
    """The carveout percent that configures ``sm`` to exactly ``capacity`` bytes (one of ``sm.smem_configs``): the
    largest percent whose preference rounds up to it (``configured_smem``).

    Raises:
        ValueError: ``capacity`` not one of the SM's configurations, or none of 0..100 % selects it.
    """
    if capacity not in sm.smem_configs:
        raise ValueError(f"capacity must be one of {[c // 1024 for c in sm.smem_configs]} KB for compute capability "
                         f"{sm.capability[0]}.{sm.capability[1]}, got {capacity} bytes")
    hits = [p for p in range(101) if configured_smem(sm, p) == capacity]
    if not hits:
        raise ValueError(f"no carveout percent selects {capacity // 1024} KB on compute capability "
                         f"{sm.capability[0]}.{sm.capability[1]}")
    return max(hits)


def smem_per_cta(res: KernelResources) -> int:
    """Bytes of shared memory one resident CTA takes: static + dynamic + the driver's 1 KB, in 128-byte units."""
    total = res.smem_static + res.smem_dynamic + RESERVED_SMEM
    return -(-total // SMEM_GRANULARITY) * SMEM_GRANULARITY


def limits_by_resource(res: KernelResources, sm: SMLimits, carveout: int = CARVEOUT_DEFAULT) -> dict[str, int]:
    """CTAs per SM each resource allows: ``{"warps", "registers", "shared_memory", "ctas"}`` (module docstring).

    Raises:
        ValueError: as :func:`configured_smem`; a CTA of more threads or registers than an SM holds.
    """
    warps = -(-res.threads // WARP)
    per_warp = -(-res.registers * WARP // REG_GRANULARITY) * REG_GRANULARITY
    if warps * WARP > sm.max_threads_per_sm or per_warp * warps > sm.regs_per_sm:
        raise ValueError(f"a CTA of {res.threads} threads x {res.registers} registers does not fit an SM of compute "
                         f"capability {sm.capability[0]}.{sm.capability[1]}")
    by_regs = (SUB_PARTITIONS * ((sm.regs_per_sm // SUB_PARTITIONS) // per_warp) // warps) if per_warp else sm.max_ctas_per_sm
    need = smem_per_cta(res)
    return {"warps": (sm.max_threads_per_sm // WARP) // warps, "registers": by_regs,
            "shared_memory": configured_smem(sm, carveout, need) // need, "ctas": sm.max_ctas_per_sm}


def resident_ctas(res: KernelResources, sm: SMLimits, carveout: int = CARVEOUT_DEFAULT) -> int:
    """CTAs of ``res`` resident per SM of ``sm`` under ``carveout`` (module docstring). Raises as
    :func:`limits_by_resource`."""
    return min(limits_by_resource(res, sm, carveout).values())
