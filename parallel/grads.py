"""Make every ``.grad`` final after backward, so a plain ``torch.optim`` step is correct.

Three reductions, each coalesced into one flat all-reduce per group:
  * parameters tagged ``sequence_parallel`` (RMSNorm weights and row-parallel biases under SP) hold
    partial sums over the TP group's sequence shards: summed over TP;
  * packed QKV parameters tagged ``kv_replicas`` (tp > num_kv_heads): the K/V rows of a replicated
    KV head received gradient only from this rank's query heads: summed over the replicas;
  * every parameter, over the data-parallel group: averaged (each DP rank's loss is its own mean)
    or summed (losses already normalized by the global token count).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import nn

from parallel.collectives import group_size


def _all_reduce_coalesced(tensors: list[torch.Tensor], group: Any, scale: float | None = None) -> None:
    if not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    if scale is not None:
        flat.mul_(scale)
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n


def _by_dtype(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Group tensors by dtype so each group flattens into one buffer."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return list(groups.values())


def _kv_replica_sum(params: list[nn.Parameter], tp_group: Any) -> None:
    """Sum the K/V rows' gradients over the ranks that replicate the same KV head.

    Each rank writes its K/V gradient into the slot of its KV head in a ``[kv_heads, ...]`` buffer;
    one all-reduce over TP sums the replicas; each rank reads its slot back. No extra groups needed.
    """
    slots = []
    for p in params:
        q_rows, kv_rows, _, head, num_kv = p.kv_replicas
        kv = p.grad[q_rows:q_rows + 2 * kv_rows]
        buf = torch.zeros((num_kv, *kv.shape), dtype=kv.dtype, device=kv.device)
        buf[head] = kv
        slots.append((p, buf))
    _all_reduce_coalesced([b for _, b in slots], tp_group)
    for p, buf in slots:
        q_rows, kv_rows, _, head, _ = p.kv_replicas
        p.grad[q_rows:q_rows + 2 * kv_rows].copy_(buf[head])


def finalize_grads(params: Iterable[nn.Parameter], *, tp_group: Any = None, dp_group: Any = None,
                   dp_average: bool = True) -> None:
    """Apply the TP (SP and KV-replica) and DP reductions to the ``.grad`` of ``params``.

    ``dp_average``: average over DP (each rank's loss is its own mean) or sum (each rank's loss is
    already divided by the global token count, as in ``forward_backward``).
    """
    params = [p for p in params if p.requires_grad and p.grad is not None]
    if group_size(tp_group) > 1:
        for grads in _by_dtype(p.grad for p in params if getattr(p, "sequence_parallel", False)):
            _all_reduce_coalesced(grads, tp_group)
        _kv_replica_sum([p for p in params if getattr(p, "kv_replicas", None)], tp_group)
    dp = group_size(dp_group)
    if dp > 1:
        for grads in _by_dtype(p.grad for p in params):
            _all_reduce_coalesced(grads, dp_group, scale=1.0 / dp if dp_average else None)
