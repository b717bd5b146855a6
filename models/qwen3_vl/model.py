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
- with pipeline parallelism the DeepStack tensor travels with the hidden states (``DeepStackChunk``):
  the first chunk (tower, embedding) sends the columns of the layers it does not hold, each later chunk
  adds those of its own layers and passes the tensor on while a later chunk still needs it; the
  gradient comes back the same way to the tower.
"""

from __future__ import annotations

import dataclasses

import torch

from models.common.blocks.moe import carry_router_sums, recording_routes
from models.common.blocks.rope import RotaryEmbedding
from models.common.blocks.vision_qwen3 import Qwen3VisionTower
from models.common.entry_point import entry_point
from models.common.training.pipeline_chunk import PipelineChunk
from models.common.vision.language import ParallelVisionLanguageModel, VisionFeatures
from models.qwen3_vl.architecture import ARCHITECTURE
from models.qwen3_vl.positions import split_video_frames
from parallel.groups import ParallelGroups
from parallel.pipeline_layout import stage_layer_ranges

__all__ = ["ARCHITECTURE", "ParallelQwen3VL", "VisionFeatures", "build_parallel_model"]


class DeepStackChunk(PipelineChunk):
    """A pipeline chunk of Qwen3-VL: ``PipelineChunk`` plus the DeepStack tensor ``[T(/tp), 1, n * hidden]``
    (the features of layers ``first_cols .. K-1``; zeros for a micro-batch without images) as a second
    output while a later chunk holds a layer it feeds, and as a second input on every chunk after the first
    that receives it. With ``aux`` (Qwen3-VL-MoE's load-balancing loss) the router carry of ``PipelineChunk``
    travels last: inputs ``(x, [deepstack], [carry])``, outputs ``(out, [deepstack], [carry])``."""

    def __init__(self, lm, chunk: int, aux: bool = False) -> None:
        super().__init__(lm, chunk, aux)
        groups, k = lm.groups, lm.config.vision.deepstack_count
        stages = stage_layer_ranges(lm.config.num_hidden_layers, groups.config)  # [pp rank][chunk] -> layers
        pp = groups.pp_size
        me = chunk * pp + groups.pp_rank  # global stage index (schedules number chunks v * pp + rank)
        fed = {v * pp + p for p, chunks in enumerate(stages) for v, layers in enumerate(chunks)
               if any(i < k for i in layers)}
        self.first_cols = min(len(stages[0][0]), k)  # the first chunk's own layers take theirs at embed time
        self.sends = any(stage > me for stage in fed) and k > self.first_cols
        self.receives = not self.first and any(stage >= me for stage in fed) and k > self.first_cols  # = me-1 sends
        self.width = (k - self.first_cols) * lm.config.hidden_size

    def forward(self, x: torch.Tensor, *carried: torch.Tensor, position_ids=None, cu_seqlens=None, seq=None,
                token_mask=None, inputs: dict | None = None):
        lm = self._lm[0]
        deepstack = carried[0] if self.receives else None
        carry = carried[-1] if self.aux and len(carried) > int(self.receives) else None
        passed = None
        if self.first:
            h = lm.embed_microbatch(x, inputs, seq)  # places the DeepStack features: lm._deepstack, offset 0
            dense = lm._deepstack
            if self.sends:
                width = lm.config.hidden_size
                passed = (dense[..., self.first_cols * width:].contiguous() if dense is not None
                          else h.new_zeros(*h.shape[:2], self.width))
        else:
            h = x
            lm._deepstack, lm._deepstack_first = deepstack, self.first_cols
            passed = deepstack.view_as(deepstack) if deepstack is not None else None
        with recording_routes(self._sparse, token_mask):
            h = lm.run_layers(h, self.layer_ids, position_ids, None, None if seq is not None else cu_seqlens, seq=seq)
            if self.aux:
                carry = carry_router_sums(carry, self._sparse, lm.groups, lm.config.moe.num_experts, h.device)
        out = self.lm_head(self.norm(h)) if self.last else h
        outputs = (out, *((passed,) if self.sends else ()), *((carry,) if self.aux else ()))
        return outputs if len(outputs) > 1 else out


class ParallelQwen3VL(ParallelVisionLanguageModel):
    """A tensor/sequence/pipeline-parallel Qwen3-VL; build it with ``build_parallel_model``."""

    tower_class = Qwen3VisionTower
    pipeline_chunk_class = DeepStackChunk

    def __init__(self, cfg, groups: ParallelGroups, weight_map, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__(cfg, groups, weight_map, dtype=dtype, device=device)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings, mrope_interleaved=True)
        if device is not None:
            self.rotary.to(device)
        self._deepstack: torch.Tensor | None = None  # [s(/tp), b, n * hidden] of the batch being embedded and run
        self._deepstack_first = 0  # the layer whose feature sits in its first columns (pipeline stages after the first)

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
        self._deepstack, self._deepstack_first = None, 0
        return super().embed_inputs(ids, multimodal)

    def embed_shard(self, ids: torch.Tensor, shard, batch=None, multimodal: VisionFeatures | None = None):
        self._deepstack, self._deepstack_first = None, 0
        return super().embed_shard(ids, shard, batch, multimodal)

    def embed_microbatch(self, ids: torch.Tensor, inputs: dict | None = None, seq=None) -> torch.Tensor:
        self._deepstack, self._deepstack_first = None, 0
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
        visual tokens (``self._deepstack``, placed when this batch was embedded; dropped here once used, so
        it lives no longer than the batch's layers need it)."""
        dense, k, first = self._deepstack, self.config.vision.deepstack_count, self._deepstack_first
        self._deepstack = None
        fed = [i for i in layer_ids if first <= i < k] if dense is not None else []
        if not fed:
            return super().run_layers(h, layer_ids, position_ids, attention_mask, cu_seqlens, max_seqlen, seq)
        width, segment = self.config.hidden_size, []
        for i in layer_ids:
            segment.append(i)
            if i in fed:
                h = super().run_layers(h, segment, position_ids, attention_mask, cu_seqlens, max_seqlen, seq)
                h = h + dense[..., (i - first) * width:(i - first + 1) * width]
                segment = []
        if segment:
            h = super().run_layers(h, segment, position_ids, attention_mask, cu_seqlens, max_seqlen, seq)
        return h


build_parallel_model = entry_point(ARCHITECTURE, "Qwen3-VL", __name__, returns="ParallelQwen3VL")
