"""CPU path on the two k4v4 needle misses of the vLLM grid (8,184 tokens, key 43936, depths 0.17 / 0.33), bf16 and k4v4
through ``kvrepro.accuracy.run_one`` (the committed prompt builder: the prompts' SHA-256 match the vLLM rows). The CPU
path reads every prompt position from the pages. Raw output of 2026-11-30: ``run_one_20261130.log``.

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. python prototypes/recent_window/run_one_8184.py [--dtype float32|bfloat16]
"""
import argparse
import time

import pandas as pd
import torch

from kvrepro.accuracy import run_one
from kvrepro.hf import load_smollm2
from kvrepro.needle import build_prompt

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="load_smollm2's compute dtype")
args = ap.parse_args()
torch.set_num_threads(2)
a = pd.read_csv("results/accuracy/vllm_h200/vllm_accuracy.csv")
model, tok = load_smollm2(getattr(torch, args.dtype))
for depth in (0.17, 0.33):
    p = build_prompt(tok, 8184, depth, "43936", "single")
    vl = a[(a.prompt_sha256 == p.sha256)]
    print(depth, p.n_tokens, "sha in vLLM rows:", len(vl), dict(zip(vl["mode"], vl["answer"])), flush=True)
    for fmt in ("bf16", "k4v4"):
        t = time.time()
        r = run_one(model, tok, p, fmt, 12)
        print(fmt, repr(r["answer"]), r["correct"], round(r["key_logprob_mean"], 4), f"{time.time() - t:.0f} s", flush=True)
