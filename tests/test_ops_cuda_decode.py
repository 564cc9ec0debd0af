"""kvrepro's CUDA decode kernel (``decode_attention(impl="cuda")``): which calls it serves, the committed fatbin
and generated layout header against their sources (``kvrepro.ops.cuda_build``), a CPU emulation of its fragment data
flow, and (on a CUDA device, ``gpu`` marker) its output vs float64 attention over the dequantized cache."""
from test_ops_helpers import DEV, block_tables, fill, make_pool, relerr  # noqa: I001  (TRITON_INTERPRET first)

import filecmp
import hashlib
import json
import shutil

import numpy as np
import pytest
import torch

import cuda_emulation as emu
from kvrepro.formats import get_format
from kvrepro.formats.layout import PageLayout
from kvrepro.ops import cuda_build, cuda_decode, decode_attention
from kvrepro.ops.decode import resolve_impl
from kvrepro.reference import attention_ref, paged_attention_ref

K4V4 = get_format("k4v4").layout(128, 16)
CUDA = torch.device("cuda", 0)


def _sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture
def capability(monkeypatch):
    """Pretend a CUDA device of the given compute capability (no GPU needed: only resolve_impl's logic)."""
    def set_cap(cap):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda_decode, "load_error", lambda device: None)      # the fatbin would load
    return set_cap


def test_auto_picks_cuda_only_where_the_kernel_applies(capability):
    capability((9, 0))
    assert resolve_impl(None, K4V4, 4, CUDA) == "cuda"
    assert resolve_impl(None, K4V4, 8, CUDA) == "cuda"
    assert resolve_impl(None, K4V4, 3, CUDA) == "cuda"
    assert resolve_impl(None, K4V4, 9, CUDA) == "triton"                                    # group > 8
    assert resolve_impl(None, get_format("k8v4").layout(128, 16), 4, CUDA) == "cuda"       # k8v4: its own kernel
    assert resolve_impl(None, get_format("k4v2").layout(128, 16), 4, CUDA) == "cuda"       # k4v2: its own kernel
    assert resolve_impl(None, PageLayout(128, 16, 8, 8), 4, CUDA) == "triton"              # no kernel for k8v8
    assert resolve_impl(None, get_format("k5v4").layout(128, 16), 4, CUDA) == "cuda"       # k5v4: its own kernel
    assert resolve_impl(None, get_format("k4v4").layout(64, 16), 3, CUDA) == "triton"      # SmolLM2 head_dim
    assert resolve_impl(None, get_format("k4v4").layout(128, 32), 4, CUDA) == "triton"     # other block size
    assert resolve_impl(None, K4V4, 4, torch.device("cpu")) == "triton"
    assert resolve_impl(None, K4V4, 4, CUDA, ("block_n",)) == "triton"                     # a Triton option
    capability((7, 5))
    assert resolve_impl(None, K4V4, 4, CUDA) == "triton"


def test_explicit_cuda_is_refused_with_the_reason(capability):
    capability((9, 0))
    assert resolve_impl("cuda", K4V4, 4, CUDA) == "cuda"
    assert resolve_impl("triton", K4V4, 4, CUDA) == "triton"
    for layout, group, dev, match in [
        (PageLayout(128, 16, 2, 4), 4, CUDA,
         "k4v4, k8v4, k4v2 and k5v4 pages with head_dim 128 and block_size 16.*key_bits=2, value_bits=4"),
        (get_format("k4v4").layout(64, 16), 3, CUDA, "head_dim=64"),
        (K4V4, 16, CUDA, "GQA groups of 1..8 query heads, got 16"),
        (K4V4, 4, torch.device("cpu"), "needs a CUDA device, got cpu"),
    ]:
        with pytest.raises(ValueError, match=f"impl='cuda': .*{match}.*use impl='triton'"):
            resolve_impl("cuda", layout, group, dev)
    with pytest.raises(ValueError, match="impl='cuda' takes no Triton launch options, got block_n, key_mma"):
        resolve_impl("cuda", K4V4, 4, CUDA, ("block_n", "key_mma"))
    with pytest.raises(ValueError, match=r"impl='fast'; allowed: None or 'auto', 'triton', 'cuda'"):
        resolve_impl("fast", K4V4, 4, CUDA)
    assert resolve_impl("auto", K4V4, 4, CUDA) == "cuda" and resolve_impl("auto", K4V4, 4, CUDA, ("dequant",)) == "triton"
    with pytest.raises(ValueError, match=r"impl='CUDA'; allowed: None or 'auto', 'triton', 'cuda'"):
        resolve_impl("CUDA", K4V4, 4, CUDA)
    capability((8, 6))
    assert resolve_impl("cuda", K4V4, 4, CUDA) == "cuda"
    capability((7, 5))
    with pytest.raises(ValueError, match="compute capability >= 8.0, got 7.5"):
        resolve_impl("cuda", K4V4, 4, CUDA)


def test_auto_takes_triton_with_a_warning_when_the_fatbin_cannot_load(capability, monkeypatch):
    """The default rule needs the fatbin to load (a driver older than its CUDA release cannot); then it runs Triton
    and says why once per device. impl="cuda" does not fall back (resolve_impl does not load; the launch raises)."""
    from kvrepro.ops import decode

    capability((9, 0))
    monkeypatch.setattr(decode, "_WARNED_LOAD", set())
    monkeypatch.setattr(cuda_decode, "load_error", lambda device: "cuModuleLoadData failed with CUDA error 222")
    with pytest.warns(RuntimeWarning, match=r"but cuModuleLoadData failed with CUDA error 222; running the Triton "
                                            r"kernel instead \(impl='triton' / KVREPRO_DECODE_IMPL=triton"):
        assert resolve_impl(None, K4V4, 4, CUDA) == "triton"
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")                                   # said once per device
        assert resolve_impl("auto", K4V4, 4, CUDA) == "triton"
    assert resolve_impl("cuda", K4V4, 4, CUDA) == "cuda"


def test_load_error_is_tried_once_per_device(monkeypatch):
    calls = []

    def failing(device, path=cuda_decode.FATBIN):
        calls.append(device)
        raise RuntimeError("kvrepro CUDA decode kernel: cuModuleLoadData failed with CUDA error 222")
    monkeypatch.setattr(cuda_decode, "load", failing)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_decode, "_MODULES", {})
    monkeypatch.setattr(cuda_decode, "_LOAD_ERRORS", {})
    assert "error 222" in cuda_decode.load_error(CUDA) and "error 222" in cuda_decode.load_error(CUDA)
    assert calls == [torch.device("cuda", 0)]


def test_rocm_is_refused(capability, monkeypatch):
    capability((9, 0))
    monkeypatch.setattr(torch.version, "hip", "6.2")
    assert resolve_impl(None, K4V4, 4, CUDA) == "triton"
    with pytest.raises(ValueError, match="built for NVIDIA GPUs, this PyTorch runs ROCm/HIP 6.2"):
        resolve_impl("cuda", K4V4, 4, CUDA)


def test_loader_errors_name_the_way_out(monkeypatch, tmp_path):
    """No CUDA driver library: a RuntimeError that names the Triton kernel as the alternative; the manifest
    names the CUDA release that built the fatbin; nvcc folders are ordered by version, not alphabetically."""
    import ctypes

    def no_lib(name):
        raise OSError(f"{name}: cannot open shared object file")
    monkeypatch.setattr(ctypes, "CDLL", no_lib)
    with pytest.raises(RuntimeError, match=r"cannot open the CUDA driver library libcuda.so.1 .*"
                                           r"use impl='triton' \(vLLM backend: KVREPRO_DECODE_IMPL=triton\)"):
        cuda_decode._Module(CUDA, cuda_decode.FATBIN)
    assert cuda_decode.built_by() == "CUDA 13.0"
    assert cuda_decode.built_by(str(tmp_path / "missing.json")).startswith("an unknown nvcc")
    folders = ["/usr/local/cuda/bin/nvcc", "/usr/local/cuda-9.2/bin/nvcc", "/usr/local/cuda-13.0/bin/nvcc",
               "/usr/local/cuda-12.8/bin/nvcc"]
    monkeypatch.setattr(cuda_build.glob, "glob", lambda pattern: list(folders))
    monkeypatch.setattr(cuda_build.shutil, "which", lambda name: None)
    monkeypatch.setattr(cuda_build.os.path, "isfile", lambda p: p in folders)
    monkeypatch.setattr(cuda_build.os, "access", lambda p, mode: True)
    assert cuda_build.find_nvcc() == "/usr/local/cuda-13.0/bin/nvcc"


def test_decode_attention_refuses_cuda_with_the_reason():
    gen = torch.Generator().manual_seed(0)
    pool = make_pool("k4v4", 2, 128, 16, 4, gen)
    q = torch.randn(1, 8, 128, generator=gen).to(DEV, torch.float16)
    bt = torch.zeros(1, 2, dtype=torch.int32, device=DEV)
    sl = torch.ones(1, dtype=torch.int32, device=DEV)
    want = ("impl='cuda': the CUDA decode kernel needs a CUDA device, got cpu" if DEV == "cpu"
            else "impl='cuda' takes no Triton launch options, got num_warps")
    with pytest.raises(ValueError, match=want):
        decode_attention(q, pool.data, bt, sl, pool.layout, pool.rotation, 128 ** -0.5, impl="cuda", num_warps=4)


