"""What a model folder contributes to the builder and the converters (plain data, no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from models.common.config import ModelConfig
from models.common.weight_map import WeightMap


@dataclass(frozen=True)
class Architecture:
    """How to read an architecture's HF config and its weight map.

    ``hf_key_aliases``: ``(prefix, replacement)`` rewrites that turn other HF key layouts of the same
    model into the weight map's names (first match wins), applied when reading checkpoints.
    ``model_class``: ``"module:Class"`` of the model (default: the shared ``ParallelCausalLM``),
    imported only when a model is built.
    ``counted_blocks``: ``cfg -> ((config field, count, tensor name prefix), ...)`` for the blocks
    besides the decoder layers that the weight map lists one by one (a vision tower's blocks): the
    converters compare each count with the ``prefix<N>.`` tensors present before the weight map is
    built, so an absurd count fails in one line instead of allocating a table of that size.
    """

    name: str
    hf_model_types: tuple[str, ...]
    model_config: Callable[[Any], ModelConfig]
    weight_map: Callable[[ModelConfig, int], WeightMap]
    hf_key_aliases: tuple[tuple[str, str], ...] = ()
    model_class: str | None = None
    counted_blocks: Callable[[ModelConfig], tuple[tuple[str, int, str], ...]] | None = None

    def canonical_name(self, name: str) -> str:
        """``name`` under the weight map's key layout (``hf_key_aliases`` applied)."""
        for prefix, replacement in self.hf_key_aliases:
            if name.startswith(prefix):
                return replacement + name[len(prefix):]
        return name

    def module_name(self, name: str) -> str:
        """A weight-map name as transformers names the tensor in memory (``hf_key_aliases`` read backwards:
        Qwen2-VL's ``model.layers.0.mlp.up_proj.weight`` is ``model.language_model.layers.0.mlp.up_proj.weight``
        on transformers' model): the names peft matches ``target_modules`` against and writes in adapters."""
        for prefix, replacement in self.hf_key_aliases:
            if name.startswith(replacement):
                return prefix + name[len(replacement):]
        return name
