"""kvrepro's compressed KV cache as an out-of-tree vLLM 0.20.2 attention backend.

Use (GPU, ``pip install kvrepro[vllm]``; no fork, no edits to vLLM)::

    KVREPRO_PRESET=k4v4 vllm serve Qwen/Qwen3-4B-Instruct-2507 --attention-backend CUSTOM
    # or, in Python:
    os.environ["KVREPRO_PRESET"] = "k4v4"          # optional; k4v4 is the default (kvrepro.settings: all variables)
    llm = vllm.LLM(model, attention_backend="CUSTOM")   # kv_cache_dtype stays "auto"

vLLM calls :func:`register` in every process it starts, through the entry point::

    [project.entry-points."vllm.general_plugins"]
    kvrepro = "kvrepro.vllm_backend:register"

It binds vLLM's ``AttentionBackendEnum.CUSTOM`` slot to
``kvrepro.vllm_backend.backend.KVReproAttentionBackend`` and installs the one patch
(``spec_patch``) through which vLLM sizes each layer's cache from the compressed page size.
Engines that do not select ``CUSTOM`` run as before, with one exception: a bad ``KVREPRO_*`` value fails
:func:`register`, so it fails every engine of a process where kvrepro is installed (a typo is never ignored).
Unsupported configurations are refused at engine start (``config.unsupported_reasons`` / ``config.check_layer``).
The backend is built and tested against vLLM 0.20.2 (``spec_patch`` wraps an internal of that version); another
version gets a warning at plugin load.

The pure parts (``config``, ``runtime``, ``fa_prefill``, ``spec_patch``) import without vLLM; ``backend`` needs it.
The capacity sweep's GPU worker is ``kvrepro.sweep_worker`` (outside this package: vLLM loads only the backend).
"""
from __future__ import annotations

BACKEND_CLASS = "kvrepro.vllm_backend.backend.KVReproAttentionBackend"
VLLM_VERSION = "0.20.2"  # the version spec_patch and the backend were written and measured against


def register() -> None:
    """vLLM general-plugin entry point: register the CUSTOM backend and the page-size patch.

    Idempotent (vLLM may call it several times). Validates every ``KVREPRO_*`` setting
    (``kvrepro.settings.Settings.from_env``) so that a bad value fails at engine start; the engine resolves and
    logs them when it builds its layers (``config.settings_for_engine``). Raises ImportError without vLLM,
    ValueError on a bad setting (naming the variable and the allowed values).
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from kvrepro.settings import Settings
    from kvrepro.vllm_backend import spec_patch

    Settings.from_env()
    import vllm

    if getattr(vllm, "__version__", None) != VLLM_VERSION:
        import logging

        logging.getLogger("vllm.kvrepro").warning(
            "kvrepro's attention backend is built for vLLM %s, this is vLLM %s: --attention-backend CUSTOM may "
            "fail or mis-size the KV cache", VLLM_VERSION, getattr(vllm, "__version__", "unknown"))
    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_CLASS)
    spec_patch.install()
