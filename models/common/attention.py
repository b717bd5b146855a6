"""Causal self-attention kernels: SDPA everywhere, flash-attn (varlen) on CUDA when installed.

Inputs are per-rank heads after RoPE: ``q [s, b, hq, d]``, ``k/v [s, b, hkv, d]`` (GQA: hq is a
multiple of hkv). Output ``[s, b, hq * d]``. Two batch forms:
  * padded ``[s, b]`` with an optional key-padding mask ``attention_mask [b, s]`` (1 = real token);
  * packed (remove-padding): ``b == 1`` and ``cu_seqlens [n + 1]`` marking sequence boundaries in
    the flat token axis; tokens attend only within their own sequence.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

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
