"""benchmarks/step_floor.py's CPU side: the decode GEMM shapes it times come from a bundled config and hold exactly
the weights the step profiles' bound counts, less the norms; its command line refuses bad input before any GPU work."""
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import step_floor as sf
from kvrepro.configs import load_config
from kvrepro.capacity import ModelConfig

ROOT = Path(__file__).resolve().parents[1]


def test_gemm_shapes_of_qwen3_4b():
    shapes = sf.gemm_shapes(load_config("qwen3-4b-instruct-2507"))
    # hidden 2560, 32 q / 8 KV heads of 128, intermediate 9728, 36 layers, vocabulary 151,936 (config.json)
    assert shapes == [("qkv", 2560, 32 * 128 + 2 * 8 * 128, 36), ("o", 32 * 128, 2560, 36),
                      ("gate_up", 2560, 2 * 9728, 36), ("down", 9728, 2560, 36), ("lm_head", 2560, 151936, 1)]


@pytest.mark.parametrize("name", ["qwen3-4b-instruct-2507", "llama-3.1-8b-instruct", "qwen3-0.6b"])
def test_gemm_weights_are_the_bounds_weights_less_the_norms(name):
    """ModelConfig.weights_bytes (the bound's weights, kvrepro.capacity) counts every parameter once; what the GEMMs
    read is that less the RMSNorm weights (2 per layer, the final one, and per-head q / k norms as that count has
    them) and, for untied embeddings, the input embedding table (a gather, not a GEMM)."""
    cfg = load_config(name)
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    norms = (2 * layers + 1) * h + 2 * layers * hd
    embed = 0 if cfg.get("tie_word_embeddings") else cfg["vocab_size"] * h
    assert sf.gemm_weight_bytes(sf.gemm_shapes(cfg)) == ModelConfig.from_hf(cfg).weights_bytes - 2 * (norms + embed)


def test_gemm_shapes_names_a_missing_key():
    cfg = dict(load_config())
    del cfg["intermediate_size"]
    with pytest.raises(ValueError, match="intermediate_size"):
        sf.gemm_shapes(cfg)


@pytest.mark.parametrize("args, msg", [(["--rows", "0"], "--rows must be in 1..4096"),
                                       (["--rows", "13", "5000"], "--rows must be in 1..4096"),
                                       (["--model", "nope"], "--model 'nope'"),
                                       (["--out", "benchmarks"], "--out 'benchmarks' is a folder"),
                                       (["--out", "/nonexistent/x.json"], "its folder does not exist")])
def test_command_line_refuses_bad_input(args, msg):
    r = subprocess.run([sys.executable, "benchmarks/step_floor.py", *args], cwd=ROOT, capture_output=True, text=True,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert r.returncode == 2 and msg in r.stderr, r.stderr
