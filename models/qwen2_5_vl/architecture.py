"""Qwen2.5-VL as the converters and the builder see it: HF model types, config glue, weight map, the
key aliases of transformers' in-memory layout, and the model class (plain data, importable without torch)."""

from __future__ import annotations

from models.common.architecture import Architecture
from models.qwen2_5_vl import config, weights

ARCHITECTURE = Architecture("qwen2_5_vl", config.HF_MODEL_TYPES, config.model_config, weights.weight_map,
                            hf_key_aliases=weights.HF_KEY_ALIASES,
                            model_class="models.qwen2_5_vl.model:ParallelQwen2_5_VL",
                            counted_blocks=weights.counted_blocks)
