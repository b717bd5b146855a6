"""Qwen3.5 (dense): transformers ``Qwen3_5TextConfig`` -> HybridModelConfig (Gated DeltaNet and gated
full-attention layers from ``layer_types``, partial rotary, zero-centred RMSNorms, q/k norms); a
``Qwen3_5Config`` (conditional generation) -> its text model with the tower carried (``model_config``) or
with the tower run (``vl_model_config``, ``models/common/hybrid/vl.py``)."""

from __future__ import annotations

from typing import Any

from models.common.hybrid.config import HybridModelConfig, hybrid_checkpoint_config, hybrid_config_from_hf
from models.common.hybrid.vl import hybrid_vl_config

HF_MODEL_TYPES = ("qwen3_5_text", "qwen3_5")  # text (CausalLM) and conditional-generation checkpoints
VL_MODEL_TYPES = ("qwen3_5",)  # conditional-generation checkpoints


def _text_config(text: Any) -> HybridModelConfig:
    return hybrid_config_from_hf(text, architecture="qwen3_5")


def model_config(hf_config: Any) -> HybridModelConfig:
    return hybrid_checkpoint_config(hf_config, _text_config)


def vl_model_config(hf_config: Any) -> HybridModelConfig:
    return hybrid_vl_config(hf_config, _text_config)
