"""Qwen3.5 (dense, text): transformers ``Qwen3_5TextConfig`` -> HybridModelConfig (Gated DeltaNet and
gated full-attention layers from ``layer_types``, partial rotary, zero-centred RMSNorms, q/k norms)."""

from __future__ import annotations

from typing import Any

from models.common.hybrid_config import HybridModelConfig, hybrid_checkpoint_config, hybrid_config_from_hf

HF_MODEL_TYPES = ("qwen3_5_text", "qwen3_5")  # text (CausalLM) and conditional-generation checkpoints


def model_config(hf_config: Any) -> HybridModelConfig:
    return hybrid_checkpoint_config(hf_config, lambda text: hybrid_config_from_hf(text, architecture="qwen3_5"))
