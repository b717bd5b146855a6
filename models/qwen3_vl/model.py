"""Qwen3-VL: the shared Qwen3 decoder (q/k norms) with interleaved M-RoPE, fed by the tensor-parallel
Qwen3-VL vision tower (``models/common/blocks/vision_qwen3.py``), with DeepStack.

``model(input_ids, ..., pixel_values=, image_grid_thw=, pixel_values_videos=, video_grid_thw=,
mm_token_type_ids=)`` computes what transformers' ``Qwen3VLForConditionalGeneration`` computes. The model
is the Qwen2-VL family's ``ParallelVisionLanguageModel`` (input checks before any collective, one tower
pass, features merged at embed time under TP+SP / CP / Ulysses, the vision work shared by the cp x
ulysses ranks, ``forward_backward``) with Qwen3-VL's differences:

- the tower returns, beside each merged feature, its K DeepStack features (``VisionFeatures.deepstack``);
  wherever the features are placed into this rank's embeddings (its ``seq/tp`` slice under SP, its own
  tokens under CP/Ulysses), the DeepStack features are placed the same way into a zero tensor
  ``[s(/tp), b, K * hidden]``, and decoder layer k < K adds its columns to its output: transformers'
  ``hidden[visual] += deepstack[k]`` after layer k (every other token gets + 0). The gradient of a
  feature placed on several TP ranks is summed over them (``copy_to_group``), as for the merged ones;
- M-RoPE is interleaved (``rope.mrope_angles_interleaved``) and videos are positioned frame by frame
  (``positions.split_video_frames``, as transformers' ``get_rope_index``);
- with pipeline parallelism the layers fed by DeepStack must all sit in the first stage's first chunk
  (with the tower); a layout that puts one elsewhere is refused (``ParallelConfigError``) on every rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from models.common.blocks.rope import RotaryEmbedding
from models.common.blocks.vision_qwen3 import Qwen3VisionTower
from models.common.builder import build_model
from models.common.vision_language import ParallelVisionLanguageModel, VisionFeatures
from models.qwen3_vl.architecture import ARCHITECTURE
from models.qwen3_vl.positions import split_video_frames
from parallel.config import ParallelConfig, ParallelConfigError
from parallel.groups import ParallelGroups
from parallel.pipeline_layout import stage_layer_ranges

__all__ = ["ARCHITECTURE", "ParallelQwen3VL", "VisionFeatures", "build_parallel_model"]


def check_deepstack_stages(cfg, pconfig: ParallelConfig) -> None:
    """Every decoder layer fed by a DeepStack feature (0..K-1) must be in pipeline rank 0's first chunk."""
    k = cfg.vision.deepstack_count
    stages = stage_layer_ranges(cfg.num_hidden_layers, pconfig)
    first = set(stages[0][0])
    outside = [i for i in range(k) if i not in first]
    if outside:
        where = {i: (p, c) for p, chunks in enumerate(stages) for c, layers in enumerate(chunks) for i in layers}
        raise ParallelConfigError(
            f"qwen3_vl {pconfig.describe()}: decoder layers 0..{k - 1} take DeepStack features from the vision tower "
            f"on pipeline stage 0, but layer(s) {outside} sit on (stage, chunk) {[where[i] for i in outside]}; "
            f"put at least {k} layers on the first stage's first chunk (num_layers_in_first_pipeline_stage)")


