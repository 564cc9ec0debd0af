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
    """Date, host, versions, GPU, the SHA-256 of kvrepro's Python sources and of the CUDA fatbin, plus ``extra``."""
    import triton
    info = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "measured": "measured (this run)",
    }
    # the code that ran, even where the copy's git metadata is stale (the device's was, 2026-11-30)
    from kvrepro.accuracy_vllm import src_sha256
    from kvrepro.ops import cuda_decode
    info["kvrepro_src_sha256"] = src_sha256()
    info["cuda_fatbin_sha256"] = cuda_decode.read_manifest()["fatbin_sha256"]
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


def capture_graph(fn):
    """A CUDA graph of one call of ``fn``: one call on a side stream first (warm-up off the capture stream, as
    PyTorch's CUDA-graph docs do), then the capture. Capture errors propagate."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return g


def cuda_event_ms(fn) -> float:
    """One warm-up call, then one call timed with CUDA events (ms). For long calls (a 128K prefill
    chunk) where ``do_bench``'s repetitions would cost minutes."""
    fn()
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    e0.record()
    fn()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1)


def prefill_prompt(num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                   gen: torch.Generator, preset: str = "k4v4"):
    """A random bf16 prompt (q ``[T, Hq, D]``, k/v ``[T, Hkv, D]``) whose K/V are stored in a fresh
    ``preset`` pool (``store_kv``, rotation in PyTorch) under a shuffled one-row block table.
    Returns ``(q, k, v, pool, block_table [1, T / block_size] int32)``."""
    from kvrepro.ops import store_kv
    n, dev = num_tokens, "cuda"
    k = torch.randn(n, num_kv_heads, head_dim, device=dev, dtype=torch.bfloat16)
    v = torch.randn(n, num_kv_heads, head_dim, device=dev, dtype=torch.bfloat16)
    q = torch.randn(n, num_q_heads, head_dim, device=dev, dtype=torch.bfloat16)
    pool = get_format(preset).new_pool(n // block_size + 8, num_kv_heads, head_dim, block_size, device=dev)
    bt = torch.randperm(pool.num_blocks, device=dev, generator=gen)[: n // block_size][None].to(torch.int32)
    pos = torch.arange(n, device=dev)
    slots = (bt[0, pos // block_size].long() * block_size + pos % block_size).to(torch.int32)
    store_kv(k, v, pool.data, slots, pool.layout, pool.rotation, rotate="torch")
    torch.cuda.synchronize()
    return q, k, v, pool, bt


def prefill_chunk(q, k, v, pool, block_table, c0: int, chunk: int, **kw):
    """A no-argument callable: ``prefill_attention`` of the prompt's chunk ``[c0, c0 + chunk)``
    (context ``[0, c0)`` from ``pool``, the chunk's own K/V fresh), softmax scale ``D ** -0.5``."""
    from kvrepro.ops import prefill_attention
    qsl = torch.tensor([0, chunk], dtype=torch.int32, device=q.device)
    sl = torch.tensor([c0 + chunk], dtype=torch.int32, device=q.device)
    rows = slice(c0, c0 + chunk)
    return lambda: prefill_attention(q[rows], k[rows], v[rows], pool.data, block_table, sl, qsl, pool.layout,
                                     pool.rotation, q.shape[-1] ** -0.5, max_query_len=chunk, **kw)
