"""The vLLM layer's split rule counts the resident CTAs of its own preset's CUDA kernel (issue 22, part 1): on an
A100 (modelled without a GPU: ``cuda_decode.CPU_CAPABILITY`` set to 8.0) an SM holds 4 CTAs of k4v4 but 3 of k8v4,
k4v2 and k5v4 (each preset counts the fewer of its kernel and its rope-mean variant, which for k8v4 and k5v4 needs
1.25 KB more shared memory than the 4th CTA leaves), so k4v4 layers plan whole waves of 4 CTAs per SM, where the
fewest of all kernels (3) would leave a quarter of the wave idle. Triton layers keep the Triton rule."""
import math
from fractions import Fraction

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
    return {"k4v4": 4, "k8v4": 3, "k4v2": 3, "k5v4": 3}   # occupancy arithmetic of the committed fatbin's sm_80 SASS


# splits per (batch, KV heads) on an A100's residency (4 or 3 CTAs) x 132 SMs, by hand: the fewest waves w
# whose floor(w x slots / pairs) fills >= 95% of ceil(waves) x slots. 4 CTAs, k4v4 (528 slots): 8 pairs 66 (1.0), 24
# pairs 22 (1.0), 20 pairs 26 (520 / 528 = 0.985), 104 pairs 5 (0.985). 3 CTAs, k8v4 / k4v2 / k5v4 (396 slots): 8 pairs 49 (392 / 396 =
# 0.99), 24 pairs 16 (0.97), 20 pairs 19 (0.96), 104 pairs: 3 fills 312 / 396 = 0.79, 7 fills 728 / 792 = 0.92,
# 11 fills 1144 / 1188 = 0.963 -> 11 (three waves; the carveout table's A100 k4v2 batch 13 row).
A100_SPLITS = {(1, 8): (66, 49), (3, 8): (22, 16), (5, 4): (26, 19), (13, 8): (5, 11)}


def _waves_fill(pairs: int, slots: int, splits: int) -> tuple[int, Fraction]:
    ctas = pairs * splits
    waves = math.ceil(Fraction(ctas, slots))
    return waves, Fraction(ctas, waves * slots)


@pytest.mark.parametrize("preset", ["k4v4", "k8v4", "k4v2", "k5v4"])
@pytest.mark.parametrize("batch,hkv", sorted(A100_SPLITS))
def test_cuda_layer_plans_whole_waves_of_its_own_kernel(a100, preset, batch, hkv):
    assert cuda_decode.modelled_ctas(COMPRESSED_PRESETS[preset], (8, 0)) == a100[preset]
    rt = LayerRuntime(preset, 4 * hkv, hkv, 128, 128 ** -0.5)
    got = rt.splits(batch, CTX, CPU, impl="cuda")
    assert got == A100_SPLITS[batch, hkv][a100[preset] == 3]
    slots, pairs = a100[preset] * SMS, batch * hkv
    waves, fill = _waves_fill(pairs, slots, got)
    assert fill >= Fraction(95, 100) and waves <= 3
    # no count of fewer waves fills its waves to 95%: the rule takes the fewest waves that do
    assert all(_waves_fill(pairs, slots, s)[1] < Fraction(95, 100) for s in range(1, got)
               if _waves_fill(pairs, slots, s)[0] < waves)


def test_k4v4_on_an_a100_is_not_planned_with_k4v2s_residency(a100):
    """The case the per-kernel residency is for: 1 sequence x 8 KV heads, 4 CTAs x 132 SMs = 528 -> 66 splits; with the
    fewest of all kernels (k4v2's 3) it would be 49."""
    rt = LayerRuntime("k4v4", 32, 8, 128, 128 ** -0.5)
    assert rt.splits(1, CTX, CPU, impl="cuda") == 66
    assert LayerRuntime("k4v2", 32, 8, 128, 128 ** -0.5).splits(1, CTX, CPU, impl="cuda") == 49


def test_triton_layers_keep_the_triton_rule(a100):
    from kvrepro.ops.decode import default_num_splits

    for preset in ("k5v4", "k4v4"):
        rt = LayerRuntime(preset, 32, 8, 128, 128 ** -0.5)
        assert rt.splits(3, CTX, CPU, impl="triton") == default_num_splits(3, 8, CTX, CPU, impl="triton")
    # the workspace bound of a layer asks both rules
    assert LayerRuntime("k5v4", 32, 8, 128, 128 ** -0.5, max_batch=4).reserve_numel(CPU) > 0
