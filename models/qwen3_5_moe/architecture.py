"""Qwen3.5-MoE (text) as the builder sees it: HF model types, config glue, weight map and the model
class (plain data, importable without torch)."""

from __future__ import annotations

from typing import Any

from models.common.architecture import Architecture
from models.common.hybrid_config import HybridModelConfig
from models.qwen3_5_moe import config, weights


class _EverySparse:
    """An HF config read as transformers reads Qwen3.5-MoE's: it has no ``decoder_sparse_step`` (every layer is
    sparse), which ``moe_from_hf`` would read as 0 from a config.json read as plain data (the converters'
    ``HFConfig``, where absent keys are None)."""

    def __init__(self, hf_config: Any) -> None:
        self._hf_config = hf_config

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._hf_config, name, None) if name == "decoder_sparse_step" else getattr(self._hf_config,
                                                                                                     name)
        return 1 if name == "decoder_sparse_step" and value is None else value


def model_config(hf_config: Any) -> HybridModelConfig:
    return config.model_config(_EverySparse(hf_config))


ARCHITECTURE = Architecture("qwen3_5_moe", config.HF_MODEL_TYPES, model_config, weights.weight_map,
                            model_class="models.common.hybrid_lm:HybridCausalLM")
