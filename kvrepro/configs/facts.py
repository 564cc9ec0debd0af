"""What serving a bundled model with kvrepro's KV cache depends on, read from its ``config.json``.

:func:`model_facts` gives head_dim, query and KV heads, GQA group, layers, RoPE theta, max positions, key biases,
sliding window and MLA, and the KV bytes per token of every KV format (``kvrepro.capacity.bytes_per_token``: the
arithmetic the capacity notebook uses, not a copy of it); :func:`models_table` one row per bundled model. A module of
its own because ``kvrepro.capacity`` reads the bundled configs (``kvrepro.configs``) and this reads ``kvrepro.capacity``.
"""
from __future__ import annotations

import dataclasses

from kvrepro.capacity import ModelConfig, bytes_per_token
from kvrepro.configs import DEFAULT_MODEL, load_config, model_names
# Architectures whose attention adds a bias to q / k / v although their config has no ``attention_bias`` key:
# Qwen2 (transformers' modeling_qwen2 and vLLM's qwen2.py build q/k/v projections with bias=True).
KEY_BIAS_BY_MODEL_TYPE = {"qwen2": True}
KV_FORMATS = ("bf16", "fp8", "k8v4", "k5v4", "k4v4", "k4v2")     # the columns of ``kv_bytes_per_token``


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What serving a model with kvrepro's KV cache depends on, from its ``config.json``.

    Attributes:
        name: bundled folder name.
        architecture: ``architectures[0]`` (``"LlamaForCausalLM"``, ...); model_type: ``model_type``.
        head_dim: ``head_dim`` if the config gives it, else ``hidden_size // num_attention_heads``.
        num_q_heads, num_kv_heads: attention heads and KV heads (``num_key_value_heads``, default: no GQA).
        group: GQA group, query heads per KV head (``num_q_heads // num_kv_heads``).
        num_layers: decoder layers. rope_theta: RoPE base. max_positions: ``max_position_embeddings``.
        has_key_bias: the key projection adds a bias (``attention_bias``, or the architecture's own, see
            ``KEY_BIAS_BY_MODEL_TYPE``): keys then carry a constant offset the key-offset setting subtracts.
        sliding_window: the window (tokens) the model attends within, None for full attention (a config's
            ``sliding_window`` counts only where ``use_sliding_window`` is not false).
        mla: multi-head latent attention (a ``kv_lora_rank`` in the config).
        kv_bytes_per_token: ``{format: bytes}`` of one token's K and V over all layers and KV heads, per format of
            ``KV_FORMATS`` (``kvrepro.capacity.bytes_per_token``); None for a format that cannot hold this head_dim.
    """

    name: str
    architecture: str
    model_type: str
    head_dim: int
    num_q_heads: int
    num_kv_heads: int
    group: int
    num_layers: int
    rope_theta: float
    max_positions: int
    has_key_bias: bool
    sliding_window: int | None
    mla: bool
    kv_bytes_per_token: dict


def facts_from_config(cfg: dict, name: str = "model") -> ModelFacts:
    """:class:`ModelFacts` of a Hugging Face ``config.json`` dict.

    Raises:
        ValueError: a config without ``num_attention_heads`` / ``num_hidden_layers`` / ``hidden_size``, or whose heads
            do not divide (names the fields).
    """
    missing = [k for k in ("num_attention_heads", "num_hidden_layers", "hidden_size") if k not in cfg]
    if missing:
        raise ValueError(f"config of {name} lacks {', '.join(missing)} (a decoder's config.json has them)")
    hq = int(cfg["num_attention_heads"])
    hkv = int(cfg.get("num_key_value_heads") or hq)
    if hq % hkv:
        raise ValueError(f"config of {name}: num_attention_heads={hq} is not a multiple of num_key_value_heads={hkv}")
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // hq)
    window = cfg.get("sliding_window")
    if cfg.get("use_sliding_window") is False:
        window = None
    cap = ModelConfig(name=name, num_layers=int(cfg["num_hidden_layers"]), num_q_heads=hq, num_kv_heads=hkv,
                      head_dim=head_dim, hidden_size=int(cfg["hidden_size"]),
                      intermediate_size=int(cfg.get("intermediate_size", 0)), vocab_size=int(cfg.get("vocab_size", 0)))
    kv = {}
    for fmt in KV_FORMATS:
        try:
            kv[fmt] = bytes_per_token(fmt, cap)
        except ValueError:                        # e.g. a head_dim the compressed formats do not hold
            kv[fmt] = None
    return ModelFacts(name=name, architecture=(cfg.get("architectures") or ["?"])[0], model_type=cfg.get("model_type", "?"),
                      head_dim=head_dim, num_q_heads=hq, num_kv_heads=hkv, group=hq // hkv,
                      num_layers=int(cfg["num_hidden_layers"]), rope_theta=float(cfg.get("rope_theta", 10000.0)),
                      max_positions=int(cfg.get("max_position_embeddings", 0)),
                      has_key_bias=bool(cfg.get("attention_bias", KEY_BIAS_BY_MODEL_TYPE.get(cfg.get("model_type"), False))),
                      sliding_window=None if window is None else int(window), mla="kv_lora_rank" in cfg,
                      kv_bytes_per_token=kv)


def model_facts(name: str = DEFAULT_MODEL) -> ModelFacts:
    """:class:`ModelFacts` of a bundled model. Raises ValueError for an unknown name (lists the bundled ones)."""
    return facts_from_config(load_config(name), name)


def models_table() -> list[dict]:
    """One row per bundled model (name order): ``dataclasses.asdict`` of its :class:`ModelFacts`."""
    return [dataclasses.asdict(model_facts(n)) for n in model_names()]
