"""Helpers shared by the benchmark scripts (not tests): provenance, pools filled with random
pages, copy bandwidth, atomic JSON writes."""
from __future__ import annotations

import datetime
import json
import os
import platform
import tempfile

import torch

from kvrepro.formats import get_format


def provenance(extra: dict | None = None) -> dict:
    import triton
    info = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "measured": "measured (this run)",
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_mem_gib=round(p.total_memory / 2**30, 1), sms=p.multi_processor_count,
                    cuda=torch.version.cuda)
    info.update(extra or {})
    return info


def write_json(path: str, obj) -> None:
    """Write ``obj`` as JSON to a temp file in the same folder, then rename (atomic)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=1, default=str)
    os.replace(tmp, path)


def random_pool(preset: str, num_blocks: int, num_kv_heads: int, head_dim: int, block_size: int,
                device, gen: torch.Generator):
    """A ``CompressedPool`` whose codes are uniform random bytes and whose float16 metadata are
    sane (K scale 0.05..0.15, zero -1.2..-0.8; V scale 0.05..0.15): real-looking pages without
    running the store kernel over gigabytes."""
    pool = get_format(preset).new_pool(num_blocks, num_kv_heads, head_dim, block_size, device=device)
    pool.data.random_(0, 256, generator=gen)
    kc, vc, km, vm = pool.regions()
    km16 = torch.empty(km.shape[:-1] + (2,), dtype=torch.float16, device=device)
    km16[..., 0].uniform_(0.05, 0.15, generator=gen)
    km16[..., 1].uniform_(-1.2, -0.8, generator=gen)
    km.copy_(km16.view(torch.uint8))
    vm16 = torch.empty(vm.shape[:-1] + (1,), dtype=torch.float16, device=device).uniform_(0.05, 0.15, generator=gen)
    vm.copy_(vm16.view(torch.uint8))
    return pool


def copy_bandwidth(nbytes: int = 4 << 30) -> dict:
    """Device-to-device copy of ``nbytes``; bandwidth counts bytes read + written."""
    import triton.testing
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 256)
    b = torch.empty_like(a)
    def copy():
        b.copy_(a)
    ms = triton.testing.do_bench(copy, warmup=50, rep=300, return_mode="median")
    return {"bytes": nbytes, "ms": ms, "GBps_read_plus_write": 2 * nbytes / ms / 1e6}
