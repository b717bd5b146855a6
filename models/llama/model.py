"""Llama tensor/sequence-parallel causal LM (the shared decoder with Llama's switches)."""

from __future__ import annotations

from models.common.entry_point import entry_point
from models.llama.architecture import ARCHITECTURE

__all__ = ["ARCHITECTURE", "build_parallel_model"]

build_parallel_model = entry_point(ARCHITECTURE, "Llama", __name__)
