"""Rotary position embeddings: default, linear, dynamic-NTK and Llama-3 frequency scaling.

Written from the published formulas; numerics follow transformers (frequencies and cos/sin in fp32,
cast to the activation dtype before the rotation) so fp32 logits agree to ~1e-6.

Dynamic NTK is evaluated per call from ``seq_len = max(position_ids) + 1``: above
``max_position_embeddings`` the base grows, at or below it the default frequencies are used. This
is transformers' result for a model that sees each batch fresh; transformers additionally caches
the largest length seen, which makes its output depend on call history (we do not copy that).
"""

from __future__ import annotations

import math

import torch

from models.common.config import RopeConfig
from parallel.fused_ops import rotary_reference, rotate_half


def _default_inv_freq(theta: float | torch.Tensor, dim: int, device=None) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    return 1.0 / (theta ** exponents)


def inv_freq(rope: RopeConfig, head_dim: int, max_position_embeddings: int, seq_len: int | None = None,
             device=None) -> torch.Tensor:
    """Inverse frequencies ``[head_dim / 2]`` (fp32) for this RoPE type (and length, for dynamic)."""
    if rope.rope_type == "default":
        return _default_inv_freq(rope.theta, head_dim, device)
    if rope.rope_type == "linear":
        return _default_inv_freq(rope.theta, head_dim, device) / rope.factor
    if rope.rope_type == "dynamic":
        if seq_len is None or seq_len <= max_position_embeddings:
            return _default_inv_freq(rope.theta, head_dim, device)
        # fp32 tensor arithmetic, as transformers evaluates it.
        length = torch.tensor(seq_len, dtype=torch.int64, device=device)
        base = rope.theta * ((rope.factor * length / max_position_embeddings) - (rope.factor - 1)) ** (
            head_dim / (head_dim - 2))
        return _default_inv_freq(base, head_dim, device)
    if rope.rope_type == "llama3":
        freq = _default_inv_freq(rope.theta, head_dim, device)
        old_len = rope.original_max_position_embeddings or max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > low_wavelen, freq / rope.factor, freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unknown rope_type {rope.rope_type!r}")


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables for given positions: ``position_ids [b, s] -> cos, sin [s, b, 1, head_dim]``."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_position_embeddings: int, *,
                 mrope_interleaved: bool = False) -> None:
        super().__init__()
        self.rope = rope
        # Qwen3-VL: M-RoPE sections interleaved over the frequencies (``mrope_angles_interleaved``)
        self.mrope_interleaved = mrope_interleaved
        self.head_dim = head_dim
        self.max_position_embeddings = max_position_embeddings
        self.register_buffer("inv_freq", inv_freq(rope, head_dim, max_position_embeddings), persistent=False)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype,
                seq_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``seq_len`` (dynamic NTK only): the batch's ``max(position) + 1`` when ``position_ids`` is
        only a slice of it (context/Ulysses parallel); default: computed from ``position_ids``."""
        freq = self.inv_freq
        if self.rope.rope_type == "dynamic":
            seq_len = int(position_ids.max()) + 1 if seq_len is None else seq_len
            if seq_len > self.max_position_embeddings:
                freq = inv_freq(self.rope, self.head_dim, self.max_position_embeddings, seq_len, position_ids.device)
        if position_ids.dim() == 3:  # M-RoPE rows [3, b, s]: each frequency section follows its own row
            rows = mrope_angles_interleaved if self.mrope_interleaved else mrope_angles
            angles = rows(position_ids, freq.to(position_ids.device), self.rope.mrope_section)
        else:
            angles = position_ids.t().unsqueeze(-1).float() * freq.to(position_ids.device)  # [s, b, hd/2]
        emb = torch.cat((angles, angles), dim=-1).unsqueeze(2)  # [s, b, 1, hd]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def mrope_angles(position_ids: torch.Tensor, freq: torch.Tensor, sections: tuple[int, ...] | None) -> torch.Tensor:
    """Multimodal RoPE angles ``[s, b, head_dim/2]`` from position rows ``[3, b, s]`` (temporal,
    height, width): the frequencies are cut into ``sections`` and section i takes its angles from
    row ``i % 3``, as transformers' Qwen2-VL does (text tokens have three equal rows: plain RoPE)."""
    if sections is None:
        raise ValueError("3-row (M-RoPE) position ids need a model whose rope has mrope_section")
    if position_ids.shape[0] != 3:
        raise ValueError(f"M-RoPE position ids must have 3 rows (temporal, height, width), got {position_ids.shape[0]}")
    angles = position_ids.permute(0, 2, 1).unsqueeze(-1).float() * freq  # [3, s, b, hd/2]
    parts = angles.split(list(sections), dim=-1)
    return torch.cat([part[i % 3] for i, part in enumerate(parts)], dim=-1)


def mrope_angles_interleaved(position_ids: torch.Tensor, freq: torch.Tensor,
                             sections: tuple[int, ...] | None) -> torch.Tensor:
    """Qwen3-VL's interleaved M-RoPE angles ``[s, b, head_dim/2]`` from rows ``[3, b, s]``: frequency j
    follows the temporal row, except ``j % 3 == 1`` below ``3 * sections[1]`` (height row) and
    ``j % 3 == 2`` below ``3 * sections[2]`` (width row), as transformers' ``Qwen3VLTextRotaryEmbedding``
    recomposes them (T/H/W interleaved; the remaining high indices stay temporal)."""
    if sections is None or len(sections) != 3:
        raise ValueError(f"interleaved M-RoPE needs three mrope_section values, got {sections!r}")
    if position_ids.shape[0] != 3:
        raise ValueError(f"M-RoPE position ids must have 3 rows (temporal, height, width), got {position_ids.shape[0]}")
    angles = position_ids.permute(0, 2, 1).unsqueeze(-1).float() * freq  # [3, s, b, hd/2]
    j = torch.arange(freq.shape[-1], device=freq.device)
    row = torch.zeros_like(j)
    for r in (1, 2):
        row[(j % 3 == r) & (j < 3 * sections[r])] = r
    return angles.gather(0, row.view(1, 1, 1, -1).expand(1, *angles.shape[1:]))[0]


_rotate_half = rotate_half


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [s, b, heads, head_dim]`` by the angles in ``cos/sin [s, b, 1, head_dim]`` (the torch
    reference; the attention block calls ``parallel.fused_ops.apply_rotary`` on q and k, which runs a
    fused kernel on CUDA and this code elsewhere)."""
    return rotary_reference(x, cos, sin)
