"""Qwen3-Next tensor/sequence-parallel causal LM: the Gated DeltaNet hybrid decoder."""

from __future__ import annotations

from typing import Any

import torch

from models.common.builder import build_model
from models.common.causal_lm import ParallelCausalLM
from models.qwen3_next.architecture import ARCHITECTURE
from parallel.config import ParallelConfig
from parallel.groups import ParallelGroups

__all__ = ["ARCHITECTURE", "build_parallel_model"]


def build_parallel_model(source: Any, parallel_config: ParallelConfig | None = None, *,
                         dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                         groups: ParallelGroups | None = None, seed: int = 0, lora: Any = None,
                         loss_chunk_tokens: int | None = None, compile: bool = False) -> ParallelCausalLM:
    """Build this rank's Qwen3-Next shard from an HF directory or a transformers config (random weights).

    Call after ``torch.distributed.init_process_group`` when the layout uses more than one rank.
    See ``models.common.builder.build_model`` for the arguments.
    """
    return build_model(ARCHITECTURE, source, parallel_config, dtype=dtype, device=device, groups=groups, seed=seed,
                       lora=lora, loss_chunk_tokens=loss_chunk_tokens, compile=compile)