def test_committed_fatbin_is_built_from_the_committed_source(tmp_path):
    """The manifest's hashes match the files (the sources' with comments stripped, the fatbin's); where an nvcc of
    the manifest's version exists, rebuilding gives the committed fatbin byte for byte (nvcc is deterministic for a
    fixed version and flags)."""
    info = cuda_decode.read_manifest()
    assert info[cuda_build.CODE_HASH_FIELD] == cuda_build.code_sha256(), \
        "decode.cu or page_layout.h changed (not only in comments): run python -m kvrepro.ops.cuda_build"
    assert info["sources"] == ["decode.cu", "page_layout.h"]
    assert info["fatbin_sha256"] == _sha(cuda_decode.FATBIN)
    assert info["kernels"] == [*cuda_decode.KERNELS.values(), *cuda_decode.ROPE_KERNELS.values()]
    assert info["gencode"] == list(cuda_build.GENCODE) and info["nvcc_flags"] == list(cuda_build.NVCC_FLAGS)
    for arch in ("sm_80", "sm_86", "sm_89", "sm_90"):   # the SASS measured or shipped before sm_100 / sm_120: no spills
        res = info["resources"][arch]
        assert all(res[k]["spill_stores"] == res[k]["spill_loads"] == 0 for k in cuda_decode.KERNELS.values()), arch
        # the rope-mean kernels: k8v4_rope none; k4v4_rope, k4v2_rope and k5v4_rope (two pages per step) up to 136
        # bytes at the 128-register cap (132 seen: k5v4_rope on sm_86 / sm_89): with both pair halves in one m16n8k16
        # and the second page at the first's angles they ran faster on the H200 than a rolled pair loop or one page
        # per step without spills (decode.cu, rope_add and ROPE_NEXT; the commits that added them give the times)
        rope = {k: res[cuda_decode.ROPE_KERNELS[k]] for k in cuda_decode.ROPE_KERNELS}
        assert rope[(8, 4)]["spill_stores"] == rope[(8, 4)]["spill_loads"] == 0, arch
        assert all(rope[b]["spill_stores"] <= 136 and rope[b]["spill_loads"] <= 136
                   for b in ((4, 4), (4, 2), (5, 4))), arch
        assert all(res[k]["registers"] <= 128 for k in res), arch
    assert cuda_build.check() == [] and cuda_build.main(["--check"]) == 0
    try:
        nvcc = cuda_build.find_nvcc()
    except FileNotFoundError:
        pytest.skip("no nvcc on this machine: byte-for-byte rebuild not checked")
    import subprocess
    version = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
    if version != info["nvcc_version"]:
        pytest.skip(f"nvcc here is {version!r}, the fatbin was built by {info['nvcc_version']!r}")
    got = cuda_build.build(nvcc, out=str(tmp_path / "k.fatbin"), manifest=str(tmp_path / "k.json"))
    assert filecmp.cmp(tmp_path / "k.fatbin", cuda_decode.FATBIN, shallow=False)
    assert got == info and not (tmp_path / "k.fatbin.tmp").exists()


def test_manifest_code_hash_ignores_comments_only():
    """``source_sha256_comments_stripped``: a comment, trailing whitespace or a blank line changes nothing; code does,
    and so does a string literal that looks like a comment."""
    src = '''#include "page_layout.h"  // layout
/* block
   comment */ constexpr int A = 1;   // why: a reason

asm("mov.u32 %0, 1; // not a comment");
const char c = '/';
'''
    same = src.replace("// why: a reason", "// why: another reason, longer").replace("block", "blk") + "\n\n   \n"
    assert cuda_build.code_text(same) == cuda_build.code_text(src)
    assert cuda_build.code_text(src) == ('#include "page_layout.h"\n  constexpr int A = 1;\n'
                                         'asm("mov.u32 %0, 1; // not a comment");\nconst char c = \'/\';\n')
    assert cuda_build.code_text(src.replace("A = 1", "A = 2")) != cuda_build.code_text(src)
    assert cuda_build.code_text(src.replace("// not", "// NOT")) != cuda_build.code_text(src)


def test_committed_page_layout_header_is_generated_from_the_formats(tmp_path):
    """``cuda/page_layout.h`` is ``page_layout_header()`` (from kvrepro.formats.layout: the one definition of the page
    layout), decode.cu includes it and instantiates one entry point per ``KERNELS`` name; ``check`` (``--check``)
    reports a header that differs, and ``write_header`` rewrites it."""
    with open(cuda_build.HEADER) as f:
        header = f.read()
    assert header == cuda_build.page_layout_header()
    assert header.startswith("// Generated by `python -m kvrepro.ops.cuda_build`") and "do not edit" in header
    for (kb, vb), lay in cuda_decode.LAYOUTS.items():
        assert lay == get_format(cuda_decode.PRESETS[kb, vb]).layout(128, 16)
        assert (f"struct PageLayout<{kb}, {vb}> {{  // {cuda_decode.PRESETS[kb, vb]}\n  static constexpr int PAGE = "
                f"{lay.page_bytes}, V_OFF = {lay.v_code_offset}, KM_OFF = {lay.k_meta_offset}, "
                f"VM_OFF = {lay.v_meta_offset};") in header
    with open(cuda_build.SOURCE) as f:
        src = f.read()
    assert '#include "page_layout.h"' in src
    for (kb, vb), name in cuda_decode.KERNELS.items():
        assert f"KVREPRO_ENTRY({name}, {kb}, {vb})" in src
        assert f"struct PageFmt<{kb}, {vb}> : PageLayout<{kb}, {vb}>" in src
    stale = tmp_path / "page_layout.h"
    stale.write_text(header.replace("PAGE = 2144", "PAGE = 2160"))
    problems = cuda_build.check(header=str(stale))
    assert any("not the header generated from kvrepro.formats.layout" in p for p in problems), problems
    assert any("differ from the sources the fatbin was built from" in p for p in problems), problems
    assert cuda_build.write_header(str(stale)) and stale.read_text() == header
    assert not cuda_build.write_header(str(stale))                     # already up to date: not rewritten
    man = tmp_path / "decode.json"
    shutil.copyfile(cuda_decode.MANIFEST, man)
    assert cuda_build.check(header=str(stale), manifest=str(man)) == []
    assert cuda_build.check(header=str(stale), manifest=str(man), fatbin=str(man)) == [
        f"{man} is not the fatbin the manifest names (fatbin_sha256)"]
    info = json.loads(man.read_text())                                 # a build setting changed, no rebuild
    man.write_text(json.dumps(info | {"gencode": info["gencode"][1:]}))
    assert cuda_build.check(header=str(stale), manifest=str(man)) == [
        f"the fatbin was built with gencode {info['gencode'][1:]}, this module asks for {info['gencode']}"]


def test_build_reports_nvcc_failure(tmp_path):
    with pytest.raises(FileNotFoundError, match="nvcc not found"):
        cuda_build.find_nvcc(str(tmp_path / "no-nvcc"))
    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\necho 'error: boom' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(RuntimeError, match=r"nvcc failed \(3\):[\s\S]*error: boom"):
        cuda_build.build(str(fake), out=str(tmp_path / "k.fatbin"), manifest=str(tmp_path / "k.json"))
    assert not list(tmp_path.glob("k.*")), "a failed build leaves no fatbin or manifest behind"


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv", [(32, 8), (24, 8), (8, 8), (16, 2), (16, 8), (40, 8), (56, 8)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("preset", ["k4v4", "k8v4", "k4v2", "k5v4"])
def test_cuda_matches_dequantized_reference(hq, hkv, dtype, num_splits, preset, ragged_batch):
    """Ragged lengths incl. 1 and a padding row (0), GQA 4 / 3 / 1 / 8 / 2 / 5 / 7, block ids at the top of the
    pool, poisoned output; every kernel (k4v4, k8v4, k4v2)."""
    gen = torch.Generator().manual_seed(hq * 7 + hkv)
    lens = [1, 5, 54, 97, 0, 8193]
    pool, bt, sl, _, _ = ragged_batch(preset, lens, hkv, 128, gen)
    q = torch.randn(len(lens), hq, 128, generator=gen).to(DEV, dtype)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, pool.data, bt, sl, pool.layout, pool.rotation, 128 ** -0.5, out=out, num_splits=num_splits,
                     impl="cuda")
    ref = paged_attention_ref(q, pool, bt, sl, torch.arange(len(lens) + 1, device=DEV), 128 ** -0.5, torch.float64)
    live = sl > 0
    tol = 5e-4 if dtype == torch.float16 else 4e-3      # the float16 query of both kernels; bf16 q rounds more
    assert relerr(out[live], ref[live]) < tol
    assert (out[~live] == 0).all()
    tri = decode_attention(q, pool.data, bt, sl, pool.layout, pool.rotation, 128 ** -0.5, num_splits=num_splits,
                           impl="triton")
    assert relerr(out, tri) < tol


def _filled(gen, lens, preset="k4v4"):
    """A poisoned 40-block ``preset`` pool (8 KV heads, head_dim 128) holding random sequences of ``lens`` tokens."""
    pool = make_pool(preset, 8, 128, 16, 40, gen)
    bt = block_tables(len(lens), 12, 40, gen)
    for b, n in enumerate(lens):
        if n:
            fill(pool, bt[b], n, gen, torch.bfloat16)
    return pool, bt


