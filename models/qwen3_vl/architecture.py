"""Qwen3-VL as the converters and the builder see it: HF model types, config glue, weight map and the
model class (plain data, importable without torch). On disk and in memory transformers 5.24 uses the
same names (``model.language_model.*``, ``model.visual.*``, ``lm_head.*``), so there are no key aliases."""

from __future__ import annotations

from models.common.architecture import Architecture
from models.qwen3_vl import config, weights

ARCHITECTURE = Architecture("qwen3_vl", config.HF_MODEL_TYPES, config.model_config, weights.weight_map,
                            model_class="models.qwen3_vl.model:ParallelQwen3VL",
                            counted_blocks=weights.counted_blocks)
