"""kvrepro: reproducibility kit for long-context LLM serving with a compressed KV cache."""
__version__ = "0.1.0"
