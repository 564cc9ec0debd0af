"""Does the source of the mean decide whether key centering helps (issue 5, CPU)? Through vLLM the backend took its
mean from the engine's first prefill step, which for the committed bundle held eight 1,023-1,024-token prompts and 4 tokens
of a ninth (8,183 keys at positions 1-1,023). Here the two 8,184-token prompts vLLM lost or kept (key 43936, depths
0.33 and 0.17) are read as vLLM serves them (prompt exact, decode steps from the pages; center_8184.VllmLike) with
the mean of (1) the first eight 1K prompts of the bundle, positions 1-1,023, and (2) one 8K prompt of the bundle
(depth 0.0, key 60494), positions 1-8,183.

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. python prototypes/key_center/center_mean_source.py
"""
import gzip
import json
import os
import sys

import torch
from transformers import Cache, DynamicLayer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from center_8184 import VllmLike, run  # noqa: E402

from kvrepro.formats import get_format  # noqa: E402
from kvrepro.hf import load_smollm2  # noqa: E402
from kvrepro.needle import build_prompt  # noqa: E402

torch.set_num_threads(2)


def mean_keys(model, prompts):
    """Per layer [H, D]: mean over every prompt's keys at positions >= 1 (each prompt prefilled alone)."""
    sums, n = None, 0
    for ids in prompts:
        c = Cache(layers=[DynamicLayer() for _ in range(model.config.num_hidden_layers)])
        with torch.no_grad():
            model(torch.tensor([ids]), past_key_values=c, use_cache=True)
        ks = [layer.keys[0].double()[:, 1:].sum(1) for layer in c.layers]
        sums = ks if sums is None else [a + b for a, b in zip(sums, ks)]
        n += len(ids) - 1
    return [(s / n).float() for s in sums]


def main():
    model, tok = load_smollm2(torch.bfloat16)
    bundle = json.load(gzip.open("results/accuracy/vllm_prompts.json.gz", "rt"))["prompts"]
    first8 = [p["input_ids"] for p in bundle[:8]]
    assert all(len(x) in (1023, 1024) for x in first8)
    long8k = [p["input_ids"] for p in bundle if p["variant"] == "single" and p["context_length"] == 8184
              and p["depth"] == 0.0 and p["key"] == "60494"][:1]
    means = {"mean of the first 8 x 1K prompts": mean_keys(model, first8),
             "mean of one 8K prompt": mean_keys(model, long8k)}
    fmt = get_format("k4v4")
    n = model.config.num_hidden_layers
    for depth in (0.33, 0.17):
        p = build_prompt(tok, 8184, depth, "43936", "single")
        for name, mu in means.items():
            text, ok, lp, sec = run(model, tok, p, Cache(layers=[VllmLike(fmt, mu[i]) for i in range(n)]))
            print(f"depth {depth}: centered, {name:34} {text!r:12} correct {ok} key logprob {lp:.4f} ({sec:.0f} s)",
                  flush=True)


if __name__ == "__main__":
    main()
