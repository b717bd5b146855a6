"""The model side of a checkpoint, torch-free: which architecture an HF config names, its model
config and conversion weight map, and the units conversions move one at a time.

A *unit* is the embedding (``EMBED``), one decoder layer (its global index) or the final norm and
output layer (``FINAL``). Readers turn their format into the HF tensors of a unit; writers consume
units. Peak memory is therefore a few units, whatever the model size.
"""

from __future__ import annotations

from typing import Any, Union

from models.common.architecture import Architecture
from models.common.config import ModelConfig
from models.common.errors import CheckpointError
from models.common.weight_map import WeightEntry, WeightMap

EMBED = "embed"
FINAL = "final"
Unit = Union[int, str]


def architectures() -> dict[str, Architecture]:
    """Registered architectures by HF model_type."""
    from models.llama.architecture import ARCHITECTURE as LLAMA
    from models.qwen2.architecture import ARCHITECTURE as QWEN2
    from models.qwen2_5_vl.architecture import ARCHITECTURE as QWEN2_5_VL
    from models.qwen2_moe.architecture import ARCHITECTURE as QWEN2_MOE
    from models.qwen2_vl.architecture import ARCHITECTURE as QWEN2_VL
    from models.qwen3.architecture import ARCHITECTURE as QWEN3
    from models.qwen3_moe.architecture import ARCHITECTURE as QWEN3_MOE

    archs = (LLAMA, QWEN2, QWEN2_MOE, QWEN2_VL, QWEN2_5_VL, QWEN3, QWEN3_MOE)
    return {t: arch for arch in archs for t in arch.hf_model_types}


def require_megatron_layout(cfg: ModelConfig, where: str) -> None:
    """Megatron formats name every tensor by its Megatron module; the vision tower of a
    vision-language model has no such names here yet (HF and vLLM formats only)."""
    if cfg.vision is not None:
        raise CheckpointError(f"{where}: {cfg.architecture} has no Megatron layout yet (its vision tower has no "
                              f"Megatron names here); convert it between HF and vLLM formats")


def architecture_for(model_type: str | None, where: str) -> Architecture:
    archs = architectures()
    if model_type not in archs:
        raise CheckpointError(f"{where}: unknown architecture {model_type!r} (supported: {', '.join(sorted(archs))})")
    return archs[model_type]


def conversion_weight_map(arch: Architecture, cfg: ModelConfig) -> WeightMap:
    """The architecture's weight map for conversion (no TP vocab padding: converters pad per format)."""
    return arch.weight_map(cfg, cfg.vocab_size)


def model_from_config(hf_config: Any, where: str, megatron: bool) -> tuple[Architecture, ModelConfig, WeightMap]:
    """Architecture, model config and conversion weight map of an HF config, for every reader and raw
    source; ``megatron``: the checkpoint is in a Megatron format (refused for models without Megatron names)."""
    arch = architecture_for(getattr(hf_config, "model_type", None), where)
    cfg = arch.model_config(hf_config)
    if megatron:
        require_megatron_layout(cfg, where)
    return arch, cfg, conversion_weight_map(arch, cfg)


def unit_entries(wmap: WeightMap, unit: Unit) -> list[WeightEntry]:
    if unit == EMBED:
        return list(wmap.first_entries)
    if unit == FINAL:
        return list(wmap.last_entries)
    return [e.format(int(unit)) for e in wmap.layer_templates(int(unit))]


def all_units(cfg: ModelConfig) -> list[Unit]:
    return [EMBED, *range(cfg.num_hidden_layers), FINAL]
