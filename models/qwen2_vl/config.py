"""Qwen2-VL: transformers ``Qwen2VLConfig`` -> ModelConfig (the Qwen2 text decoder with M-RoPE, plus
the vision tower's ``VisionConfig``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from models.common.config import ModelConfig, UnsupportedConfigError, VisionConfig

HF_MODEL_TYPES = ("qwen2_vl",)
DEFAULT_MROPE_SECTION = (16, 24, 24)  # transformers' default when rope_parameters has none


def model_config(hf_config: Any) -> ModelConfig:
    text = hf_config.text_config
    vis = hf_config.vision_config
    base = ModelConfig.from_hf(text, architecture="qwen2_vl", qkv_bias=True, o_bias=False, mlp_bias=False)
    if base.rope.rope_type != "default":
        raise UnsupportedConfigError(f"qwen2_vl: rope_type={base.rope.rope_type!r} with M-RoPE is not supported "
                                     f"(only default)")
    section = base.rope.mrope_section or DEFAULT_MROPE_SECTION
    if sum(section) != base.head_dim // 2:
        raise UnsupportedConfigError(f"qwen2_vl: mrope_section={list(section)} sums to {sum(section)}, "
                                     f"expected head_dim/2 = {base.head_dim // 2}")
    vision_rope = dict(getattr(vis, "rope_parameters", None) or {})
    vision = VisionConfig(
        depth=vis.depth, embed_dim=vis.embed_dim, out_hidden_size=vis.hidden_size, num_heads=vis.num_heads,
        mlp_ratio=float(vis.mlp_ratio), in_channels=vis.in_channels, patch_size=int(vis.patch_size),
        temporal_patch_size=int(vis.temporal_patch_size), spatial_merge_size=vis.spatial_merge_size,
        hidden_act=vis.hidden_act, rope_theta=float(vision_rope.get("rope_theta", 10000.0)),
        image_token_id=hf_config.image_token_id, video_token_id=hf_config.video_token_id)
    if vision.out_hidden_size != base.hidden_size:
        raise UnsupportedConfigError(f"qwen2_vl: vision_config.hidden_size={vision.out_hidden_size} must equal the "
                                     f"text hidden_size={base.hidden_size} (the merger feeds the text embeddings)")
    if vision.embed_dim % vision.num_heads or vision.head_dim % 4:
        raise UnsupportedConfigError(f"qwen2_vl: vision embed_dim={vision.embed_dim} / num_heads={vision.num_heads} "
                                     f"must give a head_dim divisible by 4 (2-D rotary)")
    return dataclasses.replace(base, rope=dataclasses.replace(base.rope, mrope_section=tuple(section)),
                               tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
                               vision=vision)
