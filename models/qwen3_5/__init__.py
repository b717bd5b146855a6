"""Qwen3.5 (dense): ``from models.qwen3_5 import build_parallel_model`` (text, or vision-language from a
conditional-generation config)."""

from models.qwen3_5.architecture import ARCHITECTURE


def __getattr__(name: str):
    # the model (and torch) load on first use, so converters can read the architecture without torch
    if name == "build_parallel_model":
        from models.qwen3_5.model import build_parallel_model

        return build_parallel_model
    raise AttributeError(f"module 'models.qwen3_5' has no attribute {name!r}")


__all__ = ["ARCHITECTURE", "build_parallel_model"]
