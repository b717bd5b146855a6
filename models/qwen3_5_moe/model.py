"""Qwen3.5-MoE tensor/sequence/context/pipeline/expert-parallel models: the Gated DeltaNet hybrid causal LM
(text checkpoints and configs), and, from a conditional-generation config or checkpoint
(``Qwen3_5MoeForConditionalGeneration``), the vision-language model (``models.qwen3_5.model.ParallelQwen3_5VL``
with the sparse MLP on every layer)."""

from __future__ import annotations

from models.common.entry_point import hybrid_entry_point
from models.qwen3_5_moe.architecture import ARCHITECTURE, VL_ARCHITECTURE

__all__ = ["ARCHITECTURE", "VL_ARCHITECTURE", "build_parallel_model"]

build_parallel_model = hybrid_entry_point(ARCHITECTURE, VL_ARCHITECTURE, "Qwen3.5-MoE", __name__,
                                          vl_model="``models.qwen3_5.model.ParallelQwen3_5VL`` with the sparse MLP")
