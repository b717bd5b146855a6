"""Ulysses sequence parallelism: all-to-all between a sequence split and a head split.

Outside attention each Ulysses rank holds ``1/u`` of the tokens with all (TP-local) heads; for
attention one all-to-all gives each rank all tokens of ``1/u`` of the heads, and one more brings
the attention output back. Both are autograd functions whose backward is the opposite exchange.

  seq_to_heads   [s, b, H, d] -> [s*u, b, H/u, d]    (rank i gets head group i of every rank's tokens)
  heads_to_seq   [S, b, h, d] -> [S/u, b, h*u, d]    (the inverse)

Queries, keys and values travel in one all-to-all (``qkv_to_heads``). Grouped-query attention
with fewer KV heads than Ulysses ranks repeats each KV head ``u / kv_heads`` times first, so rank
``i`` gets KV head ``i // (u / kv_heads)`` - the one its query heads use; autograd sums the
repeats' gradients.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from parallel.collectives import group_size


def _seq_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    u = group_size(group)
    s, b, h, d = x.shape
    send = x.reshape(s, b, u, h // u, d).permute(2, 0, 1, 3, 4).contiguous()  # [u(dest), s, b, h/u, d]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[i] = rank i's tokens, my head group
    return recv.reshape(u * s, b, h // u, d)


def _heads_to_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    u = group_size(group)
    s, b, h, d = x.shape
    send = x.reshape(u, s // u, b, h, d).contiguous()  # [u(dest): that rank's tokens, ...]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[i] = head group i of my tokens
    return recv.permute(1, 2, 0, 3, 4).reshape(s // u, b, u * h, d)


class _Exchange(torch.autograd.Function):
    """``to_heads``: seq -> heads, else heads -> seq; backward is the opposite exchange."""

    @staticmethod
    def forward(ctx, x, group, to_heads: bool):
        ctx.group, ctx.to_heads = group, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, group)

    @staticmethod
    def backward(ctx, grad):
        return (_heads_to_seq if ctx.to_heads else _seq_to_heads)(grad.contiguous(), ctx.group), None, None


def seq_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``[s, b, H, d]`` (my tokens, all heads) -> ``[s*u, b, H/u, d]`` (all tokens, my heads)."""
    if group_size(group) == 1:
        return x
    if x.shape[2] % group_size(group):
        raise ValueError(f"{x.shape[2]} heads cannot be split over {group_size(group)} Ulysses ranks")
    return _Exchange.apply(x, group, True)


def heads_to_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``[S, b, h, d]`` (all tokens, my heads) -> ``[S/u, b, h*u, d]`` (my tokens, all heads)."""
    if group_size(group) == 1:
        return x
    if x.shape[0] % group_size(group):
        raise ValueError(f"{x.shape[0]} tokens cannot be split over {group_size(group)} Ulysses ranks")
    return _Exchange.apply(x, group, False)


def kv_repeats(num_kv_heads: int, ulysses: int) -> int:
    """How often each (TP-local) KV head is repeated so the Ulysses ranks can split them."""
    if num_kv_heads % ulysses == 0:
        return 1
    if ulysses % num_kv_heads == 0:
        return ulysses // num_kv_heads
    raise ValueError(f"{num_kv_heads} KV heads and ulysses={ulysses}: one must divide the other")


def qkv_to_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Any):
    """One all-to-all for q ``[s, b, Hq, d]`` and k/v ``[s, b, Hkv, d]``: returns this rank's head
    group of each over all tokens: ``[s*u, b, Hq/u, d]`` and ``[s*u, b, max(Hkv/u, 1), d]``."""
    u = group_size(group)
    if u == 1:
        return q, k, v
    rep = kv_repeats(k.shape[2], u)
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    s, b, hq, d = q.shape
    hk = k.shape[2]
    # Per destination rank, its query heads then its key heads then its value heads.
    packed = torch.cat([q.reshape(s, b, u, hq // u, d), k.reshape(s, b, u, hk // u, d),
                        v.reshape(s, b, u, hk // u, d)], dim=3).reshape(s, b, u * (hq + 2 * hk) // u, d)
    out = seq_to_heads(packed, group)
    return out.split([hq // u, hk // u, hk // u], dim=2)
