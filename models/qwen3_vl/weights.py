"""Qwen3-VL weight map: the Qwen3 decoder table (q/k norms) under ``model.language_model.`` plus the
vision tower under ``model.visual.`` (``models/common/vision/qwen3.py``: names, shapes, TP rules), and
``lm_head.weight`` (absent when tied). transformers 5.24's ``save_pretrained`` writes exactly these
names (its in-memory ones; checked in tests/test_qwen3_vl.py)."""

from __future__ import annotations

from models.common.config import ModelConfig
from models.common.vision.qwen3 import VISUAL_HF_PREFIX, qwen3_vision_entries
from models.common.weight_map import WeightMap, dense_decoder_weight_map

TEXT_HF_PREFIX = "model.language_model."


def counted_blocks(cfg: ModelConfig) -> tuple[tuple[str, int, str], ...]:
    """The vision blocks and DeepStack mergers, listed one by one in the weight map."""
    return (("vision_config.depth", cfg.vision.depth, VISUAL_HF_PREFIX + "blocks."),
            ("vision_config.deepstack_visual_indexes", cfg.vision.deepstack_count,
             VISUAL_HF_PREFIX + "deepstack_merger_list."))


def weight_map(cfg: ModelConfig, padded_vocab_size: int) -> WeightMap:
    assert cfg.vision is not None, f"{cfg.architecture} needs cfg.vision"
    dense = dense_decoder_weight_map(cfg, padded_vocab_size, hf_prefix=TEXT_HF_PREFIX, hf_lm_head="lm_head.weight")
    return WeightMap(dense.layer_entries, dense.first_entries + qwen3_vision_entries(cfg.vision), dense.last_entries)
