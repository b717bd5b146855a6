"""Qwen2-VL: transformers ``Qwen2VLConfig`` -> ModelConfig (the Qwen2 text decoder with M-RoPE, plus
the vision tower's ``VisionConfig``)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

from models.common.config import ModelConfig, UnsupportedConfigError, VisionConfig

HF_MODEL_TYPES = ("qwen2_vl",)
DEFAULT_MROPE_SECTION = (16, 24, 24)  # transformers' default when rope_parameters has none


# transformers' ``Qwen2VLVisionConfig`` defaults, for a config.json read as plain JSON (the converters)
VISION_DEFAULTS = {"depth": 32, "embed_dim": 1280, "hidden_size": 3584, "hidden_act": "quick_gelu", "mlp_ratio": 4,
                   "num_heads": 16, "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2,
                   "temporal_patch_size": 2}


class _Fields(SimpleNamespace):
    """Attribute view of a plain config dict; absent keys read as None (like transformers' configs)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def _mrope_as_default(rope: Any) -> Any:
    """Older configs say ``{"type": "mrope", "mrope_section": ...}``; transformers reads it as default RoPE."""
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "mrope":
        return {**{k: v for k, v in rope.items() if k != "type"}, "rope_type": "default"}
    return rope


def text_and_vision_sections(hf_config: Any) -> tuple[Any, Any]:
    """The text and vision configs: transformers' sub-config objects as they are; for a config.json
    read as plain JSON, attribute views of ``text_config`` (transformers 5) or of the top-level
    fields (older Qwen2-VL checkpoints), and of ``vision_config`` with transformers' defaults."""
    text, vis = hf_config.text_config, hf_config.vision_config
    if not isinstance(vis, dict) and vis is not None:
        return text, vis
    raw = dict(text) if isinstance(text, dict) else hf_config.to_dict()
    raw.pop("vision_config", None)
    for key in ("rope_parameters", "rope_scaling"):
        raw[key] = _mrope_as_default(raw.get(key))
    # saves from before transformers 5 put the flag in text_config; transformers honours either place
    raw["tie_word_embeddings"] = bool(getattr(hf_config, "tie_word_embeddings", None) or raw.get("tie_word_embeddings"))
    if vis is not None and not isinstance(vis, dict):
        raise UnsupportedConfigError(f"qwen2_vl: vision_config must be an object, found {vis!r}")
    vision = {**VISION_DEFAULTS, **(vis or {})}
    if "in_chans" in vision and "in_channels" not in (vis or {}):
        vision["in_channels"] = vision["in_chans"]
    for key in ("depth", "embed_dim", "hidden_size", "num_heads", "in_channels", "patch_size", "temporal_patch_size",
                "spatial_merge_size"):
        if isinstance(vision[key], bool) or not isinstance(vision[key], int) or vision[key] <= 0:
            raise UnsupportedConfigError(f"qwen2_vl: vision_config.{key} must be a positive integer, "
                                         f"found {vision[key]!r}")
    return _Fields(**raw), _Fields(**vision)


DEFAULT_TOKEN_IDS = {"image_token_id": 151655, "video_token_id": 151656}  # transformers' Qwen2VLConfig defaults


def _token_id(hf_config: Any, name: str) -> int:
    value = getattr(hf_config, name, None)
    return DEFAULT_TOKEN_IDS[name] if value is None else value


def model_config(hf_config: Any) -> ModelConfig:
    text, vis = text_and_vision_sections(hf_config)
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
        image_token_id=_token_id(hf_config, "image_token_id"), video_token_id=_token_id(hf_config, "video_token_id"))
    if vision.out_hidden_size != base.hidden_size:
        raise UnsupportedConfigError(f"qwen2_vl: vision_config.hidden_size={vision.out_hidden_size} must equal the "
                                     f"text hidden_size={base.hidden_size} (the merger feeds the text embeddings)")
    if vision.embed_dim % vision.num_heads or vision.head_dim % 4:
        raise UnsupportedConfigError(f"qwen2_vl: vision embed_dim={vision.embed_dim} / num_heads={vision.num_heads} "
                                     f"must give a head_dim divisible by 4 (2-D rotary)")
    return dataclasses.replace(base, rope=dataclasses.replace(base.rope, mrope_section=tuple(section)),
                               tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)
                                                        or getattr(text, "tie_word_embeddings", False)),
                               vision=vision)
