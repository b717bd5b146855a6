"""Qwen3.5-MoE (text): transformers ``Qwen3_5MoeTextConfig`` -> HybridModelConfig with a MoeConfig: the
Qwen3.5 hybrid layers (Gated DeltaNet with separate ``in_proj_qkv``/``z``/``b``/``a``, gated full
attention, zero-centred RMSNorms) and a sparse MLP on every layer: softmax over all experts, top-k,
always renormalised (transformers' ``Qwen3_5MoeTopKRouter``; the config has no ``norm_topk_prob``,
``decoder_sparse_step``, ``mlp_only_layers`` nor ``intermediate_size``), plus the shared expert with its
sigmoid gate; the load-balancing loss as transformers' (``router_aux_loss_coef``, ``output_router_logits``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from models.common.hybrid.config import HybridModelConfig, hybrid_checkpoint_config, hybrid_config_from_hf
from models.common.hybrid.vl import hybrid_vl_config
from models.qwen2_moe.config import moe_from_hf

HF_MODEL_TYPES = ("qwen3_5_moe_text", "qwen3_5_moe")  # text (CausalLM) and conditional-generation checkpoints
VL_MODEL_TYPES = ("qwen3_5_moe",)  # conditional-generation checkpoints


def model_config(hf_config: Any) -> HybridModelConfig:
    return hybrid_checkpoint_config(hf_config, _text_config)


def vl_model_config(hf_config: Any) -> HybridModelConfig:
    """A conditional-generation config with its vision tower run (``models/common/hybrid/vl.py``)."""
    return hybrid_vl_config(hf_config, _text_config)


def _text_config(hf_config: Any) -> HybridModelConfig:
    moe = dataclasses.replace(moe_from_hf(hf_config, "qwen3_5_moe", shared_expert=True), norm_topk_prob=True,
                              decoder_sparse_step=1, mlp_only_layers=())
    return hybrid_config_from_hf(hf_config, architecture="qwen3_5_moe", moe=moe)
