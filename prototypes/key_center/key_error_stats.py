"""4-bit key error / variance of a 4K needle prompt's keys (SmolLM2, float32 CPU), uncentered vs centered (issue 5; notes/accuracy.md).

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. python prototypes/key_center/key_error_stats.py
"""
import torch
torch.set_num_threads(2)
from transformers import Cache, DynamicLayer
from kvrepro.hf import load_smollm2
from kvrepro.needle import build_prompt
from kvrepro.formats.compressed import quantize_rotated, dequantize_rotated
from kvrepro.formats.hadamard import rotation_matrix
model, tok = load_smollm2(torch.float32)
p = build_prompt(tok, 4096, 0.33, "43936", "single")
cache = Cache(layers=[DynamicLayer() for _ in range(model.config.num_hidden_layers)])
with torch.no_grad():
    model(torch.tensor([p.input_ids]), past_key_values=cache, use_cache=True)
R = rotation_matrix(64)
def err(k):
    kr = k @ R
    pk, m = quantize_rotated(kr, 4)
    return ((dequantize_rotated(pk, m, 4) - kr).pow(2).sum(-1)).mean().item()
tot = {}
for li, layer in enumerate(cache.layers):
    k = layer.keys[0].float()    # [H, S, D]
    for h in range(k.shape[0]):
        kk = k[h]
        mu = kk.mean(0, keepdim=True)
        mu_early = kk[:64].mean(0, keepdim=True)
        e0, e1, e2 = err(kk), err(kk - mu), err(kk - mu_early)
        var = (kk - mu).pow(2).sum(-1).mean().item()
        if li % 6 == 0 and h == 0:
            print(f"L{li} h{h}: |mu|^2/var {mu.pow(2).sum().item()/var:.2f}  err plain {e0/var:.4f} mu-sub {e1/var:.4f} mu(first64) {e2/var:.4f}")
        for n, e in (("plain", e0), ("mu", e1), ("mu64", e2)):
            tot[n] = tot.get(n, 0) + e / var
print({k: v / (len(cache.layers) * 3) for k, v in tot.items()})
