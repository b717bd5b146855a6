"""The Gated DeltaNet block (``linear_attention`` layers of Qwen3.5), tensor- and sequence-parallel.

``x [s(/tp), b, H]`` -> projections (column-parallel: ``in_proj_qkvz`` = ``[q | k | v | z]``,
``in_proj_ba`` = ``[b | a]``, this rank's heads) -> causal depthwise conv (kernel K, no bias) over
``[q | k | v]`` and SiLU -> l2-normalised q/k, ``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a +
dt_bias)`` -> the gated delta rule (``parallel/gated_delta_rule.py``, chunked, fp32 state) -> gated
RMSNorm over each value head with ``z`` -> ``out_proj`` (row-parallel: all-reduce, or reduce-scatter
to the sequence shard under SP).

TP: rank r holds key heads ``[r Hk/tp, (r+1) Hk/tp)`` and the value heads that read them (value head
j reads key head ``j // (Hv/Hk)``, so contiguous value heads ``[r Hv/tp, ...)``), their conv channels
and ``A_log``/``dt_bias`` entries; nothing crosses ranks between the projections and ``out_proj``.
The gated norm's weight ``[dv]`` is whole on every rank; each rank normalises only its own heads,
so its gradient is summed over TP by ``finalize_grads``.

Batches: a padded ``[s, b]`` batch runs row by row; as in transformers, padding positions
(``attention_mask`` 0) enter as zero projections (left or right padding is then exact against each
sequence alone: they leave the state at zero or come after the real tokens). A packed batch
(``cu_seqlens``) restarts the state and the conv window at every sequence.

Sequence split (``seq``, cp/ulysses): the projections run on this rank's tokens; one Ulysses
all-to-all per layer trades tokens for key-head groups, each group travelling with its q/k/v
pre-conv channels, and its value heads' ``g``/``beta`` (computed before it, ``A_log``/``dt_bias``
whole on every rank), so rank ``i`` gets key heads ``[i hk/u, ...)`` and the value heads reading them,
and takes the matching conv channels of the weight. The conv and the delta rule then run over this
CP rank's tokens (``parallel/context_gdn.py``: halos and chunk states across CP ranks, exact for any
CP layout; with cp = 1 the same code sees whole sequences), the output comes back by the inverse
all-to-all, and the gated norm and ``out_proj`` run on this rank's tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.common.blocks.norms import GatedRMSNorm
from models.common.hybrid.config import HybridModelConfig
from parallel.collectives import group_rank, group_size
from parallel.context_gdn import context_conv, context_delta_rule
from parallel.gated_delta_rule import causal_conv1d, gated_delta_rule, positions_in_sequence
from parallel.groups import ParallelGroups
from parallel.layers import MergedColumnParallelLinear, RowParallelLinear
from parallel.ulysses import heads_to_seq, seq_to_heads


class DepthwiseConv(nn.Module):
    """Holds the conv weight ``[C/tp, 1, K]`` under transformers' ``conv1d.weight`` name."""

    def __init__(self, channels: int, kernel: int, dtype, device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel, dtype=dtype, device=device))


