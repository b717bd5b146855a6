"""Qwen3-VL-MoE: ``from models.qwen3_vl_moe import build_parallel_model``."""

from models.qwen3_vl_moe.architecture import ARCHITECTURE


def __getattr__(name: str):
    # the model (and torch) load on first use, so converters can read the architecture without torch
    if name == "build_parallel_model":
        from models.qwen3_vl_moe.model import build_parallel_model

        return build_parallel_model
    raise AttributeError(f"module 'models.qwen3_vl_moe' has no attribute {name!r}")


__all__ = ["ARCHITECTURE", "build_parallel_model"]
