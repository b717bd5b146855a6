"""Qwen3-Next tensor/sequence-parallel causal LM: the Gated DeltaNet hybrid decoder."""

from __future__ import annotations

from models.common.entry_point import entry_point
from models.qwen3_next.architecture import ARCHITECTURE

__all__ = ["ARCHITECTURE", "build_parallel_model"]

build_parallel_model = entry_point(ARCHITECTURE, "Qwen3-Next", __name__)
