"""The vision tower of Qwen3.5 / Qwen3.5-MoE conditional-generation checkpoints
(``Qwen3_5ForConditionalGeneration``, ``Qwen3_5MoeForConditionalGeneration``), as tensors to carry.

Plain data, no torch. The converters, and the text build of such a checkpoint
(``build_parallel_model(..., text_only=True)``), hold the text model only (``text_config``, decoder under
``model.language_model.``); the tower's tensors (``model.visual.*``) are named and shaped here from the
vision config so that a checkpoint's tower is checked tensor by tensor (nothing missing, nothing
mis-shaped, nothing unexplained) and carried bitwise by conversions whose target can hold it (HF), instead
of being dropped (the default build runs the tower: ``models/common/hybrid/vl.py``). Names and shapes are
transformers 5.24's ``Qwen3_5VisionModel``: a Conv3d patch embedding with bias, a learned position table,
``depth`` pre-LayerNorm blocks (fused ``qkv`` with bias, ``proj``, a two-layer MLP with biases) and the patch
merger (LayerNorm over one patch, two linears over the ``spatial_merge_size**2`` merged patches).

In Megatron checkpoints (Megatron-Bridge 0.6.2's ``Qwen3VLModel``, mapping registry of ``qwen35_vl_bridge.py``)
the tower is megatron-core's ViT under ``vision_model.`` (``MEGATRON_TOWER``): each block a Transformer-Engine
layer (``linear_qkv`` with ``norm1`` fused as ``layer_norm_weight``/``layer_norm_bias``, ``linear_proj``,
``linear_fc1`` with ``norm2`` fused, ``linear_fc2``), ``merger.patch_norm`` / ``linear_fc1`` (column-parallel) /
``linear_fc2`` (row-parallel), ``patch_embed.proj`` (a Conv3d) and ``pos_embed`` (an Embedding) replicated.
``qkv`` is megatron-core's ``linear_qkv`` with as many query groups as heads: HF ``[q; k; v]`` reordered per
head ``[q_h; k_h; v_h]`` (Bridge's ``ConcatenatedQKVMapping``; layout ``TOWER_QKV``), split over TP by heads.
``tower_megatron`` gives each tensor's name and split (``COLUMN``: dim 0 of the Megatron tensor, ``ROW``: dim 1,
``REPLICATED``); torch_dist stacks the blocks (``vision_model.decoder.layers.<param>`` ``[depth, ...]``: the
tower's config is homogeneous) where the text model keeps one key per layer.
"""

from __future__ import annotations

from typing import Any

VISUAL_PREFIX = "model.visual."
TEXT_PREFIX = "model.language_model."  # the text decoder in a conditional-generation checkpoint
MEGATRON_TOWER = "vision_model."  # the tower in Megatron-Bridge's Qwen3VLModel
MEGATRON_TEXT = "language_model."  # the text GPT (and its MTP block) in the same model
TOWER_LAYERS = MEGATRON_TOWER + "decoder.layers."
# Qwen3-VL's DeepStack mergers (Bridge's ``qwen3_vl_bridge.py``: ``vision_model.decoder.deepstack_merger_list.{k}.*``),
# stacked like the blocks in torch_dist (``[len(deepstack_visual_indexes), ...]``)
TOWER_DEEPSTACK = MEGATRON_TOWER + "decoder.deepstack_merger_list."
TOWER_STACKS = (TOWER_LAYERS, TOWER_DEEPSTACK)  # the tower's module lists torch_dist stacks
TOWER_QKV = "tower_qkv_per_head"  # Megatron layout tag: HF [q; k; v] -> per head [q_h; k_h; v_h]
COLUMN, ROW, REPLICATED = "column", "row", "replicated"  # how megatron-core splits a Megatron tensor over TP

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


# HF block tensor -> (Megatron name in the block, TP split); the merger's likewise (Bridge's registry)
_BLOCK = {
    "norm1.weight": ("self_attention.linear_qkv.layer_norm_weight", REPLICATED),
    "norm1.bias": ("self_attention.linear_qkv.layer_norm_bias", REPLICATED),
    "norm2.weight": ("mlp.linear_fc1.layer_norm_weight", REPLICATED),
    "norm2.bias": ("mlp.linear_fc1.layer_norm_bias", REPLICATED),
    "attn.qkv.weight": ("self_attention.linear_qkv.weight", COLUMN),
    "attn.qkv.bias": ("self_attention.linear_qkv.bias", COLUMN),
    "attn.proj.weight": ("self_attention.linear_proj.weight", ROW),
    "attn.proj.bias": ("self_attention.linear_proj.bias", REPLICATED),
    "mlp.linear_fc1.weight": ("mlp.linear_fc1.weight", COLUMN),
    "mlp.linear_fc1.bias": ("mlp.linear_fc1.bias", COLUMN),
    "mlp.linear_fc2.weight": ("mlp.linear_fc2.weight", ROW),
    "mlp.linear_fc2.bias": ("mlp.linear_fc2.bias", REPLICATED),
}
_OTHER = {
    "patch_embed.proj.weight": ("patch_embed.proj.weight", REPLICATED),
    "patch_embed.proj.bias": ("patch_embed.proj.bias", REPLICATED),
    "pos_embed.weight": ("pos_embed.weight", REPLICATED),
    "merger.norm.weight": ("merger.patch_norm.weight", REPLICATED),
    "merger.norm.bias": ("merger.patch_norm.bias", REPLICATED),
    "merger.linear_fc1.weight": ("merger.linear_fc1.weight", COLUMN),
    "merger.linear_fc1.bias": ("merger.linear_fc1.bias", COLUMN),
    "merger.linear_fc2.weight": ("merger.linear_fc2.weight", ROW),
    "merger.linear_fc2.bias": ("merger.linear_fc2.bias", REPLICATED),
}
# the tower's Transformer-Engine modules (an empty ``_extra_state`` each in Bridge's checkpoints)
TOWER_BLOCK_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
TOWER_OTHER_MODULES = ("merger.patch_norm", "merger.linear_fc1", "merger.linear_fc2")
TOWER_DEEPSTACK_MODULES = ("patch_norm", "linear_fc1", "linear_fc2")  # each DeepStack merger's (Qwen3-VL)


def tower_megatron(hf_name: str) -> tuple[str, str, bool]:
    """(Megatron name, TP split, whether it is ``linear_qkv``) of a tower tensor's HF name."""
    local = hf_name[len(VISUAL_PREFIX):]
    if local.startswith("deepstack_merger_list."):  # Qwen3-VL: a merger of its own per DeepStack block
        _, k, rest = local.split(".", 2)
        name, split = _OTHER["merger." + rest]
        return f"{TOWER_DEEPSTACK}{k}.{name.removeprefix('merger.')}", split, False
    if local.startswith("blocks."):
        _, block, rest = local.split(".", 2)
        name, split = _BLOCK[rest]
        return f"{TOWER_LAYERS}{block}.{name}", split, rest.startswith("attn.qkv.")
    name, split = _OTHER[local]
    return MEGATRON_TOWER + name, split, False


def vision_heads(vision_config: Any) -> int:
    """The tower's attention heads (``num_heads``), for the per-head ``qkv`` order."""
    heads = vision_config.get("num_heads") if isinstance(vision_config, dict) else getattr(vision_config, "num_heads",
                                                                                             None)
    return int(heads or 0)
