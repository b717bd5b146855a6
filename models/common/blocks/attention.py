"""Causal self-attention: the kernels and the tensor-parallel attention block of the decoder
(``ParallelAttention``: packed QKV, RoPE, Ulysses / context-parallel attention over a sequence-split
batch, row-parallel output projection).

Kernel inputs are per-rank heads after RoPE: ``q [s, b, hq, d]``, ``k/v [s, b, hkv, d]`` (GQA: hq is a
multiple of hkv). Output ``[s, b, hq * d]``. Two batch forms:
  * padded ``[s, b]`` with an optional key-padding mask ``attention_mask [b, s]`` (1 = real token);
  * packed (remove-padding): ``b == 1`` and ``cu_seqlens [n + 1]`` marking sequence boundaries in
    the flat token axis; tokens attend only within their own sequence.

Kernels. Where a fast kernel takes the tensors (CUDA, fp16/bf16: ``varlen_kernels.flash_kernel``
chooses per device and call, ``PMZ_ATTENTION_KERNEL`` overrides) both forms run one varlen call: a
padded batch is unpadded first (each row's real tokens, in order, are one sequence; no ``s x s``
mask), and its padding rows come back as zeros. Where every sequence has the same length (a padded
batch without padding, or packed sequences of one length) the choice may be cuDNN's attention
through SDPA on the dense ``[n, h, L, d]`` batch instead (a padded batch without a mask goes to it
without any gather). Everywhere else (CPU, fp32/fp64) SDPA as before:
a causal + key-padding mask for padded batches (a padding query also sees itself, so no row is all
-inf), one SDPA call per sequence for packed ones. ``kernel=`` forces a varlen kernel (``"reference"``
runs the varlen path on CPU for tests).
"""

from __future__ import annotations

import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from models.common.config import ModelConfig
from parallel.context_attention import context_parallel_attention
from parallel.fused_ops import apply_rotary
from parallel.groups import ParallelGroups
from parallel.layers import QKVParallelLinear, RMSNorm, RowParallelLinear
from parallel.sequence_shard import SequenceShard
from parallel.ulysses import heads_to_seq, qkv_to_heads
from parallel.varlen_kernels import cudnn_backends, dense_attention, flash_kernel, varlen_attention


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """q/k/v ``[b, h, s, d]``; GQA handled by SDPA's ``enable_gqa``."""
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None, enable_gqa=gqa)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                     cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None,
                     kernel: str | None = None) -> torch.Tensor:
    """Causal attention for a padded or packed batch; see the module docstring for layouts and kernels.
    ``max_seqlen`` is a hint the varlen path does not need (it reads the lengths once per tensor)."""
    s, b, hq, d = q.shape
    auto = kernel is None
    kernel = kernel or flash_kernel(q)
    if cu_seqlens is not None:
        if q.shape[1] != 1:
            raise ValueError(f"packed attention expects batch 1 (flat tokens), got q of shape {tuple(q.shape)}")
        if kernel is not None and s:
            lay = _layouts.get(cu_seqlens, ("packed", s, q.device), lambda: packed_layout(cu_seqlens, s, q.device))
            if auto:
                kernel = flash_kernel(q, equal_lengths=_equal(lay))
            out = varlen_attention(q[:, 0], k[:, 0], v[:, 0], lay.cu, lay.cu, lay.max_len, lay.max_len, True,
                                   d ** -0.5, kernel)
            return out.reshape(s, b, hq * d)
        return _packed_sdpa(q[:, 0], k[:, 0], v[:, 0], cu_seqlens).reshape(s, b, hq * d)
    if kernel is not None:
        return _unpadded_attention(q, k, v, attention_mask, kernel, auto)
    qt, kt, vt = (x.permute(1, 2, 0, 3) for x in (q, k, v))  # [b, h, s, d]
    mask = None
    if attention_mask is not None:
        causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        keys = attention_mask.to(torch.bool)[:, None, None, :]
        # A query always sees itself, so rows of padding queries never become all -inf (NaN).
        mask = (causal & keys) | torch.eye(s, dtype=torch.bool, device=q.device)
    out = _sdpa(qt, kt, vt, mask, causal=True)  # [b, h, s, d]
    return out.permute(2, 0, 1, 3).reshape(s, b, hq * d)


def _packed_sdpa(qf, kf, vf, cu_seqlens):
    """Packed tokens ``[T, h, d]``, one SDPA call per sequence (the CPU / fp32 path)."""
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


