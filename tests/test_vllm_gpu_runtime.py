"""GPU smoke of the backend's decode path as vLLM drives it (CUDA only; no vLLM needed; skipped on CPU).

Qwen3-4B geometry (32 q / 8 KV heads, head_dim 128), k4v4, k8v4, k4v2 and k5v4, block 16, the sweep's block-table width:
kernel warm-up, then a CUDA graph of a padded decode batch (13 users in graph size 16) must allocate
nothing while capturing (vLLM's CUDA-graph memory profiling would count it once per graph size), and
its replay must equal the eager call and attention over the dequantized pages.
Prints the figures (``-s``); ``scripts/h200_sweep.sh smoke`` runs it before the sweep.
"""
import time

import pytest
import torch

from kvrepro.vllm_backend import runtime
from kvrepro.vllm_backend.runtime import LayerRuntime, reference_attend

pytestmark = pytest.mark.gpu

GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32)
MAX_MODEL_LEN = 131072 + 1024 + 32 * 32 + 64 + 1024  # the sweep's (kvrepro.sweep_worker margin)
HQ, HKV, D, BS = 32, 8, 128, 16


def non_torch_bytes(dev) -> int:
    """Device memory in use that PyTorch's allocator does not hold (driver: modules, local memory)."""
    free, total = torch.cuda.mem_get_info(dev)
    return total - free - torch.cuda.memory_reserved(dev)


@pytest.mark.parametrize("preset", ["k4v4", "k8v4", "k4v2", "k5v4"])   # each has its CUDA decode kernel
def test_warmup_then_graph_capture_allocates_nothing_and_matches_reference(preset):
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.zeros(1, device=dev) @ torch.zeros(1, 1, device=dev)  # context + cuBLAS handle first
    nt0 = non_torch_bytes(dev)
    rt = LayerRuntime(preset, HQ, HKV, D, D ** -0.5, graph_sizes=GRAPH_SIZES, max_batch=32)
    t = time.perf_counter()
    warmed = rt.warmup(dev, torch.bfloat16, BS, MAX_MODEL_LEN)
    torch.cuda.synchronize()
    grown = non_torch_bytes(dev) - nt0
    print(f"\nSMOKE {preset} warmup ({rt.impl_used} decode kernel): split counts {warmed} in {time.perf_counter() - t:.1f} s; shared workspace "
          f"{runtime._WORKSPACES[str(dev)][-1].numel() * 4 / 2**20:.2f} MiB; non-torch memory +{grown / 2**20:.0f} MiB "
          f"(store rotate={rt.store_rotate})")
    # Every kernel of the serving path loaded and launched: no large local-memory (stack) reservation.
    assert grown < 256 * 2**20
    if torch.cuda.get_device_capability(dev) >= (8, 0):     # this preset's CUDA kernel, not the Triton one
        assert rt.impl_used == "cuda", rt.impl_used
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
    # PyTorch's first capture in a process registers the CUDA generator with the graph and allocates
    # its seed/offset tensors (2 x 512 B; the 1,024 B this check once saw on the H200):
    # capture a no-op first so that only the forward's own allocations are measured below.
    noop = torch.cuda.CUDAGraph()
    with torch.cuda.graph(noop):
        out.mul_(1)
    torch.cuda.synchronize()
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

    # KVREPRO_STORE_ROTATE=kernel (the default) must not bring back the spill stack whose local-memory reservation
    # cost a user (notes/vllm.md, "Memory accounting"): the store kernel as compiled for this GPU spills nothing.
    from kvrepro.ops import store
    compiled = store._launch(k[:16].view(16, HKV, D), v[:16].view(16, HKV, D), pool, slots[:16],
                             store.hadamard_operand(rt.rotation), layout, HKV)
    print(f"SMOKE store rotate=kernel: {compiled.n_regs} registers, {compiled.n_spills} spills")
    assert rt.store_rotate == "kernel" and compiled.n_spills == 0


