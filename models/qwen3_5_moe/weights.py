"""Qwen3.5-MoE (text) weight map: the hybrid decoder's table under ``model.`` (``Qwen3_5MoeForCausalLM``)
with the sparse MLP on every layer, experts per expert (``mlp.experts.{e}.gate_proj.weight`` ...) as
transformers 5 ``save_pretrained`` writes them."""

from __future__ import annotations

from models.common.hybrid.config import HybridModelConfig
from models.common.hybrid.weights import HybridWeightMap, hybrid_decoder_weight_map


def weight_map(cfg: HybridModelConfig, padded_vocab_size: int) -> HybridWeightMap:
    return hybrid_decoder_weight_map(cfg, padded_vocab_size, hf_prefix=cfg.hf_prefix, hf_lm_head="lm_head.weight")
