"""The CUDA decode kernel's split rule (issue 22): the fewest whole waves (1, 2, 3) of the resident CTA slots whose
count fills them to >= 95%, checked against an independent count (exact fractions, every candidate split count
enumerated) for the configurations of results/reach/carveout_splits_h200.json: an H200's own budget (4 CTAs per SM),
an A100's 164 KB (k4v2: 3) and an Ada GPU's 100 KB (2), 132 SMs, 8 KV heads, batches 3 / 6 / 13 at 128K."""
import math
from fractions import Fraction

import pytest
import torch

from kvrepro.ops import cuda_decode
from kvrepro.ops.decode import default_num_splits, wave_splits

CPU = torch.device("cpu")           # kvrepro.ops.common.sm_count: 132 SMs (an H200) without a CUDA device
CTX = 131072
K4V2, K4V4 = (4, 2), (4, 4)


def reference(pairs: int, slots: int, cap: int) -> int:
    """Enumerate every split count 1..cap, group by the waves it launches, and take the fewest waves (at most 3) whose
    largest count within them fills >= 95% of their slots; else the best fill of those."""
    by_waves = {}
    for s in range(1, cap + 1):
        waves = math.ceil(Fraction(pairs * s, slots))
        if waves <= 3:
            by_waves[waves] = s                  # the largest count of that many waves
    if not by_waves:                             # even 1 split is more than 3 waves: 1 split
        return 1
    fills = {w: Fraction(pairs * s, w * slots) for w, s in by_waves.items()}
    for w in sorted(by_waves):
        if fills[w] >= Fraction(95, 100):
            return by_waves[w]
    return by_waves[max(sorted(fills), key=lambda w: (fills[w], -w))]


@pytest.mark.parametrize("capability,kernel,ctas,want", [
    ((9, 0), K4V4, 4, {3: 22, 6: 11, 13: 5}),      # H200: one wave fills >= 98.5%: unchanged
    ((9, 0), K4V2, 4, {3: 22, 6: 11, 13: 5}),
    ((8, 0), K4V4, 4, {3: 22, 6: 11, 13: 5}),      # A100 budget, 4 CTAs of k4v4
    ((8, 0), K4V2, 3, {3: 16, 6: 8, 13: 11}),      # A100 k4v2: 13 x 8 pairs: 3 fills 0.79, 7 0.92, 11 0.963
    ((8, 9), K4V4, 2, {3: 11, 6: 11, 13: 5}),      # Ada: 6 x 8: 5 fills 240 / 264 = 0.91, 11 fills 1.0; 13: 2 -> 5
])
def test_rule_on_the_carveout_tables_configurations(monkeypatch, capability, kernel, ctas, want):
    monkeypatch.setattr(cuda_decode, "CPU_CAPABILITY", capability)     # the residency model of that GPU, 132 SMs
    assert cuda_decode.ctas_per_sm(CPU, kernel) == ctas
    for batch, splits in want.items():
        got = default_num_splits(batch, 8, CTX, CPU, "cuda", kernel=kernel)
        assert got == splits == reference(batch * 8, ctas * 132, 256), (capability, kernel, batch)


def test_rule_agrees_with_the_enumeration_over_many_shapes():
    for slots in (2 * 108, 3 * 108, 4 * 108, 2 * 132, 3 * 132, 4 * 132, 2 * 170, 4 * 148):
        for pairs in list(range(1, 130)) + [200, 400, 527, 528, 529, 1000, 2000]:
            for cap in (1, 16, 64, 256):
                assert wave_splits(pairs, slots, cap) == reference(pairs, slots, cap), (pairs, slots, cap)


def test_caps_are_kept():
    assert default_num_splits(1, 8, 4096, CPU, "cuda") == 16             # 4096 / 256 tokens per split
    assert default_num_splits(1, 1, 10 ** 7, CPU, "cuda") == 256          # at most 256 splits
    assert default_num_splits(200, 8, CTX, CPU, "cuda") == 1              # 1,600 pairs > 3 waves of 528: 1 split
    assert default_num_splits(0, 8, CTX, CPU, "cuda") == 256              # an empty batch counts as one pair


def test_bad_arguments_name_the_parameter():
    for name, args in (("pairs", (0, 528)), ("slots", (8, 0)), ("cap", (8, 528, 0)), ("pairs", (True, 528))):
        with pytest.raises(ValueError, match=rf"{name} must be an int >= 1"):
            wave_splits(*args)
