"""The Qwen2-VL family (Qwen2-VL, Qwen2.5-VL): the shared Qwen2 decoder with M-RoPE, fed by a
tensor-parallel vision tower (``blocks/vision.py``; the models differ by ``VisionConfig`` options only).

``model(input_ids, ..., pixel_values=, image_grid_thw=, pixel_values_videos=, video_grid_thw=,
mm_token_type_ids=, second_per_grid_ts=)`` computes what transformers'
``Qwen2VLForConditionalGeneration`` / ``Qwen2_5_VLForConditionalGeneration`` compute
(``second_per_grid_ts``: Qwen2.5-VL only):

1. the inputs are checked (pixels, grids and placeholder tokens agree) on every rank before any
   collective;
2. the vision tower (``models/common/blocks/vision.py``, split over TP) encodes every image and video
   patch once: one pass over all of them (attention stays within each frame, so batching them
   changes nothing);
3. M-RoPE positions ``[3, b, s]`` are computed on the whole (padded or packed) sequence
   (``vision/positions.py``, transformers' ``get_rope_index``);
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

from models.common.blocks.decoder import CausalLMOutput
from models.common.blocks.vision import ParallelVisionTower
from models.common.causal_lm import ParallelCausalLM
from models.common.training.forward_backward import forward_backward
from models.common.vision.positions import (
    VisionInputError,
    check_multimodal_inputs,
    mrope_positions,
    mrope_positions_packed,
)
from parallel.collectives import copy_to_group, gather_from_sequence
from parallel.groups import ParallelGroups

__all__ = ["ParallelVisionLanguageModel", "VisionFeatures"]


@dataclass
class VisionFeatures:
    """Merged vision features and the ``[b, s]`` slot of the placeholder token each one replaces."""

    features: torch.Tensor  # [n, hidden]: images' features, then videos'
    batch_index: torch.Tensor  # [n]
    seq_index: torch.Tensor  # [n]
    # Qwen3-VL: the DeepStack features of the same tokens, ``[n, K * hidden]`` (feature k in columns
    # ``k*hidden:(k+1)*hidden``), added after decoder layer k; None for towers without DeepStack
    deepstack: torch.Tensor | None = None


class ParallelVisionLanguageModel(ParallelCausalLM):
    """A tensor/sequence/pipeline-parallel Qwen2-VL-family model (``models.qwen2_vl``, ``models.qwen2_5_vl``)."""

    tower_class = ParallelVisionTower  # the vision tower (Qwen3-VL sets its own, blocks/vision_qwen3.py)

    def __init__(self, cfg, groups: ParallelGroups, weight_map, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> None:
        super().__init__(cfg, groups, weight_map, dtype=dtype, device=device)
        # The tower feeds the embeddings, so it lives with them on the first pipeline stage.
        self.visual = self.tower_class(cfg.vision, groups, dtype, device) if self.is_first_stage else None

    def tower_width(self) -> int:
        """Columns of one row of the tower's output (the features of one placeholder token)."""
        return self.config.hidden_size

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                gather_logits: bool = False, cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None,
                return_logits: bool | None = None, *, pixel_values: torch.Tensor | None = None,
                image_grid_thw: torch.Tensor | None = None, pixel_values_videos: torch.Tensor | None = None,
                video_grid_thw: torch.Tensor | None = None, mm_token_type_ids: torch.Tensor | None = None,
                second_per_grid_ts: torch.Tensor | None = None, **kwargs: Any) -> CausalLMOutput:
        """The text model's call (``ParallelCausalLM.forward``) plus transformers' vision inputs.

        ``position_ids`` default to M-RoPE positions computed from ``input_ids``, the grids and the
        attention mask (or ``cu_seqlens`` for packed input), as transformers does; pass ``[3, b, s]``
        (packed: ``[3, 1, T]``) to override. ``mm_token_type_ids`` (0 text, 1 image, 2 video) default
        to what the image/video token ids say. ``second_per_grid_ts`` (Qwen2.5-VL, one value per video)
        spaces each video's temporal positions by ``tokens_per_second`` times it."""
        if self.groups.pp_size > 1:
            raise RuntimeError("with pipeline parallelism use model.forward_backward(...) (stages run in a schedule)")
        self._check_vision_inputs(input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw,
                                  second_per_grid_ts)
        has_vision = image_grid_thw is not None or video_grid_thw is not None
        if has_vision and position_ids is None:
            position_ids = self.rope_positions(input_ids, attention_mask=attention_mask, cu_seqlens=cu_seqlens,
                                               image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
                                               mm_token_type_ids=mm_token_type_ids,
                                               second_per_grid_ts=second_per_grid_ts)
        if has_vision and kwargs.get("sequence_plan") is not None:
            raise ValueError(f"{self.config.architecture}: images need the whole batch on every cp/ulysses rank, "
                             "not sequence_plan= slices (the model merges their features, then takes its tokens)")
        features = None
        if has_vision:
            ids = input_ids.reshape(1, -1) if cu_seqlens is not None else input_ids
            encode = self.encode_vision_shared if self.groups.sequence_split else self.encode_vision
            features = encode(ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw)
        return super().forward(input_ids, position_ids, attention_mask, labels, gather_logits, cu_seqlens, max_seqlen,
                               return_logits, multimodal=features, **kwargs)

    def forward_backward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *,
                         pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                         pixel_values_videos: torch.Tensor | None = None, video_grid_thw: torch.Tensor | None = None,
                         mm_token_type_ids: torch.Tensor | None = None,
                         second_per_grid_ts: torch.Tensor | None = None, **kwargs: Any):
        """``ParallelCausalLM.forward_backward`` (micro-batches, pipeline schedules) with the vision inputs.

        M-RoPE positions are computed on the whole batch first; then each sample (row, or packed
        segment) keeps its own images' and videos' pixel rows and grids, and the first pipeline stage
        encodes the images of each micro-batch when it embeds that micro-batch."""
        self._check_vision_inputs(input_ids, pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw,
                                  second_per_grid_ts)
        if image_grid_thw is None and video_grid_thw is None:
            return super().forward_backward(input_ids, labels, **kwargs)
        if kwargs.get("position_ids") is None:
            kwargs["position_ids"] = self.rope_positions(
                input_ids, attention_mask=kwargs.get("attention_mask"), cu_seqlens=kwargs.get("cu_seqlens"),
                image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw, mm_token_type_ids=mm_token_type_ids,
                second_per_grid_ts=second_per_grid_ts)
        vis = self.config.vision

        def per_sample(sample_ids: list[torch.Tensor]) -> list[dict]:
            """Each sample's own pixel rows and grids (samples take the images in reading order)."""
            out = [{} for _ in sample_ids]
            for key_pixels, key_grid, pixels, grid, token in (
                    ("pixel_values", "image_grid_thw", pixel_values, image_grid_thw, vis.image_token_id),
                    ("pixel_values_videos", "video_grid_thw", pixel_values_videos, video_grid_thw,
                     vis.video_token_id)):
                if grid is not None:
                    for inputs, (rows, grids) in zip(out, _split_per_sample(sample_ids, pixels, grid, token,
                                                                            vis.spatial_merge_size)):
                        if grids is not None:
                            inputs[key_pixels], inputs[key_grid] = rows, grids
            return out

        return forward_backward(self, input_ids, labels, sample_inputs=per_sample, **kwargs)

    def _check_vision_inputs(self, input_ids, pixel_values, image_grid_thw, pixel_values_videos,
                             video_grid_thw, second_per_grid_ts=None) -> None:
        """Pixels, grids and placeholder tokens agree (local checks, before any collective)."""
        vis = self.config.vision
        check_multimodal_inputs(input_ids, pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                                pixel_values_videos=pixel_values_videos, video_grid_thw=video_grid_thw,
                                image_token_id=vis.image_token_id, video_token_id=vis.video_token_id,
                                spatial_merge_size=vis.spatial_merge_size, patch_dim=vis.patch_dim,
                                tokens_per_second=vis.tokens_per_second, second_per_grid_ts=second_per_grid_ts)

    def embed_microbatch(self, ids: torch.Tensor, inputs: dict | None = None, seq=None) -> torch.Tensor:
        vision = [inputs.get(k) if inputs else None
                  for k in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")]
        if seq is None:
            return self.embed_inputs(ids, self.encode_vision(ids, *vision) if inputs else None)
        h = self.model.embed_tokens(ids.t())  # this cp/ulysses rank's tokens: [n(/tp), 1, hidden]
        if vision[1] is None and vision[3] is None:
            return h
        whole = inputs["packed_ids"]  # [1, T]: the micro-batch before it was cut over the ranks
        features = self.encode_vision_shared(whole, *vision)
        return self._place_local_features(h, features, features.seq_index, whole.shape[1], seq)

    def finalize_grads(self) -> None:
        """``ParallelCausalLM.finalize_grads``; a tower that saw no image in this rank's batch gets zero
        gradients first, so every replica reduces the same tensors (another DP rank may have had images)."""
        if self.visual is not None:
            for p in self.visual.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
        super().finalize_grads()

    def rope_positions(self, input_ids: torch.Tensor, *, attention_mask=None, cu_seqlens=None, image_grid_thw=None,
                       video_grid_thw=None, mm_token_type_ids=None, second_per_grid_ts=None) -> torch.Tensor:
        """M-RoPE positions: ``[3, b, s]`` for a padded batch, ``[3, 1, T]`` for a packed one."""
        vis = self.config.vision
        common = dict(image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
                      mm_token_type_ids=mm_token_type_ids, image_token_id=vis.image_token_id,
                      video_token_id=vis.video_token_id, spatial_merge_size=vis.spatial_merge_size,
                      tokens_per_second=vis.tokens_per_second, second_per_grid_ts=second_per_grid_ts)
        if cu_seqlens is not None:
            return mrope_positions_packed(input_ids, cu_seqlens, **common).reshape(3, 1, -1)
        return mrope_positions(input_ids, attention_mask=attention_mask, **common)[0]

    def encode_vision(self, input_ids: torch.Tensor, pixel_values, image_grid_thw, pixel_values_videos,
                      video_grid_thw) -> VisionFeatures:
        """Every image's and video's merged features (one tower pass) and their placeholder slots in
        ``input_ids [b, s]``."""
        pixels, grid = _all_patches(pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw)
        features = self.visual(pixels, grid)
        return self._features_at_placeholders(features, input_ids, image_grid_thw, video_grid_thw)

    def _features_at_placeholders(self, features: torch.Tensor, input_ids: torch.Tensor, image_grid_thw,
                                  video_grid_thw) -> VisionFeatures:
        """``features`` (images', then videos') with the ``[b, s]`` slot of each one's placeholder token,
        batch-major: the order transformers scatters them in."""
        vis = self.config.vision
        slot = torch.cat([(input_ids == token).nonzero() for token, grid in (
            (vis.image_token_id, image_grid_thw), (vis.video_token_id, video_grid_thw)) if grid is not None])
        return VisionFeatures(features, slot[:, 0], slot[:, 1])

    def encode_vision_shared(self, input_ids: torch.Tensor, pixel_values, image_grid_thw, pixel_values_videos,
                             video_grid_thw) -> VisionFeatures:
        """``encode_vision`` with the work shared by the cp x ulysses ranks (which all hold the whole
        batch): whole images/videos are dealt to the ranks by patch count (largest first, to the least
        loaded), each rank encodes its own, and the features are all-gathered (backward: each rank
        gets the summed gradient of its own images)."""
        groups, merge = self.groups, self.config.vision.spatial_merge_size
        pixels, grid = _all_patches(pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw)
        patches = grid.prod(-1).tolist()  # per image/video, in transformers' order: images, then videos
        items = pixels.split(patches)
        ranks = groups.cp_size * groups.ulysses_size
        me = groups.cp_rank * groups.ulysses_size + groups.ulysses_rank
        owner = _deal(patches, ranks)
        tokens = [n // merge ** 2 for n in patches]
        load = [sum(t for t, o in zip(tokens, owner) if o == r) for r in range(ranks)]
        mine = [i for i, o in enumerate(owner) if o == me]
        if mine:
            local = self.visual(torch.cat([items[i] for i in mine]), grid[mine])
        else:  # nothing to encode here: a zero term keeps the tower in this rank's backward
            anchor = sum(p.sum() for p in self.visual.parameters()) * 0.0
            local = anchor.new_zeros(0, self.tower_width()) + anchor
        local = torch.nn.functional.pad(local, (0, 0, 0, max(load) - local.shape[0]))
        gathered = gather_from_sequence(gather_from_sequence(local, groups.ulysses_group), groups.cp_group)
        rows, seen = [], [0] * ranks  # each item's rows in its owner's block of max(load) rows
        for o, t in zip(owner, tokens):
            rows.append(torch.arange(o * max(load) + seen[o], o * max(load) + seen[o] + t))
            seen[o] += t
        return self._features_at_placeholders(gathered[torch.cat(rows).to(gathered.device)], input_ids,
                                              image_grid_thw, video_grid_thw)

    def embed_shard(self, ids: torch.Tensor, shard, batch=None, multimodal: VisionFeatures | None = None):
        """This cp/ulysses rank's embeddings with the features of its own tokens merged in."""
        h = self.model.embed_tokens(ids[:, None])  # [n(/tp), 1, hidden]
        if multimodal is None:
            return h
        flat = multimodal.batch_index * batch.shape[1] + multimodal.seq_index  # in the caller's [b, s]
        order = torch.searchsorted(batch.keep, flat) if batch.keep is not None else flat  # in the real tokens
        return self._place_local_features(h, multimodal, order, batch.total, shard)

    def _place_local_features(self, h: torch.Tensor, multimodal: VisionFeatures, order: torch.Tensor, total: int,
                              shard) -> torch.Tensor:
        """Write into ``h`` (this rank's tokens of a sequence-split batch of ``total`` tokens) the features
        whose tokens it holds; ``order``: each feature's token in the batch's flat real-token order."""
        feature_of = torch.full((total,), -1, dtype=torch.long, device=h.device)
        feature_of[order.to(h.device)] = torch.arange(len(order), device=h.device)
        local = shard.take(feature_of, fill=-1)
        features, groups = multimodal.features, self.groups
        if groups.sequence_parallel and groups.tp_size > 1:  # this TP rank's slice of the local tokens
            features = copy_to_group(features, groups.tp_group)
            local = local[groups.tp_rank * h.shape[0]:(groups.tp_rank + 1) * h.shape[0]]
        where = (local >= 0).nonzero()[:, 0]
        return h.index_put((where, torch.zeros_like(where)), features[local[where]].to(h.dtype))

    def embed_inputs(self, ids: torch.Tensor, multimodal: VisionFeatures | None = None) -> torch.Tensor:
        h = self.model.embed_tokens(ids.t())  # [s(/tp), b, hidden]
        if multimodal is None:
            return h
        return self._place_features(h, multimodal)

    def _place_features(self, h: torch.Tensor, multimodal: VisionFeatures) -> torch.Tensor:
        """``h [s(/tp), b, hidden]`` (a padded or packed batch, this TP rank's slice under SP) with each
        feature written at its placeholder's slot."""
        features, batch_index, seq_index = multimodal.features, multimodal.batch_index, multimodal.seq_index
        groups = self.groups
        if groups.sequence_parallel and groups.tp_size > 1:  # keep the features of this rank's slice
            features = copy_to_group(features, groups.tp_group)  # bwd: the slices' gradients summed
            start = groups.tp_rank * h.shape[0]
            keep = (seq_index >= start) & (seq_index < start + h.shape[0])
            features, batch_index, seq_index = features[keep], batch_index[keep], seq_index[keep] - start
        return h.index_put((seq_index.to(h.device), batch_index.to(h.device)), features.to(h.dtype))


def _all_patches(pixel_values, image_grid_thw, pixel_values_videos, video_grid_thw):
    """Every image's, then every video's, pixel rows and grid rows, concatenated (one tower pass)."""
    kinds = [(values, grid) for values, grid in ((pixel_values, image_grid_thw), (pixel_values_videos, video_grid_thw))
             if grid is not None]
    return torch.cat([values for values, _ in kinds]), torch.cat([grid for _, grid in kinds])


def _deal(patches: list[int], ranks: int) -> list[int]:
    """Owner rank of each image/video: largest first, each to the least loaded rank (lowest on ties)."""
    load, owner = [0] * ranks, [0] * len(patches)
    for i in sorted(range(len(patches)), key=lambda i: (-patches[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        owner[i], load[r] = r, load[r] + patches[i]
    return owner


def _split_per_sample(rows: list[torch.Tensor], pixels: torch.Tensor, grid: torch.Tensor, token: int,
                      merge: int) -> list[tuple[torch.Tensor | None, torch.Tensor | None]]:
    """Each sample's pixel rows and grids: samples take the images (videos) in reading order, as many
    as their placeholder tokens account for (already checked to add up by ``check_multimodal_inputs``)."""
    tokens = [int(g.prod()) // merge ** 2 for g in grid]
    patches = [int(g.prod()) for g in grid]
    out, item, offset = [], 0, 0
    for row in rows:
        need = int((row == token).sum())
        first = item
        while need > 0:
            need -= tokens[item]
            item += 1
        if need < 0:
            raise VisionInputError(f"a sample's {token}-placeholder tokens end inside image/video {item - 1}")
        rows_here = sum(patches[first:item])
        out.append((pixels[offset:offset + rows_here], grid[first:item]) if item > first else (None, None))
        offset += rows_here
    return out
