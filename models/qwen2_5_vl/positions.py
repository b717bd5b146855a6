"""Qwen2.5-VL positions and input checks: the family's pure functions in
``models/common/vision/positions.py`` (shared with Qwen2-VL). Qwen2.5-VL passes its
``tokens_per_second``: a video's temporal positions step by ``tokens_per_second * second_per_grid_ts[v]``
(truncated to integers, as transformers' ``get_rope_index``); and its tower reorders the merged patches
window by window (``vision_window_index``, transformers' ``get_vision_window_index``)."""

from models.common.vision.positions import (
    IMAGE,
    TEXT,
    VIDEO,
    VisionInputError,
    check_multimodal_inputs,
    merged_token_counts,
    mrope_positions,
    mrope_positions_packed,
    token_types,
    vision_cu_seqlens,
    vision_patch_positions,
    vision_window_index,
)

__all__ = ["IMAGE", "TEXT", "VIDEO", "VisionInputError", "check_multimodal_inputs", "merged_token_counts",
           "mrope_positions", "mrope_positions_packed", "token_types", "vision_cu_seqlens", "vision_patch_positions",
           "vision_window_index"]
