"""Qwen3.5 (dense, text): transformers ``Qwen3_5TextConfig`` -> HybridModelConfig (Gated DeltaNet and
gated full-attention layers from ``layer_types``, partial rotary, zero-centred RMSNorms, q/k norms)."""

from __future__ import annotations

from typing import Any

from models.common.hybrid_config import HybridModelConfig, hybrid_config_from_hf

HF_MODEL_TYPES = ("qwen3_5_text",)


def model_config(hf_config: Any) -> HybridModelConfig:
    return hybrid_config_from_hf(hf_config, architecture="qwen3_5")
