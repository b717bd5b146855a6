"""The Gated DeltaNet hybrids as vision-language models (Qwen3.5 / Qwen3.5-MoE conditional generation): config
and weight map, plain data (no torch).

A ``Qwen3_5Config`` / ``Qwen3_5MoeConfig`` (``text_config`` + ``vision_config``) read for a model that *runs*
its vision tower: the text decoder is the hybrid one (``hybrid_config_from_hf`` of ``text_config``, decoder
under ``model.language_model.``), the tower is transformers 5.24's ``Qwen3_5VisionModel``, which is the
Qwen3-VL tower without DeepStack (``models/common/vision/qwen3.py`` with ``deepstack_visual_indexes=()``: its
blocks, learned position table, 2-D rotary and merger; tensors under ``model.visual.``). The gated attention
rotates the first ``rotary_dim`` channels of each head with interleaved M-RoPE: of its ``rotary_dim / 2``
frequencies, j follows the height row when ``j % 3 == 1`` and ``j < 3 * mrope_section[1]``, the width row when
``j % 3 == 2`` and ``j < 3 * mrope_section[2]``, the temporal row otherwise (transformers'
``Qwen3_5TextRotaryEmbedding``, default ``[11, 11, 10]``; like transformers, sections need not sum to
``rotary_dim / 2``: real checkpoints' do, tiny test models' may not).

This is the builder's view only. The converters keep reading such checkpoints through the text
architecture (``hybrid_checkpoint_config``: the tower carried bitwise, ``models/common/hybrid/vision.py``),
which is also what ``build_parallel_model(..., text_only=True)`` builds.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from models.common.config import UnsupportedConfigError
from models.common.hybrid.config import HybridModelConfig
from models.common.hybrid.vision import TEXT_PREFIX
from models.common.hybrid.weights import HybridWeightMap, hybrid_decoder_weight_map
from models.common.vision.config import text_and_vision_sections, vision_rope_theta, with_vision
from models.common.vision.qwen3 import (
    QWEN3_VISION_ACTIVATIONS,
    VISUAL_HF_PREFIX,
    Qwen3VisionConfig,
    qwen3_vision_entries,
)

DEFAULT_MROPE_SECTION = (11, 11, 10)  # transformers' Qwen3_5TextRotaryEmbedding default
# transformers' Qwen3_5Config token defaults (a config.json may leave them out)
DEFAULT_TOKENS = {"image_token_id": 248056, "video_token_id": 248057}
# transformers' ``Qwen3_5VisionConfig`` defaults, for a config given as plain data
VISION_DEFAULTS = {"depth": 27, "hidden_size": 1152, "hidden_act": "gelu_pytorch_tanh", "intermediate_size": 4304,
                   "num_heads": 16, "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2,
                   "temporal_patch_size": 2, "out_hidden_size": 3584, "num_position_embeddings": 2304}
POSITIVE = ("depth", "hidden_size", "intermediate_size", "out_hidden_size", "num_heads", "in_channels",
            "spatial_merge_size", "num_position_embeddings")


def is_conditional_generation(hf_config: Any) -> bool:
    """A ``Qwen3_5Config`` / ``Qwen3_5MoeConfig`` (text and vision sub-configs), not a text config."""
    return getattr(hf_config, "text_config", None) is not None and getattr(hf_config, "vision_config", None) is not None


def _square(value: Any, field: str, arch: str) -> int:
    """``patch_size`` / ``temporal_patch_size``: transformers also accepts a list of equal sizes."""
    if isinstance(value, (list, tuple)) and len(value) > 0 and len(set(value)) == 1:
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise UnsupportedConfigError(f"{arch}: vision_config.{field}={value!r} must be a positive integer (or a "
                                     f"list of equal ones)")
    return value


def hybrid_vl_config(hf_config: Any, read: Callable[[Any], HybridModelConfig]) -> HybridModelConfig:
    """The hybrid text decoder of ``text_config`` (``read``) with interleaved M-RoPE over its rotary channels
    and the Qwen3.5 vision tower (``cfg.vision``); refused in one line naming the numbers: other than three
    M-RoPE sections, a rope type other than default, a tower activation the block does
    not compute, a merger output other than the text width."""
    text, vis = text_and_vision_sections(hf_config, "qwen3_5", VISION_DEFAULTS, POSITIVE)
    cfg = read(text)
    arch = cfg.architecture
    params = dict(getattr(text, "rope_parameters", None) or {})
    if cfg.rope.rope_type != "default":
        raise UnsupportedConfigError(f"{arch}: rope_type={cfg.rope.rope_type!r} with M-RoPE is not supported "
                                     f"(only default)")
    section = tuple(int(x) for x in (params.get("mrope_section") or DEFAULT_MROPE_SECTION))
    if len(section) != 3 or min(section) < 0:
        raise UnsupportedConfigError(f"{arch}: mrope_section={list(section)} must be three non-negative sections "
                                     f"(temporal, height, width)")
    if vis.hidden_act not in QWEN3_VISION_ACTIVATIONS:
        raise UnsupportedConfigError(f"{arch}: vision_config.hidden_act={vis.hidden_act!r} is not supported "
                                     f"({', '.join(QWEN3_VISION_ACTIVATIONS)})")

    def token(name: str) -> int:
        value = getattr(hf_config, name, None)
        return DEFAULT_TOKENS[name] if value is None else int(value)

    vision = Qwen3VisionConfig(
        depth=vis.depth, embed_dim=vis.hidden_size, out_hidden_size=vis.out_hidden_size, num_heads=vis.num_heads,
        intermediate_size=vis.intermediate_size, in_channels=vis.in_channels,
        patch_size=_square(vis.patch_size, "patch_size", arch),
        temporal_patch_size=_square(vis.temporal_patch_size, "temporal_patch_size", arch),
        spatial_merge_size=vis.spatial_merge_size, hidden_act=vis.hidden_act, rope_theta=vision_rope_theta(vis),
        image_token_id=token("image_token_id"), video_token_id=token("video_token_id"),
        num_position_embeddings=vis.num_position_embeddings, deepstack_visual_indexes=())
    cfg = dataclasses.replace(cfg, rope=dataclasses.replace(cfg.rope, mrope_section=section), hf_prefix=TEXT_PREFIX,
                              carried=(), vision_heads=0,
                              tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)))
    return with_vision(cfg, vision, "out_hidden_size")


def hybrid_vl_weight_map(cfg: HybridModelConfig, padded_vocab_size: int) -> HybridWeightMap:
    """The hybrid decoder's table under ``model.language_model.`` plus the tower's entries (``visual.*``
    parameters from ``model.visual.*``, with their TP rules) on the first pipeline stage."""
    assert cfg.vision is not None, f"{cfg.architecture} needs cfg.vision"
    text = hybrid_decoder_weight_map(cfg, padded_vocab_size, hf_prefix=cfg.hf_prefix, hf_lm_head="lm_head.weight")
    return dataclasses.replace(text, first_entries=text.first_entries + qwen3_vision_entries(cfg.vision))


def counted_blocks(cfg: HybridModelConfig) -> tuple[tuple[str, int, str], ...]:
    """The vision blocks, listed one by one in the weight map."""
    return (("vision_config.depth", cfg.vision.depth, VISUAL_HF_PREFIX + "blocks."),)