@pytest.mark.vllm
def test_prefill_paths_at_128k_with_vllm_flash_attention():
    """One layer, one 16K chunk after 112K of context (the last chunk of a 128K prompt): ``fa`` and
    ``dequant`` (KVREPRO_PREFILL) against attention over the dequantized pages (float32, last 64
    rows), timed. Writes ``$KVREPRO_SMOKE_FLAGS/prefill_dequant_ok`` when ``dequant`` is right and faster
    (scripts/h200_sweep.sh then may select it for the sweep: PREFILL_AUTO=1)."""
    import os

    from kvrepro.vllm_backend.fa_prefill import FlashPrefill, RotatedDequantPrefill

    dev = torch.device("cuda", torch.cuda.current_device())
    rt = LayerRuntime("k4v4", HQ, HKV, D, D ** -0.5)
    ctx, ql = 131072 - 16384, 16384
    seq = ctx + ql
    layout = rt.fmt.layout(D, BS)
    nb = seq // BS + 1
    pool = torch.zeros(nb, HKV, layout.page_bytes, dtype=torch.uint8, device=dev)
    g = torch.Generator(device=dev).manual_seed(1)
    bt = (torch.randperm(nb - 1, generator=g, device=dev) + 1).int()[None, :]
    slots = (bt[0].long()[:, None] * BS + torch.arange(BS, device=dev)).reshape(-1)[:seq]
    k = torch.randn(seq, HKV * D, generator=g, device=dev).bfloat16()
    v = torch.randn(seq, HKV * D, generator=g, device=dev).bfloat16()
    rt.store(k, v, pool, slots)
    q = torch.randn(ql, HQ, D, generator=g, device=dev).bfloat16()
    kc, vc = k[ctx:].view(ql, HKV, D), v[ctx:].view(ql, HKV, D)
    lens = torch.tensor([seq], dtype=torch.int32, device=dev)
    qsl = torch.tensor([0, ql], dtype=torch.int32, device=dev)
    rot = rt.prepare(dev)
    res = {}
    for name, path in (("fa", FlashPrefill(rt.fmt, HKV, D)), ("dequant", RotatedDequantPrefill(D))):
        out = torch.empty_like(q)
        path(q, kc, vc, pool, bt, lens, qsl, layout, rot, rt.scale, out=out, max_query_len=ql)  # warm
        torch.cuda.synchronize()
        t0 = torch.cuda.Event(enable_timing=True)
        t1 = torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(3):
            path(q, kc, vc, pool, bt, lens, qsl, layout, rot, rt.scale, out=out, max_query_len=ql)
        t1.record()
        torch.cuda.synchronize()
        res[name] = (out.clone(), t0.elapsed_time(t1) / 3)
    # reference: the last 64 query rows attend (causally) to the dequantized context pages + the
    # chunk's own K/V unquantized, float32
    from kvrepro.reference import attention_ref

    tail = 64
    ref_pool = rt.fmt.new_pool(1, HKV, D, BS, device=dev)
    ref_pool.data = pool
    kp, vp = ref_pool.gather(bt[0], ctx)
    ref = attention_ref(q[-tail:], torch.cat([kp.float(), kc.float()]), torch.cat([vp.float(), vc.float()]),
                        rt.scale, torch.float32)
    del kp, vp
    errs = {n: ((o[-tail:].float() - ref).abs().max() / ref.abs().max()).item() for n, (o, _) in res.items()}
    print("\nSMOKE prefill 16K chunk after 112K context, one layer: " + ", ".join(
        f"{n} {ms:.1f} ms relerr {errs[n]:.1e}" for n, (_, ms) in res.items()))
    assert errs["fa"] < 2e-2
    ok = errs["dequant"] < 2e-2 and res["dequant"][1] < res["fa"][1]
    flags = os.environ.get("KVREPRO_SMOKE_FLAGS")
    if flags and ok:
        os.makedirs(flags, exist_ok=True)
        open(os.path.join(flags, "prefill_dequant_ok"), "w").write(
            f"dequant {res['dequant'][1]:.1f} ms vs fa {res['fa'][1]:.1f} ms, relerr {errs['dequant']:.1e}\n")
    assert errs["dequant"] < 2e-2