@pytest.mark.gpu
def test_cuda_nan_query_head_stays_nan():
    gen = torch.Generator().manual_seed(3)
    pool, bt = _filled(gen, [170, 170])
    q = torch.randn(2, 32, 128, generator=gen).to(DEV, torch.float16)
    q[1, 5, 7] = float("nan")
    sl = torch.tensor([170, 170], dtype=torch.int32, device=DEV)
    out = decode_attention(q, pool.data, bt, sl, pool.layout, pool.rotation, 128 ** -0.5, impl="cuda")
    ref = paged_attention_ref(q, pool, bt, sl, torch.arange(3, device=DEV), 128 ** -0.5, torch.float64)
    keep = torch.ones(2, 32, dtype=torch.bool, device=DEV)
    keep[1, 5] = False
    assert torch.isnan(out[1, 5]).all() and torch.isfinite(out[keep]).all()
    assert relerr(out[keep], ref[keep]) < 5e-4


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["k4v4", "k8v4", "k4v2", "k5v4"])
def test_cuda_kernel_is_graph_capturable(preset):
    """Launched on PyTorch's current stream: a captured CUDA graph replays it with new query values."""
    gen = torch.Generator().manual_seed(4)
    pool, bt = _filled(gen, [150, 151, 152], preset)
    sl = torch.tensor([150, 151, 152], dtype=torch.int32, device=DEV)
    q = torch.randn(3, 32, 128, generator=gen).to(DEV, torch.bfloat16)
    out = torch.empty_like(q)
    ws = torch.empty(1 << 20, dtype=torch.float32, device=DEV)
    call = lambda: decode_attention(q, pool.data, bt, sl, pool.layout, pool.rotation, 128 ** -0.5, out=out,  # noqa: E731
                                    num_splits=2, workspace=ws, impl="cuda")
    call()                                   # loads the module outside capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    q.copy_(torch.randn(3, 32, 128, generator=gen).to(DEV, torch.bfloat16))
    g.replay()
    torch.cuda.synchronize()
    ref = paged_attention_ref(q, pool, bt, sl, torch.arange(4, device=DEV), 128 ** -0.5, torch.float64)
    assert relerr(out, ref) < 4e-3


def test_cuda_split_rule():
    """Exact batches: one wave of the kernel's resident CTAs per SM (the CPU: the H200 model, 4 for every kernel), any
    integer count; padded (a graph serving a range of batches): at most CUDA_PROGRAMS_PER_SM CTAs per SM (power of two,
    rounded down), at least CUDA_MIN_SPLITS. Both: each split >= 256 tokens, <= 256 splits; the CPU counts as 132 SMs
    (an H200)."""
    from kvrepro.ops.decode import default_num_splits

    cpu = torch.device("cpu")
    got = {b: default_num_splits(b, 8, 131072, cpu, "cuda") for b in (1, 3, 6, 13, 64, 66, 200)}
    assert got == {1: 66, 3: 22, 6: 11, 13: 5, 64: 1, 66: 1, 200: 1}   # 4 * 132 // (b * 8)
    got = {b: default_num_splits(b, 8, 131072, cpu, "cuda", padded=True) for b in (1, 3, 6, 13, 64)}
    assert got == {1: 128, 3: 64, 6: 32, 13: 32, 64: 32}            # 12 * 132 // (b * 8) = 198, 66, 33, 15, 3
    assert {b: default_num_splits(b, 8, 131072, cpu) for b in (1, 3, 6, 13)} == {1: 256, 3: 256, 6: 128, 13: 64}
    assert default_num_splits(1, 8, 4096, cpu, "cuda") == 16                 # 4096 / 256 tokens per split
    assert default_num_splits(1, 1, 10 ** 7, cpu, "cuda") == 256
    with pytest.raises(ValueError, match="impl='gpu'; allowed: 'triton', 'cuda'"):
        default_num_splits(1, 8, 4096, cpu, "gpu")


def test_runtime_uses_the_split_rule_of_its_kernel(monkeypatch):
    """The vLLM runtime counts splits with the rule of the kernel it resolved; its workspace reservation
    covers both rules."""
    from kvrepro.ops.decode import decode_workspace_numel, default_num_splits
    from kvrepro.vllm_backend.runtime import LayerRuntime, decode_splits

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_decode, "load_error", lambda device: None)
    cpu = torch.device("cpu")
    rt = LayerRuntime("k4v4", 32, 8, 128, 0.088, graph_sizes=(1, 2, 4, 8, 16), max_batch=16)
    assert rt.splits(16, 131072, cpu) == decode_splits(16, 8, 131072, cpu, (1, 2, 4, 8, 16)) == 64   # triton rule
    assert rt.record_impl(get_format("k4v4").layout(128, 16), torch.device("cuda", 0)) == "cuda"
    # graph size 16 serves 9..16 rows: the padded rule, counted for 9
    assert rt.splits(16, 131072, cpu) == default_num_splits(9, 8, 131072, cpu, "cuda", padded=True) == 32
    assert rt.splits(1, 131072, cpu) == 66             # graph size 1 serves exactly 1 row: one wave
    assert rt.splits(2, 131072, cpu) == 33
    assert rt.splits(13, 131072, cpu) == 5             # not a capture size: an eager, exact batch
    big = LayerRuntime("k4v4", 32, 8, 128, 0.088, graph_sizes=(1, 2, 4, 8, 16), max_batch=64)
    triton_only = max(decode_workspace_numel(b, 32, 128, big.splits(b, 65536, cpu, "triton")) for b in range(1, 65))
    need_cuda = max(decode_workspace_numel(b, 32, 128, big.splits(b, 65536, cpu, "cuda")) for b in range(1, 65))
    assert need_cuda == decode_workspace_numel(16, 32, 128, 32)        # graph 16, padded rule
    assert big.reserve_numel(cpu) == max(need_cuda, triton_only)      # covers whichever kernel resolves


