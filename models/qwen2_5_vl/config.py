"""Qwen2.5-VL: transformers ``Qwen2_5_VLConfig`` -> ModelConfig (the Qwen2 text decoder with M-RoPE, plus
the vision tower's ``VisionConfig`` with Qwen2.5-VL's options: RMSNorm, gated SiLU MLP, window
attention, ``out_hidden_size``, video positions scaled by ``tokens_per_second``); the reading shared
with Qwen2-VL is in ``models/common/vision/config.py``.

Vision field names differ from Qwen2-VL's: ``hidden_size`` is the tower's own width (Qwen2-VL's
``embed_dim``), ``intermediate_size`` its MLP width, ``out_hidden_size`` the merger's output.
Refused in one line naming the field (before any collective or write): a ``window_size`` that is not
a positive multiple of the merged patch size (``spatial_merge_size x patch_size``, transformers'
``window_size // merge // patch`` would silently truncate it), ``fullatt_block_indexes`` that are not
integers, a vision ``hidden_act`` the tower does not compute; the text model's own refusals (sliding
window, RoPE scaling) are ``ModelConfig.from_hf``'s.
"""

from __future__ import annotations

from typing import Any

from models.common.config import ModelConfig, UnsupportedConfigError, VisionConfig
from models.common.vision.config import (
    VISION_ACTIVATIONS,
    text_and_vision_sections,
    text_model_config,
    token_id,
    vision_rope_theta,
    with_vision,
)

HF_MODEL_TYPES = ("qwen2_5_vl",)

# transformers' ``Qwen2_5_VLVisionConfig`` defaults, for a config.json read as plain JSON (the converters)
VISION_DEFAULTS = {"depth": 32, "hidden_size": 3584, "hidden_act": "silu", "intermediate_size": 3420,
                   "num_heads": 16, "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2,
                   "temporal_patch_size": 2, "tokens_per_second": 4, "window_size": 112, "out_hidden_size": 3584,
                   "fullatt_block_indexes": [7, 15, 23, 31]}
POSITIVE = ("depth", "hidden_size", "intermediate_size", "out_hidden_size", "num_heads", "in_channels", "patch_size",
            "temporal_patch_size", "spatial_merge_size")


def _vision_checks(vis: Any) -> tuple[tuple[int, ...], float]:
    """Window size, full-attention blocks, tokens per second and activation as computed here."""
    merged = vis.spatial_merge_size * vis.patch_size
    if not isinstance(vis.window_size, int) or isinstance(vis.window_size, bool) or vis.window_size <= 0 \
            or vis.window_size % merged:
        raise UnsupportedConfigError(
            f"qwen2_5_vl: vision_config.window_size={vis.window_size!r} is not a positive multiple of the merged "
            f"patch size spatial_merge_size x patch_size = {vis.spatial_merge_size} x {vis.patch_size} = {merged}")
    indexes = vis.fullatt_block_indexes
    if not isinstance(indexes, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in indexes):
        raise UnsupportedConfigError(f"qwen2_5_vl: vision_config.fullatt_block_indexes must be a list of block "
                                     f"indexes, found {indexes!r}")
    tps = vis.tokens_per_second
    if isinstance(tps, bool) or not isinstance(tps, (int, float)):
        raise UnsupportedConfigError(f"qwen2_5_vl: vision_config.tokens_per_second must be a number, found {tps!r}")
    if vis.hidden_act not in VISION_ACTIVATIONS:
        raise UnsupportedConfigError(f"qwen2_5_vl: vision_config.hidden_act={vis.hidden_act!r} is not supported "
                                     f"({', '.join(VISION_ACTIVATIONS)})")
    return tuple(indexes), tps


def model_config(hf_config: Any) -> ModelConfig:
    text, vis = text_and_vision_sections(hf_config, "qwen2_5_vl", VISION_DEFAULTS, POSITIVE)
    base = text_model_config(hf_config, text, "qwen2_5_vl")
    indexes, tps = _vision_checks(vis)
    vision = VisionConfig(
        depth=vis.depth, embed_dim=vis.hidden_size, out_hidden_size=vis.out_hidden_size, num_heads=vis.num_heads,
        intermediate_size=vis.intermediate_size, in_channels=vis.in_channels, patch_size=int(vis.patch_size),
        temporal_patch_size=int(vis.temporal_patch_size), spatial_merge_size=vis.spatial_merge_size,
        hidden_act=vis.hidden_act, rope_theta=vision_rope_theta(vis),
        image_token_id=token_id(hf_config, "image_token_id"), video_token_id=token_id(hf_config, "video_token_id"),
        rms_norm=True, gated_mlp=True, window_size=vis.window_size, fullatt_block_indexes=indexes,
        tokens_per_second=tps)
    return with_vision(base, vision, "out_hidden_size")
