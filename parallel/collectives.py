"""Autograd-aware collectives over a process group (Megatron's f/g operators and their SP forms).

Each function is the identity when the group is None or has one rank, so single-process models
pay nothing. Sequence functions split/gather along dim 0 (activations are ``[seq, batch, hidden]``).

  copy_to_group                fwd: identity          bwd: all-reduce        (Megatron "f")
  reduce_from_group            fwd: all-reduce        bwd: identity          (Megatron "g")
  scatter_to_sequence          fwd: keep own chunk    bwd: all-gather
  gather_from_sequence         fwd: all-gather        bwd: reduce-scatter    (input of column-parallel under SP)
  reduce_scatter_to_sequence   fwd: reduce-scatter    bwd: all-gather        (output of row-parallel under SP)
  gather_last_dim              fwd: all-gather        bwd: keep own chunk    (gather vocab-sharded logits)
  gather_for_replicas          fwd: all-gather dim 0  bwd: keep own chunk    (sequence-split outputs that every
                                                                              rank then uses identically)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def group_size(group: Any) -> int:
    """Ranks in ``group``; 1 for None (no group means a single rank)."""
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: Any) -> int:
    """This rank's index in ``group``; 0 for None."""
    return 0 if group is None else dist.get_rank(group)


# torch >= 2.12 names the tensor-in/tensor-out collectives *_single; older releases *_into_tensor/*_tensor.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_reduce_sum(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Plain (no autograd) all-reduce: the sum over ranks of ``x``, in place (``x`` made contiguous first)."""
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x



def all_gather_dim0(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Plain (no autograd) all-gather concatenating every rank's ``x`` along dim 0."""
    n = group_size(group)
    x = x.contiguous()
    out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x, group=group)
    return out


def gather_shards(x: torch.Tensor, group: Any) -> list[torch.Tensor]:
    """Plain (no autograd) all-gather: every rank's ``x`` as a list in rank order (``[x]`` alone for a
    group of one, no copy); used to merge TP shards back into full tensors."""
    n = group_size(group)
    if n == 1:
        return [x]
    x = x.contiguous()
    out = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(out, x, group=group)
    return out


def reduce_scatter_dim0(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Plain (no autograd) reduce-scatter: the sum over ranks of ``x``, this rank's dim-0 chunk."""
    n = group_size(group)
    if x.shape[0] % n:
        raise ValueError(f"reduce-scatter along dim 0: size {x.shape[0]} is not divisible by group size {n}")
    x = x.contiguous()
    out = torch.empty((x.shape[0] // n, *x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, x, group=group)
    return out


def _own_chunk(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    n = group_size(group)
    if x.shape[dim] % n:
        raise ValueError(f"split along dim {dim}: size {x.shape[dim]} is not divisible by group size {n}")
    return x.chunk(n, dim=dim)[group_rank(group)].contiguous()


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_sum(grad, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_sum(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _own_chunk(x, group, 0)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim0(grad, ctx.group), None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_dim0(grad, ctx.group), None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim0(grad, ctx.group), None


class _GatherKeepOwnGrad(torch.autograd.Function):
    """All-gather along ``dim``; backward keeps this rank's chunk (every rank uses the result alike)."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        if dim == 0:
            return all_gather_dim0(x, group)
        return all_gather_dim0(x.movedim(dim, 0), group).movedim(0, dim).contiguous()

    @staticmethod
    def backward(ctx, grad):
        return _own_chunk(grad, ctx.group, ctx.dim % grad.dim()), None, None


def _wrap(fn: type[torch.autograd.Function]):
    def apply(x: torch.Tensor, group: Any) -> torch.Tensor:
        if group_size(group) == 1:
            return x
        return fn.apply(x, group)

    apply.__doc__ = fn.__name__
    return apply


copy_to_group = _wrap(_CopyToGroup)
reduce_from_group = _wrap(_ReduceFromGroup)
scatter_to_sequence = _wrap(_ScatterToSequence)
gather_from_sequence = _wrap(_GatherFromSequence)
reduce_scatter_to_sequence = _wrap(_ReduceScatterToSequence)


def gather_last_dim(x: torch.Tensor, group: Any) -> torch.Tensor:
    """fwd: all-gather along the last dim; bwd: keep own chunk."""
    return x if group_size(group) == 1 else _GatherKeepOwnGrad.apply(x, group, -1)


def gather_for_replicas(x: torch.Tensor, group: Any) -> torch.Tensor:
    """fwd: all-gather along dim 0; bwd: keep own chunk."""
    return x if group_size(group) == 1 else _GatherKeepOwnGrad.apply(x, group, 0)
