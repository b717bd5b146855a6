"""Causal self-attention: the kernels (SDPA everywhere, flash-attn (varlen) on CUDA when installed) and
the tensor-parallel attention block of the decoder (``ParallelAttention``: packed QKV, RoPE, Ulysses /
context-parallel attention over a sequence-split batch, row-parallel output projection).

Kernel inputs are per-rank heads after RoPE: ``q [s, b, hq, d]``, ``k/v [s, b, hkv, d]`` (GQA: hq is a
multiple of hkv). Output ``[s, b, hq * d]``. Two batch forms:
  * padded ``[s, b]`` with an optional key-padding mask ``attention_mask [b, s]`` (1 = real token);
  * packed (remove-padding): ``b == 1`` and ``cu_seqlens [n + 1]`` marking sequence boundaries in
    the flat token axis; tokens attend only within their own sequence.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch import nn

from models.common.blocks.rope import apply_rotary
from models.common.config import ModelConfig
from parallel.context_attention import context_parallel_attention
from parallel.groups import ParallelGroups
from parallel.layers import QKVParallelLinear, RMSNorm, RowParallelLinear
from parallel.sequence_shard import SequenceShard
from parallel.ulysses import heads_to_seq, qkv_to_heads

_FLASH_AVAILABLE = importlib.util.find_spec("flash_attn") is not None


def flash_attn_usable(q: torch.Tensor) -> bool:
    """flash-attn applies: installed, CUDA tensors, half precision."""
    return _FLASH_AVAILABLE and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """q/k/v ``[b, h, s, d]``; GQA handled by SDPA's ``enable_gqa``."""
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None, enable_gqa=gqa)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                     cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None) -> torch.Tensor:
    """Causal attention for a padded or packed batch; see the module docstring for layouts."""
    s, b, hq, d = q.shape
    if cu_seqlens is not None:
        return _packed_attention(q, k, v, cu_seqlens, max_seqlen).reshape(s, b, hq * d)
    if flash_attn_usable(q) and attention_mask is None:
        from flash_attn import flash_attn_func

        out = flash_attn_func(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), causal=True)  # [b, s, h, d]
        return out.transpose(0, 1).reshape(s, b, hq * d)
    qt, kt, vt = (x.permute(1, 2, 0, 3) for x in (q, k, v))  # [b, h, s, d]
    mask = None
    if attention_mask is not None:
        causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        keys = attention_mask.to(torch.bool)[:, None, None, :]
        # A query always sees itself, so rows of padding queries never become all -inf (NaN).
        mask = (causal & keys) | torch.eye(s, dtype=torch.bool, device=q.device)
    out = _sdpa(qt, kt, vt, mask, causal=True)  # [b, h, s, d]
    return out.permute(2, 0, 1, 3).reshape(s, b, hq * d)


def _packed_attention(q, k, v, cu_seqlens, max_seqlen):
    """Packed tokens ``[T, 1, h, d]``: each sequence attends causally within itself."""
    if q.shape[1] != 1:
        raise ValueError(f"packed attention expects batch 1 (flat tokens), got q of shape {tuple(q.shape)}")
    qf, kf, vf = q[:, 0], k[:, 0], v[:, 0]  # [T, h, d]
    if flash_attn_usable(q):
        from flash_attn import flash_attn_varlen_func

        cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
        if max_seqlen is None:
            max_seqlen = int((cu[1:] - cu[:-1]).max())
        return flash_attn_varlen_func(qf, kf, vf, cu, cu, max_seqlen, max_seqlen, causal=True)
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != qf.shape[0]:
        raise ValueError(f"cu_seqlens must run from 0 to the token count {qf.shape[0]}, got {bounds[0]}..{bounds[-1]}")
    outs = []
    for start, stop in zip(bounds[:-1], bounds[1:]):
        if stop == start:
            continue
        qs, ks, vs = (x[start:stop].transpose(0, 1).unsqueeze(0) for x in (qf, kf, vf))  # [1, h, n, d]
        outs.append(_sdpa(qs, ks, vs, None, causal=True)[0].transpose(0, 1))  # [n, h, d]
    return torch.cat(outs, dim=0)


class ParallelAttention(nn.Module):
    """Full causal self-attention of one decoder layer over this TP rank's heads.

    ``cfg.qk_norm`` (Qwen3): ``q_norm``/``k_norm``, RMSNorm over ``head_dim`` of every query/key head,
    applied before RoPE. Their weights ``[head_dim]`` are whole on every TP rank, but each rank
    normalises only its own heads (and, when tp > kv heads, a replicated KV head only for its own
    query heads), so their gradients are partial sums over TP: tagged ``sequence_parallel`` for
    ``finalize_grads`` to sum (the replica groups - dp, cp, ulysses - then reduce them like any parameter).
    """

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups, dtype, device) -> None:
        super().__init__()
        sp = groups.sequence_parallel
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, bias=cfg.qkv_bias, tp_group=groups.tp_group,
                                          sequence_parallel=sp, dtype=dtype, device=device)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias,
                                        tp_group=groups.tp_group, sequence_parallel=sp, dtype=dtype, device=device)
        self.head_dim = cfg.head_dim
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            partial = groups.tp_size > 1
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, sequence_parallel=partial, dtype=dtype, device=device)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, sequence_parallel=partial, dtype=dtype, device=device)

    def forward(self, x, cos, sin, attention_mask, cu_seqlens, max_seqlen, seq: SequenceShard | None = None):
        qkv = self.qkv_proj(x)  # [s, b, (hq + 2 hkv) * d]
        s, b, _ = qkv.shape
        q_size, kv_size, _ = self.qkv_proj.local_sizes()
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q, k, v = (t.view(s, b, -1, self.head_dim) for t in (q, k, v))  # [s, b, heads, d]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if seq is None:
            out = causal_attention(q, k, v, attention_mask=attention_mask, cu_seqlens=cu_seqlens,
                                   max_seqlen=max_seqlen)
        else:
            out = self._split_sequence_attention(q, k, v, seq)
        return self.o_proj(out)

    @staticmethod
    def _split_sequence_attention(q, k, v, seq: SequenceShard) -> torch.Tensor:
        """Ulysses all-to-all to all tokens of a head group, then causal attention over this CP
        rank's tokens (ring / all-gather across CP ranks), then back. ``[s, 1, h, d] -> [s, 1, h*d]``."""
        s, b, hq, d = q.shape
        q, k, v = qkv_to_heads(q, k, v, seq.ulysses_group)  # [L, 1, h/u, d]
        if seq.plan.cp > 1:
            out = context_parallel_attention(q[:, 0], k[:, 0], v[:, 0], seq.plan, seq.cp_group, comm=seq.cp_comm)
            out = out[:, None]
        else:
            out = causal_attention(q, k, v, cu_seqlens=seq.local_cu_seqlens()).view(q.shape)
        return heads_to_seq(out, seq.ulysses_group).reshape(s, b, hq * d)
