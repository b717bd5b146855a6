"""Llama: transformers ``LlamaConfig`` -> ModelConfig (``attention_bias`` covers q/k/v and o_proj)."""

from __future__ import annotations

from typing import Any

from models.common.config import ModelConfig

HF_MODEL_TYPES = ("llama",)


def model_config(hf_config: Any) -> ModelConfig:
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    return ModelConfig.from_hf(hf_config, architecture="llama", qkv_bias=attention_bias, o_bias=attention_bias,
                               mlp_bias=bool(getattr(hf_config, "mlp_bias", False)))
