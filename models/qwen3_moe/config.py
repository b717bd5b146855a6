"""Qwen3-MoE: transformers ``Qwen3MoeConfig`` -> ModelConfig with a MoeConfig: Qwen3's attention (q/k
norms, head_dim as configured, ``attention_bias`` on q/k/v and o_proj) and routed experts without a
shared expert (softmax over all experts, top-k, renormalised when ``norm_topk_prob``: the router of
Qwen2-MoE; ``decoder_sparse_step``, ``mlp_only_layers`` and the load-balancing loss alike)."""

from __future__ import annotations

import dataclasses
from typing import Any

from models.common.config import ModelConfig
from models.qwen2_moe.config import moe_from_hf

HF_MODEL_TYPES = ("qwen3_moe",)


def model_config(hf_config: Any) -> ModelConfig:
    bias = bool(getattr(hf_config, "attention_bias", False))
    base = ModelConfig.from_hf(hf_config, architecture="qwen3_moe", qkv_bias=bias, o_bias=bias, mlp_bias=False,
                               qk_norm=True)
    return dataclasses.replace(base, moe=moe_from_hf(hf_config, "qwen3_moe", shared_expert=False))
