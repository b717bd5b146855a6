"""Qwen3 as the converters and the builder see it: HF model types, config glue and weight map
(plain data, importable without torch)."""

from __future__ import annotations

from models.common.architecture import Architecture
from models.qwen3 import config, weights

ARCHITECTURE = Architecture("qwen3", config.HF_MODEL_TYPES, config.model_config, weights.weight_map)
