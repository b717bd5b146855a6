"""Qwen2 tensor/sequence-parallel causal LM (the shared decoder with Qwen2's switches)."""

from __future__ import annotations

from models.common.entry_point import entry_point
from models.qwen2.architecture import ARCHITECTURE

__all__ = ["ARCHITECTURE", "build_parallel_model"]

build_parallel_model = entry_point(ARCHITECTURE, "Qwen2", __name__)
