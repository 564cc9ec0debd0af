"""Settings a user can read (issue 22, part 4), without a GPU: the engine-start line (preset, decode kernel and why,
split rule, resident CTAs per SM and where that number comes from, prefill path), logged by the engine's settings
resolution; the README's settings table is the declarations' (with the measured-effect column); and the helpers the
``vllm serve`` GPU test reads ``/metrics`` with."""
from test_ops_helpers import DEV  # noqa: F401,I001  (TRITON_INTERPRET before triton loads)

import logging
import types
from pathlib import Path

import pytest
import torch

from kvrepro import settings as st
from kvrepro.ops import common, cuda_decode
from kvrepro.settings import Settings
from kvrepro.vllm_backend import config as cfg

CUDA = torch.device("cuda", 0)
QWEN3_4B = dict(head_dim=128, num_q_heads=32, num_kv_heads=8, block_size=16)


@pytest.fixture(autouse=True)
def _fresh_engine_settings(monkeypatch):
    monkeypatch.setattr(cfg, "_ENGINE_SETTINGS", {})
    monkeypatch.setattr(cfg, "_LAST", [])


@pytest.fixture
def gpu(monkeypatch):
    """A pretend CUDA device 0 of compute capability ``cap`` and ``sms`` SMs whose kernels answer the driver's
    occupancy query with ``answers`` (or whose fatbin fails to load with ``load_error``)."""
    def make(cap=(9, 0), sms=132, answers=None, load_error=None):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
        monkeypatch.setattr(common, "sm_count", lambda device: sms)
        monkeypatch.setattr(cuda_decode, "_RESIDENT", {})
        monkeypatch.setattr(cuda_decode, "load_error", lambda device: load_error)
        mod = types.SimpleNamespace(occupancy=lambda bits: (answers or {})[bits], index=0)
        monkeypatch.setattr(cuda_decode, "load", lambda device, path=cuda_decode.FATBIN: mod)
    return make


def test_engine_line_on_a_gpu_names_kernel_rule_residency_and_prefill(gpu):
    """An A100 answering 3 k4v2 CTAs per SM: the line says the CUDA kernel and why, the whole-wave rule, the 3 resident
    CTAs from the driver's query with the SM count, and the prefill path."""
    gpu(cap=(8, 0), sms=108, answers={(4, 2): 3})
    line = cfg.engine_summary(Settings(preset="k4v2", prefill="dequant"), **QWEN3_4B, device=CUDA)
    assert line == ("kvrepro engine: preset=k4v2 decode=cuda (auto: the CUDA kernel applies, SASS sm_80) "
                    "split_rule=whole waves: w x resident CTAs per SM x SMs // (batch x KV heads) for the fewest w in "
                    "1..3 that fills >= 95% of the launched waves' slots (CUDA graphs serving a range of batches: <= 12 "
                    "CTAs per SM, a power of two, >= 32 splits) "
                    "resident_ctas_per_sm=3 (driver occupancy query; 108 SMs) prefill=dequant")


def test_engine_line_for_triton_fixed_splits_fallback_and_refusal(gpu):
    gpu(cap=(9, 0), sms=132, answers={(4, 4): 4, (5, 4): 4})
    line = cfg.engine_summary(Settings(preset="k4v4", num_splits=8), **QWEN3_4B, device=CUDA)
    assert "decode=cuda" in line and "split_rule=fixed: KVREPRO_NUM_SPLITS=8 " in line
    assert "resident_ctas_per_sm=4 (driver occupancy query; 132 SMs)" in line
    line = cfg.engine_summary(Settings(preset="k4v4"), head_dim=64, num_q_heads=9, num_kv_heads=3, block_size=16, device=CUDA)
    assert line.startswith("kvrepro engine: preset=k4v4 decode=triton (auto: the CUDA decode kernel supports k4v4, "
                           "k8v4, k4v2 and k5v4 pages with head_dim 128 and block_size 16 only")
    assert "split_rule=~32 programs per SM, a power of two (Triton) resident_ctas_per_sm=n/a" in line
    line = cfg.engine_summary(Settings(preset="k5v4"), **QWEN3_4B, device=CUDA)
    assert "decode=cuda (auto: the CUDA kernel applies, SASS sm_90)" in line     # the default preset's own kernel
    line = cfg.engine_summary(Settings(preset="k4v4"), head_dim=256, num_q_heads=16, num_kv_heads=2, block_size=16, device=CUDA)
    assert line.startswith("kvrepro engine: preset=k4v4 decode=refused (head_dim=256 not supported (supported: 64, "
                           "128") and line.endswith(" prefill=fa")
    gpu(cap=(9, 0), sms=132, load_error="cuModuleLoadData failed with CUDA error 222")
    line = cfg.engine_summary(Settings(preset="k4v4"), **QWEN3_4B, device=CUDA)
    assert "decode=triton (auto: the CUDA kernel applies but cuModuleLoadData failed with CUDA error 222)" in line
    gpu(cap=(7, 5))
    line = cfg.engine_summary(Settings(), **QWEN3_4B, device=CUDA)
    assert "decode=refused (kvrepro: compute capability 7.5 not supported" in line


