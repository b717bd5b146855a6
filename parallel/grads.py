"""Make every ``.grad`` final after backward, so a plain ``torch.optim`` step is correct.

Three reductions, each coalesced into one flat all-reduce per group:
  * parameters tagged ``sequence_parallel`` (RMSNorm weights and row-parallel biases under SP) hold
    partial sums over the TP group's sequence shards: summed over TP;
  * packed QKV parameters tagged ``kv_replicas`` (tp > num_kv_heads): the K/V rows of a replicated
    KV head received gradient only from this rank's query heads: summed over the replicas;
  * every parameter, over the replica group (the dp, cp and ulysses ranks holding the same
    parameters; for experts split over EP, tagged ``expert_parallel``, the expert-data-parallel
    group: the ranks holding the same experts): summed, then scaled by ``replica_scale``
    (``1/dp`` when each DP rank's loss is its own mean; None when losses are already normalized by
    the global token count). cp/ulysses
    ranks saw different tokens of the same sequences, so their gradients are always summed.

Under FSDP2 the replica reduction already happened in its reduce-scatter and each ``.grad`` is a
DTensor holding rows ``[offset, offset + n)`` of the gradient (dim-0 sharding); the TP reductions
apply to those local rows (every TP rank of a replica slot holds the same rows).
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


def local_rows(grad: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The locally held gradient and the global row its first row is (FSDP2 dim-0 shards, or whole)."""
    to_local = getattr(grad, "to_local", None)
    if to_local is None:
        return grad, 0
    local = to_local()
    mesh = grad.device_mesh
    rows = grad.shape[0]
    per = -(-rows // mesh.size())  # torch.chunk sizes: FSDP2's Shard(0)
    return local, min(per * mesh.get_local_rank(), rows)


def _kv_replica_sum(params: list[nn.Parameter], tp_group: Any) -> None:
    """Sum the K/V rows' gradients over the ranks that replicate the same KV head.

    Each rank writes its K/V gradient rows into the slot of its KV head in a ``[kv_heads, ...]``
    buffer; one all-reduce over TP sums the replicas; each rank reads its slot back. No extra groups.
    """
    slots = []
    for p in params:
        q_rows, kv_rows, _, head, num_kv = p.kv_replicas
        grad, offset = local_rows(p.grad)
        lo, hi = max(q_rows, offset), min(q_rows + 2 * kv_rows, offset + grad.shape[0])
        buf = torch.zeros((num_kv, 2 * kv_rows, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        if hi > lo:
            buf[head, lo - q_rows:hi - q_rows] = grad[lo - offset:hi - offset]
        slots.append((grad, offset, lo, hi, buf, head, q_rows))
    _all_reduce_coalesced([s[4] for s in slots], tp_group)
    for grad, offset, lo, hi, buf, head, q_rows in slots:
        if hi > lo:
            grad[lo - offset:hi - offset].copy_(buf[head, lo - q_rows:hi - q_rows])


def finalize_grads(params: Iterable[nn.Parameter], *, tp_group: Any = None, replica_group: Any = None,
                   replica_scale: float | None = None, replicas_reduced: bool = False,
                   expert_replica_group: Any = None) -> None:
    """Apply the TP (SP and KV-replica) and replica (dp/cp/ulysses) reductions to ``.grad``.

    ``replicas_reduced``: the replica reduction was already done (FSDP2's reduce-scatter).
    ``expert_replica_group``: where parameters tagged ``expert_parallel`` are reduced instead of
    ``replica_group`` (their EP group already summed the token contributions of its members).
    """
    params = [p for p in params if p.requires_grad and p.grad is not None]
    if group_size(tp_group) > 1:
        for grads in _by_dtype(local_rows(p.grad)[0] for p in params if getattr(p, "sequence_parallel", False)):
            _all_reduce_coalesced(grads, tp_group)
        _kv_replica_sum([p for p in params if getattr(p, "kv_replicas", None)], tp_group)
    if replicas_reduced:
        return
    experts = [p for p in params if getattr(p, "expert_parallel", False)]
    dense = [p for p in params if not getattr(p, "expert_parallel", False)]
    for group, members in ((replica_group, dense), (expert_replica_group, experts)):
        if group_size(group) > 1:
            for grads in _by_dtype(p.grad for p in members):
                _all_reduce_coalesced(grads, group, scale=replica_scale)
        elif replica_scale is not None and replica_scale != 1.0:
            for p in members:  # one holder (e.g. dp=ep: the EP group was the whole DP): only the scaling
                p.grad.mul_(replica_scale)
