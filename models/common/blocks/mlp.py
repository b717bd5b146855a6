"""The dense SwiGLU MLP block, tensor-parallel: ``gate_up_proj`` column-parallel (``[gate | up]`` packed),
``down_proj`` row-parallel; also the shared expert of the mixture-of-experts block (``moe.py``)."""

from __future__ import annotations

from torch import nn

from models.common.config import ModelConfig
from parallel.fused_ops import swiglu
from parallel.groups import ParallelGroups
from parallel.layers import MergedColumnParallelLinear, RowParallelLinear


class ParallelMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, groups: ParallelGroups, dtype, device, intermediate_size: int | None = None):
        super().__init__()
        sp = groups.sequence_parallel
        inter = cfg.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter] * 2, bias=cfg.mlp_bias,
                                                       tp_group=groups.tp_group, sequence_parallel=sp,
                                                       dtype=dtype, device=device)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias=cfg.mlp_bias,
                                           tp_group=groups.tp_group, sequence_parallel=sp, dtype=dtype, device=device)

    def forward(self, x):
        # silu(gate) * up on the packed [gate | up] output: one kernel on CUDA, no chunk copies
        return self.down_proj(swiglu(self.gate_up_proj(x)))
