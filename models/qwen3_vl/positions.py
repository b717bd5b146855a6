"""Qwen3-VL positions and input checks: the Qwen2-VL family's pure functions
(``models/common/vision/positions.py``) with Qwen3-VL's treatment of videos.

Qwen3-VL's processor writes a video frame by frame, each frame's placeholder tokens behind a
timestamp (``<t1> <vision_start> frame 1 <vision_end> <t2> <vision_start> frame 2 ...``), and
transformers' ``Qwen3VLModel.get_rope_index`` splits every video grid ``(t, h, w)`` into ``t`` grids
``(1, h, w)``: each frame is a run of its own that takes the next frame grid, placed like an image
(temporal position = the run's start, height and width from there; the text after it resumes at the
start plus ``max(h, w) / merge``). ``split_video_frames`` does that split; the positions are then the
family's ``mrope_positions`` with a temporal step of 1. The tower still encodes each video whole
(``video_grid_thw`` as given: attention within each frame). Two frames with no token between them
form one run, which matches no frame grid: ``VisionInputError`` (transformers fails on a shape).
"""

from __future__ import annotations

import torch

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


def split_video_frames(video_grid_thw: torch.Tensor | None) -> torch.Tensor | None:
    """``(t, h, w)`` per video -> ``t`` rows ``(1, h, w)``, videos in order (transformers' get_rope_index)."""
    if video_grid_thw is None:
        return None
    frames = torch.repeat_interleave(video_grid_thw, video_grid_thw[:, 0], dim=0)
    frames[:, 0] = 1
    return frames


def qwen3_vl_positions(input_ids: torch.Tensor, *, video_grid_thw=None, **kwargs):
    """``mrope_positions`` (positions ``[3, b, s]`` and deltas ``[b, 1]``) of Qwen3-VL: videos per frame."""
    return mrope_positions(input_ids, video_grid_thw=split_video_frames(video_grid_thw), **kwargs)


def qwen3_vl_positions_packed(input_ids: torch.Tensor, cu_seqlens: torch.Tensor, *, video_grid_thw=None, **kwargs):
    """``mrope_positions_packed`` (``[3, T]``) of Qwen3-VL: videos per frame."""
    return mrope_positions_packed(input_ids, cu_seqlens, video_grid_thw=split_video_frames(video_grid_thw), **kwargs)


__all__ = ["IMAGE", "TEXT", "VIDEO", "VisionInputError", "check_multimodal_inputs", "merged_token_counts",
           "qwen3_vl_positions", "qwen3_vl_positions_packed", "split_video_frames", "token_types",
           "vision_cu_seqlens", "vision_patch_positions"]
