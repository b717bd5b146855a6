"""The Qwen2-VL family's vision tower, tensor-parallel: patch embedding, 2-D rotary blocks, patch merger.

Semantics are transformers' ``Qwen2VisionTransformerPretrainedModel``: ``pixel_values [N, C*T*P*P]``
(one row per patch, as the image processor emits them, grouped by ``spatial_merge_size^2`` windows)
-> Conv3d patch embedding (stride = kernel, so one matmul per patch) -> ``depth`` blocks of
pre-LayerNorm attention (fused ``qkv``, 2-D rotary over the patch's (h, w), attention within each
frame of each image/video, from ``cu_seqlens``) and a quick-GELU MLP -> the merger (LayerNorm,
``spatial_merge_size^2`` patches concatenated, Linear-GELU-Linear) -> one feature per merged patch.

Tensor parallel over the TP group, the way the text decoder splits (Megatron without SP): ``qkv``
column-parallel per q/k/v block then per head (rule ``Fused(3)``: each rank holds
``[q_r | k_r | v_r]``), ``proj`` row-parallel, ``fc1`` column, ``fc2`` row, merger ``mlp.0`` column,
``mlp.2`` row. Norms, patch embedding and the residual stream stay whole on every TP rank (they are
a small share of the tower's work); the matmuls and attention are split, so no rank repeats them.
The output features are whole on every TP rank. Parameter names are transformers' (``visual.*``).

Qwen2.5-VL is the same tower with options (``VisionConfig``): RMSNorm instead of LayerNorm (blocks
and merger), a gated MLP ``down(act(gate(x)) * up(x))`` with biases (``gate_up_proj`` column-parallel
holding ``[gate_r | up_r]``, ``down_proj`` row), and window attention: after the patch embedding the
merged patches (``spatial_merge_size^2`` consecutive rows each) are reordered window by window
(``vision_window_index``), the blocks attend within windows except those in ``fullatt_block_indexes``
(within frames, which the reordering keeps contiguous), and the merger's output is put back in the
original order (the inverse permutation), so features line up with the placeholder tokens.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from models.common.config import VisionConfig
from models.common.vision.positions import vision_cu_seqlens, vision_patch_positions, vision_window_index
from parallel.groups import ParallelGroups
from parallel.layers import ColumnParallelLinear, MergedColumnParallelLinear, RMSNorm, RowParallelLinear


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


_ACTIVATIONS = {"quick_gelu": quick_gelu, "gelu": F.gelu, "silu": F.silu}


class PatchEmbed(nn.Module):
    """Conv3d with stride = kernel over ``temporal_patch x patch x patch`` pixels (no bias); replicated."""

    def __init__(self, cfg: VisionConfig, dtype, device) -> None:
        super().__init__()
        self.cfg = cfg
        t, p = cfg.temporal_patch_size, cfg.patch_size
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(cfg.embed_dim, cfg.in_channels, t, p, p, dtype=dtype,
                                                    device=device))
        self.proj.lora = None  # a parallel.lora.PatchLoRA when LoRA adapts the patch embedding

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return with_patch_lora(self.proj, pixels, patch_linear(pixels, self.proj.weight))


def patch_linear(pixels: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The Conv3d of stride = kernel over one patch per row, as the matmul it is: ``pixels [N, C*T*P*P]``
    (rows flattened in the kernel's ``(C, T, P, P)`` order) times the flattened ``weight [E, C, T, P, P]``
    -> ``[N, E]``. Same sums as the convolution (fp32 rounding apart); on CPU the convolution's backward
    took ~4x the matmul's time."""
    return F.linear(pixels.reshape(-1, weight[0].numel()).to(weight.dtype), weight.flatten(1), bias)


