"""Qwen3-Next weight map: the hybrid decoder's table under ``model.`` (``Qwen3NextForCausalLM``), the linear
layers' ``in_proj_qkvz``/``in_proj_ba`` interleaved per key-head group on disk (rule ``Groups``), the
sparse MLP (experts per expert, as transformers writes them) on ``cfg.sparse_layers()``."""

from __future__ import annotations

from models.common.hybrid.config import HybridModelConfig
from models.common.hybrid.weights import HybridWeightMap, hybrid_decoder_weight_map


def weight_map(cfg: HybridModelConfig, padded_vocab_size: int) -> HybridWeightMap:
    return hybrid_decoder_weight_map(cfg, padded_vocab_size, hf_prefix="model.", hf_lm_head="lm_head.weight",
                                     interleaved=True)
