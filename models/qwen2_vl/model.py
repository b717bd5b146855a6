"""Qwen2-VL: the shared Qwen2 decoder with M-RoPE, fed by a tensor-parallel vision tower.

``model(input_ids, ..., pixel_values=, image_grid_thw=, pixel_values_videos=, video_grid_thw=,
mm_token_type_ids=)`` computes what transformers' ``Qwen2VLForConditionalGeneration`` computes. The
model is the Qwen2-VL family's ``ParallelVisionLanguageModel`` (``models/common/vision_language.py``:
input checks, one tower pass, M-RoPE positions, features merged at embed time under SP/CP/Ulysses,
the vision work shared by the cp x ulysses ranks, ``forward_backward``) with Qwen2-VL's tower
(LayerNorm, quick-GELU MLP, attention per frame) and temporal positions stepping by 1.
"""

from __future__ import annotations

from typing import Any

import torch

from models.common.builder import build_model
from models.common.vision_language import ParallelVisionLanguageModel, VisionFeatures
from models.qwen2_vl.architecture import ARCHITECTURE
from parallel.config import ParallelConfig
from parallel.groups import ParallelGroups

__all__ = ["ARCHITECTURE", "ParallelQwen2VL", "VisionFeatures", "build_parallel_model"]


class ParallelQwen2VL(ParallelVisionLanguageModel):
    """A tensor/sequence/pipeline-parallel Qwen2-VL; build it with ``build_parallel_model``."""


def build_parallel_model(source: Any, parallel_config: ParallelConfig | None = None, *,
                         dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                         groups: ParallelGroups | None = None, seed: int = 0, lora: Any = None,
                         loss_chunk_tokens: int | None = None, compile: bool = False) -> ParallelQwen2VL:
    """Build this rank's Qwen2-VL shard from an HF directory (either key layout) or a transformers
    config (random weights). Call after ``torch.distributed.init_process_group`` when the layout
    uses more than one rank. See ``models.common.builder.build_model`` for the arguments."""
    if lora is not None:
        raise ValueError("qwen2_vl: LoRA is not supported yet")
    return build_model(ARCHITECTURE, source, parallel_config, dtype=dtype, device=device, groups=groups, seed=seed,
                       loss_chunk_tokens=loss_chunk_tokens, compile=compile)
