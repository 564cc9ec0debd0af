"""CPU emulation (numpy): the P.V accumulation of the split-plane decode kernel over one 131,072-token
split when the tensor core adds in float32 with round-toward-zero (Fasi, Higham, Mikaitis, Pranesh
2021, "Numerical behavior of NVIDIA tensor cores"), for one 4-bit value plane: the old scheme
(unsigned codes, chained accumulation) vs centred codes vs the fix (centred, per-tile sums added
in float32 round-to-nearest). A model of the hardware, not a measurement: `python benchmarks/emulate_tc_accumulation.py`."""
import numpy as np
rng = np.random.default_rng(0)
N, C = 131072, 64                      # tokens in one split, channels of one plane
logits = rng.standard_normal(N) * 1.44  # log2 units, like q.k for N(0,1) data at head_dim 128
p = np.exp2(logits - logits.max())
vs = np.abs(rng.standard_normal(N)) * 0.1 + 0.3          # V scales
codes = rng.integers(0, 16, size=(N, C)).astype(np.float64)
pv16 = (p * vs).astype(np.float16).astype(np.float64)
pvs = p * vs

def rz32(x):
    r = x.astype(np.float32)
    over = np.abs(r.astype(np.float64)) > np.abs(x)
    r[over] = np.nextafter(r[over], np.float32(0))
    return r.astype(np.float64)

def accumulate(center, per_tile, tile=256):
    vals = codes - center
    acc = np.zeros(C)
    for t0 in range(0, N, tile):
        blk = np.zeros(C) if per_tile else acc
        for k0 in range(t0, t0 + tile, 16):               # one k16 MMA step: exact products, RZ add
            blk = rz32(blk + pv16[k0:k0 + 16] @ vals[k0:k0 + 16])
        acc = (acc + blk).astype(np.float32).astype(np.float64) if per_tile else blk
    return acc

l = p.sum()
ref = (pvs[:, None] * (codes - 7.5)).sum(0) / l                 # exact output (code units x scale)
for center, per_tile, name in ((0, False, "old: unsigned codes, chained MMA accumulation"),
                               (8, False, "centred codes, chained"),
                               (8, True, "new: centred codes, per-tile MMA sums + fp32 RNE adds")):
    acc = accumulate(center, per_tile)
    out = acc / l + (center - 7.5) * pvs.sum() / l
    print(f"{name:58s} relerr {np.linalg.norm(out - ref) / np.linalg.norm(ref):.2e}")