def with_patch_lora(proj: nn.Module, pixels: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The patch embedding's output ``y`` plus its LoRA delta, if LoRA adapts it (``proj.lora``)."""
    return y if proj.lora is None else y + proj.lora(pixels)


class VisionRotary(nn.Module):
    """Axial 2-D RoPE: ``head_dim/4`` frequencies for h and for w, concatenated, then doubled."""

    def __init__(self, cfg: VisionConfig, device) -> None:
        super().__init__()
        spatial = cfg.head_dim // 2
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float32, device=device) / spatial))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [N, 2]`` (h, w) -> fp32 ``cos, sin [N, 1, head_dim]``."""
        freqs = positions[..., None].float() * self.inv_freq.to(positions.device)  # [N, 2, hd/4]
        hw = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        emb = torch.cat([hw, hw], dim=-1)[:, None]
        return emb.cos(), emb.sin()


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig, groups: ParallelGroups, dtype, device) -> None:
        super().__init__()
        tp = groups.tp_size
        if cfg.num_heads % tp:
            raise ValueError(f"vision num_heads={cfg.num_heads} is not divisible by tp={tp}")
        self.local_heads = cfg.num_heads // tp
        self.head_dim = cfg.head_dim
        self.qkv = ColumnParallelLinear(cfg.embed_dim, 3 * cfg.embed_dim, bias=True, tp_group=groups.tp_group,
                                        dtype=dtype, device=device)
        self.proj = RowParallelLinear(cfg.embed_dim, cfg.embed_dim, bias=True, tp_group=groups.tp_group,
                                      dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        qk, v = self.qkv(x).view(n, 3, self.local_heads, self.head_dim).split([2, 1], dim=1)  # [N, 2|1, h_r, d]
        q, k = rotate_pairs(qk, cos, sin).unbind(1)  # [N, h_r, d] each, strided views SDPA takes as they are
        return self.proj(segment_attention(q, k, v.squeeze(1), cu_seqlens).reshape(n, -1))


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The 2-D rotary of ``x [N, 2, h, d]`` (q and k side by side, one pass over both) with ``cos, sin
    [N, 1, d]``: ``x * cos + rotate_half(x) * sin`` in fp32 (as transformers), back in ``x``'s dtype.
    ``rotate_half(x) * sin = [-x2 * sin1, x1 * sin2]`` is computed as ``[x2, x1] * [-sin1, sin2]``: the
    same products bit for bit (negation is exact), with one ``flip`` of the halves instead of two
    slices, a negation and a concatenation per tensor (and their backward scatters)."""
    d = x.shape[-1]
    xf = x.float()
    sin = torch.cat([-sin[..., : d // 2], sin[..., d // 2:]], dim=-1)
    swapped = xf.unflatten(-1, (2, d // 2)).flip(-2).flatten(-2)
    return (xf * cos[:, None] + swapped * sin[:, None]).to(x.dtype)


@functools.lru_cache(maxsize=64)
def _equal_runs(cu_seqlens: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """``(count, length)`` of each run of consecutive segments of equal length (a video's frames, an
    image's full windows), in order."""
    runs: list[list[int]] = []
    for start, stop in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        if runs and runs[-1][1] == stop - start:
            runs[-1][0] += 1
        else:
            runs.append([1, stop - start])
    return tuple((c, length) for c, length in runs if length)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens) -> torch.Tensor:
    """Non-causal attention of ``q, k, v [N, h, d]`` within each segment of ``cu_seqlens`` (a frame or a
    window) -> ``[N, h, d]``. Consecutive segments of equal length go through SDPA as one batch (one call
    per run instead of one per segment); the rows are cut with ``split`` (whose backward is one
    concatenation, where slices each scatter into a zero tensor of all N rows)."""
    runs = _equal_runs(tuple(int(b) for b in cu_seqlens))
    if not runs:
        return q.new_zeros(q.shape)
    if len(runs) == 1:
        parts = [(q, k, v)]
    else:
        parts = zip(*(t.split([c * length for c, length in runs]) for t in (q, k, v)))
    outs = []
    for (count, length), (qs, ks, vs) in zip(runs, parts):
        qs, ks, vs = (t.view(count, length, *t.shape[1:]).transpose(1, 2) for t in (qs, ks, vs))  # [c, h, L, d]
        outs.append(F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2).reshape(count * length, *q.shape[1:]))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _activation(cfg: VisionConfig):
    if cfg.hidden_act not in _ACTIVATIONS:
        raise ValueError(f"vision hidden_act={cfg.hidden_act!r} is not supported ({', '.join(_ACTIVATIONS)})")
    return _ACTIVATIONS[cfg.hidden_act]


def _norm(cfg: VisionConfig, dtype, device) -> nn.Module:
    """The blocks' and the merger's norm: LayerNorm (Qwen2-VL) or RMSNorm without bias (Qwen2.5-VL)."""
    if cfg.rms_norm:
        return RMSNorm(cfg.embed_dim, 1e-6, dtype=dtype, device=device)
    return nn.LayerNorm(cfg.embed_dim, eps=1e-6, dtype=dtype, device=device)


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig, groups: ParallelGroups, dtype, device) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(cfg.embed_dim, cfg.mlp_hidden, bias=True, tp_group=groups.tp_group,
                                        dtype=dtype, device=device)
        self.fc2 = RowParallelLinear(cfg.mlp_hidden, cfg.embed_dim, bias=True, tp_group=groups.tp_group,
                                     dtype=dtype, device=device)
        self.act = _activation(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class GatedVisionMLP(nn.Module):
    """Qwen2.5-VL's ``down_proj(act(gate_proj(x)) * up_proj(x))`` with biases; ``gate_up_proj`` holds
    this rank's ``[gate_r | up_r]`` rows (vLLM's packing)."""

    def __init__(self, cfg: VisionConfig, groups: ParallelGroups, dtype, device) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(cfg.embed_dim, [cfg.mlp_hidden] * 2, bias=True,
                                                       tp_group=groups.tp_group, dtype=dtype, device=device)
        self.down_proj = RowParallelLinear(cfg.mlp_hidden, cfg.embed_dim, bias=True, tp_group=groups.tp_group,
                                           dtype=dtype, device=device)
        self.act = _activation(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig, groups: ParallelGroups, dtype, device) -> None:
        super().__init__()
        self.norm1 = _norm(cfg, dtype, device)
        self.norm2 = _norm(cfg, dtype, device)
        self.attn = VisionAttention(cfg, groups, dtype, device)
        self.mlp = (GatedVisionMLP if cfg.gated_mlp else VisionMLP)(cfg, groups, dtype, device)

    def forward(self, x, cu_seqlens, cos, sin):
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Norm, then ``spatial_merge_size^2`` consecutive patches as one row, Linear-GELU-Linear."""

    def __init__(self, cfg: VisionConfig, groups: ParallelGroups, dtype, device) -> None:
        super().__init__()
        self.merged_dim = cfg.merged_dim
        self.ln_q = _norm(cfg, dtype, device)
        self.mlp = nn.ModuleList([
            ColumnParallelLinear(cfg.merged_dim, cfg.merged_dim, bias=True, tp_group=groups.tp_group, dtype=dtype,
                                 device=device),
            nn.GELU(),
            RowParallelLinear(cfg.merged_dim, cfg.out_hidden_size, bias=True, tp_group=groups.tp_group, dtype=dtype,
                              device=device),
        ])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln_q(x).view(-1, self.merged_dim)
        for layer in self.mlp:
            x = layer(x)
        return x


class ParallelVisionTower(nn.Module):
    """``visual``: pixel patches of images/videos -> merged features ``[sum(t*h*w) / merge^2, out_hidden]``."""

    def __init__(self, cfg: VisionConfig, groups: ParallelGroups, dtype, device) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg, dtype, device)
        self.rotary_pos_emb = VisionRotary(cfg, device)
        self.blocks = nn.ModuleList([VisionBlock(cfg, groups, dtype, device) for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg, groups, dtype, device)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """``pixel_values [sum t*h*w, patch_dim]`` of the images/videos whose grids are ``grid_thw [n, 3]``
        -> their merged features in the same order. Each patch's (h, w) rotary position and the frame
        boundaries (attention stays within a frame, or within a window) come from the grids
        (``models/common/vision/positions.py``)."""
        cfg = self.cfg
        grid_thw = grid_thw.cpu()
        cos, sin = self.rotary_pos_emb(vision_patch_positions(grid_thw, cfg.spatial_merge_size).to(pixel_values.device))
        frames = vision_cu_seqlens(grid_thw).tolist()
        x = self.patch_embed(pixel_values)
        window = None
        if cfg.window_size:
            window, windows = vision_window_index(grid_thw, cfg.spatial_merge_size, cfg.window_tokens)
            window = window.to(x.device)
            x, cos, sin = (_by_merged_patch(t, window, cfg.spatial_merge_size) for t in (x, cos, sin))
        for j, block in enumerate(self.blocks):
            full = window is None or j in cfg.fullatt_block_indexes
            x = block(x, frames if full else windows, cos, sin)
        x = self.merger(x)
        if window is not None:  # back to the patches' own order
            x = x[torch.argsort(window)]
        return x


def _by_merged_patch(x: torch.Tensor, order: torch.Tensor, merge: int) -> torch.Tensor:
    """Rows of ``x [N, ...]`` reordered in groups of ``merge^2`` (one merged patch each) by ``order``."""
    unit = merge ** 2
    return x.reshape(x.shape[0] // unit, unit, *x.shape[1:])[order].reshape(x.shape)
