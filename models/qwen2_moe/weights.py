"""Qwen2-MoE weight map: the dense decoder table plus the sparse MLP entries (router, per-expert
SwiGLU stacked over experts, shared expert and its gate) on the sparse layers."""

from __future__ import annotations

from models.common.config import ModelConfig
from models.common.weight_map import WeightMap, moe_decoder_weight_map


def weight_map(cfg: ModelConfig, padded_vocab_size: int) -> WeightMap:
    return moe_decoder_weight_map(cfg, padded_vocab_size, hf_prefix="model.", hf_lm_head="lm_head.weight")