@pytest.mark.gpu
@pytest.mark.parametrize("forced", [None, (30, 200)])
@pytest.mark.parametrize("preset", ["k4v4", "k8v4", "k4v2", "k5v4"])
def test_cuda_splits_partition_the_sequence(forced, preset, monkeypatch):
    """Each split's log-sum-exp (the workspace's part_lse, log2) is that of its own tokens only: whole 16-token pages
    cut as ``cuda_decode.split_pages`` says (weighted by round of placement; decode.cu split_weight_prefix), empty
    splits -inf. A kernel whose splits each read the whole sequence would still merge to the right output, and one
    that cut the pages elsewhere would too; this catches both. ``forced``: ``(rank_div, rank_skew)`` handed to the
    kernel instead of ``rank_args``'s (120 CTAs all sit in round 0 of 132 SMs), so that the weights differ (rounds
    change every 30 block indices: every KV head's 5 splits span several)."""
    from kvrepro.ops import cuda_decode

    if forced is not None:
        monkeypatch.setattr(cuda_decode, "rank_args", lambda *a: forced)
    from kvrepro.ops.decode import LOG2E, decode_workspace_numel

    gen = torch.Generator().manual_seed(6)
    lens, hq, hkv, splits = [1000, 37, 16], 32, 8, 5
    maxb = 64
    pool = make_pool(preset, hkv, 128, 16, len(lens) * maxb + 3, gen)
    bt = block_tables(len(lens), maxb, len(lens) * maxb + 3, gen)
    for b, n in enumerate(lens):
        fill(pool, bt[b], n, gen, torch.bfloat16)
    q = torch.randn(len(lens), hq, 128, generator=gen).to(DEV, torch.float16)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    ws = torch.full((decode_workspace_numel(len(lens), hq, 128, splits),), float("nan"), device=DEV)
    decode_attention(q, pool.data, bt, sl, pool.layout, pool.rotation, 128 ** -0.5, num_splits=splits, workspace=ws,
                     impl="cuda")
    n_o = len(lens) * hq * splits * 128
    lse = ws[n_o:n_o + len(lens) * hq * splits].view(len(lens), hq, splits).double()
    for b, n in enumerate(lens):
        k, _ = pool.gather(bt[b], n)                                     # dequantized keys [n, Hkv, D]
        k = k.double().repeat_interleave(hq // hkv, dim=1)               # [n, Hq, D]
        logits = torch.einsum("hd,nhd->hn", q[b].double(), k) * 128 ** -0.5 * LOG2E
        rank_div, skew = cuda_decode.rank_args(DEV, len(lens), hkv, splits)
        assert skew == (cuda_decode.RANK_SKEW if forced is None else 200)   # 120 CTAs: one wave, skew applies
        for kvh in range(hkv):
            pages = cuda_decode.split_pages(n, splits, b, kvh, len(lens), hkv, rank_div, skew)
            if forced is not None and n == 1000:                            # the skew moves the cuts here
                assert pages != cuda_decode.split_pages(n, splits, b, kvh, len(lens), hkv, rank_div, 0), pages
            check_split_lse(lse[b, kvh * (hq // hkv):(kvh + 1) * (hq // hkv)], logits[kvh * (hq // hkv):
                            (kvh + 1) * (hq // hkv)], pages, n, (b, kvh))


def check_split_lse(lse, logits, pages, n, where):
    """``lse [group, S]`` (log2) against the log-sum-exp of ``logits [group, n]`` (log2 units) over each split's
    ``pages`` (``split_pages``'s ``(first, end)``, 16 tokens each); an empty split must be -inf."""
    from kvrepro.ops.decode import LOG2E

    for s_, (p0, p1) in enumerate(pages):
        lo, hi = p0 * 16, min(p1 * 16, n)
        want = torch.logsumexp(logits[:, lo:hi] / LOG2E, dim=1) * LOG2E if hi > lo else None
        got = lse[:, s_]
        if hi > lo:
            assert (got - want).abs().max() < 0.05, (where, s_, lo, hi)   # log2 units; float16 query digits
        else:
            assert torch.isneginf(got).all(), (where, s_)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["k4v4", "k8v4", "k4v2", "k5v4"])
def test_cuda_pool_over_2_gib_and_unaligned_pool(preset):
    """Block ids whose byte offset passes 2**31 give the same output as low block ids (int64 offsets); a pool that
    does not start on a 16-byte boundary is refused (cp.async copies 16-byte chunks)."""
    gen = torch.Generator().manual_seed(8)
    layout = get_format(preset).layout(128, 16)
    nb = (2 ** 31) // (8 * layout.page_bytes) + 64                      # > 2 GiB of pages
    pool = get_format(preset).new_pool(nb, 8, 128, 16, device=DEV)
    n = 300
    low = torch.arange(0, 19, dtype=torch.int32, device=DEV)
    high = torch.arange(nb - 19, nb, dtype=torch.int32, device=DEV)
    assert int(high[-1]) * 8 * layout.page_bytes > 2 ** 31
    k = torch.randn(n, 8, 128, generator=gen).to(DEV, torch.bfloat16)
    v = torch.randn(n, 8, 128, generator=gen).to(DEV, torch.bfloat16)
    pos = torch.arange(n, device=DEV)
    from kvrepro.ops import store_kv
    for row in (low, high):
        store_kv(k, v, pool.data, (row[pos // 16].long() * 16 + pos % 16).to(torch.int32), pool.layout, pool.rotation)
    q = torch.randn(1, 32, 128, generator=gen).to(DEV, torch.bfloat16)
    sl = torch.tensor([n], dtype=torch.int32, device=DEV)
    o_low = decode_attention(q, pool.data, low[None], sl, pool.layout, pool.rotation, 128 ** -0.5, impl="cuda")
    o_high = decode_attention(q, pool.data, high[None], sl, pool.layout, pool.rotation, 128 ** -0.5, impl="cuda")
    assert torch.equal(o_low, o_high) and torch.isfinite(o_low).all()
    rot = pool.rotation
    del pool
    raw = torch.zeros(4 * 8 * layout.page_bytes + 8, dtype=torch.uint8, device=DEV)
    shifted = raw[8:].view(4, 8, layout.page_bytes)
    with pytest.raises(ValueError, match="pool must start on a 16-byte boundary"):
        decode_attention(q, shifted, low[None, :1], torch.ones(1, dtype=torch.int32, device=DEV), layout, rot,
                         128 ** -0.5, impl="cuda")


def test_rotation_signs_accepts_only_the_hadamard_form():
    """The fused kernel applies the rotation as a Walsh-Hadamard transform with signs: rotation_signs returns those
    signs for kvrepro's rotation (any seed) and refuses any other orthogonal matrix (runs on the CPU)."""
    from kvrepro.formats.hadamard import rotation_matrix, rotation_signs

    for seed in (0, 3):
        r = rotation_matrix(128, seed)
        assert torch.equal(cuda_decode.rotation_signs(r), rotation_signs(128, seed))
        assert cuda_decode.rotation_signs(r) is cuda_decode.rotation_signs(r)        # checked once, then cached
    other = torch.linalg.qr(torch.randn(128, 128, generator=torch.Generator().manual_seed(1)))[0].float().contiguous()
    with pytest.raises(ValueError, match="rotation must be diag\\(s\\) H / sqrt\\(head_dim\\)"):
        cuda_decode.rotation_signs(other)
    r = rotation_matrix(128, 0).clone()
    cuda_decode.rotation_signs(r)
    r[3, 5] += 0.01                                              # changed in place: checked again, refused
    with pytest.raises(ValueError, match="Sylvester Hadamard"):
        cuda_decode.rotation_signs(r)


@pytest.mark.gpu
def test_cuda_strided_query_and_output_and_mixed_dtypes():
    """The kernel reads the query and writes the output through their strides (a slice of a wider buffer, as vLLM's
    [tokens, heads * head_dim] views), in float16 or bfloat16 independently, and leaves the rest of the buffer alone."""
    gen = torch.Generator().manual_seed(9)
    pool, bt = _filled(gen, [190, 77, 16])
    sl = torch.tensor([190, 77, 16], dtype=torch.int32, device=DEV)
    ref = None
    for qd, od in ((torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16)):
        wide = torch.randn(3, 40, 128, generator=gen).to(DEV, qd)
        q = wide[:, 4:36]                                           # strides (5120, 128, 1)
        assert not q.is_contiguous()
        obuf = torch.full((5, 34, 128), 7.0, device=DEV, dtype=od)
        out = obuf[1:4, 2:]
        decode_attention(q, pool.data, bt, sl, pool.layout, pool.rotation, 128 ** -0.5, out=out, impl="cuda")
        ref = paged_attention_ref(q.contiguous(), pool, bt, sl, torch.arange(4, device=DEV), 128 ** -0.5,
                                  torch.float64)
        assert relerr(out, ref) < (5e-4 if qd == torch.float16 else 4e-3) + (4e-3 if od == torch.bfloat16 else 5e-4)
        untouched = torch.ones(5, 34, dtype=torch.bool, device=DEV)
        untouched[1:4, 2:] = False
        assert (obuf[untouched] == 7.0).all()


@pytest.mark.gpu
def test_cuda_split_counters_return_to_zero_and_calls_repeat_exactly():
    """The last CTA of each (sequence, KV head) merges and resets its arrival counter: after any launch the counters
    are zero again, so back-to-back launches (and graph replays) give bit-identical outputs, at every split count."""
    gen = torch.Generator().manual_seed(10)
    lens = [170, 1, 0]                                          # _filled holds up to 3 rows of <= 192 tokens
    pool, bt = _filled(gen, lens)
    sl = torch.tensor(lens, dtype=torch.int32, device=DEV)
    q = torch.randn(3, 32, 128, generator=gen).to(DEV, torch.bfloat16)
    ref = paged_attention_ref(q, pool, bt, sl, torch.arange(4, device=DEV), 128 ** -0.5, torch.float64)
    live = sl > 0
    for s in (1, 2, 7, 22, 64):
        outs = [decode_attention(q, pool.data, bt, sl, pool.layout, pool.rotation, 128 ** -0.5, num_splits=s,
                                 impl="cuda") for _ in range(3)]
        torch.cuda.synchronize()
        assert (cuda_decode.split_counters(DEV, 32) == 0).all(), s
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2]), s
        assert relerr(outs[0][live], ref[live]) < 4e-3 and (outs[0][~live] == 0).all(), s


@pytest.mark.gpu
def test_cuda_unchecked_rotation_refused_during_capture(monkeypatch):
    """A rotation tensor never seen eagerly cannot be checked inside graph capture (the check syncs): refused with
    a message that says to run it once eagerly; one seen before is served from the cache."""
    from kvrepro.formats.hadamard import rotation_matrix

    seen = rotation_matrix(128, 0, DEV).clone()
    cuda_decode.rotation_signs(seen)
    fresh = rotation_matrix(128, 0, DEV).clone()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert cuda_decode.rotation_signs(seen).device == seen.device
    with pytest.raises(RuntimeError, match="run decode_attention once eagerly"):
        cuda_decode.rotation_signs(fresh)


@pytest.mark.gpu
def test_cuda_refuses_more_splits_than_its_merge_holds():
    """impl='cuda' merges in the kernel, holding num_splits x group weights in shared memory: more is refused with
    the limit named."""
    pool = get_format("k4v4").new_pool(4, 8, 128, 16, device=DEV)
    q = torch.zeros(1, 32, 128, dtype=torch.bfloat16, device=DEV)
    bt = torch.zeros(1, 4, dtype=torch.int32, device=DEV)
    sl = torch.ones(1, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match=r"num_splits must be <= 1024 \(4096 // GQA group 4\) for impl='cuda'"):
        decode_attention(q, pool.data, bt, sl, pool.layout, pool.rotation, 128 ** -0.5, num_splits=1025, impl="cuda")


def test_rotation_signs_refuses_wrong_shapes_and_dtypes():
    from kvrepro.formats.hadamard import rotation_matrix

    r = rotation_matrix(128, 0)
    for bad in (r[None], r.double(), r.half(), r[:, :64], "R"):
        with pytest.raises(ValueError, match=r"rotation must be a float32 \[D, D\] tensor"):
            cuda_decode.rotation_signs(bad)


def test_cuda_helpers_refuse_a_cpu_device(monkeypatch):
    """A CPU device, or a CUDA device that this PyTorch cannot see, gets a message, not an assertion from torch."""
    assert cuda_decode.load_error(torch.device("cpu")) == "the CUDA decode kernel needs a CUDA device, got cpu"
    with pytest.raises(ValueError, match="needs a CUDA device, got cpu"):
        cuda_decode.load("cpu")
    with pytest.raises(ValueError, match="layout must be a kvrepro PageLayout .*got NoneType"):
        cuda_decode.unsupported_reason(None, 4, "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cuda_decode.load_error("cuda") == cuda_decode.unsupported_reason(K4V4, 4, "cuda") == \
        "the CUDA decode kernel needs a CUDA device, this PyTorch sees none (cuda requested)"
    with pytest.raises(RuntimeError, match="this PyTorch sees none"):
        cuda_decode.load("cuda")
    with pytest.raises(ValueError, match="split_counters needs a CUDA device, got cpu"):
        cuda_decode.split_counters("cpu", 8)


def test_split_pages_partition_properties():
    """``split_pages`` (the kernel's partition, checked against the kernel by the GPU test above): the splits tile the
    pages in order; with skew 0 their sizes differ by at most one page; with a skew, a split of an earlier round never
    holds fewer pages than one of a later round minus one (integer cuts); each split holds its weight's share of the
    pages within one page (weights from the definition: 1024 - skew x min(L // rank_div, 3)). Bad rank arguments are
    refused."""
    from fractions import Fraction

    from kvrepro.ops import cuda_decode

    for seq_len, s, batch, hkv, div, skew in [(131072, 22, 3, 8, 132, 48), (131072, 66, 1, 8, 132, 48),
                                              (1000, 5, 3, 8, 5, 200), (1, 7, 2, 2, 3, 255), (8193, 11, 6, 8, 132, 0),
                                              (54, 13, 1, 3, 1, 100)]:
        pages = -(-seq_len // 16)
        for b in range(batch):
            for kvh in range(hkv):
                parts = cuda_decode.split_pages(seq_len, s, b, kvh, batch, hkv, div, skew)
                assert parts[0][0] == 0 and parts[-1][1] == pages
                assert all(parts[i][1] == parts[i + 1][0] for i in range(s - 1))
                sizes = [p1 - p0 for p0, p1 in parts]
                assert min(sizes) >= 0
                w = [1024 - skew * min((i * batch * hkv + kvh * batch + b) // div, 3) for i in range(s)]
                for size, wi in zip(sizes, w):
                    assert abs(Fraction(pages * wi, sum(w)) - size) < 1, (size, wi, sum(w), pages)
                if skew == 0:
                    assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="rank_skew must be an int in 0..255, got 256"):
        cuda_decode.split_pages(100, 4, 0, 0, 1, 8, 132, 256)
    with pytest.raises(ValueError, match="rank_div must be an int in 1..65535"):
        cuda_decode.split_pages(100, 4, 0, 0, 1, 8, 0, 48)
    for args, match in [((100, 0, 0, 0, 1, 8), "num_splits must be an int >= 1, got 0"),
                        ((100, 4, 1, 0, 1, 8), "b must be an int in 0..0, got 1"),
                        ((100, 4, 0, 8, 1, 8), "kvh must be an int in 0..7, got 8"),
                        ((-1, 4, 0, 0, 1, 8), "seq_len must be an int in 0..2147483632 .*got -1"),
                        ((2 ** 31 - 15, 4, 0, 0, 1, 8), "seq_len must be an int in 0..2147483632"),
                        ((100, 4097, 0, 0, 1, 8), "num_splits must be <= 4096 .*got 4097")]:
        with pytest.raises(ValueError, match=match):
            cuda_decode.split_pages(*args, 132, 48)


def _weight_prefix_cpp(s, c, p, rank_div, rank_skew):
    """decode.cu ``split_weight_prefix`` transcribed literally: unsigned 32-bit arithmetic (wrapping mod 2^32,
    which the caller's ranges never reach) and C++ unsigned division."""
    m32 = (1 << 32) - 1
    w = (1024 * s) & m32
    for j in (1, 2, 3):
        first = (((j * rank_div) & m32) + ((p - 1 - c) & m32)) & m32
        first //= p
        w = (w - rank_skew * max(0, s - first)) & m32
    return w


def test_split_pages_equals_the_kernels_closed_form():
    """``split_pages`` (sum of weights) and the kernel's closed form (``_weight_prefix_cpp``: cut at ``pages x W(s) /
    W(S)``) give the same pages for every split: exhaustively on small grids, then on random large cases."""
    import random

    from kvrepro.ops import cuda_decode

    def kernel_pages(seq_len, s_all, b, kvh, batch, hkv, div, skew):
        # the kernel's cut: (int)((double)pages * (double)W(s) / (double)W(S)), IEEE double like Python's float
        pages = -(-seq_len // 16)
        c, p = kvh * batch + b, batch * hkv
        w_all = float(_weight_prefix_cpp(s_all, c, p, div, skew))
        return [(int(float(pages) * float(_weight_prefix_cpp(s, c, p, div, skew)) / w_all),
                 int(float(pages) * float(_weight_prefix_cpp(s + 1, c, p, div, skew)) / w_all)) for s in range(s_all)]

    cases = [(seq_len, s_all, b, kvh, batch, hkv, div, skew)
             for seq_len in (0, 1, 16, 17, 100) for s_all in (1, 3, 9) for batch in (1, 2) for hkv in (1, 3)
             for b in range(batch) for kvh in range(hkv) for div in (1, 2, 5, 132) for skew in (0, 48, 255)]
    rng = random.Random(11)
    for _ in range(3000):
        batch, hkv = rng.randint(1, 16), rng.randint(1, 8)
        cases.append((rng.randint(0, 1 << 20), rng.randint(1, 300), rng.randrange(batch), rng.randrange(hkv), batch,
                      hkv, rng.randint(1, 200), rng.randint(0, 255)))
    for _ in range(300):                 # the largest ranges: seq_len to 2^31 - 16 (the kernel's int page count),
        batch, hkv = rng.randint(1, 64), rng.randint(1, 64)          # 4096 splits, rank_div up to 65535
        cases.append((rng.randint((1 << 31) - (1 << 20), (1 << 31) - 16), rng.choice((1, 2, 3, 4095, 4096)),
                      rng.randrange(batch), rng.randrange(hkv), batch, hkv, rng.choice((1, 132, 65535)),
                      rng.randint(0, 255)))
    for case in cases:
        assert cuda_decode.split_pages(*case) == kernel_pages(*case), case


def test_rank_args_skews_only_one_wave_on_hopper(monkeypatch):
    """The skew goes to grids of at most one wave (4 CTAs per SM) on compute capability 9.x; multi-wave grids, other
    GPUs and the CPU get equal splits; a RANK_SKEW outside 0..255 and an SM count past 65535 are refused."""
    from kvrepro.ops import cuda_decode

    monkeypatch.setattr(cuda_decode, "sm_count", lambda device: 132)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_decode, "ctas_per_sm", lambda device, bits=None: 4)     # the H200's residency
    cap = {"v": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap["v"])
    assert cuda_decode.rank_args(CUDA, 3, 8, 22) == (132, cuda_decode.RANK_SKEW)       # 528 CTAs = one wave
    assert cuda_decode.rank_args(CUDA, 3, 8, 23) == (132, 0)                           # 552 CTAs
    assert cuda_decode.rank_args(torch.device("cpu"), 3, 8, 22) == (132, 0)
    cap["v"] = (8, 0)
    assert cuda_decode.rank_args(CUDA, 3, 8, 22) == (132, 0)
    monkeypatch.setattr(cuda_decode, "RANK_SKEW", 400)
    with pytest.raises(ValueError, match="RANK_SKEW must be an int in 0..255, got 400"):
        cuda_decode.rank_args(CUDA, 3, 8, 22)
    monkeypatch.setattr(cuda_decode, "RANK_SKEW", 48)
    monkeypatch.setattr(cuda_decode, "sm_count", lambda device: 70000)       # past the kernel's 32-bit weights
    with pytest.raises(ValueError, match=r"rank_div must be an int in 1\.\.65535 .*got 70000"):
        cuda_decode.rank_args(CUDA, 3, 8, 22)


def test_launch_refuses_a_page_size_of_another_kernel():
    """``LAYOUTS`` are kvrepro.formats' page layouts of k4v4, k8v4, k4v2 and k5v4 (2,144 / 3,168 / 1,632 / 2,352
    bytes); a pool
    whose page size is not the layout of ``(key_bits, value_bits)`` is refused before anything runs (CPU tensors: the
    check comes first)."""
    from kvrepro.ops import cuda_decode

    assert [v.page_bytes for v in cuda_decode.LAYOUTS.values()] == [2144, 3168, 1632, 2352]
    for preset in ("k4v4", "k8v4", "k4v2", "k5v4"):
        layout = get_format(preset).layout(128, 16)
        bits = (layout.key_bits, layout.value_bits)
        assert cuda_decode.LAYOUTS[bits] == layout
        assert cuda_decode.PRESETS[bits] == preset and cuda_decode.KERNELS[bits] == f"kvrepro_decode_{preset}"
    q = torch.zeros(1, 32, 128, dtype=torch.bfloat16)
    args = [torch.zeros(1, 4, dtype=torch.int32), torch.ones(1, dtype=torch.int32), torch.zeros(1 << 16),
            torch.zeros(64), q, 0.088, 2, 8, 4]
    pool = torch.zeros(4, 8, get_format("k4v2").layout(128, 16).page_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"pool pages must be 2144 bytes for k4v4 \(key_bits=4, value_bits=4.*got 1632"):
        cuda_decode.launch(q, torch.eye(128), pool, *args, key_bits=4, value_bits=4)
    pool = torch.zeros(4, 8, get_format("k4v4").layout(128, 16).page_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"pool pages must be 1632 bytes for k4v2 \(key_bits=4, value_bits=2.*got 2144"):
        cuda_decode.launch(q, torch.eye(128), pool, *args, key_bits=4, value_bits=2)


def test_launch_and_helpers_check_their_arguments_first():
    """Bad sizes, a rotation of another head_dim, a CPU pool and a GQA group outside 1..8 are refused by name before
    any CUDA call; the build command refuses --check with --nvcc (usage, exit 2), and a missing nvcc is one line,
    exit 1."""
    from kvrepro.ops import cuda_decode

    q = torch.zeros(1, 32, 128, dtype=torch.bfloat16)
    pool = torch.zeros(4, 8, 2144, dtype=torch.uint8)
    args = [torch.zeros(1, 4, dtype=torch.int32), torch.ones(1, dtype=torch.int32), torch.zeros(1 << 16),
            torch.zeros(64), q, 0.088]
    with pytest.raises(ValueError, match=r"rotation must be a \[128, 128\] tensor.*got \(64, 64\)"):
        cuda_decode.launch(q, torch.eye(64), pool, *args, 2, 8, 4, key_bits=4, value_bits=4)
    with pytest.raises(ValueError, match=r"\(key_bits, value_bits\) must be one of \(4, 4\) \(k4v4\), \(8, 4\) "
                                         r"\(k8v4\), \(4, 2\) \(k4v2\), \(5, 4\) \(k5v4\) for the CUDA decode kernel, "
                                         r"got \(2, 4\)"):
        cuda_decode.launch(q, torch.eye(128), pool, *args, 2, 8, 4, key_bits=2, value_bits=4)
    with pytest.raises(ValueError, match="pool pages must be 3168 bytes for k8v4.*got 2144"):
        cuda_decode.launch(q, torch.eye(128), pool, *args, 2, 8, 4, key_bits=8, value_bits=4)
    with pytest.raises(ValueError, match="pool must be on a CUDA device.*got cpu"):
        cuda_decode.launch(q, torch.eye(128), pool, *args, 2, 8, 4, key_bits=4, value_bits=4)
    for splits, group, match in [(2, 0, "must be an int in 1..8 for impl='cuda', got 0"),
                                 (0, 4, "num_splits must be an int >= 1"),
                                 (-5, 8, "num_splits must be an int >= 1, got -5"),
                                 (5000, 1, "num_splits must be <= 4096")]:
        with pytest.raises(ValueError, match=match):
            cuda_decode.check_splits(splits, group)
    for bad in [(0, 8, 22), (3, 8, 2.5), (True, 8, 22)]:
        with pytest.raises(ValueError, match="must be an int >= 1"):
            cuda_decode.rank_args("cpu", *bad)
    with pytest.raises(ValueError, match="rank_div must be an int in 1..65535"):
        cuda_decode.split_pages(100, 4, 0, 0, 1, 8, True, 48)
    assert cuda_decode.unsupported_reason(get_format("k8v4").layout(128, 16), 4, "cpu").endswith("got cpu")
    assert cuda_build.main(["--check", "--nvcc", "/usr/bin/nvcc"]) == 2
    assert cuda_build.main(["--nvcc", "/nonexistent/nvcc"]) == 1


class _FakeDriver:
    """Stands in for libcuda in ``_Module._dyn_smem``: ``cuModuleGetGlobal_v2`` answers ``rc`` with a symbol of
    ``size`` bytes, ``cuMemcpyDtoH_v2`` writes ``value`` or fails with ``copy_rc``."""

    def __init__(self, rc=0, size=4, value=0, copy_rc=0):
        self.rc, self.size, self.value, self.copy_rc = rc, size, value, copy_rc

    def cuModuleGetGlobal_v2(self, ptr, size, module, name):
        import ctypes
        ctypes.cast(size, ctypes.POINTER(ctypes.c_size_t))[0] = self.size
        return self.rc

    def cuMemcpyDtoH_v2(self, dst, src, n):
        import ctypes
        if not self.copy_rc:
            ctypes.cast(dst, ctypes.POINTER(ctypes.c_int))[0] = self.value
        return self.copy_rc

    def cuGetErrorName(self, rc, name):
        return 1                                                   # unknown to the driver: _ERRORS names it


def test_dynamic_shared_memory_symbol_is_read_or_refused():
    """``_Module._dyn_smem`` (no GPU: a fake driver): the value of ``<name>_dyn_smem``; a build without the symbol
    counts as 0 only for an explicit kernel subset (older benchmark builds), never for the committed kernels, where it
    would launch a dynamic ring with no shared memory; a symbol of the wrong size or a failed copy is an error that
    names the symbol and the driver's error."""
    mod = object.__new__(cuda_decode._Module)
    mod.module = None
    mod.lib = _FakeDriver(value=50688)
    assert mod._dyn_smem("kvrepro_decode_k8v4", missing_ok=False) == 50688
    mod.lib = _FakeDriver(rc=500)
    assert mod._dyn_smem("kvrepro_decode_k4v4", missing_ok=True) == 0
    with pytest.raises(RuntimeError, match=r"kvrepro_decode_k4v4_dyn_smem not found in the fatbin \(CUDA error 500 "
                                           r"\(CUDA_ERROR_NOT_FOUND\)\); rebuild it"):
        mod._dyn_smem("kvrepro_decode_k4v4", missing_ok=False)
    mod.lib = _FakeDriver(size=8)
    with pytest.raises(RuntimeError, match="kvrepro_decode_k4v2_dyn_smem is 8 bytes, expected a 4-byte int"):
        mod._dyn_smem("kvrepro_decode_k4v2", missing_ok=True)
    mod.lib = _FakeDriver(copy_rc=700)
    with pytest.raises(RuntimeError, match=r"cannot read kvrepro_decode_k4v2_dyn_smem \(CUDA error 700"):
        mod._dyn_smem("kvrepro_decode_k4v2", missing_ok=True)


def _direct_codes(page, layout, region, bits):
    """[16 tokens, 128 channels] codes of a region (``"k"`` / ``"v"``) of a split-plane page, decoded directly: byte
    j of a token holds channel j + i P in bits [i bits, (i + 1) bits) (``P`` bytes per token)."""
    lo, hi = ((layout.k_code_offset, layout.v_code_offset) if region == "k"
              else (layout.v_code_offset, layout.k_meta_offset))
    codes = page[lo:hi].reshape(16, -1)
    mask = (1 << bits) - 1
    return np.concatenate([(codes >> (i * bits)) & mask for i in range(8 // bits)], 1).astype(np.int64)


def test_emulated_key_logits_equal_the_direct_dot_product():
    """k4v4 keys (emulated lane by lane, tests/cuda_emulation.py): the swizzled copy, ldmatrix, the int8 planes
    16 (code - 8) and two int8 MMA chains of the query digits give exactly the int32 dot products of the direct decode,
    16 tokens x 8 heads (GQA 4: heads 4-7 are padding, zero)."""
    rng = np.random.default_rng(0)
    page = emu.random_page(rng, emu.K4V4)
    qi = rng.integers(-16255, 16256, size=(8, 128))
    qi[4:] = 0
    qh = (qi + 64) >> 7                                     # the kernel's two digits: qi = 128 qh + ql
    ql = qi - (qh << 7)
    chi, clo = emu.key_dot(emu.to_smem(page), emu.query_fragments(qh), emu.query_fragments(ql))
    got = emu.logits_from_fragments(chi * 128 + clo)
    assert np.array_equal(got, 16 * (_direct_codes(page, emu.K4V4, "k", 4) - 8) @ qi.T)


def test_emulated_k5v4_key_logits_equal_the_direct_dot_product():
    """k5v4 keys (emulated): the high plane through k4v4's int8 planes and the low plane's bits moved to bit 3 give,
    in the same two chains, exactly 8 (code - 16) . qi, code = 2 hi + lo of the direct decode (kvrepro.formats'
    unpack_codes), so s = S_q / 8 ks acc + sum(q) ks / 2 = q . (code - 15.5) ks; the 80-byte rows read conflict-free."""
    from kvrepro.formats.compressed import unpack_codes

    rng = np.random.default_rng(5)
    page = emu.random_page(rng, emu.K5V4)
    qi = rng.integers(-16255, 16256, size=(8, 128))
    qi[5:] = 0
    qh = (qi + 64) >> 7
    ql = qi - (qh << 7)
    chi, clo, ways = emu.key_dot_k5v4(page, emu.query_fragments(qh), emu.query_fragments(ql))
    got = emu.logits_from_fragments(chi * 128 + clo)
    codes = unpack_codes(torch.from_numpy(page[:emu.K5V4.v_code_offset].reshape(16, 80).copy()), 5).numpy()
    assert codes.shape == (16, 128) and codes.max() == 31 and codes.min() == 0
    assert np.array_equal(got, 8 * (codes.astype(np.int64) - 16) @ qi.T)
    assert ways == 1


def test_emulated_values_equal_the_direct_weighted_sum():
    """k4v4 and k4v2 values (emulated): ldmatrix.trans, the float16 magic-number unpack and the P^T fragments from
    movmatrix give sum over tokens of w (code - mid) per head and channel, to float64 rounding; the page regions
    the emulation reads are where kvrepro.formats' pool puts them."""
    rng = np.random.default_rng(1)
    page = emu.random_page(rng, emu.K4V4)
    vs = page[emu.K4V4.v_meta_offset:].view(np.float16).astype(np.float64)
    w = rng.uniform(0, 1, size=(16, 8)) * vs[:, None]
    w[:, 4:] = 0
    b = emu.weight_fragments(w)
    w16 = w.astype(np.float16).astype(np.float64)           # the kernel packs the weights to float16
    tc = emu.value_dot(emu.to_smem(page), b)
    got = emu.outputs_from_tiles(tc, lambda t8: (t8 >> 2) * 64 + ((t8 >> 1) & 1) * 32 + (t8 & 1) * 16)
    got[:, 64:] /= 16                                       # plane 1 is summed as 16 x the code
    want = w16.T @ (_direct_codes(page, emu.K4V4, "v", 4) - 8)
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()

    pool = get_format("k4v4").new_pool(1, 1, 128, 16, device="cpu")
    pool.data.copy_(torch.from_numpy(page.copy()).view(1, 1, -1))
    kr, vr = pool.regions()[:2]
    assert torch.equal(kr.reshape(-1), torch.from_numpy(page[:emu.K4V4.v_code_offset].copy()))
    assert torch.equal(vr.reshape(-1), torch.from_numpy(page[emu.K4V4.v_code_offset:emu.K4V4.k_meta_offset].copy()))

    page2 = emu.random_page(rng, emu.K4V2)
    tc, ways = emu.value_dot_k4v2(page2, b)
    got = emu.outputs_from_tiles(tc, lambda t8: (t8 >> 1) * 32 + (t8 & 1) * 16)
    got /= 4.0 ** (np.arange(128) // 32)[None, :]           # 2-bit plane p is summed as 4^p x the code
    want = w16.T @ (_direct_codes(page2, emu.K4V2, "v", 2) - 2)
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()
    assert ways == 1                                        # k4v2's value reads are conflict-free


def test_swizzle_makes_the_code_reads_conflict_free():
    """Each ldmatrix of k4v4's key and value code rows hits every shared-memory bank once with the kernel's swizzle
    (rows t and t + 2 of 64-byte rows would share banks without it: 4-way)."""
    regions = (0, emu.K4V4.v_code_offset)
    assert max(emu.bank_ways(emu.row_addr(base, half)) for base in regions for half in (0, 1)) == 1
    assert max(emu.bank_ways(emu.plain_row_addr(base, half)) for base in regions for half in (0, 1)) == 4


def test_build_refuses_what_is_not_a_fatbin_of_these_kernels(tmp_path, monkeypatch):
    """``build`` writes nothing unless nvcc produced a fatbin naming every kernel and its ``_dyn_smem`` symbol: an
    "nvcc" that exits 0 without output, or with other bytes, is an error; an empty ``--nvcc`` is refused (not replaced
    by a search)."""
    out, man = tmp_path / "k.fatbin", tmp_path / "k.json"
    silent = tmp_path / "silent"
    silent.write_text("#!/bin/sh\nexit 0\n")
    junk = tmp_path / "junk"
    junk.write_text('#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\necho junk > "$2"\n')
    fake_fatbin = tmp_path / "fakefatbin"
    fake_fatbin.write_text('#!/bin/sh\nwhile [ "$1" != "-o" ]; do shift; done\n'
                           'printf "\\120\\355\\125\\272 kvrepro_decode_k4v4 kvrepro_decode_k4v4_dyn_smem" > "$2"\n')
    for exe in (silent, junk, fake_fatbin):
        exe.chmod(0o755)
    for exe, match in [(silent, "exited 0 but wrote no fatbin"), (junk, "5 bytes that are not a fatbin"),
                       (fake_fatbin, "lacks kvrepro_decode_k8v4, kvrepro_decode_k8v4_dyn_smem, kvrepro_decode_k4v2")]:
        with pytest.raises(RuntimeError, match=match):
            cuda_build.build(str(exe), out=str(out), manifest=str(man))
        assert not out.exists() and not man.exists()
    cuda_build.check_fatbin(cuda_decode.FATBIN)                        # the committed one passes
    with pytest.raises(FileNotFoundError, match="--nvcc / nvcc is empty"):
        cuda_build.find_nvcc("  ")
    monkeypatch.setattr(cuda_build.shutil, "which", lambda name: str(junk) if name == "mynvcc" else None)
    assert cuda_build.find_nvcc("mynvcc") == str(junk)                 # a command name: looked up on PATH
    assert cuda_build.main(["--nvcc", str(junk)]) == 1                 # built with it: not a fatbin, exit 1


# --- key offset rope-mean: the *_rope kernels' correction (decode.cu rope_setup / rope_sincos / rope_add) ------------

def test_emulated_rope_sincos_is_float32_accurate_up_to_2_pow_20():
    """The kernel's sin / cos of float32 angles (Cody-Waite pi / 2 reduction, the hardware sine / cosine of the
    remainder taken correctly rounded here), emulated operation by operation, against float64 sin / cos of the same
    float32 angles: absolute error < 2.5e-7 (a float32 cosine's ~6e-8 plus the reduction's roundings) from 0 to 2^20
    rad, including angles next to multiples of pi / 2 (quadrant edges); the hardware's own error is the correction
    test's (mufu_err)."""
    rng = np.random.default_rng(0)
    k = np.arange(0, 2 ** 20 / (np.pi / 2), 997.0)
    a = np.concatenate([rng.uniform(0, 2 ** 20, 200_000), rng.uniform(0, 8, 20_000), k * np.pi / 2,
                        np.nextafter((k * np.pi / 2).astype(np.float32), np.float32(np.inf)),
                        [0.0, 1e-30, np.pi / 4, 2 ** 20 - 1]]).astype(np.float32)
    sn, cs = emu.rope_sincos(a)
    err_s = np.abs(sn.astype(np.float64) - np.sin(a.astype(np.float64))).max()
    err_c = np.abs(cs.astype(np.float64) - np.cos(a.astype(np.float64))).max()
    assert err_s < 2.5e-7 and err_c < 2.5e-7, (err_s, err_c)


def test_emulated_rope_sincos_takes_the_exact_angle_of_position_times_theta():
    """rope_add's angle is the float32 product plus its remainder (one FMA, exact): sin / cos of the exact product
    ``position x theta`` (RopeMean.angles) within 2.5e-7 at positions up to 2^20 and theta up to 1, where the float32
    product alone is off by up to 2^-5 rad (so the test would fail without the remainder)."""
    rng = np.random.default_rng(1)
    pos = np.concatenate([rng.integers(0, 2 ** 20, 100_000), np.arange(131_000, 131_072)]).astype(np.float32)
    theta = np.concatenate([rng.uniform(0, 1, 100_000), np.ones(72)]).astype(np.float32)
    a = (pos * theta).astype(np.float32)
    lo = emu._fma32(pos, theta, -a)
    exact = pos.astype(np.float64) * theta.astype(np.float64)
    assert np.abs(a.astype(np.float64) + lo.astype(np.float64) - exact).max() == 0     # the remainder is exact
    sn, cs = emu.rope_sincos(a, lo)
    err = max(np.abs(sn - np.sin(exact)).max(), np.abs(cs - np.cos(exact)).max())
    assert err < 2.5e-7, err
    assert np.abs(emu.rope_sincos(a)[1] - np.cos(exact)).max() > 1e-3                  # without it: the float32 angle


def _rope_mean_set(hkv, d, neox, gen, norm=1000.0):
    """A RopeMean on the CPU with 8 kept pairs per KV head chosen at random among all of the layout's pairs (the
    fastest, pair 0, in every head), b_hat of norm ``norm`` per head, as calibrate() would leave it."""
    from kvrepro.formats.offset import RopeMean

    rm = RopeMean(hkv, d, {"rope_theta": 1e6, "neox": neox})
    x, y, inv = rm.all_pairs()
    xs, ys, fs, bs = rm.x_ch.clone(), rm.y_ch.clone(), rm.inv_freq.clone(), rm.bias.clone()
    for h in range(hkv):
        pick = torch.cat([torch.zeros(1, dtype=torch.int64), 1 + torch.randperm(x.numel() - 1, generator=gen)[:7]])
        xs[h], ys[h], fs[h] = x[pick], y[pick], inv[pick]
        b = torch.randn(8, 2, generator=gen)
        bs[h] = b / b.norm() * norm
    rm.set_slots(xs, ys, fs, bs)
    rm.kept, rm.calibrated = [8] * hkv, True
    return rm


def _rope_case(seed: int, neox: bool):
    """A CTA's inputs for the emulated correction tests: ``(rm, q, terms, freq, group)``, a ``_rope_mean_set`` at
    Qwen3-4B shapes (32 q / 8 KV heads, head_dim 128, batch 2), queries, their score terms (A then B, float32 numpy
    [2, 32, 16]), the kept pairs' frequencies and the GQA group."""
    gen = torch.Generator().manual_seed(seed)
    hq, hkv, d, batch = 32, 8, 128, 2
    rm = _rope_mean_set(hkv, d, neox, gen)
    q = torch.randn(batch, hq, d, generator=gen)
    a_, b_ = rm.score_terms(q)
    return rm, q, torch.cat([a_, b_], -1).contiguous().numpy(), rm.inv_freq.numpy(), hq // hkv


# (sequence b, KV head kvh), coefficient scale, MUFU error direction: every pair of each at least once
ROPE_GRID = list(zip(((1, 3), (0, 7), (1, 0)) * 3, (1.0, 1e-9, 1e7) * 3, (0,) * 3 + (1,) * 3 + (-1,) * 3))


@pytest.mark.parametrize("neox", [True, False])
def test_emulated_rope_correction_equals_float64_over_the_restored_keys(neox):
    """The *_rope kernels' correction for one CTA (sequence b, KV head kvh), emulated lane by lane (rope_setup's table
    of cos / sin(t theta) and scaled coefficients, rope_add's turn by the page's start angle, float16 hi / lo split and
    m16n8k16 MMAs), against float64 q . R(j) b_hat of the restored keys (RopeMean.offset, channel space: checks the
    pair order of terms vs inv_freq and the neox / interleaved layout), heads of the CTA's GQA group only (the others
    0), at pages from position 0 to 2^20 - 16 and coefficients scaled by 1e-9 .. 1e7 (the power-of-two scale): within
    1.5e-6 of the largest correction with the hardware sine / cosine correctly rounded, as the Triton kernel's
    float64-reduced one, and within 3e-6 with them off by their documented bound either way (~1.9e-6 seen; scale 1:
    rope_scale multiplies A, B)."""
    rm, q, terms, freq, group = _rope_case(1 + neox, neox)
    for (b, kvh), mul, mufu in ROPE_GRID:
        shared = emu.rope_shared(terms * np.float32(mul), freq, 1.0, b, kvh, group, mufu)
        for pos0 in (0, 16, 4080, 65_520, 105_600, 131_056, 2 ** 20 - 16):
            got = emu.logits_from_fragments(emu.rope_add(pos0, shared, mufu))     # [16 tokens, 8 heads]
            pos = torch.arange(pos0, pos0 + 16)
            off = rm.offset(pos)[:, kvh].double()                                  # [16, D]: R(j) b_hat
            want = (q[b, kvh * group:(kvh + 1) * group].double() @ off.T).T.numpy() * np.float32(mul)  # [16, group]
            big = np.abs(want).max()
            assert np.abs(got[:, :group] - want).max() / big < (3e-6 if mufu else 1.5e-6), (b, kvh, pos0, mul, mufu)
            assert not got[:, group:].any()


@pytest.mark.parametrize("np_", [1, 2])
def test_emulated_rope_correction_of_a_warps_pages_equals_float64(np_):
    """A warp's pages as the *_rope kernels take their angles (decode.cu rope_angles / ROPE_NEXT): each step's first
    page at its exact angle, a two-page step's second page at the first's angles with its coefficients turned by
    ROPE_NEXT theta in rope_setup. Every page of 5 steps against float64 q . R(j) b_hat within the same bounds as one
    page at its exact angle (1.5e-6 of the largest correction, 3e-6 with the hardware sine / cosine off by their
    bound either way; 4e-6 then for a second page, whose turn by ROPE_NEXT theta adds that bound once more; 3.03e-6
    seen), from position 0 up to 2^20; a second page that takes the unturned coefficients is off by > 1e-3 (the test
    sees the turn)."""
    rm, q, terms, freq, group = _rope_case(3, True)
    steps = 5
    span = steps * np_ * emu.ROPE_NEXT
    for (b, kvh), mul, mufu in ROPE_GRID:
        shared = emu.rope_shared(terms * np.float32(mul), freq, 1.0, b, kvh, group, mufu, np_=np_)
        assert (shared[4] is None) == (np_ == 1)
        for start in (0, 48, 65_520, 131_072 - span, 2 ** 20 - span):
            pages = emu.rope_pages(start, steps, shared, np_, mufu)
            assert [p for p, _ in pages] == [start + j * emu.ROPE_NEXT for j in range(steps * np_)]
            for pos0, frag in pages:
                got = emu.logits_from_fragments(frag)
                off = rm.offset(torch.arange(pos0, pos0 + 16))[:, kvh].double()
                want = (q[b, kvh * group:(kvh + 1) * group].double() @ off.T).T.numpy() * np.float32(mul)
                big = np.abs(want).max()
                bound = 1.5e-6 if not mufu else 4e-6 if (pos0 - start) % (2 * emu.ROPE_NEXT) and np_ == 2 else 3e-6
                assert np.abs(got[:, :group] - want).max() / big < bound, (np_, b, kvh, pos0, mufu)
                assert not got[:, group:].any()
    if np_ == 2:
        shared = emu.rope_shared(terms, freq, 1.0, 1, 3, group, np_=2)
        unturned = shared[:4] + (shared[1],)
        pos0, frag = emu.rope_pages(65_520, 1, unturned, 2)[1]
        off = rm.offset(torch.arange(pos0, pos0 + 16))[:, 3].double()
        want = (q[1, 3 * group:4 * group].double() @ off.T).T.numpy()
        assert np.abs(emu.logits_from_fragments(frag)[:, :group] - want).max() / np.abs(want).max() > 1e-3


def test_emulated_rope_correction_reads_each_row_of_terms():
    """Index check with one-hot coefficients: A_i = 1 for one (head, pair) gives cos(j theta_i) in that head's column
    only, B_i sin; at GQA groups 1..8 and the last KV head of the last sequence."""
    freq = np.linspace(0.001, 1.0, 8 * 8, dtype=np.float32).reshape(8, 8)     # [Hkv, 8]
    for group in (1, 3, 8):
        hq = 8 * group
        for col in (0, 5, 11, 15):
            for h in {0, group - 1}:
                terms = np.zeros((2, hq, 16), np.float32)
                terms[1, 7 * group + h, col] = 1.0
                shared = emu.rope_shared(terms, freq, 1.0, 1, 7, group)
                got = emu.logits_from_fragments(emu.rope_add(480, shared))
                ang = np.arange(480, 496, dtype=np.float64) * np.float64(freq[7, col % 8])   # the exact angle
                want = np.zeros((16, 8))
                want[:, h] = np.cos(ang) if col < 8 else np.sin(ang)
                assert np.abs(got - want).max() < 1e-6, (group, col, h)


def test_emulated_rope_correction_of_zero_coefficients_is_zero():
    """All-zero terms (a head before calibration, dummy weights: no pair kept) give a correction of exactly 0, not
    0 x inf: rope_setup clamps the power-of-two scale's exponent so that the scale and its inverse stay finite."""
    freq = np.linspace(0.001, 1.0, 64, dtype=np.float32).reshape(8, 8)
    shared = emu.rope_shared(np.zeros((2, 32, 16), np.float32), freq, 0.1275, 1, 7, 4)
    assert np.isfinite(shared[3]) and np.isfinite(shared[1]).all()
    for pos0 in (0, 131_056):
        got = emu.rope_add(pos0, shared)
        assert np.isfinite(got).all() and not got.any()
    sc, inv = emu.rope_scale_pow2(np.float32(3e38))                   # the other end: finite too
    assert np.isfinite(sc) and np.isfinite(inv) and sc * inv == 1


def test_cuda_rope_bias_argument_is_checked_by_name():
    """The CUDA kernel's rope_bias contract (launch / check_rope_bias_cuda): terms float32 [B, Hq, 16], inv_freq
    float32 [Hkv, 8], contiguous, on the pool's device; anything else names rope_bias, the 8 pairs and the way out."""
    terms, freq = torch.zeros(2, 32, 16), torch.zeros(8, 8)
    assert cuda_decode.check_rope_bias_cuda(None, 2, 32, 8, "cpu") == []
    got = cuda_decode.check_rope_bias_cuda((terms, freq), 2, 32, 8, "cpu")
    assert got[0] is terms and got[1] is freq
    for bad in ((terms[:1], freq), (torch.zeros(2, 32, 32), torch.zeros(8, 16)), (terms.double(), freq),
                (terms, freq.t()), (terms,), terms):
        with pytest.raises(ValueError, match=r"rope_bias must be .*it takes 8 pairs per KV head.*impl='triton'"):
            cuda_decode.check_rope_bias_cuda(bad, 2, 32, 8, "cpu")


def _rope_pool(preset, lens, seed):
    """k4v4 / k8v4 / k4v2 pages (32 / 8 heads, head_dim 128) of sequences of ``lens`` tokens stored as the runtime
    stores them under rope-mean (RopeMean.remove of keys R(j) b_hat + N(0, 1), b_hat of norm 1000 in 8 pairs per
    KV head incl. the fastest, neox pairs, theta 1e6). Returns pool, block tables, seq_lens and the RopeMean."""
    from kvrepro.ops import store_kv
    gen = torch.Generator().manual_seed(seed)
    g = torch.Generator(device=DEV).manual_seed(seed)
    maxb = max(-(-max(n, 1) // 16) for n in lens) + 1
    nb = len(lens) * maxb + 5
    pool = make_pool(preset, 8, 128, 16, nb, gen)
    bt = block_tables(len(lens), maxb, nb, gen)
    rm = _rope_mean_set(8, 128, True, gen).to(DEV)
    for r, n in enumerate(lens):
        if n:
            pos = torch.arange(n, device=DEV)
            k = (rm.offset(pos) + torch.randn(n, 8, 128, device=DEV, generator=g)).to(torch.bfloat16)
            v = torch.randn(n, 8, 128, device=DEV, generator=g).to(torch.bfloat16)
            slots = (bt[r][pos // 16].long() * 16 + pos % 16).to(torch.int32)
            store_kv(rm.remove(k, pos), v, pool.data, slots, pool.layout, pool.rotation)
            del k, v
    return pool, bt, torch.tensor(lens, dtype=torch.int32, device=DEV), rm


@pytest.mark.gpu
@pytest.mark.parametrize("qscale", [1.0, 0.03])
@pytest.mark.parametrize("preset", ["k4v4", "k8v4", "k4v2", "k5v4"])
def test_cuda_rope_mean_matches_float64_over_restored_keys_and_triton(preset, qscale):
    """The *_rope kernels at 32 / 8 heads, head_dim 128, contexts up to 128K (131,072 and ragged 50,001 / 37 / a padding
    row), bias norm 1000: within 3e-3 of float64 attention over the restored keys (pool.gather + R(j) b_hat) and of
    the Triton kernel with the same rope_bias; the same pages read without the correction are far off. qscale 1:
    logits spread ~90 nats (a few keys carry each head), 0.03: ~3 nats (thousands of keys). The default (auto) picks
    the CUDA kernel with rope_bias and gives the same bits; a CUDA graph replays it bit for bit."""
    lens = [131_072, 50_001, 37, 0]
    pool, bt, sl, rm = _rope_pool(preset, lens, seed=11)
    q = (torch.randn(4, 32, 128, device=DEV, generator=torch.Generator(device=DEV).manual_seed(3)) * qscale).half()
    a_, b_ = rm.score_terms(q)
    rb = (torch.cat([a_, b_], -1).contiguous(), rm.inv_freq.contiguous())
    args = (q, pool.data, bt, sl, pool.layout, pool.rotation, 128 ** -0.5)
    out = decode_attention(*args, impl="cuda", rope_bias=rb)
    tri = decode_attention(*args, impl="triton", rope_bias=rb)
    auto = decode_attention(*args, rope_bias=rb)
    plain = decode_attention(*args, impl="cuda")
    assert torch.equal(auto, out)
    assert torch.equal(out[3], torch.zeros_like(out[3]))
    for r, n in enumerate(lens[:3]):
        kd, vd = pool.gather(bt[r], n)
        ref = attention_ref(q[r:r + 1], rm.restore(kd, torch.arange(n, device=DEV)).double(), vd.double(),
                            128 ** -0.5, torch.float64)
        del kd, vd
        err = relerr(out[r:r + 1], ref)
        assert err < 3e-3, (r, err)
        assert relerr(out[r:r + 1], tri[r:r + 1]) < 3e-3, r
        assert relerr(plain[r:r + 1], ref) > 10 * err, r
    ws = torch.empty(1 << 24, dtype=torch.float32, device=DEV)
    again = torch.empty_like(out)
    call = lambda: decode_attention(*args, out=again, workspace=ws, num_splits=7, impl="cuda", rope_bias=rb)  # noqa: E731
    call()
    eager = again.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    again.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(again, eager)