def test_engine_line_without_a_gpu():
    line = cfg.engine_summary(Settings(preset="k4v4", prefill="fa-pages"), **QWEN3_4B, device=torch.device("cpu"))
    assert line == ("kvrepro engine: preset=k4v4 decode=triton (no CUDA device (cpu): the Triton kernel) "
                    "split_rule=~32 programs per SM, a power of two (Triton) resident_ctas_per_sm=n/a (the Triton "
                    "kernel's split rule counts programs, not resident CTAs) prefill=fa-pages")


def test_settings_for_engine_logs_the_engine_line_once(gpu, caplog, monkeypatch):
    """vLLM's config (its model, parallel and cache configs) gives the geometry per tensor-parallel rank: a worker
    logs its settings line and the engine line once, at its first layer; a process that has not initialized CUDA
    (vLLM's API server) is not made to."""
    gpu(cap=(9, 0), sms=132, answers={(8, 4): 4})

    class ModelConfig:
        def get_head_size(self):
            return 128

        def get_num_attention_heads(self, parallel_config):
            return 32 // parallel_config.tensor_parallel_size

        def get_num_kv_heads(self, parallel_config):
            return 8 // parallel_config.tensor_parallel_size

    vllm_config = types.SimpleNamespace(model_config=ModelConfig(),
                                        parallel_config=types.SimpleNamespace(tensor_parallel_size=2),
                                        cache_config=types.SimpleNamespace(block_size=16))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)     # a process that has not touched CUDA
    assert cfg.engine_geometry(vllm_config) is None
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)      # a worker
    with caplog.at_level(logging.INFO, logger=cfg.LOGGER_NAME):
        s = cfg.settings_for_engine(vllm_config, {"KVREPRO_PRESET": "k8v4"})
        cfg.settings_for_engine(vllm_config, {"KVREPRO_PRESET": "k8v4"})
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos == [s.describe(), cfg.engine_summary(s, head_dim=128, num_q_heads=16, num_kv_heads=4, block_size=16,
                                                      device=CUDA)]
    assert infos[1].startswith("kvrepro engine: preset=k8v4 decode=cuda (auto: the CUDA kernel applies, SASS sm_90)")
    assert cfg.engine_geometry(types.SimpleNamespace()) is None


def test_readme_settings_table_is_the_declarations():
    """README.md's settings block is ``kvrepro.summary.settings_block()`` (generated from kvrepro.settings), under
    its own "Settings" heading, with the measured-effect column."""
    from kvrepro import summary

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    block = summary.current_block(text, summary.README, summary.SETTINGS_BEGIN, summary.SETTINGS_END)
    assert block == summary.settings_block()
    assert "| variable | values | default | what it changes | measured effect |" in block
    assert text.index("## Settings") < text.index(summary.SETTINGS_BEGIN)
    assert all(f"| `{d.env}` |" in block for d in st.SETTINGS)


def test_readme_reach_block_is_generated():
    """README.md's "Supported GPUs and models" block is ``kvrepro.reach.block()``; only the H100 / H200 row claims a
    measurement, and every bundled model has a row."""
    from kvrepro import reach
    from kvrepro.configs import model_names

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    new = reach.block()
    assert reach.replace_block(text, new) == text, "README.md's reach block differs: run python -m kvrepro.reach --write"
    measured = [r["family"] for r in reach.gpu_rows() if r["status"].startswith("**measured**")]
    assert measured == ["H100 / H200"]
    assert [r["model"] for r in reach.model_rows()] == list(model_names())
    assert reach.family_of("NVIDIA A10").family == "A10 / A40 / RTX 30"
    assert reach.family_of("NVIDIA A100-SXM4-80GB").family == "A100" and reach.family_of("Tesla T4") is None


def test_serve_metrics_helpers():
    """The GPU serve test's readers: a Prometheus counter summed over label sets (with or without ``_total``), and a
    missing metric is an error, not zero."""
    import test_reach_serve_gpu as serve

    text = """# HELP vllm:num_preemptions Cumulative number of preemptions
# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0",model_name="m"} 2.0
vllm:num_preemptions_total{engine="1",model_name="m"} 1.0
vllm:num_preemptions_created{engine="0"} 1.7e9
"""
    assert serve.counter(text, "vllm:num_preemptions") == 3.0
    with pytest.raises(ValueError, match="vllm:num_requests_running not in /metrics"):
        serve.counter(text, "vllm:num_requests_running")
    assert len(serve.PROMPT_LENS) == len(serve.MAX_TOKENS) >= 16 and max(serve.PROMPT_LENS) < serve.MAX_MODEL_LEN
