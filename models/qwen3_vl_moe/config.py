"""Qwen3-VL-MoE: transformers ``Qwen3VLMoeConfig`` -> ModelConfig. The tower (DeepStack included) and the
text decoder's attention and M-RoPE are Qwen3-VL's (``models/qwen3_vl/config.py``, read under this
architecture's name, with its checks and one-line errors); the MLPs are Qwen3-MoE's experts
(``models/qwen2_moe/config.moe_from_hf``: ``num_experts`` / ``num_local_experts``, ``num_experts_per_tok``,
``moe_intermediate_size``, ``decoder_sparse_step``, ``mlp_only_layers``, ``router_aux_loss_coef``; no
shared expert), with two differences from Qwen3-MoE read from transformers' ``modeling_qwen3_vl_moe.py``:

- the router always renormalises its top-k weights (``Qwen3VLMoeTextTopKRouter`` divides by their sum
  whatever the config says; the config has no ``norm_topk_prob``), so ``norm_topk_prob`` is True;
- the LM head is tied by the top-level ``tie_word_embeddings`` alone: ``Qwen3VLMoeTextConfig`` defaults its
  own flag to True and transformers ignores it (checked: top False / text True is untied), where the dense
  Qwen3-VL reader accepts either place.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from models.common.config import ModelConfig
from models.common.vision.config import text_and_vision_sections
from models.qwen2_moe.config import moe_from_hf
from models.qwen3_vl import config as qwen3_vl_config

ARCH = "qwen3_vl_moe"
HF_MODEL_TYPES = (ARCH,)


def model_config(hf_config: Any) -> ModelConfig:
    base = qwen3_vl_config.model_config(hf_config, ARCH)
    text, _ = text_and_vision_sections(hf_config, ARCH, qwen3_vl_config.VISION_DEFAULTS, qwen3_vl_config.POSITIVE)
    moe = dataclasses.replace(moe_from_hf(text, ARCH, shared_expert=False), norm_topk_prob=True)
    return dataclasses.replace(base, moe=moe,
                               tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", None) or False))
