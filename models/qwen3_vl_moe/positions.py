"""Qwen3-VL-MoE positions and input checks: Qwen3-VL's (``models/qwen3_vl/positions.py``: interleaved M-RoPE,
videos frame by frame, placeholder tokens checked against the grids before any collective); the experts
change nothing there."""

from __future__ import annotations

from models.qwen3_vl.positions import (
    IMAGE,
    TEXT,
    VIDEO,
    VisionInputError,
    check_multimodal_inputs,
    merged_token_counts,
    qwen3_vl_positions,
    qwen3_vl_positions_packed,
    split_video_frames,
    token_types,
    vision_cu_seqlens,
    vision_patch_positions,
)

__all__ = ["IMAGE", "TEXT", "VIDEO", "VisionInputError", "check_multimodal_inputs", "merged_token_counts",
           "qwen3_vl_positions", "qwen3_vl_positions_packed", "split_video_frames", "token_types",
           "vision_cu_seqlens", "vision_patch_positions"]
