"""Qwen3.5 (dense) tensor/sequence/context/pipeline-parallel models: the Gated DeltaNet hybrid causal LM
(text checkpoints and configs), and, from a conditional-generation config or checkpoint
(``Qwen3_5ForConditionalGeneration``), the vision-language model ``ParallelQwen3_5VL``.

``ParallelQwen3_5VL`` is Qwen3-VL's model (``models/qwen3_vl/model.py``: the Qwen2-VL family's input checks,
one tower pass shared by the cp x ulysses ranks, features merged at embed time under TP+SP / CP / Ulysses /
PP, videos positioned frame by frame as transformers' ``get_rope_index``) with the hybrid decoder
(``blocks/hybrid_decoder.py``: Gated DeltaNet and gated full-attention layers) in place of Qwen3's, the
tower without DeepStack (transformers' ``Qwen3_5VisionModel``), and interleaved M-RoPE over the
``rotary_dim`` channels the gated attention rotates. It takes the same forward keyword arguments as
``models.qwen3_vl`` (``pixel_values``, ``image_grid_thw``, ``pixel_values_videos``, ``video_grid_thw``,
``mm_token_type_ids``, packed ``cu_seqlens``, ...)."""

from __future__ import annotations

import os
from typing import Any

import torch

from models.common.blocks.hybrid_decoder import HybridDecoder
from models.common.blocks.rope import RotaryEmbedding
from models.common.builder import build_model, load_hf_config
from models.common.causal_lm import ParallelCausalLM
from models.common.hybrid_vl import is_conditional_generation
from models.common.training.pipeline_chunk import PipelineChunk
from models.qwen3_5.architecture import ARCHITECTURE, VL_ARCHITECTURE
from models.qwen3_vl.model import ParallelQwen3VL
from parallel.config import ParallelConfig
from parallel.groups import ParallelGroups

__all__ = ["ARCHITECTURE", "VL_ARCHITECTURE", "ParallelQwen3_5VL", "build_parallel_model", "build_hybrid"]


class ParallelQwen3_5VL(ParallelQwen3VL):
    """A tensor/sequence/context/pipeline/expert-parallel Qwen3.5 (or Qwen3.5-MoE) vision-language model;
    build it with ``build_parallel_model`` from a conditional-generation config or checkpoint."""

    decoder_class = HybridDecoder
    pipeline_chunk_class = PipelineChunk  # no DeepStack tensor to carry between stages

    def __init__(self, cfg, groups: ParallelGroups, weight_map, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__(cfg, groups, weight_map, dtype=dtype, device=device)
        # cos/sin [s, b, 1, rotary_dim]: the gated attention rotates the first rotary_dim channels of a head
        self.rotary = RotaryEmbedding(cfg.rope, cfg.rotary_dim, cfg.max_position_embeddings, mrope_interleaved=True)
        if device is not None:
            self.rotary.to(device)

    # The builder records as "unloaded" every ``model.visual.*`` tensor of a hybrid's checkpoint (the text
    # model leaves the tower unread); this model loads the tower, so only what its weight map lacks (the MTP
    # block) stays unloaded and is carried by ``save_pretrained``.
    @property
    def unloaded_tensors(self) -> tuple[str, ...]:
        return self._unloaded

    @unloaded_tensors.setter
    def unloaded_tensors(self, names) -> None:
        held = {n for e in self.weight_map.first_entries for n in e.hf}
        self._unloaded = tuple(n for n in names if n not in held)


def build_hybrid(arch, vl_arch, source: Any, parallel_config: ParallelConfig | None, *, text_only: bool,
                 **kwargs) -> ParallelCausalLM:
    """``build_model`` with ``vl_arch`` (the vision-language model) for a conditional-generation config or
    checkpoint unless ``text_only``, else ``arch`` (the text model; a conditional-generation checkpoint's
    tower is then carried bitwise, as before the vision-language build existed)."""
    if not text_only:
        hf_config = source[0] if isinstance(source, tuple) else source
        if isinstance(source, (str, os.PathLike)):
            hf_config = load_hf_config(source)
        if is_conditional_generation(hf_config):
            arch = vl_arch  # LoRA: the language model's (tower targets refused by models/common/blocks/lora.py)
    return build_model(arch, source, parallel_config, **kwargs)


def build_parallel_model(source: Any, parallel_config: ParallelConfig | None = None, *,
                         dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                         groups: ParallelGroups | None = None, seed: int = 0, lora: Any = None,
                         loss_chunk_tokens: int | None = None, compile: bool = False,
                         text_only: bool = False) -> ParallelCausalLM:
    """Build this rank's Qwen3.5 shard from an HF directory or a transformers config (random weights).

    A ``Qwen3_5ForConditionalGeneration`` config or checkpoint gives ``ParallelQwen3_5VL`` (the vision tower
    runs); ``text_only=True`` builds its text model alone (the tower carried, not run). Text configs and
    ``Qwen3_5ForCausalLM`` checkpoints give the hybrid causal LM. Call after
    ``torch.distributed.init_process_group`` when the layout uses more than one rank. See
    ``models.common.builder.build_model`` for the arguments."""
    return build_hybrid(ARCHITECTURE, VL_ARCHITECTURE, source, parallel_config, text_only=text_only, dtype=dtype,
                        device=device, groups=groups, seed=seed, lora=lora, loss_chunk_tokens=loss_chunk_tokens,
                        compile=compile)