class ParallelGatedDeltaNet(nn.Module):
    def __init__(self, cfg: HybridModelConfig, groups: ParallelGroups, dtype, device) -> None:
        super().__init__()
        tp, sp = groups.tp_size, groups.sequence_parallel
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        if hk % tp:
            raise ValueError(f"linear_num_key_heads={hk} is not divisible by tp={tp}")
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.hk, self.hv = hk // tp, hv // tp  # this rank's heads
        kd, vd = cfg.linear_key_dim, cfg.linear_value_dim
        self.in_proj_qkvz = MergedColumnParallelLinear(cfg.hidden_size, [kd, kd, vd, vd], bias=False,
                                                       tp_group=groups.tp_group, sequence_parallel=sp, dtype=dtype,
                                                       device=device)
        self.in_proj_ba = MergedColumnParallelLinear(cfg.hidden_size, [hv, hv], bias=False, tp_group=groups.tp_group,
                                                     sequence_parallel=sp, dtype=dtype, device=device)
        self.conv1d = DepthwiseConv(cfg.linear_conv_dim // tp, cfg.linear_conv_kernel_dim, dtype, device)
        self.A_log = nn.Parameter(torch.empty(self.hv, dtype=dtype, device=device))
        self.dt_bias = nn.Parameter(torch.empty(self.hv, dtype=dtype, device=device))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps, partial_grad=tp > 1, dtype=dtype, device=device)
        self.out_proj = RowParallelLinear(vd, cfg.hidden_size, bias=False, tp_group=groups.tp_group,
                                          sequence_parallel=sp, dtype=dtype, device=device)

    def forward(self, x, cos=None, sin=None, attention_mask=None, cu_seqlens=None, max_seqlen=None, seq=None):
        if seq is not None:
            return self._split_forward(x, seq)
        kd, vd = self.hk * self.dk, self.hv * self.dv
        qkv, z = self.in_proj_qkvz(x).transpose(0, 1).split([2 * kd + vd, vd], dim=-1)  # [b, s, ...]
        b_proj, a = self.in_proj_ba(x).transpose(0, 1).split([self.hv, self.hv], dim=-1)
        batch, s = qkv.shape[:2]
        positions = None
        if cu_seqlens is not None:
            positions = positions_in_sequence(cu_seqlens.to(qkv.device), s)
        elif attention_mask is not None:  # padding enters as zero input, as in transformers
            keep = attention_mask[:, :s, None].to(qkv.dtype)
            qkv, z, b_proj, a = qkv * keep, z * keep, b_proj * keep, a * keep
        weight = self.conv1d.weight[:, 0]  # [C, K]
        qkv = F.silu(causal_conv1d(qkv, weight, positions, cu_seqlens=cu_seqlens)).to(x.dtype)
        q, k, v = qkv.split([kd, kd, vd], dim=-1)
        q = q.reshape(batch, s, self.hk, self.dk)
        k = k.reshape(batch, s, self.hk, self.dk)
        v = v.reshape(batch, s, self.hv, self.dv)
        beta = b_proj.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out = gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu_seqlens, use_qk_l2norm=True)  # [b, s, hv, dv]
        out = self.norm(out, z.reshape(batch, s, self.hv, self.dv))
        return self.out_proj(out.reshape(batch, s, vd).transpose(0, 1))  # [s(/tp), b, H]

    def _split_forward(self, x, seq):
        """``x [n(/tp), 1, H]``: this (cp, ulysses) rank's tokens of a sequence-split batch (module doc)."""
        kd, vd = self.hk * self.dk, self.hv * self.dv
        qkv, z = self.in_proj_qkvz(x).split([2 * kd + vd, vd], dim=-1)  # [n, 1, ...]
        b_proj, a = self.in_proj_ba(x).split([self.hv, self.hv], dim=-1)
        n = qkv.shape[0]
        u, rank = group_size(seq.ulysses_group), group_rank(seq.ulysses_group)
        if self.hk % u:
            raise ValueError(f"{self.hk} linear-attention key heads per TP rank cannot be split over ulysses={u}")
        rep = self.hv // self.hk  # value heads per key head
        beta = b_proj.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        q, k, v = qkv.split([kd, kd, vd], dim=-1)
        per_group = [q.reshape(n, 1, self.hk, self.dk), k.reshape(n, 1, self.hk, self.dk),
                     v.reshape(n, 1, self.hk, rep * self.dv), beta.reshape(n, 1, self.hk, rep)]
        packed = seq_to_heads(torch.cat(per_group, dim=-1), seq.ulysses_group)  # [L, 1, hk/u, ...]
        g = seq_to_heads(g.reshape(n, 1, self.hk, rep), seq.ulysses_group)  # fp32, as without the split
        hk, hv = self.hk // u, self.hv // u
        q, k, v, beta = packed[:, 0].split([self.dk, self.dk, rep * self.dv, rep], dim=-1)
        length = packed.shape[0]
        weight = self.conv1d.weight[:, 0]  # [C, K]: this rank's key-head groups' q, k and v channels
        kernel = weight.shape[-1]
        wq, wk, wv = weight.split([kd, kd, vd])
        weight = torch.cat([wq[rank * hk * self.dk:(rank + 1) * hk * self.dk],
                            wk[rank * hk * self.dk:(rank + 1) * hk * self.dk],
                            wv[rank * hv * self.dv:(rank + 1) * hv * self.dv]])
        pre = torch.cat([q.reshape(length, -1), k.reshape(length, -1), v.reshape(length, -1)], dim=-1)
        plan, cp_rank = seq.plan, group_rank(seq.cp_group)
        qkv = F.silu(context_conv(pre, weight, plan, cp_rank, seq.cp_group)).to(x.dtype)
        q, k, v = qkv.split([hk * self.dk, hk * self.dk, hv * self.dv], dim=-1)
        out = context_delta_rule(q.reshape(1, length, hk, self.dk), k.reshape(1, length, hk, self.dk),
                                 v.reshape(1, length, hv, self.dv), g.reshape(1, length, hv),
                                 beta.reshape(1, length, hv), plan, cp_rank, seq.cp_group, kernel)
        out = heads_to_seq(out[0, :, None], seq.ulysses_group)  # [n, 1, self.hv, dv]
        out = self.norm(out.transpose(0, 1), z.transpose(0, 1).reshape(1, n, self.hv, self.dv))
        return self.out_proj(out.reshape(1, n, vd).transpose(0, 1))  # [n(/tp), 1, H]
