"""GPU smoke of the backend's decode path as vLLM drives it (CUDA only; no vLLM needed; skipped on CPU).

Qwen3-4B geometry (32 q / 8 KV heads, head_dim 128), k4v4, block 16, the sweep's block-table width:
kernel warm-up, then a CUDA graph of a padded decode batch (13 users in graph size 16) must allocate
nothing while capturing (vLLM's CUDA-graph memory profiling would count it once per graph size), and
its replay must equal the eager call and attention over the dequantized pages.
Prints the figures (``-s``); ``scripts/h200_sweep.sh smoke`` runs it before the sweep.
"""
import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from kvrepro.vllm_backend import runtime  # noqa: E402
from kvrepro.vllm_backend.runtime import LayerRuntime, reference_attend  # noqa: E402

GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32)
MAX_MODEL_LEN = 131072 + 1024 + 32 * 32 + 64 + 1024  # the sweep's (kvrepro.vllm_backend.measure margin)
HQ, HKV, D, BS = 32, 8, 128, 16


def non_torch_bytes(dev) -> int:
    """Device memory in use that PyTorch's allocator does not hold (driver: modules, local memory)."""
    free, total = torch.cuda.mem_get_info(dev)
    return total - free - torch.cuda.memory_reserved(dev)


def test_warmup_then_graph_capture_allocates_nothing_and_matches_reference():
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.zeros(1, device=dev) @ torch.zeros(1, 1, device=dev)  # context + cuBLAS handle first
    nt0 = non_torch_bytes(dev)
    rt = LayerRuntime("k4v4", HQ, HKV, D, D ** -0.5, graph_sizes=GRAPH_SIZES, max_batch=32)
    t = time.perf_counter()
    warmed = rt.warmup(dev, torch.bfloat16, BS, MAX_MODEL_LEN)
    torch.cuda.synchronize()
    grown = non_torch_bytes(dev) - nt0
    print(f"\nSMOKE warmup: split counts {warmed} in {time.perf_counter() - t:.1f} s; shared workspace "
          f"{runtime._WORKSPACES[str(dev)][-1].numel() * 4 / 2**20:.2f} MiB; non-torch memory +{grown / 2**20:.0f} MiB "
          f"(store rotate={rt.store_rotate})")
    # Every kernel of the serving path loaded and launched: no large local-memory (stack) reservation.
    assert grown < 256 * 2**20
    width = -(-MAX_MODEL_LEN // BS)
    print("SMOKE splits per graph size: " + ", ".join(
        f"{b}:{rt.splits(b, width * BS, dev)}" for b in GRAPH_SIZES))

    g = torch.Generator(device="cpu").manual_seed(0)
    users, batch, ctx = 13, 16, 4096
    nb = users * ctx // BS + 1
    layout = rt.fmt.layout(D, BS)
    pool = torch.zeros(nb, HKV, layout.page_bytes, dtype=torch.uint8, device=dev)
    perm = torch.randperm(nb - 1, generator=g) + 1
    bt = torch.zeros(batch, width, dtype=torch.int32)
    bt[:users, :ctx // BS] = perm[:users * ctx // BS].view(users, ctx // BS).int()
    bt = bt.to(dev)
    slots = (bt[:users, :ctx // BS].long()[:, :, None] * BS + torch.arange(BS, device=dev)).reshape(-1)
    k = torch.randn(users * ctx, HKV * D, generator=g).bfloat16().to(dev)
    v = torch.randn(users * ctx, HKV * D, generator=g).bfloat16().to(dev)
    rt.store(k, v, pool, slots)
    seq = torch.tensor([ctx] * users + [0] * (batch - users), dtype=torch.int32, device=dev)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=dev)
    q = torch.randn(batch, HQ * D, generator=g).bfloat16().to(dev)
    out = torch.zeros(batch, HQ, D, dtype=torch.bfloat16, device=dev)

    def step():
        rt.attend(q, k[:batch], v[:batch], pool, bt, seq, qsl, batch, batch, batch, out)

    step()  # eager (same kernels the graph captures)
    torch.cuda.synchronize()
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    held = list(runtime._WORKSPACES[str(dev)])
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev)
    free0 = torch.cuda.mem_get_info()[0]
    with torch.cuda.graph(graph):
        step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(dev)
    print(f"SMOKE capture: torch allocations during capture {peak - before} B; device memory "
          f"{(free0 - torch.cuda.mem_get_info()[0]) / 2**20:.1f} MiB (graph object)")
    assert peak == before, "a captured decode forward allocated memory"
    assert runtime._WORKSPACES[str(dev)] == held
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert (out[users:] == 0).all()
    ref = reference_attend(rt, q, k[:batch], v[:batch], pool, bt[:users], seq[:users], qsl[:users + 1], users,
                           users, dtype=torch.float32)
    err = ((out[:users].float() - ref).abs().max() / ref.abs().max()).item()
    print(f"SMOKE graph replay == eager; rel err vs attention over the dequantized pages {err:.2e}")
    assert err < 1e-2

    # Evidence for notes/vllm.md: the in-kernel rotation's register-spill stack makes the driver
    # reserve local memory for every resident thread of the GPU at its first launch.
    nt1 = non_torch_bytes(dev)
    rt_kernel = LayerRuntime("k4v4", HQ, HKV, D, D ** -0.5, store_rotate="kernel")
    rt_kernel.store(k[:16], v[:16], pool, slots[:16])
    torch.cuda.synchronize()
    print(f"SMOKE store rotate=kernel: non-torch memory +{(non_torch_bytes(dev) - nt1) / 2**30:.2f} GiB "
          "(local memory for its register-spill stack)")