# ---------------------------------------------------------------------- varlen layouts
class VarlenLayout(NamedTuple):
    """Where the sequences of a batch are: ``index`` (padded batches: flat ``[s * b]`` position of each
    real token, sequence by sequence; None for packed input, already flat), ``cu`` int32 cumulative
    lengths on the device (empty sequences dropped: flash's kernel selection assumes none), ``max_len``
    and ``tokens`` (the real token count) as host ints."""

    index: torch.Tensor | None
    cu: torch.Tensor
    max_len: int
    tokens: int


def _cu_of(lengths: list[int], device) -> torch.Tensor:
    kept = [n for n in lengths if n > 0]
    return torch.tensor([0] + kept, dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)


def packed_layout(cu_seqlens: torch.Tensor, total: int, device) -> VarlenLayout:
    """Layout of packed tokens from ``cu_seqlens`` (read on the host once)."""
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != total or any(b < a for a, b in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to the token count {total}, got {bounds}")
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    return VarlenLayout(None, _cu_of(lengths, device), max(lengths, default=0), total)


def padded_layout(attention_mask: torch.Tensor | None, s: int, b: int, device) -> VarlenLayout:
    """Layout of a padded ``[s, b]`` batch: row ``r``'s real tokens (mask 1; all ``s`` without a mask),
    in order, are one sequence; token ``(t, r)`` sits at flat position ``t * b + r``. Holes in a mask
    are fine: a real query sees the real keys before it, as the mask says."""
    if attention_mask is None:  # built on the device: nothing to read back
        t = torch.arange(s, device=device)
        index = (t[None, :] * b + torch.arange(b, device=device)[:, None]).reshape(-1)
        cu = torch.arange(b + 1, dtype=torch.int32, device=device) * s
        return VarlenLayout(index, cu, s, s * b)
    if tuple(attention_mask.shape) != (b, s):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, the batch is [b={b}, s={s}]")
    rows, cols = attention_mask.to(device=device).bool().nonzero(as_tuple=True)  # row-major: row, then position
    lengths = attention_mask.bool().sum(1).tolist()
    return VarlenLayout(cols * b + rows, _cu_of(lengths, device), max(lengths, default=0), rows.numel())


class _LastLayouts:
    """Memo of the layout of the last mask / cu_seqlens tensor seen (weakly held, checked by identity
    and version). Every layer of a forward passes the same tensor, so the host read of its lengths (a
    device sync on CUDA) happens once per forward, not once per layer."""

    def __init__(self) -> None:
        self._entry: tuple | None = None

    def get(self, tensor: torch.Tensor | None, key: tuple, build) -> VarlenLayout:
        if tensor is None:
            return build()
        if self._entry is not None:
            ref, version, old_key, value = self._entry
            if ref() is tensor and version == tensor._version and old_key == key:
                return value
        value = build()
        self._entry = (weakref.ref(tensor), tensor._version, key, value)
        return value


_layouts = _LastLayouts()


def _equal(lay: VarlenLayout) -> bool:
    """Every sequence of the layout has the same length (host values only)."""
    n = lay.cu.numel() - 1
    return n > 0 and lay.tokens == n * lay.max_len


def _unpadded_attention(q, k, v, attention_mask, kernel: str, auto: bool = False) -> torch.Tensor:
    """A padded batch through one varlen call: gather the real tokens, attend, scatter back (padding
    rows 0). ``auto``: the kernel is re-chosen knowing whether the lengths are equal; without a mask
    cuDNN takes the batch as it is (no gather)."""
    s, b, hq, d = q.shape
    if attention_mask is None and s and "cudnn" in (kernel, auto and flash_kernel(q, equal_lengths=True)):
        return dense_attention(q, k, v, True, d ** -0.5, cudnn_backends())
    lay = _layouts.get(attention_mask, ("padded", s, b, q.device),
                       lambda: padded_layout(attention_mask, s, b, q.device))
    if auto:
        kernel = flash_kernel(q, equal_lengths=_equal(lay)) or kernel
    out = q.new_zeros(s * b, hq, d)
    if lay.tokens:
        qu, ku, vu = (x.reshape(s * b, x.shape[2], d).index_select(0, lay.index) for x in (q, k, v))
        att = varlen_attention(qu, ku, vu, lay.cu, lay.cu, lay.max_len, lay.max_len, True, d ** -0.5, kernel)
        out = out.index_copy(0, lay.index, att)
    return out.reshape(s, b, hq * d)


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
        q, k = apply_rotary(q, k, cos, sin)  # one fused kernel per tensor on CUDA (parallel.fused_ops)
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
