"""Qwen2-MoE: transformers ``Qwen2MoeConfig`` -> ModelConfig with a MoeConfig (qkv bias as configured,
no bias on o_proj or the MLPs). ``moe_from_hf`` reads the MoE fields Qwen2-MoE and Qwen3-MoE share."""

from __future__ import annotations

import dataclasses
from typing import Any

from models.common.config import ModelConfig, MoeConfig, UnsupportedConfigError

HF_MODEL_TYPES = ("qwen2_moe",)


def model_config(hf_config: Any) -> ModelConfig:
    base = ModelConfig.from_hf(hf_config, architecture="qwen2_moe", qkv_bias=bool(getattr(hf_config, "qkv_bias", True)),
                               o_bias=False, mlp_bias=False)
    return dataclasses.replace(base, moe=moe_from_hf(hf_config, "qwen2_moe", shared_expert=True))


def moe_from_hf(hf_config: Any, architecture: str, *, shared_expert: bool) -> MoeConfig:
    """The MoE fields of a Qwen-MoE transformers config, checked (one UnsupportedConfigError naming every
    bad field). ``shared_expert=False`` (Qwen3-MoE): the architecture has no shared expert, so a
    ``shared_expert_intermediate_size`` above 0 is refused (transformers would ignore it, vLLM build one)."""
    # transformers 5 saves Qwen3-MoE's count as num_local_experts (its attribute_map), checkpoints as num_experts
    experts = int(_or(getattr(hf_config, "num_experts", None), getattr(hf_config, "num_local_experts", None)) or 0)
    top_k = int(getattr(hf_config, "num_experts_per_tok", 0) or 0)
    step = int(_or(getattr(hf_config, "decoder_sparse_step", None), 1))
    problems = []
    if experts < 1:
        problems.append(f"num_experts={experts} (a mixture-of-experts model needs experts)")
    if not 1 <= top_k <= max(experts, 1):
        problems.append(f"num_experts_per_tok={top_k} must be between 1 and num_experts={experts}")
    if step < 1:
        problems.append(f"decoder_sparse_step={step} must be positive")
    for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if int(getattr(hf_config, name, 0) or 0) < 0:
            problems.append(f"{name}={getattr(hf_config, name)} is negative")
    shared = int(getattr(hf_config, "shared_expert_intermediate_size", 0) or 0)
    if not shared_expert and shared > 0:
        problems.append(f"shared_expert_intermediate_size={shared}: {architecture} has no shared expert")
    if problems:
        raise UnsupportedConfigError(f"{architecture} config: " + "; ".join(problems))
    return MoeConfig(
        num_experts=experts,
        top_k=top_k,
        moe_intermediate_size=int(hf_config.moe_intermediate_size),
        shared_expert_intermediate_size=shared if shared_expert else 0,
        norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", False)),  # transformers' default for both
        decoder_sparse_step=step,
        mlp_only_layers=tuple(int(i) for i in (getattr(hf_config, "mlp_only_layers", None) or ())),
        # transformers' default where config.json leaves it out (plain-dict configs read None)
        router_aux_loss_coef=float(_or(getattr(hf_config, "router_aux_loss_coef", None), 0.001)),
        shared_expert=shared_expert,
    )


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value
