"""The Qwen3-VL vision tower, tensor-parallel like the Qwen2-VL family's (``blocks/vision.py``).

Semantics are transformers' ``Qwen3VLVisionModel`` (described in ``models/common/vision/qwen3.py``):
``pixel_values [N, C*T*P*P]`` -> Conv3d patch embedding with bias, plus the learned position table
bilinearly interpolated (align_corners) to each image's ``h x w`` patch grid -> ``depth`` LayerNorm
blocks (fused ``qkv`` with the 2-D axial rotary, attention within each frame, MLP ``linear_fc1`` ->
``hidden_act`` -> ``linear_fc2``) -> the merger; the outputs of blocks ``deepstack_visual_indexes`` go
through the DeepStack mergers (LayerNorm after the ``merge^2`` shuffle).

``forward`` returns ``[n, (1 + K) * out_hidden]``: the merged features, then the K DeepStack features
of the same merged patch (in block order, transformers' order), side by side so that one tensor goes
through the family's placement and cp/ulysses sharing (``models/common/vision/language.py``).

Tensor parallel as the Qwen2-VL tower: ``qkv`` per q/k/v block then per head (``Fused(3)``), ``proj`` /
``linear_fc2`` row-parallel, ``linear_fc1`` column-parallel (mergers too); patch embedding, position
table, norms and the residual stream whole on every TP rank; the output whole on every TP rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.common.blocks.vision import VisionAttention, VisionRotary, patch_linear, quick_gelu, with_patch_lora
from models.common.vision.positions import vision_cu_seqlens, vision_patch_positions
from models.common.vision.qwen3 import Qwen3VisionConfig
from parallel.groups import ParallelGroups
from parallel.layers import ColumnParallelLinear, RowParallelLinear

_ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu,
                "quick_gelu": quick_gelu, "silu": F.silu}


class Qwen3PatchEmbed(nn.Module):
    """Conv3d with stride = kernel over ``temporal_patch x patch x patch`` pixels, with bias; replicated."""

    def __init__(self, cfg: Qwen3VisionConfig, dtype, device) -> None:
        super().__init__()
        self.cfg = cfg
        t, p = cfg.temporal_patch_size, cfg.patch_size
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(cfg.embed_dim, cfg.in_channels, t, p, p, dtype=dtype,
                                                    device=device))
        self.proj.bias = nn.Parameter(torch.empty(cfg.embed_dim, dtype=dtype, device=device))
        self.proj.lora = None  # a parallel.lora.PatchLoRA when LoRA adapts the patch embedding

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return with_patch_lora(self.proj, pixels, patch_linear(pixels, self.proj.weight, self.proj.bias))


def _axis_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear (align_corners) resampling of ``size`` positions from a ``side``-long table: for each
    position ``index``, the two table rows around ``index * (side - 1) / (size - 1)`` and their weights."""
    src = index.float() * (side - 1) / torch.clamp(size - 1, min=1)
    low = torch.floor(src)
    frac = src - low
    rows = torch.stack([low.long(), low.long() + 1], dim=-1).clamp(0, side - 1)
    return rows, torch.stack([1 - frac, frac], dim=-1).clamp(min=0)


def interpolation_taps(grid_thw: torch.Tensor, patch_hw: torch.Tensor, side: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the flattened ``side x side`` position table and weights ``[N, 4]`` each that resample it
    bilinearly (align_corners) to every patch's ``(h, w)`` in its image's grid; ``patch_hw [N, 2]`` in the
    tower's patch order (``vision_patch_positions``). Taps (h0, w0), (h0, w1), (h1, w0), (h1, w1)."""
    counts = grid_thw.prod(-1)
    heights = torch.repeat_interleave(grid_thw[:, 1], counts).to(patch_hw.device)
    widths = torch.repeat_interleave(grid_thw[:, 2], counts).to(patch_hw.device)
    h_rows, h_weights = _axis_taps(patch_hw[:, 0], heights, side)
    w_rows, w_weights = _axis_taps(patch_hw[:, 1], widths, side)
    index = (h_rows[:, :, None] * side + w_rows[:, None, :]).reshape(-1, 4)
    weight = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)
    return index, weight


