"""Qwen3 tensor/sequence-parallel causal LM (the shared decoder with Qwen3's switches: q/k norms)."""

from __future__ import annotations

from models.common.entry_point import entry_point
from models.qwen3.architecture import ARCHITECTURE

__all__ = ["ARCHITECTURE", "build_parallel_model"]

build_parallel_model = entry_point(ARCHITECTURE, "Qwen3", __name__)
