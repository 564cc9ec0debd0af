"""CPU experiment (issue 5): which part of k4v4 loses the single-needle prompt 8184 tokens / depth 0.33 / key 43936,
and whether a bf16 window of the most recent tokens (KIVI, Liu et al. 2024, arXiv:2402.02750, keeps a full-precision
residual of recent tokens) rescues it.

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. python prototypes/recent_window/cpu_needle_8184.py [--recent 16 32 64 128]

The CPU path (SmolLM2-135M-Instruct, KV stored as k4v4 page bytes, ``kvrepro.hf``) with ``load_smollm2(torch.bfloat16)``
(bf16 casts around the matmuls) reproduces the vLLM miss of this prompt; float32 compute does not (notes/accuracy.md).
As in vLLM (its prefill paths attend to a chunk's own K/V exactly; the accuracy runner prefills each prompt in one
chunk), a multi-token call (the prompt, the teacher-forced answer) reads its own tokens exact and earlier ones from
the pages; a decode step reads everything, itself included, from the pages. Each variant then replaces selected
positions of the dequantized K/V by the exact bf16 values.
Results (2026-11-30, the 2-core CPU machine, torch 2.13.0+cpu, transformers 5.24.0; ~34 s a run): see
prototypes/recent_window/README.md. Not a kvrepro feature: the vLLM backend has no bf16 window.
"""
import argparse
import time

import torch
from transformers import Cache
torch.set_num_threads(2)
from kvrepro.formats import get_format
from kvrepro.hf import PagedKVLayer, load_smollm2, prefill, teacher_forced_logprobs, greedy_generate
from kvrepro.needle import build_prompt, score_answer, answer_decided

class Mixed(PagedKVLayer):
    def __init__(self, fmt, exact_k=False, exact_v=False, sink=0, recent=0):
        super().__init__(fmt, 16)
        self.exact_k, self.exact_v, self.sink, self.recent = exact_k, exact_v, sink, recent
        self.rk = self.rv = None
    def crop(self, n):
        super().crop(n)
        self.rk, self.rv = self.rk[:, :, :self.seq_len], self.rv[:, :, :self.seq_len]

    def update(self, key_states, value_states, *a, **kw):
        k, v = super().update(key_states, value_states, *a, **kw)
        self.rk = key_states if self.rk is None else torch.cat([self.rk, key_states], 2)
        self.rv = value_states if self.rv is None else torch.cat([self.rv, value_states], 2)
        k, v = k.clone(), v.clone()
        S, t = k.shape[2], key_states.shape[2]
        keep = torch.zeros(S, dtype=torch.bool)
        if t > 1:   # a prefill chunk attends to its own K/V exactly, as vLLM's prefill paths do (decode: all from pages)
            keep[S - t:] = True
        keep[:self.sink] = True
        if self.recent: keep[max(0, S - self.recent):] = True
        if self.exact_k: k = self.rk.to(k.dtype)
        if self.exact_v: v = self.rv.to(v.dtype)
        k[:, :, keep] = self.rk[:, :, keep].to(k.dtype); v[:, :, keep] = self.rv[:, :, keep].to(v.dtype)
        return k, v

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("--recent", type=int, nargs="*", default=[16, 32, 64, 128], help="bf16 window sizes to try")
args = ap.parse_args()
model, tok = load_smollm2(torch.bfloat16)
p = build_prompt(tok, 8184, 0.33, "43936", "single")
fmt = get_format("k4v4")
variants = [("bf16 (exact K and V)", dict(exact_k=True, exact_v=True)), ("k4v4", {}), ("k4v4 exact K (V 4-bit)", dict(exact_k=True)), ("k4v4 exact V (K 4-bit)", dict(exact_v=True)),
            ("k4v4 + bf16 sink 4", dict(sink=4)), ("k4v4 + bf16 sink 4 + recent 128", dict(sink=4, recent=128))]
variants += [(f"k4v4 + bf16 recent {r}", dict(recent=r)) for r in args.recent]
for name, kw in variants:
    t = time.time()
    cache = Cache(layers=[Mixed(fmt, **kw) for _ in range(model.config.num_hidden_layers)])
    ids = torch.tensor([p.input_ids])
    first = prefill(model, ids, cache)
    lps = teacher_forced_logprobs(model, first, p.answer_ids, cache)
    out = greedy_generate(model, first, cache, 12, stop_ids=(tok.eos_token_id,), stop_when=lambda t_: answer_decided(tok.decode(t_)))
    text = tok.decode(out, skip_special_tokens=True)
    print(f"{name:34} {text!r:14} correct {score_answer(text, '43936')} key logprob {float(lps.mean()):.4f} ({time.time() - t:.0f} s)", flush=True)
