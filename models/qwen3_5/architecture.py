"""Qwen3.5 (dense) as the builder sees it: HF model types, config glue, weight map and the model class
(plain data, importable without torch).

``ARCHITECTURE``: the text model (``Qwen3_5ForCausalLM``; a ``Qwen3_5ForConditionalGeneration`` checkpoint's
text model with its tower carried), what the converters read. ``VL_ARCHITECTURE``: the vision-language model
the builder makes from a conditional-generation config or checkpoint (``models/common/hybrid/vl.py``)."""

from __future__ import annotations

from models.common.architecture import Architecture
from models.common.hybrid.vl import counted_blocks, hybrid_vl_weight_map
from models.qwen3_5 import config, weights

ARCHITECTURE = Architecture("qwen3_5", config.HF_MODEL_TYPES, config.model_config, weights.weight_map,
                            model_class="models.common.hybrid.lm:HybridCausalLM")
VL_ARCHITECTURE = Architecture("qwen3_5", config.VL_MODEL_TYPES, config.vl_model_config, hybrid_vl_weight_map,
                               model_class="models.qwen3_5.model:ParallelQwen3_5VL", counted_blocks=counted_blocks)