class ParallelQwen3VL(ParallelVisionLanguageModel):
    """A tensor/sequence/pipeline-parallel Qwen3-VL; build it with ``build_parallel_model``."""

    tower_class = Qwen3VisionTower

    def __init__(self, cfg, groups: ParallelGroups, weight_map, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        if groups.pp_size > 1:
            check_deepstack_stages(cfg, groups.config)
        super().__init__(cfg, groups, weight_map, dtype=dtype, device=device)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings, mrope_interleaved=True)
        if device is not None:
            self.rotary.to(device)
        self._deepstack: torch.Tensor | None = None  # [s(/tp), b, K * hidden] of the batch being embedded and run

    def tower_width(self) -> int:
        return (1 + self.config.vision.deepstack_count) * self.config.hidden_size

    def rope_positions(self, input_ids: torch.Tensor, *, video_grid_thw=None, **kwargs) -> torch.Tensor:
        """Interleaved M-RoPE positions, videos frame by frame (transformers' ``get_rope_index``)."""
        return super().rope_positions(input_ids, video_grid_thw=split_video_frames(video_grid_thw), **kwargs)

    def _features_at_placeholders(self, features: torch.Tensor, input_ids: torch.Tensor, image_grid_thw,
                                  video_grid_thw) -> VisionFeatures:
        width = self.config.hidden_size
        out = super()._features_at_placeholders(features[:, :width], input_ids, image_grid_thw, video_grid_thw)
        out.deepstack = features[:, width:] if features.shape[1] > width else None
        return out

    # ---------------------------------------------------------------- DeepStack: placed with the features
    def embed_inputs(self, ids: torch.Tensor, multimodal: VisionFeatures | None = None) -> torch.Tensor:
        self._deepstack = None
        return super().embed_inputs(ids, multimodal)

    def embed_shard(self, ids: torch.Tensor, shard, batch=None, multimodal: VisionFeatures | None = None):
        self._deepstack = None
        return super().embed_shard(ids, shard, batch, multimodal)

    def embed_microbatch(self, ids: torch.Tensor, inputs: dict | None = None, seq=None) -> torch.Tensor:
        self._deepstack = None
        return super().embed_microbatch(ids, inputs, seq)

    @staticmethod
    def _as_deepstack(multimodal: VisionFeatures) -> VisionFeatures:
        return dataclasses.replace(multimodal, features=multimodal.deepstack, deepstack=None)

    def _place_features(self, h: torch.Tensor, multimodal: VisionFeatures) -> torch.Tensor:
        if multimodal.deepstack is not None:
            zeros = h.new_zeros(*h.shape[:2], multimodal.deepstack.shape[1])
            self._deepstack = super()._place_features(zeros, self._as_deepstack(multimodal))
        return super()._place_features(h, multimodal)

    def _place_local_features(self, h: torch.Tensor, multimodal: VisionFeatures, order: torch.Tensor, total: int,
                              shard) -> torch.Tensor:
        if multimodal.deepstack is not None:
            zeros = h.new_zeros(*h.shape[:2], multimodal.deepstack.shape[1])
            self._deepstack = super()._place_local_features(zeros, self._as_deepstack(multimodal), order, total,
                                                            shard)
        return super()._place_local_features(h, multimodal, order, total, shard)

    def run_layers(self, h: torch.Tensor, layer_ids: list[int], position_ids: torch.Tensor,
                   attention_mask: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None,
                   max_seqlen: int | None = None, seq=None) -> torch.Tensor:
        """``ParallelCausalLM.run_layers``; after decoder layer k < K, DeepStack feature k is added at the
        visual tokens (``self._deepstack``, placed when this batch was embedded)."""
        dense, k = self._deepstack, self.config.vision.deepstack_count
        if dense is None or not any(i < k for i in layer_ids):
            return super().run_layers(h, layer_ids, position_ids, attention_mask, cu_seqlens, max_seqlen, seq)
        width, segment = self.config.hidden_size, []
        for i in layer_ids:
            segment.append(i)
            if i < k:
                h = super().run_layers(h, segment, position_ids, attention_mask, cu_seqlens, max_seqlen, seq)
                h = h + dense[..., i * width:(i + 1) * width]
                segment = []
        if segment:
            h = super().run_layers(h, segment, position_ids, attention_mask, cu_seqlens, max_seqlen, seq)
        return h


def build_parallel_model(source: Any, parallel_config: ParallelConfig | None = None, *,
                         dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                         groups: ParallelGroups | None = None, seed: int = 0, lora: Any = None,
                         loss_chunk_tokens: int | None = None, compile: bool = False) -> ParallelQwen3VL:
    """Build this rank's Qwen3-VL shard from an HF directory (``Qwen3VLForConditionalGeneration``'s
    ``save_pretrained``) or a transformers config (random weights). Call after
    ``torch.distributed.init_process_group`` when the layout uses more than one rank. See
    ``models.common.builder.build_model`` for the arguments."""
    if lora is not None:
        raise ValueError("qwen3_vl: LoRA is not supported yet")
    return build_model(ARCHITECTURE, source, parallel_config, dtype=dtype, device=device, groups=groups, seed=seed,
                       loss_chunk_tokens=loss_chunk_tokens, compile=compile)
