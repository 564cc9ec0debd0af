"""Reach across GPUs (issue 22, part 1), without a GPU: resident CTAs per SM of the CUDA decode kernels by the
arithmetic model against an independent count from their shared memory, the carveouts that cap an H200 to an A100's
or an Ada GPU's budget, which fatbin code each GPU family runs, and the decisions that follow (the split rule's one
wave, a fatbin without code for the GPU: Triton with a warning, or refused when KVREPRO_DECODE_IMPL=cuda)."""
from test_ops_helpers import DEV  # noqa: F401,I001  (TRITON_INTERPRET before triton loads)

import json
import re

import pytest
import torch

import scripts_module
from kvrepro.formats import get_format
from kvrepro.ops import cuda_build, cuda_decode, occupancy
from kvrepro.ops.decode import default_num_splits, resolve_impl

CUDA = torch.device("cuda", 0)
BITS = {name: bits for bits, name in cuda_decode.PRESETS.items()}
KB = 1024


def _static_smem_from_source(preset: str, rope: bool = False) -> int:
    """Static shared memory of a kernel as decode.cu declares it: the ring (WARPS x KSTAGES pages of the preset's
    layout, its #define default depth), the query digits ``qd_hi/qd_lo`` int8 [8][D], ``s_q/q_sum`` float [8] and
    ``s_last`` int, k5v4's ``log_mant`` unsigned [8] (all kernels declare it, ptxas keeps it where k5v4 reads it),
    rounded up to the ring's 128-byte alignment (ptxas reports whole 128-byte units)."""
    src = open(cuda_build.SOURCE).read()
    stages = {"k4v4": "KVREPRO_STAGES", "k8v4": "KVREPRO_STAGES_K8V4", "k4v2": "KVREPRO_STAGES_K4V2",
              "k5v4": "KVREPRO_STAGES_K5V4"}[preset]
    depth = re.search(rf"#define {stages} (\w+)", src).group(1)
    depth = int(depth if depth.isdigit() else re.search(rf"#define {depth} (\d+)", src).group(1))   # an alias
    warps = int(re.search(r"constexpr int WARPS = (\d+);", src).group(1))
    assert "__shared__ __align__(16) int8_t qd_hi[8][D], qd_lo[8][D];" in src
    assert "__shared__ float s_q[8], q_sum[8];" in src and "__shared__ int s_last;" in src
    d = 128
    assert "__shared__ unsigned log_mant[8];" in src
    # rope: the table and coefficients, and for a two-page step the second page's turned coefficients
    assert "__shared__ __align__(16) uint4 rope_s[NP == 2 ? ROPE_SM_UINT4_TWO : ROPE_SM_UINT4];" in src
    one, two = map(int, re.search(r"constexpr int ROPE_SM_UINT4 = (\d+), ROPE_SM_UINT4_TWO = (\d+);", src).groups())
    step = {"k8v4": "KVREPRO_STEP_K8V4"}.get(preset, f"KVREPRO_ROPE_STEP_{preset.upper()}")   # ROPE_STEP's source
    rope_uint4 = two if int(re.search(rf"#define {step} (\d+)", src).group(1)) == 2 else one
    total = (warps * depth * get_format(preset).layout(d, 16).page_bytes + 2 * 8 * d + 2 * 8 * 4 + 4
             + (8 * 4 if preset == "k5v4" else 0) + (rope_uint4 * 16 if rope else 0))
    return -(-total // 128) * 128


def test_static_shared_memory_in_the_manifest_is_what_the_source_declares():
    """ptxas's reported shared memory per kernel (the manifest's ``resources``, every SASS target) equals the sum of
    the source's declarations: the model reads numbers that follow from the code, not typed-in ones."""
    res = cuda_decode.read_manifest()["resources"]
    assert sorted(res) == sorted(t for t in cuda_build.targets() if t.startswith("sm_"))
    for preset, bits in BITS.items():
        want = _static_smem_from_source(preset)
        assert want == {"k4v4": 36480, "k8v4": 40192, "k4v2": 41344, "k5v4": 39808}[preset]
        want_rope = _static_smem_from_source(preset, rope=True)
        for arch, kernels in res.items():
            assert kernels[cuda_decode.KERNELS[bits]]["smem_static"] == want, (arch, preset)
            assert kernels[cuda_decode.ROPE_KERNELS[bits]]["smem_static"] == want_rope, (arch, preset)
            assert kernels[cuda_decode.KERNELS[bits]]["registers"] <= 128      # __launch_bounds__(128, 4)


@pytest.mark.parametrize("capability,smem_kb,want", [
    ((8, 0), 164, {"k4v4": 4, "k8v4": 3, "k4v2": 3, "k5v4": 3}),      # A100: the rope-mean kernels bind k8v4, k5v4
    ((8, 6), 100, {"k4v4": 2, "k8v4": 2, "k4v2": 2, "k5v4": 2}),      # A10 / RTX 30
    ((8, 9), 100, {"k4v4": 2, "k8v4": 2, "k4v2": 2, "k5v4": 2}),      # L40S / RTX 4090 (Ada)
    ((9, 0), 228, {"k4v4": 4, "k8v4": 4, "k4v2": 4, "k5v4": 4}),      # H100 / H200: registers bind
    ((10, 0), 228, {"k4v4": 4, "k8v4": 4, "k4v2": 4, "k5v4": 4}),     # B200
    ((12, 0), 100, {"k4v4": 2, "k8v4": 2, "k4v2": 2, "k5v4": 2}),     # RTX 5090
])
def test_modelled_residency_matches_a_count_by_hand(capability, smem_kb, want):
    """Resident CTAs = min(registers: 64 K / (128 registers x 128 threads) = 4, shared memory: the SM's bytes // the
    CTA's bytes with the 1 KB the driver reserves, in 128-byte units), the fewer of a preset's kernel and its
    rope-mean variant (either may launch); warps and the per-SM CTA cap do not bind."""
    sm = occupancy.limits(capability)
    assert sm.smem_per_sm == smem_kb * KB and sm.regs_per_sm == 65536
    for preset, bits in BITS.items():
        by_hand = min(min(65536 // (128 * 128), smem_kb * KB // (-(-(_static_smem_from_source(preset, rope) + 1024)
                                                                   // 128) * 128)) for rope in (False, True))
        assert by_hand == want[preset], (capability, preset)
        assert cuda_decode.modelled_ctas(bits, capability) == want[preset], (capability, preset)
        lim = occupancy.limits_by_resource(cuda_decode.kernel_resources(bits, sm.arch), sm)
        assert lim["registers"] == 4 and lim["warps"] >= 12 and lim["ctas"] >= 16


def test_carveouts_cap_an_h200_to_the_a100_and_ada_budgets():
    """The carveout percent that configures an sm_90 SM to 164 KB (A100) or 100 KB (Ada) and nothing larger, and
    the residency under it: what the GPU tests set on the H200 and what the query must then answer."""
    h = occupancy.limits((9, 0))
    assert occupancy.carveout_for(h, 164 * KB) == 71 and occupancy.carveout_for(h, 100 * KB) == 43
    assert occupancy.configured_smem(h, 71) == 164 * KB and occupancy.configured_smem(h, 72) == 196 * KB
    assert occupancy.configured_smem(h, 43) == 100 * KB and occupancy.configured_smem(h, 44) == 132 * KB
    assert occupancy.configured_smem(h) == 228 * KB                          # no preference: the largest
    assert occupancy.configured_smem(h, 0, need=37504) == 64 * KB            # too small for one CTA: the least that fits
    assert {p: cuda_decode.modelled_ctas(b, (9, 0), 71) for p, b in BITS.items()} == {"k4v4": 4, "k8v4": 3, "k4v2": 3,
                                                                                       "k5v4": 3}
    assert {p: cuda_decode.modelled_ctas(b, (9, 0), 43) for p, b in BITS.items()} == {"k4v4": 2, "k8v4": 2, "k4v2": 2,
                                                                                       "k5v4": 2}
    assert {p: cuda_decode.modelled_ctas(b, (9, 0), 0) for p, b in BITS.items()} == {"k4v4": 1, "k8v4": 1, "k4v2": 1,
                                                                                      "k5v4": 1}
    with pytest.raises(ValueError, match=r"capacity must be one of \[0, 8, 16, 32, 64, 100, 132, 164, 196, 228\] KB"):
        occupancy.carveout_for(h, 150 * KB)
    with pytest.raises(ValueError, match=r"carveout must be -1 \(no preference\) or an int percent in 0..100, got 101"):
        occupancy.configured_smem(h, 101)
    with pytest.raises(ValueError, match=r"capability must be one of 8.0, 8.6, 8.9, 9.0, 10.0, 12.0 .*got \(7, 5\)"):
        occupancy.limits((7, 5))
    with pytest.raises(ValueError, match="threads must be an int >= 1, got 0"):
        occupancy.KernelResources(threads=0, registers=128, smem_static=0)


def test_gpu_limits_agree_with_the_carveouts_of_nvidia_occupancy_calculator():
    """gpus.json's carveouts per compute capability are the capacities cuda_occupancy.h rounds a preference up to
    (CUDA 13.0, cudaOccAlignUpShmemSizeVoltaPlus), where that header is installed; its last is the SM's memory."""
    import glob

    headers = sorted(glob.glob("/usr/local/cuda*/include/cuda_occupancy.h"))
    if not headers:
        pytest.skip("no CUDA toolkit here (include/cuda_occupancy.h)")
    text = open(headers[-1]).read()
    body = text[text.index("cudaOccAlignUpShmemSizeVoltaPlus"):]
    body = body[:body.index("cudaOccSMemPreferenceVoltaPlus")]
    for sm in occupancy.families():
        major, minor = sm.capability
        case = body[body.index(f"case {major}:"):]
        if major == 8:                                       # 8.0 / 8.7 take the first branch, the others the else
            case = case[:case.index("else {\n            if")] if minor in (0, 7) else case[case.index("else {\n            if"):]
        sizes = [int(x) for x in re.findall(r"\*shMemSize = (\d+) \* 1024", case.split("break;")[0])]
        assert [0] + sizes == [c // KB for c in sm.smem_configs], sm.family


def test_the_fatbin_holds_sass_for_every_family_and_ptx_of_the_newest():
    """The manifest's ``entries`` are read from the committed fatbin's container (``cuda_build.check`` compares); each
    family in gpus.json runs its own SASS; a GPU with no SASS of its major runs PTX (compute_80 up to 11.x,
    compute_120 from 12.0), below 8.0 nothing."""
    info = cuda_decode.read_manifest()
    assert info["entries"] == cuda_build.fatbin_entries(cuda_decode.FATBIN)
    codes = [e["code"] for e in info["entries"]]
    assert sorted(codes) == sorted(cuda_build.targets())
    assert {"sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_120", "compute_80", "compute_120"} == set(codes)
    for sm in occupancy.families():
        assert cuda_decode.fatbin_code_for(sm.capability) == sm.arch
    assert cuda_decode.fatbin_code_for((8, 7)) == "sm_86" and cuda_decode.fatbin_code_for((10, 3)) == "sm_100"
    assert cuda_decode.fatbin_code_for((12, 1)) == "sm_120" and cuda_decode.fatbin_code_for((11, 0)) == "compute_80"
    assert cuda_decode.fatbin_code_for((13, 0)) == "compute_120"
    assert cuda_decode.fatbin_code_for((7, 5)) is None
    assert "no code for compute capability 7.5 (SASS sm_80, sm_86, sm_89, sm_90, sm_100, sm_120; PTX compute_80, " \
           "compute_120)" in cuda_decode.fatbin_gap((7, 5))
    with pytest.raises(ValueError, match=r"capability must be \(major, minor\), two ints >= 0, got '9.0'"):
        cuda_decode.fatbin_code_for("9.0")


def test_sm_90_code_is_the_code_the_h200_measurements_ran():
    """The H200 results were measured with the fatbins ea2007... (capacity rows, benchmarks) and 970ceb... (carveout,
    per-model runs); adding sm_100 / sm_120 (970ceb...) left the sm_90 entry and compute_80 PTX of ea2007... as they
    were; adding the rope-mean kernels changed the sm_90 entry (and the PTX, which holds them too) but not the code of
    the plain kernels in it (per-kernel hashes of the committed fatbin equal those of the measured one;
    tests/test_reach_fatbin.py reads them from the fatbins in git history)."""
    with open(f"{cuda_decode.HERE}/measured_fatbins.json") as f:
        fatbins = json.load(f)["fatbins"]
    old, mid = ({e["code"]: e for e in fatbins[sha]["entries"]} for sha in
                ("ea200779094fc163cd7f133bdbca2112f04d918d84ca7377188cf595a2aaa90e",
                 "970ceb3112d47cab66b47a927138db2e7e6dfd517fc5f3b2fe654206619af74b"))
    assert old["sm_90"]["sha256"] == mid["sm_90"]["sha256"] == \
        "19caa3753f302d5e53894b2ba5d98c0fda4587af8968cb8ce2477c463f5b22e8"
    assert old["compute_80"]["sha256"] == mid["compute_80"]["sha256"] == \
        "b4a223fdae8709040f1dc27f9851925a4ab398e62d9c2e7d0308e30d3c95a9f7"
    entries = {e["code"]: e for e in cuda_decode.read_manifest()["entries"]}
    assert entries["sm_90"]["sha256"] != old["sm_90"]["sha256"]              # the rope kernels were added
    assert entries["compute_80"]["sha256"] != old["compute_80"]["sha256"]
    for name in cuda_decode.KERNELS.values():
        if name != "kvrepro_decode_k5v4":                                    # added after these runs
            assert entries["sm_90"]["kernels"][name] == old["sm_90"]["kernels"][name], name


def test_manifest_check_names_entries_that_are_not_the_fatbins(tmp_path):
    man = tmp_path / "decode.json"
    info = cuda_decode.read_manifest()
    man.write_text(json.dumps(info | {"entries": info["entries"][:-1]}))
    problems = cuda_build.check(manifest=str(man))
    assert any("are not the code" in p and "sm_120" in p for p in problems), problems
    man.write_text(json.dumps(info | {"resources": {k: v for k, v in info["resources"].items() if k != "sm_100"}}))
    assert any("ptxas resources cover" in p for p in cuda_build.check(manifest=str(man)))
    bad = tmp_path / "x.fatbin"
    bad.write_bytes(b"\x00" * 64)
    with pytest.raises(RuntimeError, match="is not a fatbin"):
        cuda_build.fatbin_entries(str(bad))


def test_ptxas_resources_reads_entry_points_only():
    text = """ptxas info    : Compiling entry function 'kvrepro_decode_k4v4' for 'sm_100'
ptxas info    : Function properties for kvrepro_decode_k4v4
    16 bytes stack frame, 16 bytes spill stores, 24 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 16 bytes cumulative stack size, 36480 bytes smem
ptxas info    : Function properties for _Z12merge_splitsILi4ELi4EEvPhPKfS2_S2_Pviiiiixxb
    0 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
"""
    assert cuda_build.ptxas_resources(text) == {"sm_100": {"kvrepro_decode_k4v4": {
        "stack_frame": 16, "spill_stores": 16, "spill_loads": 24, "registers": 128, "smem_static": 36480}}}


class _FakeModule:
    """Stands in for a loaded fatbin: the driver's occupancy answer per kernel (or an error code)."""

    def __init__(self, answers, rc=0):
        self.answers, self.rc, self.index = answers, rc, 0

    def occupancy(self, bits):
        if self.rc:
            raise RuntimeError(f"kvrepro CUDA decode kernel: the driver's occupancy query for {cuda_decode.KERNELS[bits]} "
                               f"failed with CUDA error {self.rc}")
        return self.answers[bits]


@pytest.fixture
def fake_gpu(monkeypatch):
    """A pretend CUDA device 0 of compute capability ``cap`` with ``sms`` SMs, whose loaded kernels answer the
    occupancy query with ``answers`` (None: the fatbin does not load there, ``load_error``)."""
    from kvrepro.ops import decode

    def make(cap=(8, 0), sms=108, answers=None, load_error=None, rc=0):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
        monkeypatch.setattr(decode, "sm_count", lambda device: sms)
        monkeypatch.setattr(cuda_decode, "sm_count", lambda device: sms)
        monkeypatch.setattr(cuda_decode, "_RESIDENT", {})
        monkeypatch.setattr(cuda_decode, "load_error", lambda device: load_error)
        mod = _FakeModule(answers or {}, rc)
        monkeypatch.setattr(cuda_decode, "load", lambda device, path=cuda_decode.FATBIN: mod)
        return mod
    return make


def test_split_rule_plans_one_wave_of_the_queried_residency(fake_gpu):
    """An A100 (108 SMs) answering 4 / 4 / 3 CTAs: one wave is 432 CTAs for k4v4 and k8v4, 324 for k4v2; the count the
    old constant 4 gave k4v2 (54 splits at batch 1 x 8 KV heads) would be 432 CTAs, a partial second wave."""
    fake_gpu(cap=(8, 0), sms=108, answers={BITS["k4v4"]: 4, BITS["k8v4"]: 4, BITS["k4v2"]: 3, BITS["k5v4"]: 4})
    got = {p: default_num_splits(1, 8, 131072, CUDA, "cuda", kernel=b) for p, b in BITS.items()}
    assert got == {"k4v4": 54, "k8v4": 54, "k4v2": 40, "k5v4": 54}          # 4 * 108 // 8, 3 * 108 // 8
    assert default_num_splits(1, 8, 131072, CUDA, "cuda") == 40              # no kernel named: the fewest
    assert default_num_splits(3, 8, 131072, CUDA, "cuda", kernel=BITS["k4v2"]) == 13
    assert cuda_decode.resident_ctas(CUDA, BITS["k4v2"]) == (3, "driver occupancy query")
    assert default_num_splits(1, 8, 131072, CUDA, "cuda", padded=True, kernel=BITS["k4v2"]) == 128   # many waves
    with pytest.raises(ValueError, match=r"bits must be None or one of \[\(4, 2\), \(4, 4\), \(5, 4\), \(8, 4\)\], "
                                         r"got \(2, 4\)"):
        default_num_splits(1, 8, 131072, CUDA, "cuda", kernel=(2, 4))


def test_a_failing_occupancy_query_is_an_error_not_a_guess(fake_gpu):
    fake_gpu(cap=(9, 0), sms=132, rc=999)
    with pytest.raises(RuntimeError, match="occupancy query for kvrepro_decode_k4v4 failed with CUDA error 999"):
        default_num_splits(1, 8, 131072, CUDA, "cuda", kernel=BITS["k4v4"])


def test_without_a_loadable_kernel_the_launch_bounds_size_the_reservation(fake_gpu):
    """Where the fatbin does not load no CUDA launch happens (decode runs Triton); the CUDA rule's count, used only to
    size the workspace for both kernels, takes the launch bounds' 4, an upper bound, and says why."""
    fake_gpu(cap=(9, 0), sms=132, load_error="cuModuleLoadData failed with CUDA error 222")
    n, source = cuda_decode.resident_ctas(CUDA, BITS["k4v4"])
    assert n == cuda_decode.LAUNCH_BOUNDS_CTAS == 4 and "cannot load here: cuModuleLoadData failed" in source
    cpu = cuda_decode.resident_ctas(torch.device("cpu"))
    assert cpu == (4, "arithmetic model for compute capability 9.0 (no CUDA device to query)")


def test_rank_skew_follows_the_queried_wave(fake_gpu):
    """An H200 capped to the A100's budget holds 3 k4v2 CTAs per SM: 396 CTAs are one wave (skewed splits), 408 are
    not; the skew stays on compute capability 9.x only."""
    fake_gpu(cap=(9, 0), sms=132, answers={BITS["k4v4"]: 4, BITS["k8v4"]: 4, BITS["k4v2"]: 3})
    assert cuda_decode.rank_args(CUDA, 3, 8, 16, BITS["k4v2"]) == (132, cuda_decode.RANK_SKEW)   # 384 CTAs
    assert cuda_decode.rank_args(CUDA, 3, 8, 17, BITS["k4v2"]) == (132, 0)                       # 408 CTAs
    assert cuda_decode.rank_args(CUDA, 3, 8, 17, BITS["k4v4"]) == (132, cuda_decode.RANK_SKEW)   # 408 <= 528
    fake_gpu(cap=(8, 0), sms=108, answers={BITS["k4v4"]: 4, BITS["k8v4"]: 4, BITS["k4v2"]: 3})
    assert cuda_decode.rank_args(CUDA, 1, 8, 4, BITS["k4v4"]) == (108, 0)


@pytest.fixture
def no_ptx_manifest(monkeypatch):
    """The committed manifest without its PTX entries (a build of SASS only): a compute capability 11.0 GPU then has
    no code to run."""
    info = cuda_decode.read_manifest()
    info = info | {"entries": [e for e in info["entries"] if e["code"].startswith("sm_")]}
    monkeypatch.setattr(cuda_decode, "read_manifest", lambda manifest=cuda_decode.MANIFEST: info)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (11, 0))
    monkeypatch.setattr(cuda_decode, "_MODULES", {})
    monkeypatch.setattr(cuda_decode, "_LOAD_ERRORS", {})
    return info


def test_a_fatbin_without_code_for_the_gpu_falls_back_with_a_warning_or_is_refused(no_ptx_manifest, monkeypatch):
    """Never a wrong answer: the default rule takes Triton and warns with the reason; KVREPRO_DECODE_IMPL=cuda is
    refused at engine start (LayerRuntime.check_decode_impl loads the kernel there) with the same reason. The driver is
    not asked (the check reads the manifest), so this runs without a GPU."""
    from kvrepro.ops import decode
    from kvrepro.vllm_backend.runtime import LayerRuntime

    assert cuda_decode.fatbin_code_for((11, 0)) is None
    monkeypatch.setattr(decode, "_WARNED_LOAD", set())
    layout = get_format("k4v4").layout(128, 16)
    with pytest.warns(RuntimeWarning, match=r"no code for compute capability 11.0 \(SASS sm_80.*PTX none\).*running "
                                            r"the Triton kernel instead"):
        assert resolve_impl(None, layout, 4, CUDA) == "triton"
    rt = LayerRuntime("k4v4", 32, 8, 128, 0.088, decode_impl="cuda")
    with pytest.raises(RuntimeError, match=r"KVREPRO_DECODE_IMPL=cuda, but the CUDA decode kernel cannot load here: "
                                           r".*no code for compute capability 11.0"):
        rt.check_decode_impl(16, CUDA)


def _script():
    return scripts_module.load("reach_carveout_splits")


def test_carveout_benchmark_plans_and_tabulates_without_a_gpu(capsys):
    """scripts/reach_carveout_splits.py (run on the H200): the counts it times around the rule's, its table (rule,
    fastest and the former constant's count marked; times relative to the rule's), and its refusals."""
    mod = _script()
    # an H200 capped to 164 KB, k4v2 (3 CTAs per SM), batch 3: one wave 16, former constant 22, two / three waves
    assert mod.candidates(16, 3, 132, 3, 131072) == [16, 22, 32, 33, 49, 64]
    assert mod.candidates(1, 2, 132, 200, 131072) == [1, 16, 32, 64]
    assert mod.candidates(66, 4, 132, 1, 4096) == [16]                      # 4096 tokens: at most 16 splits
    rows = [dict(budget_kb=164, preset="k4v2", batch=3, ctas_per_sm=3, splits=s, waves=3 * 8 * s / 396, ms_graph=ms,
                 rule=s == 16, old_constant=s == 22, relerr_vs_f64=2e-4) for s, ms in ((16, 1.0), (22, 1.3), (33, 0.98))]
    text = mod.table(rows)
    lines = [ln for ln in text.splitlines() if "k4v2" in ln]
    assert lines[0].split()[:5] == ["164", "k4v2", "3", "3", "16"] and lines[0].endswith("rule")
    assert "1.300" in lines[1] and lines[1].endswith("old constant")
    assert "0.980" in lines[2] and lines[2].endswith("fastest")
    with pytest.raises(SystemExit):
        mod.main(["--presets", "k2v2"])
    assert "--presets must be among ['k4v2', 'k4v4', 'k5v4', 'k8v4'], got ['k2v2']" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA device"):
            mod.main([])
