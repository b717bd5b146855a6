"""Qwen3-MoE as the converters and the builder see it: HF model types, config glue and weight map
(plain data, importable without torch)."""

from __future__ import annotations

from models.common.architecture import Architecture
from models.qwen3_moe import config, weights

ARCHITECTURE = Architecture("qwen3_moe", config.HF_MODEL_TYPES, config.model_config, weights.weight_map)
