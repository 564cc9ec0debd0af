"""Bundled model configs (Hugging Face ``config.json``), for arithmetic and for vLLM's ``load_format="dummy"``.

Each model is a folder ``kvrepro/configs/<name>/config.json``; vLLM can be pointed at that folder
(``LLM(model=str(config_dir(name)), load_format="dummy", skip_tokenizer_init=True)``) to run the
architecture with random weights (fine for capacity and speed, meaningless for accuracy).

Sources: the public ``config.json`` of each model on the Hugging Face Hub, one URL per folder in ``SOURCES.md``
(Qwen/Qwen3-4B-Instruct-2507's values as listed in REPRODUCTION-CARD.md, "Model config").

``kvrepro.configs.facts.model_facts`` reads what serving a model with a compressed KV cache depends on from a config
(head_dim, query and KV heads, GQA group, layers, RoPE theta, max positions, key biases, sliding window, MLA) and the KV
bytes per token of every KV format; ``models_table`` gives one row per bundled model.
"""
from __future__ import annotations

import json
from pathlib import Path

_HERE = Path(__file__).resolve().parent
DEFAULT_MODEL = "qwen3-4b-instruct-2507"


def model_names() -> tuple[str, ...]:
    """Names of the bundled configs (folder names), sorted."""
    return tuple(sorted(p.parent.name for p in _HERE.glob("*/config.json")))


def config_dir(name: str = DEFAULT_MODEL) -> Path:
    """Folder holding ``config.json`` of a bundled model.

    Raises:
        ValueError: unknown ``name`` (the message lists the bundled names).
    """
    path = _HERE / name
    if name not in model_names():
        raise ValueError(f"model={name!r} has no bundled config; allowed: {', '.join(model_names())}")
    return path


def load_config(name: str = DEFAULT_MODEL) -> dict:
    """The bundled ``config.json`` of ``name`` as a dict. Raises ValueError like :func:`config_dir`."""
    return json.loads((config_dir(name) / "config.json").read_text(encoding="utf-8"))

