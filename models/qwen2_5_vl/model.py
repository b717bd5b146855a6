"""Qwen2.5-VL: the shared Qwen2 decoder with M-RoPE, fed by a tensor-parallel vision tower with window
attention.

``model(input_ids, ..., pixel_values=, image_grid_thw=, pixel_values_videos=, video_grid_thw=,
mm_token_type_ids=, second_per_grid_ts=)`` computes what transformers'
``Qwen2_5_VLForConditionalGeneration`` computes. The model is the Qwen2-VL family's
``ParallelVisionLanguageModel`` (``models/common/vision/language.py``: input checks, one tower pass,
M-RoPE positions, features merged at embed time under SP/CP/Ulysses, the vision work shared by the
cp x ulysses ranks, ``forward_backward``); Qwen2.5-VL differs by options of the shared tower and
positions only (``VisionConfig``: RMSNorm, gated SiLU MLP with biases, window attention with
``fullatt_block_indexes``, ``out_hidden_size``, video temporal positions scaled by
``tokens_per_second * second_per_grid_ts``).
"""

from __future__ import annotations

from models.common.entry_point import entry_point
from models.common.vision.language import ParallelVisionLanguageModel, VisionFeatures
from models.qwen2_5_vl.architecture import ARCHITECTURE

__all__ = ["ARCHITECTURE", "ParallelQwen2_5_VL", "VisionFeatures", "build_parallel_model"]


class ParallelQwen2_5_VL(ParallelVisionLanguageModel):
    """A tensor/sequence/pipeline-parallel Qwen2.5-VL; build it with ``build_parallel_model``."""


build_parallel_model = entry_point(ARCHITECTURE, "Qwen2.5-VL", __name__, returns="ParallelQwen2_5_VL")
