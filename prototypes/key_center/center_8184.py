"""CPU experiment (issue 5): does key centering (kvrepro.formats.centering) rescue the k4v4 miss at 8,184 tokens /
depth 0.33 / key 43936 (SmolLM2-135M-Instruct with bf16 casts, as in prototypes/recent_window/)?

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. python prototypes/key_center/center_8184.py

Two readings, as in prototypes/recent_window/README.md: (a) the CPU path's own rule (every position from the
pages; kvrepro.hf.make_cache, with key_center=True: the mean key of the prompt itself, its first prefill),
(b) as vLLM serves it (the prompt attends to its own keys exact, decode steps read everything from the pages),
with the mean taken from *another* prompt (2,048 tokens, depth 0.5, key 27182), as the vLLM backend takes it from
the engine's first prefill. Prints the greedy answer and the mean teacher-forced log-prob of the key digits.
"""
import time

import torch
from transformers import Cache, DynamicLayer

from kvrepro.formats import get_format
from kvrepro.hf import PagedKVLayer, greedy_generate, load_smollm2, make_cache, prefill, teacher_forced_logprobs
from kvrepro.needle import answer_decided, build_prompt, score_answer

torch.set_num_threads(2)


class VllmLike(PagedKVLayer):
    """Reading (b): a multi-token call attends to its own K/V exact (shifted by the same mean), a decode step
    reads every position from the pages."""

    def __init__(self, fmt, mean):
        super().__init__(fmt, 16)
        self.mean = mean
        self.raw_k = self.raw_v = None

    def update(self, key_states, value_states, *a, **kw):
        if self.mean is not None:
            key_states = key_states - self.mean.to(key_states.dtype)[None, :, None, :]
        k, v = super().update(key_states, value_states, *a, **kw)
        t = key_states.shape[2]
        if t > 1:
            k, v = k.clone(), v.clone()
            k[:, :, -t:] = key_states.to(k.dtype)
            v[:, :, -t:] = value_states.to(v.dtype)
        return k, v


def key_means(model, ids):
    c = Cache(layers=[DynamicLayer() for _ in range(model.config.num_hidden_layers)])
    with torch.no_grad():
        model(torch.tensor([ids]), past_key_values=c, use_cache=True)
    return [layer.keys[0].float()[:, 1:].mean(1) for layer in c.layers]   # [H, D], positions >= 1


def run(model, tok, p, cache):
    t = time.time()
    first = prefill(model, torch.tensor([p.input_ids]), cache)
    lps = teacher_forced_logprobs(model, first, p.answer_ids, cache)
    out = greedy_generate(model, first, cache, 12, stop_ids=(tok.eos_token_id,),
                          stop_when=lambda t_: answer_decided(tok.decode(t_)))
    text = tok.decode(out, skip_special_tokens=True)
    return text, score_answer(text, p.key), float(lps.mean()), time.time() - t


def main():
    model, tok = load_smollm2(torch.bfloat16)
    fmt = get_format("k4v4")
    n = model.config.num_hidden_layers
    mu_other = key_means(model, build_prompt(tok, 2048, 0.5, "27182", "single").input_ids)
    for depth in (0.33, 0.17):
        p = build_prompt(tok, 8184, depth, "43936", "single")
        variants = [
            ("(a) bf16", make_cache("bf16", n)),
            ("(a) k4v4 uncentered", make_cache("k4v4", n, key_center=False)),
            ("(a) k4v4 centered (make_cache default)", make_cache("k4v4", n, key_center=True)),
            ("(b) k4v4 uncentered", Cache(layers=[VllmLike(fmt, None) for _ in range(n)])),
            ("(b) k4v4 centered, mean of another prompt", Cache(layers=[VllmLike(fmt, mu_other[i]) for i in range(n)])),
        ]
        for name, cache in variants:
            text, ok, lp, sec = run(model, tok, p, cache)
            print(f"depth {depth}: {name:42} {text!r:12} correct {ok} key logprob {lp:.4f} ({sec:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
