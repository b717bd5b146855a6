"""Qwen2-VL positions and input checks: the family's pure functions in
``models/common/vision/positions.py`` (shared with Qwen2.5-VL), used here with Qwen2-VL's temporal
step of 1 (no ``tokens_per_second``)."""

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
)

__all__ = ["IMAGE", "TEXT", "VIDEO", "VisionInputError", "check_multimodal_inputs", "merged_token_counts",
           "mrope_positions", "mrope_positions_packed", "token_types", "vision_cu_seqlens", "vision_patch_positions"]
