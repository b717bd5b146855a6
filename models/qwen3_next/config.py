"""Qwen3-Next: transformers ``Qwen3NextConfig`` -> HybridModelConfig with a MoeConfig: Gated DeltaNet
layers (projections fused and interleaved per key-head group on disk, see ``weights.py``), gated full
attention with partial rotary, zero-centred RMSNorms (``Qwen3NextRMSNorm``: ``x * (1 + w)``; the gated
norm of the linear layer plain), and Qwen2-MoE's sparse MLP (softmax, top-k, renormalised when
``norm_topk_prob``; sigmoid-gated shared expert; ``decoder_sparse_step``, ``mlp_only_layers``, the dense
MLP of ``intermediate_size`` elsewhere)."""

from __future__ import annotations

from typing import Any

from models.common.hybrid.config import HybridModelConfig, hybrid_config_from_hf
from models.qwen2_moe.config import moe_from_hf

HF_MODEL_TYPES = ("qwen3_next",)


def model_config(hf_config: Any) -> HybridModelConfig:
    return hybrid_config_from_hf(hf_config, architecture="qwen3_next",
                                 moe=moe_from_hf(hf_config, "qwen3_next", shared_expert=True))
