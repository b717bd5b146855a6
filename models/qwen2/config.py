"""Qwen2: transformers ``Qwen2Config`` -> ModelConfig (bias on q/k/v only, none on o_proj or the MLP)."""

from __future__ import annotations

from typing import Any

from models.common.config import ModelConfig

HF_MODEL_TYPES = ("qwen2",)


def model_config(hf_config: Any) -> ModelConfig:
    return ModelConfig.from_hf(hf_config, architecture="qwen2", qkv_bias=True, o_bias=False, mlp_bias=False)
