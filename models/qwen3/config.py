"""Qwen3: transformers ``Qwen3Config`` -> ModelConfig (per-head q/k RMSNorm before RoPE, head_dim as
configured, ``attention_bias`` on q/k/v and o_proj, no MLP bias)."""

from __future__ import annotations

from typing import Any

from models.common.config import ModelConfig

HF_MODEL_TYPES = ("qwen3",)


def model_config(hf_config: Any) -> ModelConfig:
    bias = bool(getattr(hf_config, "attention_bias", False))  # transformers' Qwen3Attention: q/k/v and o_proj
    return ModelConfig.from_hf(hf_config, architecture="qwen3", qkv_bias=bias, o_bias=bias, mlp_bias=False,
                               qk_norm=True)
