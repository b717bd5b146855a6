"""What a model folder contributes to the builder and the converters (plain data, no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from models.common.config import ModelConfig
from models.common.weight_map import WeightMap


@dataclass(frozen=True)
class Architecture:
    """How to read an architecture's HF config and its weight map."""

    name: str
    hf_model_types: tuple[str, ...]
    model_config: Callable[[Any], ModelConfig]
    weight_map: Callable[[ModelConfig, int], WeightMap]
