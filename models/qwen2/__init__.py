"""Qwen2: ``from models.qwen2 import build_parallel_model``."""

from models.qwen2.architecture import ARCHITECTURE


def __getattr__(name: str):
    # the model (and torch) load on first use, so converters can read the architecture without torch
    if name == "build_parallel_model":
        from models.qwen2.model import build_parallel_model

        return build_parallel_model
    raise AttributeError(f"module 'models.qwen2' has no attribute {name!r}")


__all__ = ["ARCHITECTURE", "build_parallel_model"]
