"""Qwen3 weight map: the shared dense-decoder table (with its q/k-norm entries) under ``model.``."""

from __future__ import annotations

from models.common.config import ModelConfig
from models.common.weight_map import WeightMap, dense_decoder_weight_map


def weight_map(cfg: ModelConfig, padded_vocab_size: int) -> WeightMap:
    return dense_decoder_weight_map(cfg, padded_vocab_size, hf_prefix="model.", hf_lm_head="lm_head.weight")
