"""LoRA factors on tensor-parallel layers, sharded like the layer they adapt (peft's math).

``delta(x) = B(A(dropout(x))) * scaling`` added to the layer's output, per adapted projection:

  column-parallel (q/k/v, gate/up, ...): A ``[r, in]`` whole on every rank, B ``[out_r, r]`` this
      rank's rows (the same rows as the base weight). The rank-r activation ``A x`` is gathered
      over the sequence under SP (r columns instead of ``in``: cheap), or marked with Megatron's
      "f" (all-reduce of its gradient) otherwise, so A's gradient is complete on every rank
      (partial over sequence shards under SP: tagged ``sequence_parallel``, summed by
      ``finalize_grads``).
  row-parallel (o_proj, down_proj): A ``[r, in/tp]`` this rank's columns, B ``[out, r]`` whole;
      ``A x`` is summed over TP (reduce-scattered over the sequence under SP; B then tagged
      ``sequence_parallel``, like a row-parallel bias), in fp32 and rounded once when its layer's
      ``reduce_in_fp32`` is set (``ParallelConfig.tp_reduce_in_fp32``).

Packed layers get one (A, B) pair per adapted projection; projections without LoRA contribute
zeros to their part of the packed output. A vision tower's layers are built without SP (its activations
are whole on every TP rank): the same classes, the non-SP branches. Its patch embedding (a Conv3d held
whole) takes ``PatchLoRA``, peft's Conv3d LoRA as the matmul it is over one patch.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from parallel.collectives import copy_to_group, gather_from_sequence
from parallel.layers import row_parallel_linear


class ColumnLoRA(nn.Module):
    """LoRA for a (packed) column-parallel layer; ``parts``: (name or None, local output rows) in
    packed order. Parameters ``lora_A_<name>`` ``[r, in]`` and ``lora_B_<name>`` ``[rows, r]``."""

    def __init__(self, in_features: int, parts: Sequence[tuple[str | None, int]], *, r: int, scaling: float,
                 dropout: float, tp_group: Any, sequence_parallel: bool, dtype=None, device=None) -> None:
        super().__init__()
        self.parts = list(parts)
        self.r, self.scaling, self.tp_group, self.sequence_parallel = r, scaling, tp_group, sequence_parallel
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        for name, rows in self.parts:
            if name is None:
                continue
            a = nn.Parameter(torch.zeros(r, in_features, dtype=dtype, device=device))
            if sequence_parallel:
                a.sequence_parallel = True
            self.register_parameter(f"lora_A_{name}", a)
            self.register_parameter(f"lora_B_{name}", nn.Parameter(torch.zeros(rows, r, dtype=dtype, device=device)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` is the layer's input (``[s/tp, b, in]`` under SP); returns the packed delta ``[s, b, out_local]``."""
        names = [n for n, _ in self.parts if n is not None]
        a = torch.cat([getattr(self, f"lora_A_{n}") for n in names], dim=0)  # [k*r, in]
        u = F.linear(self.dropout(x), a)
        u = gather_from_sequence(u, self.tp_group) if self.sequence_parallel else copy_to_group(u, self.tp_group)
        outs, k = [], 0
        for name, rows in self.parts:
            if name is None:
                outs.append(u.new_zeros((*u.shape[:-1], rows)))
                continue
            outs.append(F.linear(u[..., k * self.r:(k + 1) * self.r], getattr(self, f"lora_B_{name}")))
            k += 1
        return torch.cat(outs, dim=-1) * self.scaling if len(outs) > 1 else outs[0] * self.scaling


class RowLoRA(nn.Module):
    """LoRA for a row-parallel layer: ``lora_A_<name>`` ``[r, in/tp]``, ``lora_B_<name>`` ``[out, r]``."""

    def __init__(self, name: str, in_local: int, out_features: int, *, r: int, scaling: float, dropout: float,
                 tp_group: Any, sequence_parallel: bool, dtype=None, device=None) -> None:
        super().__init__()
        self.name, self.scaling, self.tp_group, self.sequence_parallel = name, scaling, tp_group, sequence_parallel
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.register_parameter(f"lora_A_{name}", nn.Parameter(torch.zeros(r, in_local, dtype=dtype, device=device)))
        b = nn.Parameter(torch.zeros(out_features, r, dtype=dtype, device=device))
        if sequence_parallel:
            b.sequence_parallel = True
        self.register_parameter(f"lora_B_{name}", b)

    def forward(self, x: torch.Tensor, reduce_in_fp32: bool = False) -> torch.Tensor:
        """``x [s, b, in/tp]`` (the layer's input) -> the delta; ``reduce_in_fp32``: its layer's setting, the TP sum
        of ``A x`` in fp32 rounded once (peft's one bf16 GEMM ``A x``; ``parallel.layers.row_parallel_linear``)."""
        a = getattr(self, f"lora_A_{self.name}")
        u = row_parallel_linear(self.dropout(x), a, None, self.tp_group, self.sequence_parallel, reduce_in_fp32)
        return F.linear(u, getattr(self, f"lora_B_{self.name}")) * self.scaling


class PatchLoRA(nn.Module):
    """LoRA for a vision tower's patch embedding, a Conv3d of stride = kernel held whole on every rank
    (computed as the matmul over one flattened patch per row, ``blocks/vision.py``'s ``patch_linear``). As
    peft's Conv3d LoRA: ``lora_A_<name>`` ``[r, C, T, P, P]`` (a convolution of the same kernel and stride),
    ``lora_B_<name>`` ``[out, r, 1, 1, 1]`` (a 1x1x1 convolution): over one patch, ``B_flat A_flat x``."""

    def __init__(self, name: str, a_shape: Sequence[int], b_shape: Sequence[int], *, scaling: float,
                 dropout: float, dtype=None, device=None) -> None:
        super().__init__()
        self.name, self.scaling = name, scaling
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.register_parameter(f"lora_A_{name}", nn.Parameter(torch.zeros(*a_shape, dtype=dtype, device=device)))
        self.register_parameter(f"lora_B_{name}", nn.Parameter(torch.zeros(*b_shape, dtype=dtype, device=device)))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """``pixels [N, C*T*P*P]`` (the kernel's order) -> the delta ``[N, out]``."""
        a, b = getattr(self, f"lora_A_{self.name}"), getattr(self, f"lora_B_{self.name}")
        u = F.linear(self.dropout(pixels.reshape(-1, a[0].numel()).to(a.dtype)), a.flatten(1))
        return F.linear(u, b.flatten(1)) * self.scaling
