"""Qwen3-Next as the builder sees it: HF model types, config glue, weight map and the model
class (plain data, importable without torch)."""

from __future__ import annotations

from models.common.architecture import Architecture
from models.qwen3_next import config, weights

ARCHITECTURE = Architecture("qwen3_next", config.HF_MODEL_TYPES, config.model_config, weights.weight_map,
                            model_class="models.common.hybrid.lm:HybridCausalLM")
