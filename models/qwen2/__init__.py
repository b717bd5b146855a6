"""Qwen2: ``from models.qwen2 import build_parallel_model``."""

from models.qwen2.model import ARCHITECTURE, build_parallel_model

__all__ = ["ARCHITECTURE", "build_parallel_model"]
