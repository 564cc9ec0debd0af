"""The vLLM layer's split rule counts the resident CTAs of its own preset's CUDA kernel (issue 22, part 1): on an
A100 (modelled without a GPU: ``cuda_decode.CPU_CAPABILITY`` set to 8.0) an SM holds 4 CTAs of k4v4 and k8v4 but 3 of
k4v2, so k4v4 layers plan one wave of 4 CTAs per SM, where the fewest of all kernels (3) would leave a quarter of
the wave idle. Triton layers and k5v4 (no CUDA kernel) keep the Triton rule."""
import pytest
import torch

from kvrepro.formats import COMPRESSED_PRESETS
from kvrepro.ops import cuda_decode
from kvrepro.ops.decode import MIN_TOKENS_PER_SPLIT
from kvrepro.vllm_backend.runtime import LayerRuntime

CPU = torch.device("cpu")
SMS = 132                           # kvrepro.ops.common.sm_count without a CUDA device
CTX = 256 * MIN_TOKENS_PER_SPLIT    # wide enough that the context never caps the split count


@pytest.fixture
def a100(monkeypatch):
    monkeypatch.setattr(cuda_decode, "CPU_CAPABILITY", (8, 0))
    return {"k4v4": 4, "k8v4": 4, "k4v2": 3}     # occupancy arithmetic of the committed fatbin's sm_80 SASS


@pytest.mark.parametrize("preset", ["k4v4", "k8v4", "k4v2"])
@pytest.mark.parametrize("batch,hkv", [(1, 8), (3, 8), (5, 4), (13, 8)])
def test_cuda_layer_plans_one_wave_of_its_own_kernel(a100, preset, batch, hkv):
    assert cuda_decode.modelled_ctas(COMPRESSED_PRESETS[preset], (8, 0)) == a100[preset]
    rt = LayerRuntime(preset, 4 * hkv, hkv, 128, 128 ** -0.5)
    got = rt.splits(batch, CTX, CPU, impl="cuda")
    assert got == max(1, min(a100[preset] * SMS // (batch * hkv), 256))
    assert batch * hkv * got <= a100[preset] * SMS          # one wave of this kernel's residency


def test_k4v4_on_an_a100_is_not_planned_with_k4v2s_residency(a100):
    """The case the fix is for: 1 sequence x 8 KV heads, 4 CTAs x 132 SMs = 528 -> 66 splits; with the fewest of all
    kernels (k4v2's 3) it would be 49."""
    rt = LayerRuntime("k4v4", 32, 8, 128, 128 ** -0.5)
    assert rt.splits(1, CTX, CPU, impl="cuda") == 66
    assert LayerRuntime("k4v2", 32, 8, 128, 128 ** -0.5).splits(1, CTX, CPU, impl="cuda") == 49


def test_triton_and_k5v4_layers_keep_the_triton_rule(a100):
    from kvrepro.ops.decode import default_num_splits

    for preset in ("k5v4", "k4v4"):
        rt = LayerRuntime(preset, 32, 8, 128, 128 ** -0.5)
        assert rt.splits(3, CTX, CPU, impl="triton") == default_num_splits(3, 8, CTX, CPU, impl="triton")
    # the workspace bound of a k5v4 layer asks both rules and must not ask for a CUDA kernel k5v4 does not have
    assert LayerRuntime("k5v4", 32, 8, 128, 128 ** -0.5, max_batch=4).reserve_numel(CPU) > 0
