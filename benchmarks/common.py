"""Helpers shared by the benchmark scripts (not tests): provenance, the decode workload (Qwen3-4B shapes over pools
filled with random pages), CUDA-graph timing, copy bandwidth, atomic JSON writes."""
from __future__ import annotations

import datetime
import json
import os
import platform

import torch

from kvrepro.formats import get_format
from kvrepro.listarg import comma_list

HQ, HKV, D, BS = 32, 8, 128, 16        # Qwen3-4B: 32 query / 8 KV heads, head_dim 128; vLLM's block of 16 tokens
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


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
    # the code that ran, even where the machine's git metadata does not match its working tree
    from kvrepro.ops import cuda_decode
    from kvrepro.provenance import src_sha256
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
    from kvrepro.fileio import atomic_write

    atomic_write(path, lambda f: json.dump(obj, f, indent=1, default=str))


def random_pool(preset: str, num_blocks: int, num_kv_heads: int, head_dim: int, block_size: int,
                device, gen: torch.Generator):
    """A ``CompressedPool`` whose codes are uniform random bytes and whose float16 metadata are
    sane (K scale 0.05..0.15, zero -1.2..-0.8; V scale 0.05..0.15): real-looking pages without
    running the store kernel over gigabytes."""
    pool = get_format(preset).new_pool(num_blocks, num_kv_heads, head_dim, block_size, device=device)
    pool.data.random_(0, 256, generator=gen)
    kc, vc, km, vm = pool.regions()
    km16 = torch.empty(km.shape[:-1] + (km.shape[-1] // 2,), dtype=torch.float16, device=device)
    km16[..., 0].uniform_(0.05, 0.15, generator=gen)
    if km16.shape[-1] > 1:                     # asymmetric keys: a zero point beside the scale
        km16[..., 1].uniform_(-1.2, -0.8, generator=gen)
    km.copy_(km16.view(torch.uint8))
    if pool.layout.value_log_scale:            # one-byte log2 scale code: s_hat = 2**((u - 128) / 8), 0.05..0.15
        vm.random_(93, 107, generator=gen)
    else:
        vm16 = torch.empty(vm.shape[:-1] + (1,), dtype=torch.float16, device=device).uniform_(0.05, 0.15, generator=gen)
        vm.copy_(vm16.view(torch.uint8))
    return pool


def decode_setup(preset: str, ctx: int, batch: int, gen: torch.Generator):
    """One decode step's inputs on CUDA at Qwen3-4B shapes: a ``random_pool`` of ``preset`` holding ``batch``
    sequences of ``ctx`` tokens under a shuffled block table. Returns ``(pool, block_tables [batch, ctx / BS] int32,
    seq_lens [batch] int32, query [batch, HQ, D] bfloat16)``."""
    nb_per = ctx // BS
    pool = random_pool(preset, batch * nb_per + 8, HKV, D, BS, "cuda", gen)
    bt = torch.randperm(pool.num_blocks, device="cuda", generator=gen)[: batch * nb_per].reshape(batch, nb_per)
    sl = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    return pool, bt.to(torch.int32), sl, q


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


def bench(fn):
    """``(eager_ms, graph_ms, graph_error)``: ``triton.testing.do_bench`` medians (L2 flushed before every call) of
    ``fn`` and of a CUDA graph of one call; ``graph_ms`` None and the error's text if the call cannot be captured."""
    import triton.testing
    fn()
    torch.cuda.synchronize()
    eager = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
    try:
        g = capture_graph(fn)
        return eager, triton.testing.do_bench(g.replay, warmup=10, rep=50, return_mode="median"), ""
    except Exception as e:  # recorded, never replaced by the eager figure
        torch.cuda.synchronize()
        return eager, None, repr(e)[:300]


def parse_launch(text: str) -> tuple[int, int]:
    """``"64,2"`` -> (64, 2): block_n as the Triton kernels take it (``kvrepro.ops.common.check_block_n``), num_warps
    in 1, 2, 4, 8 (ValueError naming ``--launch``)."""
    from kvrepro.ops.common import check_block_n

    try:
        bn, w = (int(x) for x in comma_list(text, "--launch"))
    except ValueError as e:
        raise ValueError(f"--launch takes block_n,num_warps (e.g. 64,2), got {text!r}: {e}") from None
    try:
        check_block_n(bn)
    except ValueError as e:
        raise ValueError(f"--launch {text!r}: {e}") from None
    if w not in (1, 2, 4, 8):
        raise ValueError(f"--launch {text!r}: num_warps={w}; allowed: 1, 2, 4, 8")
    return bn, w
