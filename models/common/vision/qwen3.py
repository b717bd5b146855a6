"""The Qwen3-VL vision tower as plain data (no torch): its config (``Qwen3VisionConfig``) and its weight
entries (names, shapes, tensor-parallel rules), read by ``models/qwen3_vl`` and by the tower block
(``models/common/blocks/vision_qwen3.py``).

The tower is the Qwen2-VL family's (Conv3d patches, 2-D rotary, attention within each frame,
``spatial_merge_size^2`` patch merger) with Qwen3-VL's changes: the patch embedding has a bias; a
learned position table ``pos_embed [num_position_embeddings, hidden]`` (a square grid of
``int(sqrt(num_position_embeddings))`` per side) is bilinearly interpolated to every image's grid and
added to the patch embeddings; LayerNorm blocks with biases and an MLP ``linear_fc2(act(linear_fc1(x)))``
(``hidden_act``, e.g. ``gelu_pytorch_tanh``); the merger is ``norm``/``linear_fc1``/GELU/``linear_fc2``;
and DeepStack: the outputs of blocks ``deepstack_visual_indexes`` go through mergers of their own
(``deepstack_merger_list.{k}``, LayerNorm after the 2x2 shuffle, over ``hidden * merge^2``), whose
features the language model adds to its hidden states after decoder layer k, at the visual tokens.

Tensors under ``model.visual.`` (what transformers 5.24 writes on disk and holds in memory); rules:
  ``patch_embed.proj.{weight,bias}``, ``pos_embed.weight``, norms      replicated
  ``blocks.{j}.attn.qkv.{weight,bias}``                                 Fused(3): per q/k/v block, then per head
  ``blocks.{j}.attn.proj.weight`` / ``.bias``                           row / replicated
  ``blocks.{j}.mlp.linear_fc1.{weight,bias}``                           column
  ``blocks.{j}.mlp.linear_fc2.weight`` / ``.bias``                      row / replicated
  ``merger.linear_fc1``, ``deepstack_merger_list.{k}.linear_fc1``       column (weight and bias)
  ``merger.linear_fc2``, ``deepstack_merger_list.{k}.linear_fc2``       row weight, replicated bias
"""

from __future__ import annotations

from dataclasses import dataclass

from models.common.config import VisionConfig
from models.common.weight_map import WeightEntry
from parallel.sharding import Fused, Replicated, Split

VISUAL_HF_PREFIX = "model.visual."  # where the tower sits in HF names
QWEN3_VISION_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu", "quick_gelu", "silu")  # what the tower block computes


@dataclass(frozen=True)
class Qwen3VisionConfig(VisionConfig):
    """``VisionConfig`` plus Qwen3-VL's learned position table and DeepStack block indexes."""

    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = ()

    @property
    def grid_per_side(self) -> int:
        """Side of the square learned position grid (transformers' ``int(num_position_embeddings ** 0.5)``)."""
        return int(self.num_position_embeddings ** 0.5)

    @property
    def deepstack_count(self) -> int:
        return len(self.deepstack_visual_indexes)


def qwen3_vision_entries(vis: Qwen3VisionConfig, hf_prefix: str = VISUAL_HF_PREFIX) -> tuple[WeightEntry, ...]:
    """The tower's weight entries; parameters are named ``visual.*`` (the model's ``visual`` module)."""
    col, row, rep, fused = Split(0), Split(1), Replicated(), Fused(3)
    e, m, d, out = vis.embed_dim, vis.mlp_hidden, vis.merged_dim, vis.out_hidden_size
    p, t = vis.patch_size, vis.temporal_patch_size

    def entry(name: str, rule, shape) -> WeightEntry:
        return WeightEntry("visual." + name, (hf_prefix + name,), (rule,), shapes=(tuple(shape),))

    def layer_norm(name: str, width: int) -> list[WeightEntry]:
        return [entry(name + ".weight", rep, (width,)), entry(name + ".bias", rep, (width,))]

    def merger(name: str, norm_width: int) -> list[WeightEntry]:
        return layer_norm(name + ".norm", norm_width) + [
            entry(name + ".linear_fc1.weight", col, (d, d)), entry(name + ".linear_fc1.bias", col, (d,)),
            entry(name + ".linear_fc2.weight", row, (out, d)), entry(name + ".linear_fc2.bias", rep, (out,))]

    entries = [entry("patch_embed.proj.weight", rep, (e, vis.in_channels, t, p, p)),
               entry("patch_embed.proj.bias", rep, (e,)),
               entry("pos_embed.weight", rep, (vis.num_position_embeddings, e))]
    for j in range(vis.depth):
        b = f"blocks.{j}."
        entries += layer_norm(b + "norm1", e) + [
            entry(b + "attn.qkv.weight", fused, (3 * e, e)), entry(b + "attn.qkv.bias", fused, (3 * e,)),
            entry(b + "attn.proj.weight", row, (e, e)), entry(b + "attn.proj.bias", rep, (e,))]
        entries += layer_norm(b + "norm2", e) + [
            entry(b + "mlp.linear_fc1.weight", col, (m, e)), entry(b + "mlp.linear_fc1.bias", col, (m,)),
            entry(b + "mlp.linear_fc2.weight", row, (e, m)), entry(b + "mlp.linear_fc2.bias", rep, (e,))]
    entries += merger("merger", e)
    for k in range(vis.deepstack_count):
        entries += merger(f"deepstack_merger_list.{k}", d)
    return tuple(entries)
