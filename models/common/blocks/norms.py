"""The RMSNorm variants of the Gated DeltaNet hybrids (Qwen3.5), with transformers' dtype handling.

``ZeroCenteredRMSNorm``: ``(x / rms(x)) * (1 + w)`` computed in fp32 and cast back (Qwen3.5's decoder,
final and q/k norms; ``w`` starts at 0). ``GatedRMSNorm``: the linear-attention output norm,
``w * (x / rms(x)).to(dtype) * silu(gate)`` with the gate in fp32 (not zero-centred).

``partial_grad``: the input is a share of what the full norm sees (a sequence shard under SP, or this
TP rank's heads), so the weight's gradient is a partial sum: tagged ``sequence_parallel`` for
``finalize_grads`` to sum over TP.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ZeroCenteredRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, *, partial_grad: bool = False, dtype=None, device=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device))
        if partial_grad:
            self.weight.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, *, partial_grad: bool = False, dtype=None, device=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        if partial_grad:
            self.weight.sequence_parallel = True

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (self.weight * normed * F.silu(gate.float())).to(dtype)
