"""GPU smoke test of the kvrepro vLLM backend on a tiny Qwen3-shaped model (dummy weights).

One case per process (``--case``), vLLM in-process, results as one JSON line on stdout and in ``--out``:

  graphs    CUSTOM/k4v4 with torch.compile + full CUDA graphs for decode (vLLM default mode),
            chunked prefill (max_num_batched_tokens 512) so prefill chunks and decodes share batches;
            greedy twice (must be identical), then sampled; every eagerly run attention call
            (prefill/mixed) is compared with ``runtime.reference_attend`` (KVREPRO_DEBUG_CHECK=1).
  piecewise same engine with cudagraph_mode PIECEWISE (decode attention eager, hence checked too) and
            prefix caching on: a shared-prefix pair, the second request's prefill must hit vLLM's prefix
            cache (``vllm:prefix_cache_hits`` grows by >= 1,024 tokens) and read that context from the
            compressed pages, checked against the reference like every call; greedy tokens compared with
            the graphs case.
  refuse    a head_dim-96 model with --attention-backend CUSTOM must fail at engine start naming head_dim.
  sizing    Qwen3-4B bundled config at an emulated 80 GiB: KV-cache tokens with CUSTOM (KVREPRO_PRESET)
            vs bf16 from --bf16-tokens; needs ``--preset``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("KVREPRO_DEBUG_CHECK", "1")

TINY = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "head_dim": 128,
        "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 2048, "max_position_embeddings": 40960,
        "num_attention_heads": 8, "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "vocab_size": 151936,
        "bos_token_id": 151643, "eos_token_id": 151645, "sliding_window": None, "use_sliding_window": False}


def model_dir(**overrides) -> str:
    d = tempfile.mkdtemp(prefix="kvrepro_tiny_")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(dict(TINY, **overrides), f)
    return d


def prompts(n_long=3000):
    import numpy as np

    rng = np.random.default_rng(0)
    return [{"prompt_token_ids": rng.integers(1000, 150000, size=n).tolist()} for n in (n_long, 100, 17, 700)]


def engine(**kw):
    from vllm import LLM

    args = dict(model=model_dir(), load_format="dummy", skip_tokenizer_init=True, max_model_len=8192,
                gpu_memory_utilization=0.12, attention_backend="CUSTOM", max_num_batched_tokens=512,
                max_num_seqs=16, block_size=16, seed=0, enable_prefix_caching=False)
    args.update(kw)
    return LLM(**args)


def gen(llm, ps, **sp):
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=sp.pop("max_tokens", 48), ignore_eos=True, detokenize=False, **sp)
    return [list(o.outputs[0].token_ids) for o in llm.generate(ps, params, use_tqdm=False)]


def check_summary():
    from kvrepro.vllm_backend.runtime import CHECKS

    ok = [c for c in CHECKS if c["rel_err"] is not None]
    errs = [c["rel_err"] for c in ok]
    return {"checked_calls": len(ok), "decode_calls_checked": sum(1 for c in ok if c["num_decodes"]),
            "unchecked_calls": len(CHECKS) - len(ok), "first_unchecked": next((c for c in CHECKS if c["rel_err"] is None), None),
            "max_rel_err": max(errs) if errs else None}


def case_graphs(a):
    t = time.perf_counter()
    llm = engine()
    init = time.perf_counter() - t
    cc = llm.llm_engine.vllm_config.compilation_config
    ps = prompts()
    g1 = gen(llm, ps, temperature=0.0)
    g2 = gen(llm, ps, temperature=0.0)
    s1 = gen(llm, ps, temperature=1.0, top_p=0.9, seed=7)
    return {"init_s": round(init, 1), "cudagraph_mode": str(cc.cudagraph_mode), "compile_mode": str(cc.mode),
            "greedy_repeatable": g1 == g2, "greedy": g1, "sampled_differs_from_greedy": s1 != g1,
            "backend": type(llm.llm_engine.vllm_config.attention_config.backend).__name__ + ":" +
            str(llm.llm_engine.vllm_config.attention_config.backend), **check_summary()}


def case_piecewise(a):
    # disable_log_stats=False: the offline LLM turns stat logging off, and get_metrics() (the prefix-cache hit
    # counter) then raises "Stat logging disabled"
    llm = engine(compilation_config={"cudagraph_mode": "PIECEWISE"}, enable_prefix_caching=True,
                 disable_log_stats=False)
    ps = prompts()
    g = gen(llm, ps, temperature=0.0)
    import numpy as np

    rng = np.random.default_rng(1)
    prefix = rng.integers(1000, 150000, size=1024).tolist()
    pair = [{"prompt_token_ids": prefix + rng.integers(1000, 150000, size=n).tolist()} for n in (50, 90)]
    gen(llm, pair[:1], temperature=0.0, max_tokens=4)
    from kvrepro.sweep_worker import counter
    from kvrepro.vllm_backend.runtime import CHECKS

    hits0, calls0 = counter(llm, "vllm:prefix_cache_hits"), len(CHECKS)
    from vllm import SamplingParams

    out2 = llm.generate(pair[1:], SamplingParams(max_tokens=16, ignore_eos=True, detokenize=False, temperature=0.0),
                        use_tqdm=False)
    p2 = [list(o.outputs[0].token_ids) for o in out2]
    hit_calls = [c for c in CHECKS[calls0:] if c["rel_err"] is not None]
    ref = json.load(open(a.compare)) if a.compare and os.path.exists(a.compare) else None
    same = None if ref is None else [x == y for x, y in zip(g, ref["greedy"])]
    return {"greedy": g, "greedy_equal_to_graphs_case": same, "prefix_hit_output_tokens": len(p2[0]),
            "prefix_cache_hit_tokens": counter(llm, "vllm:prefix_cache_hits") - hits0,
            "prefix_hit_request_num_cached_tokens": getattr(out2[0], "num_cached_tokens", None),
            "prefix_hit_request_checked_calls": len(hit_calls),
            "prefix_hit_request_max_rel_err": max((c["rel_err"] for c in hit_calls), default=None),
            **check_summary()}


def case_preempt(a):
    """vLLM's preemption counter, read as the capacity sweep reads it (``sweep_worker.preemptions``), on a workload
    that must preempt: 8 requests of 64 + 128 tokens (96 blocks of 16) in a KV cache of 48 blocks."""
    from kvrepro.sweep_worker import counter, preemptions

    llm = engine(num_gpu_blocks_override=48, max_num_seqs=8, max_model_len=512, disable_log_stats=False)
    import numpy as np

    rng = np.random.default_rng(2)
    ps = [{"prompt_token_ids": rng.integers(1000, 150000, size=64).tolist()} for _ in range(8)]
    p0 = preemptions(llm)
    out = gen(llm, ps, temperature=0.0, max_tokens=128)
    return {"num_gpu_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
            "blocks_needed_if_all_ran_at_once": 8 * (64 + 128) // 16, "preemptions_counter_delta": preemptions(llm) - p0,
            "output_tokens": [len(o) for o in out], "prompt_tokens_counter": counter(llm, "vllm:prompt_tokens"),
            "generation_tokens_counter": counter(llm, "vllm:generation_tokens")}


def case_refuse(a):
    try:
        engine(model=model_dir(head_dim=96, hidden_size=768))
    except Exception as e:  # noqa: BLE001 - report what vLLM raised
        msg = f"{type(e).__name__}: {e}"
        return {"refused": True, "names_head_dim": "head_dim=96" in msg, "message": msg[-600:]}
    return {"refused": False}


def case_sizing(a):
    from kvrepro.configs import config_dir
    from kvrepro.sweep import memory_utilization

    import torch

    util = memory_utilization(80.0, torch.cuda.get_device_properties(0).total_memory)
    llm = engine(model=str(config_dir()), gpu_memory_utilization=util, max_model_len=131072 + 1024 + 1088,
                 max_num_batched_tokens=None, max_num_seqs=32)
    blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    return {"preset": os.environ.get("KVREPRO_PRESET", "k4v4"), "num_gpu_blocks": blocks,
            "kv_cache_tokens": blocks * 16, "gpu_memory_utilization": util}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True, choices=["graphs", "piecewise", "refuse", "sizing", "preempt"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--compare", default=None)
    a = ap.parse_args()
    res = {"case": a.case, **globals()[f"case_{a.case}"](a)}
    from kvrepro.fileio import atomic_write
    from kvrepro.vllm_backend.config import settings_for_engine

    res["kvrepro_settings"] = settings_for_engine().as_dict()   # what the case's engine resolved (and logged)
    atomic_write(a.out, lambda f: json.dump(res, f))   # write, then rename: no half-written result file
    print("SMOKE " + json.dumps({k: v for k, v in res.items() if k not in ("greedy",)}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
