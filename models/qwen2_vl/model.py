"""Qwen2-VL: the shared Qwen2 decoder with M-RoPE, fed by a tensor-parallel vision tower.

``model(input_ids, ..., pixel_values=, image_grid_thw=, pixel_values_videos=, video_grid_thw=,
mm_token_type_ids=)`` computes what transformers' ``Qwen2VLForConditionalGeneration`` computes:

1. the inputs are checked (pixels, grids and placeholder tokens agree) on every rank before any
   collective;
2. the vision tower (``models/common/vision.py``, split over TP) encodes every image and video
   patch once: one pass over all of them (attention stays within each frame, so batching them
   changes nothing);
3. M-RoPE positions ``[3, b, s]`` are computed on the whole (padded or packed) sequence
   (``positions.py``, transformers' ``get_rope_index``);
4. the text tokens are embedded and each image/video feature replaces its placeholder token's
   embedding. Under sequence parallelism the embedding comes out already cut to this rank's
   ``seq/tp`` slice (the vocab-parallel reduce-scatter), so each rank writes only the features
   whose tokens fall in its slice: padding happens before embedding, slicing after the merge,
   with the features' gradient summed over the TP ranks that used them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from models.common.builder import build_model
from models.common.transformer import CausalLMOutput, ParallelCausalLM
from models.common.vision import ParallelVisionTower
from models.qwen2_vl.architecture import ARCHITECTURE
from models.qwen2_vl.positions import (
    check_multimodal_inputs,
    mrope_positions,
    mrope_positions_packed,
    vision_cu_seqlens,
    vision_patch_positions,
)
from parallel.collectives import copy_to_group
from parallel.config import ParallelConfig
from parallel.groups import ParallelGroups

__all__ = ["ARCHITECTURE", "ParallelQwen2VL", "build_parallel_model"]


@dataclass
class VisionFeatures:
    """Merged vision features and the ``[b, s]`` slot of the placeholder token each one replaces."""

    features: torch.Tensor  # [n, hidden]: images' features, then videos'
    batch_index: torch.Tensor  # [n]
    seq_index: torch.Tensor  # [n]


class ParallelQwen2VL(ParallelCausalLM):
    """A tensor/sequence/pipeline-parallel Qwen2-VL; build it with ``build_parallel_model``."""

    def __init__(self, cfg, groups: ParallelGroups, weight_map, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__(cfg, groups, weight_map, dtype=dtype, device=device)
        # The tower feeds the embeddings, so it lives with them on the first pipeline stage.
        self.visual = ParallelVisionTower(cfg.vision, groups, dtype, device) if self.is_first_stage else None

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                gather_logits: bool = False, cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None,
                return_logits: bool = True, *, pixel_values: torch.Tensor | None = None,
                image_grid_thw: torch.Tensor | None = None, pixel_values_videos: torch.Tensor | None = None,
                video_grid_thw: torch.Tensor | None = None, mm_token_type_ids: torch.Tensor | None = None,
                **kwargs: Any) -> CausalLMOutput:
        """The text model's call (``ParallelCausalLM.forward``) plus transformers' vision inputs.

        ``position_ids`` default to M-RoPE positions computed from ``input_ids``, the grids and the
        attention mask (or ``cu_seqlens`` for packed input), as transformers does; pass ``[3, b, s]``
        (packed: ``[3, 1, T]``) to override. ``mm_token_type_ids`` (0 text, 1 image, 2 video) default
        to what the image/video token ids say."""
        vis = self.config.vision
        check_multimodal_inputs(input_ids, pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                                pixel_values_videos=pixel_values_videos, video_grid_thw=video_grid_thw,
                                image_token_id=vis.image_token_id, video_token_id=vis.video_token_id,
                                spatial_merge_size=vis.spatial_merge_size, patch_dim=vis.patch_dim)
        has_vision = image_grid_thw is not None or video_grid_thw is not None
        if has_vision and position_ids is None:
            position_ids = self.rope_positions(input_ids, attention_mask=attention_mask, cu_seqlens=cu_seqlens,
                                               image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
                                               mm_token_type_ids=mm_token_type_ids)
        if self.groups.sequence_split or kwargs.get("sequence_plan") is not None:
            raise ValueError(f"qwen2_vl with cp/ulysses {self.groups.config.describe()} is not supported yet")
        features = None
        if has_vision:
            ids = input_ids.reshape(1, -1) if cu_seqlens is not None else input_ids
            features = self.encode_vision(ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw)
        return super().forward(input_ids, position_ids, attention_mask, labels, gather_logits, cu_seqlens, max_seqlen,
                               return_logits, multimodal=features, **kwargs)

    def rope_positions(self, input_ids: torch.Tensor, *, attention_mask=None, cu_seqlens=None, image_grid_thw=None,
                       video_grid_thw=None, mm_token_type_ids=None) -> torch.Tensor:
        """M-RoPE positions: ``[3, b, s]`` for a padded batch, ``[3, 1, T]`` for a packed one."""
        vis = self.config.vision
        common = dict(image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
                      mm_token_type_ids=mm_token_type_ids, image_token_id=vis.image_token_id,
                      video_token_id=vis.video_token_id, spatial_merge_size=vis.spatial_merge_size)
        if cu_seqlens is not None:
            return mrope_positions_packed(input_ids, cu_seqlens, **common).reshape(3, 1, -1)
        return mrope_positions(input_ids, attention_mask=attention_mask, **common)[0]

    def encode_vision(self, input_ids: torch.Tensor, pixel_values, image_grid_thw, pixel_values_videos,
                      video_grid_thw) -> VisionFeatures:
        """Every image's and video's merged features (one tower pass) and their placeholder slots in
        ``input_ids [b, s]``."""
        vis = self.config.vision
        pixels, grids, slots = [], [], []
        for values, grid, token in ((pixel_values, image_grid_thw, vis.image_token_id),
                                    (pixel_values_videos, video_grid_thw, vis.video_token_id)):
            if grid is None:
                continue
            pixels.append(values)
            grids.append(grid)
            slots.append((input_ids == token).nonzero())  # batch-major, the order transformers scatters in
        grid = torch.cat(grids)
        features = self.visual(torch.cat(pixels), vision_patch_positions(grid, vis.spatial_merge_size),
                               vision_cu_seqlens(grid).tolist())
        slot = torch.cat(slots)
        return VisionFeatures(features, slot[:, 0], slot[:, 1])

    def embed_inputs(self, ids: torch.Tensor, multimodal: VisionFeatures | None = None) -> torch.Tensor:
        h = self.model.embed_tokens(ids.t())  # [s(/tp), b, hidden]
        if multimodal is None:
            return h
        features, batch_index, seq_index = multimodal.features, multimodal.batch_index, multimodal.seq_index
        groups = self.groups
        if groups.sequence_parallel and groups.tp_size > 1:  # keep the features of this rank's slice
            features = copy_to_group(features, groups.tp_group)  # bwd: the slices' gradients summed
            start = groups.tp_rank * h.shape[0]
            keep = (seq_index >= start) & (seq_index < start + h.shape[0])
            features, batch_index, seq_index = features[keep], batch_index[keep], seq_index[keep] - start
        return h.index_put((seq_index.to(h.device), batch_index.to(h.device)), features.to(h.dtype))


def build_parallel_model(source: Any, parallel_config: ParallelConfig | None = None, *,
                         dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                         groups: ParallelGroups | None = None, seed: int = 0, lora: Any = None) -> ParallelQwen2VL:
    """Build this rank's Qwen2-VL shard from an HF directory (either key layout) or a transformers
    config (random weights). Call after ``torch.distributed.init_process_group`` when the layout
    uses more than one rank. See ``models.common.builder.build_model`` for the arguments."""
    if lora is not None:
        raise ValueError("qwen2_vl: LoRA is not supported yet")
    return build_model(ARCHITECTURE, source, parallel_config, dtype=dtype, device=device, groups=groups, seed=seed)
