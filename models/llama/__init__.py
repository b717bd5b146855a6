"""Llama: ``from models.llama import build_parallel_model``."""

from models.llama.model import ARCHITECTURE, build_parallel_model

__all__ = ["ARCHITECTURE", "build_parallel_model"]
