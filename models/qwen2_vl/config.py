"""Qwen2-VL: transformers ``Qwen2VLConfig`` -> ModelConfig (the Qwen2 text decoder with M-RoPE, plus
the vision tower's ``VisionConfig``); the reading shared with Qwen2.5-VL is in
``models/common/vision/config.py``."""

from __future__ import annotations

from typing import Any

from models.common.config import ModelConfig, VisionConfig
from models.common.vision.config import (
    text_and_vision_sections,
    text_model_config,
    token_id,
    vision_rope_theta,
    with_vision,
)

HF_MODEL_TYPES = ("qwen2_vl",)

# transformers' ``Qwen2VLVisionConfig`` defaults, for a config.json read as plain JSON (the converters)
VISION_DEFAULTS = {"depth": 32, "embed_dim": 1280, "hidden_size": 3584, "hidden_act": "quick_gelu", "mlp_ratio": 4,
                   "num_heads": 16, "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2,
                   "temporal_patch_size": 2}
POSITIVE = ("depth", "embed_dim", "hidden_size", "num_heads", "in_channels", "patch_size", "temporal_patch_size",
            "spatial_merge_size")


def model_config(hf_config: Any) -> ModelConfig:
    text, vis = text_and_vision_sections(hf_config, "qwen2_vl", VISION_DEFAULTS, POSITIVE)
    base = text_model_config(hf_config, text, "qwen2_vl")
    vision = VisionConfig(
        depth=vis.depth, embed_dim=vis.embed_dim, out_hidden_size=vis.hidden_size, num_heads=vis.num_heads,
        mlp_ratio=float(vis.mlp_ratio), in_channels=vis.in_channels, patch_size=int(vis.patch_size),
        temporal_patch_size=int(vis.temporal_patch_size), spatial_merge_size=vis.spatial_merge_size,
        hidden_act=vis.hidden_act, rope_theta=vision_rope_theta(vis),
        image_token_id=token_id(hf_config, "image_token_id"), video_token_id=token_id(hf_config, "video_token_id"))
    return with_vision(base, vision, "hidden_size")
