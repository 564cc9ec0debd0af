"""Key centering vs position (issue 5, CPU): 4-bit key error (k4v4's quantizer: Hadamard rotation, per-token
asymmetric 4 bits) of an 8,184-token needle prompt's keys, per position range, with no centering and with the mean
key of another prompt (8,184 tokens, positions >= 1, as the vLLM backend takes it from the engine's first prefill),
SmolLM2-135M-Instruct in float32 on the CPU. Error = squared error / squared norm of the key, averaged over layers,
KV heads and the positions of the range.

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. python prototypes/key_center/error_by_position.py
"""
import torch
from transformers import Cache, DynamicLayer

from kvrepro.formats.compressed import dequantize_rotated, quantize_rotated
from kvrepro.formats.hadamard import rotation_matrix
from kvrepro.hf import load_smollm2
from kvrepro.needle import build_prompt

torch.set_num_threads(2)


def keys_of(model, ids):
    c = Cache(layers=[DynamicLayer() for _ in range(model.config.num_hidden_layers)])
    with torch.no_grad():
        model(torch.tensor([ids]), past_key_values=c, use_cache=True)
    return [layer.keys[0].float() for layer in c.layers]   # [H, S, D] per layer


def main():
    model, tok = load_smollm2(torch.float32)
    scored = keys_of(model, build_prompt(tok, 8184, 0.33, "43936", "single").input_ids)
    calib = keys_of(model, build_prompt(tok, 8184, 0.0, "60494", "single").input_ids)
    rot = rotation_matrix(scored[0].shape[-1])
    edges = [1, 1024, 2048, 4096, 6144, 8184]
    rows = {"uncentered": [], "centered (mean of another 8K prompt)": [], "centered (mean of positions 1-2047)": []}
    for k, kc in zip(scored, calib):
        n = k.shape[1]
        means = {"uncentered": torch.zeros(k.shape[0], 1, k.shape[2]),
                 "centered (mean of another 8K prompt)": kc[:, 1:].mean(1, keepdim=True),
                 "centered (mean of positions 1-2047)": kc[:, 1:2048].mean(1, keepdim=True)}
        for name, mu in means.items():
            x = (k - mu) @ rot
            packed, meta = quantize_rotated(x, 4)
            err = (dequantize_rotated(packed, meta, 4) - x).pow(2).sum(-1) / k.pow(2).sum(-1)   # [H, S]
            rows[name].append([float(err[:, lo:min(hi, n)].mean()) for lo, hi in zip(edges, edges[1:])])
    print("positions:", ", ".join(f"{lo}-{hi - 1}" for lo, hi in zip(edges, edges[1:])))
    for name, per_layer in rows.items():
        avg = torch.tensor(per_layer).mean(0).tolist()
        print(f"{name:40} " + "  ".join(f"{v:.5f}" for v in avg))


if __name__ == "__main__":
    main()
