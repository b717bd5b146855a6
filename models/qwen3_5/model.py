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

import torch

from models.common.blocks.hybrid_decoder import HybridDecoder
from models.common.blocks.rope import RotaryEmbedding
from models.common.entry_point import hybrid_entry_point
from models.common.training.pipeline_chunk import PipelineChunk
from models.qwen3_5.architecture import ARCHITECTURE, VL_ARCHITECTURE
from models.qwen3_vl.model import ParallelQwen3VL
from parallel.groups import ParallelGroups

__all__ = ["ARCHITECTURE", "VL_ARCHITECTURE", "ParallelQwen3_5VL", "build_parallel_model"]


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


build_parallel_model = hybrid_entry_point(ARCHITECTURE, VL_ARCHITECTURE, "Qwen3.5", __name__,
                                          vl_model="``ParallelQwen3_5VL``")
