"""Qwen3.5-MoE tensor/sequence/context/pipeline/expert-parallel models: the Gated DeltaNet hybrid causal LM
(text checkpoints and configs), and, from a conditional-generation config or checkpoint
(``Qwen3_5MoeForConditionalGeneration``), the vision-language model (``models.qwen3_5.model.ParallelQwen3_5VL``
with the sparse MLP on every layer)."""

from __future__ import annotations

from typing import Any

import torch

from models.common.causal_lm import ParallelCausalLM
from models.qwen3_5.model import build_hybrid
from models.qwen3_5_moe.architecture import ARCHITECTURE, VL_ARCHITECTURE
from parallel.config import ParallelConfig
from parallel.groups import ParallelGroups

__all__ = ["ARCHITECTURE", "VL_ARCHITECTURE", "build_parallel_model"]


def build_parallel_model(source: Any, parallel_config: ParallelConfig | None = None, *,
                         dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                         groups: ParallelGroups | None = None, seed: int = 0, lora: Any = None,
                         loss_chunk_tokens: int | None = None, compile: bool = False,
                         text_only: bool = False) -> ParallelCausalLM:
    """Build this rank's Qwen3.5-MoE shard from an HF directory or a transformers config (random weights).

    A ``Qwen3_5MoeForConditionalGeneration`` config or checkpoint gives the vision-language model (the
    tower runs); ``text_only=True`` builds its text model alone (the tower carried, not run). Call after
    ``torch.distributed.init_process_group`` when the layout uses more than one rank. See
    ``models.common.builder.build_model`` for the arguments."""
    return build_hybrid(ARCHITECTURE, VL_ARCHITECTURE, source, parallel_config, text_only=text_only, dtype=dtype,
                        device=device, groups=groups, seed=seed, lora=lora, loss_chunk_tokens=loss_chunk_tokens,
                        compile=compile)
