"""Key centering across the 8,184-token single-needle prompts (issue 5, CPU), every position read from the pages (the
CPU path's own rule, `make_cache`), uncentered vs centered with the mean vLLM's engine used (its first prefill step on
the committed bundle: eight ~1K prompts and 4 tokens of a ninth; center_mean_source.py). Key 43936, depths 0-0.83.
Prints the teacher-forced mean log-prob of the key digits per prompt and the mean change vs bf16.

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. python prototypes/key_center/center_grid_8184.py
"""
import gzip
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from center_mean_source import mean_keys  # noqa: E402

from kvrepro.hf import load_smollm2, make_cache, prefill, teacher_forced_logprobs  # noqa: E402
from kvrepro.needle import build_prompt  # noqa: E402

torch.set_num_threads(2)


def key_logprob(model, p, cache):
    first = prefill(model, torch.tensor([p.input_ids]), cache)
    return float(teacher_forced_logprobs(model, first, p.answer_ids, cache).mean())


def main():
    model, tok = load_smollm2(torch.bfloat16)
    n = model.config.num_hidden_layers
    bundle = json.load(gzip.open("results/accuracy/vllm_prompts.json.gz", "rt"))["prompts"]
    mu = mean_keys(model, [p["input_ids"] for p in bundle[:8]])
    deltas = {"uncentered": [], "centered": []}
    for depth in (0.0, 0.17, 0.33, 0.5, 0.67, 0.83):
        t = time.time()
        p = build_prompt(tok, 8184, depth, "43936", "single")
        base = key_logprob(model, p, make_cache("bf16", n))
        un = key_logprob(model, p, make_cache("k4v4", n))
        cache = make_cache("k4v4", n, key_center=True)
        for layer, m in zip(cache.layers, mu):
            layer.key_mean = m            # the engine's mean, fixed before the first update
        ce = key_logprob(model, p, cache)
        deltas["uncentered"].append(un - base)
        deltas["centered"].append(ce - base)
        print(f"depth {depth}: bf16 {base:.4f}  k4v4 uncentered {un:.4f}  k4v4 centered {ce:.4f}  ({time.time() - t:.0f} s)",
              flush=True)
    for k, v in deltas.items():
        print(f"mean change vs bf16, {k}: {sum(v) / len(v):+.4f}  (worst {min(v):+.4f})", flush=True)


if __name__ == "__main__":
    main()