class Qwen3VisionMLP(nn.Module):
    def __init__(self, cfg: Qwen3VisionConfig, groups: ParallelGroups, dtype, device) -> None:
        super().__init__()
        if cfg.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"vision hidden_act={cfg.hidden_act!r} is not supported ({', '.join(_ACTIVATIONS)})")
        self.linear_fc1 = ColumnParallelLinear(cfg.embed_dim, cfg.mlp_hidden, bias=True, tp_group=groups.tp_group,
                                               dtype=dtype, device=device)
        self.linear_fc2 = RowParallelLinear(cfg.mlp_hidden, cfg.embed_dim, bias=True, tp_group=groups.tp_group,
                                            dtype=dtype, device=device)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3VisionBlock(nn.Module):
    def __init__(self, cfg: Qwen3VisionConfig, groups: ParallelGroups, dtype, device) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.embed_dim, eps=1e-6, dtype=dtype, device=device)
        self.norm2 = nn.LayerNorm(cfg.embed_dim, eps=1e-6, dtype=dtype, device=device)
        self.attn = VisionAttention(cfg, groups, dtype, device)
        self.mlp = Qwen3VisionMLP(cfg, groups, dtype, device)

    def forward(self, x, cu_seqlens, cos, sin):
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class Qwen3PatchMerger(nn.Module):
    """LayerNorm (over ``embed_dim`` before the ``merge^2`` shuffle, or over ``merged_dim`` after it: the
    DeepStack mergers), then Linear-GELU-Linear to ``out_hidden_size``."""

    def __init__(self, cfg: Qwen3VisionConfig, groups: ParallelGroups, dtype, device, *, postshuffle: bool) -> None:
        super().__init__()
        self.merged_dim, self.postshuffle = cfg.merged_dim, postshuffle
        self.norm = nn.LayerNorm(cfg.merged_dim if postshuffle else cfg.embed_dim, eps=1e-6, dtype=dtype,
                                 device=device)
        self.linear_fc1 = ColumnParallelLinear(cfg.merged_dim, cfg.merged_dim, bias=True, tp_group=groups.tp_group,
                                               dtype=dtype, device=device)
        self.linear_fc2 = RowParallelLinear(cfg.merged_dim, cfg.out_hidden_size, bias=True, tp_group=groups.tp_group,
                                            dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.merged_dim)) if self.postshuffle else self.norm(x).view(-1, self.merged_dim)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class Qwen3VisionTower(nn.Module):
    """``visual``: pixel patches -> ``[sum(t*h*w) / merge^2, (1 + K) * out_hidden]`` (merged features, then
    the K DeepStack features of each merged patch)."""

    def __init__(self, cfg: Qwen3VisionConfig, groups: ParallelGroups, dtype, device) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = Qwen3PatchEmbed(cfg, dtype, device)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.embed_dim, dtype=dtype, device=device)
        self.rotary_pos_emb = VisionRotary(cfg, device)
        self.blocks = nn.ModuleList([Qwen3VisionBlock(cfg, groups, dtype, device) for _ in range(cfg.depth)])
        self.merger = Qwen3PatchMerger(cfg, groups, dtype, device, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList([Qwen3PatchMerger(cfg, groups, dtype, device, postshuffle=True)
                                                    for _ in cfg.deepstack_visual_indexes])

    @property
    def out_width(self) -> int:
        return (1 + self.cfg.deepstack_count) * self.cfg.out_hidden_size

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        grid_thw = grid_thw.cpu()
        patch_hw = vision_patch_positions(grid_thw, cfg.spatial_merge_size)
        index, weight = interpolation_taps(grid_thw, patch_hw, cfg.grid_per_side)
        device = pixel_values.device
        cos, sin = self.rotary_pos_emb(patch_hw.to(device))
        frames = vision_cu_seqlens(grid_thw).tolist()
        x = self.patch_embed(pixel_values)
        positions = (self.pos_embed(index.to(device)) * weight.to(device)[:, :, None]).sum(1)
        x = x + positions.to(x.dtype)
        deep = []
        indexes = list(cfg.deepstack_visual_indexes)
        for j, block in enumerate(self.blocks):
            x = block(x, frames, cos, sin)
            if j in indexes:
                deep.append(self.deepstack_merger_list[indexes.index(j)](x))
        return torch.cat([self.merger(x), *deep], dim=-1)
