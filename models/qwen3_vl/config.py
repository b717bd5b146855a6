"""Qwen3-VL: transformers ``Qwen3VLConfig`` -> ModelConfig (the Qwen3 text decoder: per-head q/k RMSNorm,
``attention_bias`` on q/k/v and o_proj, interleaved M-RoPE) plus the tower's ``Qwen3VisionConfig``
(``models/common/vision/qwen3.py``: learned position table, DeepStack block indexes).

Inputs are transformers config objects (the builder) or a config.json read as plain JSON (the
converters): text fields in ``text_config``, the tower's in ``vision_config`` with transformers'
defaults. M-RoPE: ``text_config.rope_parameters.mrope_section`` (transformers' default [24, 20, 20]),
always interleaved (transformers' ``Qwen3VLTextRotaryEmbedding`` interleaves whatever
``mrope_interleaved`` says). Refused in one line naming the numbers, before any collective: a
DeepStack index outside the tower's blocks ``0..depth-1`` or listed twice, more DeepStack features
than text layers (transformers would leave their mergers unused), a ``hidden_act`` the tower does not
compute, sections that do not sum to ``head_dim / 2``, a merger output not equal to the text width.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from models.common.config import ModelConfig, UnsupportedConfigError
from models.common.vision.config import text_and_vision_sections, token_id, vision_rope_theta, with_vision
from models.common.vision.qwen3 import QWEN3_VISION_ACTIVATIONS, Qwen3VisionConfig

HF_MODEL_TYPES = ("qwen3_vl",)
DEFAULT_MROPE_SECTION = (24, 20, 20)  # transformers' Qwen3VLTextRotaryEmbedding default

# transformers' ``Qwen3VLVisionConfig`` defaults, for a config.json read as plain JSON (the converters)
VISION_DEFAULTS = {"depth": 27, "hidden_size": 1152, "hidden_act": "gelu_pytorch_tanh", "intermediate_size": 4304,
                   "num_heads": 16, "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2,
                   "temporal_patch_size": 2, "out_hidden_size": 3584, "num_position_embeddings": 2304,
                   "deepstack_visual_indexes": [8, 16, 24]}
POSITIVE = ("depth", "hidden_size", "intermediate_size", "out_hidden_size", "num_heads", "in_channels",
            "spatial_merge_size", "num_position_embeddings")  # patch sizes: ``_square`` (an int or equal ints)


def _deepstack_indexes(vis: Any, text_layers: int, arch: str = "qwen3_vl") -> tuple[int, ...]:
    indexes = vis.deepstack_visual_indexes
    if indexes is None:
        indexes = ()
    if not isinstance(indexes, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in indexes):
        raise UnsupportedConfigError(f"{arch}: vision_config.deepstack_visual_indexes must be a list of block "
                                     f"indexes, found {indexes!r}")
    outside = [i for i in indexes if not 0 <= i < vis.depth]
    if outside:
        raise UnsupportedConfigError(f"{arch}: vision_config.deepstack_visual_indexes={list(indexes)} names "
                                     f"block(s) {outside} but the tower has depth={vis.depth} "
                                     f"(blocks 0..{vis.depth - 1})")
    if len(set(indexes)) != len(indexes):
        raise UnsupportedConfigError(f"{arch}: vision_config.deepstack_visual_indexes={list(indexes)} lists a block "
                                     f"twice (each DeepStack merger needs a block of its own)")
    if len(indexes) > text_layers:
        raise UnsupportedConfigError(f"{arch}: {len(indexes)} DeepStack features (vision_config."
                                     f"deepstack_visual_indexes={list(indexes)}) but the text model has "
                                     f"num_hidden_layers={text_layers}: feature k is added after decoder layer k")
    return tuple(indexes)


def _square(value: Any, field: str, arch: str = "qwen3_vl") -> int:
    """``patch_size`` / ``temporal_patch_size``: transformers also accepts a list of equal sizes."""
    if isinstance(value, (list, tuple)) and len(value) > 0 and len(set(value)) == 1:
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UnsupportedConfigError(f"{arch}: vision_config.{field}={value!r} must be a positive integer (or a "
                                     f"list of equal ones)")
    return value


def text_config(hf_config: Any, text: Any, arch: str = "qwen3_vl") -> ModelConfig:
    """The Qwen3 text decoder with interleaved M-RoPE (default RoPE only, sections summing to head_dim/2);
    ``arch``: the architecture named in the config and its errors (Qwen3-VL-MoE reads the same text fields)."""
    bias = bool(getattr(text, "attention_bias", False))
    base = ModelConfig.from_hf(text, architecture=arch, qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True)
    if base.rope.rope_type != "default":
        raise UnsupportedConfigError(f"{arch}: rope_type={base.rope.rope_type!r} with M-RoPE is not supported "
                                     f"(only default)")
    section = base.rope.mrope_section or DEFAULT_MROPE_SECTION
    if len(section) != 3 or sum(section) != base.head_dim // 2:
        raise UnsupportedConfigError(f"{arch}: mrope_section={list(section)} must be three sections summing to "
                                     f"head_dim/2 = {base.head_dim // 2}")
    return dataclasses.replace(base, rope=dataclasses.replace(base.rope, mrope_section=tuple(section)),
                               tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)
                                                        or getattr(text, "tie_word_embeddings", False)))


def model_config(hf_config: Any, arch: str = "qwen3_vl") -> ModelConfig:
    """The text decoder and the tower (``arch``: the architecture named in the config and its errors;
    Qwen3-VL-MoE's tower and text fields are Qwen3-VL's, models/qwen3_vl_moe/config.py adds the experts)."""
    text, vis = text_and_vision_sections(hf_config, arch, VISION_DEFAULTS, POSITIVE)
    base = text_config(hf_config, text, arch)
    if vis.hidden_act not in QWEN3_VISION_ACTIVATIONS:
        raise UnsupportedConfigError(f"{arch}: vision_config.hidden_act={vis.hidden_act!r} is not supported "
                                     f"({', '.join(QWEN3_VISION_ACTIVATIONS)})")
    vision = Qwen3VisionConfig(
        depth=vis.depth, embed_dim=vis.hidden_size, out_hidden_size=vis.out_hidden_size, num_heads=vis.num_heads,
        intermediate_size=vis.intermediate_size, in_channels=vis.in_channels,
        patch_size=_square(vis.patch_size, "patch_size", arch),
        temporal_patch_size=_square(vis.temporal_patch_size, "temporal_patch_size", arch),
        spatial_merge_size=vis.spatial_merge_size,
        hidden_act=vis.hidden_act, rope_theta=vision_rope_theta(vis),
        image_token_id=token_id(hf_config, "image_token_id"), video_token_id=token_id(hf_config, "video_token_id"),
        num_position_embeddings=vis.num_position_embeddings,
        deepstack_visual_indexes=_deepstack_indexes(vis, base.num_hidden_layers, arch))
    return with_vision(base, vision, "out_hidden_size")
