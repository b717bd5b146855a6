"""Qwen2-VL: the shared Qwen2 decoder with M-RoPE, fed by a tensor-parallel vision tower.

``model(input_ids, ..., pixel_values=, image_grid_thw=, pixel_values_videos=, video_grid_thw=,
mm_token_type_ids=)`` computes what transformers' ``Qwen2VLForConditionalGeneration`` computes. The
model is the Qwen2-VL family's ``ParallelVisionLanguageModel`` (``models/common/vision/language.py``:
input checks, one tower pass, M-RoPE positions, features merged at embed time under SP/CP/Ulysses,
the vision work shared by the cp x ulysses ranks, ``forward_backward``) with Qwen2-VL's tower
(LayerNorm, quick-GELU MLP, attention per frame) and temporal positions stepping by 1.
"""

from __future__ import annotations

from models.common.entry_point import entry_point
from models.common.vision.language import ParallelVisionLanguageModel, VisionFeatures
from models.qwen2_vl.architecture import ARCHITECTURE

__all__ = ["ARCHITECTURE", "ParallelQwen2VL", "VisionFeatures", "build_parallel_model"]


class ParallelQwen2VL(ParallelVisionLanguageModel):
    """A tensor/sequence/pipeline-parallel Qwen2-VL; build it with ``build_parallel_model``."""


build_parallel_model = entry_point(ARCHITECTURE, "Qwen2-VL", __name__, returns="ParallelQwen2VL")
