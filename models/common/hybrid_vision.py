"""The vision tower of Qwen3.5 / Qwen3.5-MoE conditional-generation checkpoints
(``Qwen3_5ForConditionalGeneration``, ``Qwen3_5MoeForConditionalGeneration``), as tensors to carry.

Plain data, no torch. The parallel models run the text model only (``text_config``, decoder under
``model.language_model.``); the tower's tensors (``model.visual.*``) are named and shaped here from the
vision config so that a checkpoint's tower is checked tensor by tensor (nothing missing, nothing
mis-shaped, nothing unexplained) and carried bitwise by conversions whose target can hold it (HF), instead
of being dropped. Names and shapes are transformers 5.24's ``Qwen3_5VisionModel``: a Conv3d patch embedding
with bias, a learned position table, ``depth`` pre-LayerNorm blocks (fused ``qkv`` with bias, ``proj``, a
two-layer MLP with biases) and the patch merger (LayerNorm over one patch, two linears over the
``spatial_merge_size**2`` merged patches).
"""

from __future__ import annotations

from typing import Any

VISUAL_PREFIX = "model.visual."
TEXT_PREFIX = "model.language_model."  # the text decoder in a conditional-generation checkpoint

Shape = tuple[int, ...]


def _size(value: Any, what: str) -> int:
    """An int from a config field that may be a one-element or repeated list (transformers allows both)."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ValueError(f"vision_config.{what}={list(value)}: only square patches are supported")
        value = value[0]
    return int(value)


def vision_tensors(vision_config: Any) -> tuple[tuple[str, Shape], ...]:
    """Every tensor of the tower, ``(HF name, shape)``, in transformers' module order."""
    def get(name: str, default: Any = None) -> Any:
        if isinstance(vision_config, dict):
            return vision_config.get(name, default)
        return getattr(vision_config, name, default)

    h, inter, depth = int(get("hidden_size")), int(get("intermediate_size")), int(get("depth"))
    patch, frames = _size(get("patch_size", 16), "patch_size"), _size(get("temporal_patch_size", 2),
                                                                      "temporal_patch_size")
    merged = h * int(get("spatial_merge_size", 2)) ** 2
    out: list[tuple[str, Shape]] = [
        ("patch_embed.proj.weight", (h, int(get("in_channels", 3)), frames, patch, patch)),
        ("patch_embed.proj.bias", (h,)),
        ("pos_embed.weight", (int(get("num_position_embeddings", 2304)), h)),
    ]
    for i in range(depth):
        b = f"blocks.{i}."
        out += [(b + "norm1.weight", (h,)), (b + "norm1.bias", (h,)), (b + "norm2.weight", (h,)),
                (b + "norm2.bias", (h,)), (b + "attn.qkv.weight", (3 * h, h)), (b + "attn.qkv.bias", (3 * h,)),
                (b + "attn.proj.weight", (h, h)), (b + "attn.proj.bias", (h,)),
                (b + "mlp.linear_fc1.weight", (inter, h)), (b + "mlp.linear_fc1.bias", (inter,)),
                (b + "mlp.linear_fc2.weight", (h, inter)), (b + "mlp.linear_fc2.bias", (h,))]
    out += [("merger.norm.weight", (h,)), ("merger.norm.bias", (h,)),
            ("merger.linear_fc1.weight", (merged, merged)), ("merger.linear_fc1.bias", (merged,)),
            ("merger.linear_fc2.weight", (int(get("out_hidden_size")), merged)),
            ("merger.linear_fc2.bias", (int(get("out_hidden_size")),))]
    return tuple((VISUAL_PREFIX + name, shape) for name, shape in out)
