"""Qwen2-MoE: transformers ``Qwen2MoeConfig`` -> ModelConfig with a MoeConfig (qkv bias as configured,
no bias on o_proj or the MLPs)."""

from __future__ import annotations

from typing import Any

from models.common.config import ModelConfig, MoeConfig, UnsupportedConfigError

HF_MODEL_TYPES = ("qwen2_moe",)


def model_config(hf_config: Any) -> ModelConfig:
    import dataclasses

    base = ModelConfig.from_hf(hf_config, architecture="qwen2_moe", qkv_bias=bool(getattr(hf_config, "qkv_bias", True)),
                               o_bias=False, mlp_bias=False)
    experts = int(getattr(hf_config, "num_experts", 0) or 0)
    top_k = int(getattr(hf_config, "num_experts_per_tok", 0) or 0)
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 0)
    problems = []
    if experts < 1:
        problems.append(f"num_experts={experts} (a Qwen2-MoE model needs experts)")
    if not 1 <= top_k <= max(experts, 1):
        problems.append(f"num_experts_per_tok={top_k} must be between 1 and num_experts={experts}")
    if step < 1:
        problems.append(f"decoder_sparse_step={step} must be positive")
    for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if int(getattr(hf_config, name, 0) or 0) < 0:
            problems.append(f"{name}={getattr(hf_config, name)} is negative")
    if problems:
        raise UnsupportedConfigError("qwen2_moe config: " + "; ".join(problems))
    moe = MoeConfig(
        num_experts=experts,
        top_k=top_k,
        moe_intermediate_size=int(hf_config.moe_intermediate_size),
        shared_expert_intermediate_size=int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0),
        norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", False)),
        decoder_sparse_step=step,
        mlp_only_layers=tuple(int(i) for i in (getattr(hf_config, "mlp_only_layers", None) or ())),
        # transformers' default where config.json leaves it out (plain-dict configs read None)
        router_aux_loss_coef=float(_or(getattr(hf_config, "router_aux_loss_coef", None), 0.001)),
    )
    return dataclasses.replace(base, moe=moe)


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value
