"""Reading a Qwen2-VL-family config (Qwen2-VL, Qwen2.5-VL) into ``ModelConfig`` + ``VisionConfig``.

Shared by ``models/qwen2_vl/config.py`` and ``models/qwen2_5_vl/config.py``, which give their
transformers defaults and map their vision fields. Inputs are transformers config objects (the
builder) or a config.json read as plain JSON (the converters, without transformers): the text model's
fields in ``text_config`` (transformers 5) or at the top level (older checkpoints, with
``rope_scaling: {"type": "mrope", ...}``), the vision tower's in ``vision_config``.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

from models.common.config import ModelConfig, UnsupportedConfigError, VisionConfig

DEFAULT_MROPE_SECTION = (16, 24, 24)  # transformers' default when rope_parameters has none
DEFAULT_TOKEN_IDS = {"image_token_id": 151655, "video_token_id": 151656}  # transformers' defaults (both models)
VISION_ACTIVATIONS = ("quick_gelu", "gelu", "silu")  # what blocks/vision.py computes


class Fields(SimpleNamespace):
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


def text_and_vision_sections(hf_config: Any, arch: str, vision_defaults: dict,
                             positive: tuple[str, ...]) -> tuple[Any, Any]:
    """The text and vision configs: transformers' sub-config objects as they are; for a config.json
    read as plain JSON, attribute views of ``text_config`` (transformers 5) or of the top-level
    fields (older checkpoints), and of ``vision_config`` with transformers' defaults
    (``vision_defaults``); the ``positive`` vision fields must be positive integers."""
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
        raise UnsupportedConfigError(f"{arch}: vision_config must be an object, found {vis!r}")
    vision = {**vision_defaults, **(vis or {})}
    if "in_chans" in vision and "in_channels" not in (vis or {}):
        vision["in_channels"] = vision["in_chans"]
    for key in positive:
        if isinstance(vision[key], bool) or not isinstance(vision[key], int) or vision[key] <= 0:
            raise UnsupportedConfigError(f"{arch}: vision_config.{key} must be a positive integer, "
                                         f"found {vision[key]!r}")
    return Fields(**raw), Fields(**vision)


def token_id(hf_config: Any, name: str) -> int:
    value = getattr(hf_config, name, None)
    return DEFAULT_TOKEN_IDS[name] if value is None else value


def vision_rope_theta(vis: Any) -> float:
    return float(dict(getattr(vis, "rope_parameters", None) or {}).get("rope_theta", 10000.0))


def text_model_config(hf_config: Any, text: Any, arch: str) -> ModelConfig:
    """The Qwen2 text decoder with M-RoPE (qkv bias, default RoPE only, sections summing to head_dim/2)."""
    base = ModelConfig.from_hf(text, architecture=arch, qkv_bias=True, o_bias=False, mlp_bias=False)
    if base.rope.rope_type != "default":
        raise UnsupportedConfigError(f"{arch}: rope_type={base.rope.rope_type!r} with M-RoPE is not supported "
                                     f"(only default)")
    section = base.rope.mrope_section or DEFAULT_MROPE_SECTION
    if sum(section) != base.head_dim // 2:
        raise UnsupportedConfigError(f"{arch}: mrope_section={list(section)} sums to {sum(section)}, "
                                     f"expected head_dim/2 = {base.head_dim // 2}")
    return dataclasses.replace(base, rope=dataclasses.replace(base.rope, mrope_section=tuple(section)),
                               tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)
                                                        or getattr(text, "tie_word_embeddings", False)))


def with_vision(base: ModelConfig, vision: VisionConfig, out_field: str) -> ModelConfig:
    """``base`` with its vision tower, after the checks both models share (``out_field``: the config
    field that holds the merger's output width)."""
    arch = base.architecture
    if vision.out_hidden_size != base.hidden_size:
        raise UnsupportedConfigError(f"{arch}: vision_config.{out_field}={vision.out_hidden_size} must equal the "
                                     f"text hidden_size={base.hidden_size} (the merger feeds the text embeddings)")
    if vision.embed_dim % vision.num_heads or vision.head_dim % 4:
        raise UnsupportedConfigError(f"{arch}: vision embed_dim={vision.embed_dim} / num_heads={vision.num_heads} "
                                     f"must give a head_dim divisible by 4 (2-D rotary)")
    return dataclasses.replace(base, vision=vision)
