"""Qwen3-VL-MoE as the converters and the builder see it: HF model types, config glue, weight map and the
model class (plain data, importable without torch). transformers 5.24 holds and saves the model under
``model.language_model.*``, ``model.visual.*``, ``lm_head.*`` (no key aliases); its experts are stored
fused per layer and read per expert by the loader (see ``weights.py``)."""

from __future__ import annotations

from models.common.architecture import Architecture
from models.qwen3_vl_moe import config, weights

ARCHITECTURE = Architecture("qwen3_vl_moe", config.HF_MODEL_TYPES, config.model_config, weights.weight_map,
                            model_class="models.qwen3_vl_moe.model:ParallelQwen3VLMoe",
                            counted_blocks=weights.counted_blocks)
