"""Qwen2-MoE causal LM: the shared decoder with mixture-of-experts MLPs (TP/SP/PP/DP plus expert parallelism)."""

from __future__ import annotations

from models.common.entry_point import entry_point
from models.qwen2_moe.architecture import ARCHITECTURE

__all__ = ["ARCHITECTURE", "build_parallel_model"]

build_parallel_model = entry_point(ARCHITECTURE, "Qwen2-MoE", __name__)
