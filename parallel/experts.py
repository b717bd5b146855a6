"""Expert parallelism: Qwen2-MoE routing, token dispatch over an expert-parallel group, expert compute.

``route`` turns router logits into each token's top-k experts and weights (Qwen2-MoE semantics:
softmax over all experts in fp32, top-k, renormalised only with ``norm_topk_prob``).

A dispatcher runs the experts of one MoE layer for this rank's tokens ``x [T, H]``: every
(token, expert) assignment goes to the EP rank holding that expert (rank r of an EP group of n
holds experts ``[r*E/n, (r+1)*E/n)``, stacked in ``w13 [E/n, 2I, H]`` = per expert ``[gate | up]``
and ``w2 [E/n, H, I]``), the expert output comes back, and the outputs of a token's k experts are
summed with its routing weights. Both dispatchers are drop-less (no capacity limit) and exact:

  ``alltoall``   the per-expert counts are exchanged (one all-to-all of E integers), then the
                 assignments' hidden states, sorted by expert, travel with one all-to-all of
                 variable split sizes, and the results return with the inverse one. Traffic per
                 rank: T*k*H each way.
  ``allgather``  every rank's tokens are all-gathered (padded to the largest count), each rank runs
                 its experts on the tokens routed to them, and the partial outputs are
                 reduce-scattered back. Traffic per rank: n*T*H each way; no count exchange
                 before the data moves.

Expert compute is batched per local expert: assignments are sorted by expert once and each expert
runs two matmuls on its contiguous rows (``torch.nn.functional.grouped_mm`` would fuse them but
on CPU its backward fails and its forward is no faster, measured on torch 2.13). An expert that
receives no token still gets a (zero) gradient, so gradient reductions see the same tensors on
every rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel.collectives import (
    all_gather_dim0,
    gather_from_sequence,
    group_rank,
    group_size,
    reduce_scatter_to_sequence,
)

DISPATCHERS = ("alltoall", "allgather")


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``logits [T, E]`` -> (``weights [T, k]`` in the logits' dtype, ``experts [T, k]``, ``probs [T, E]`` fp32).

    transformers' Qwen2MoeTopKRouter: softmax in fp32 over all experts, then top-k; the k weights
    are divided by their sum only when ``norm_topk_prob``.
    """
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts, probs


def expert_mlp(x: torch.Tensor, counts: list[int], w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """SwiGLU experts on rows grouped by expert: rows ``[sum(counts[:j]), sum(counts[:j+1]))`` go to local expert j."""
    # split/unbind, not x[a:b] / w13[j]: one backward node each that assembles its gradient once
    # (per-expert slicing builds a zero-filled full-size gradient per expert: O(experts^2) memory traffic)
    outs = []
    for rows, w_in, w_out, n in zip(x.split(counts), w13.unbind(0), w2.unbind(0), counts):
        if n:
            gate, up = F.linear(rows, w_in).chunk(2, dim=-1)
            outs.append(F.linear(F.silu(gate) * up, w_out))
    out = torch.cat(outs) if len(outs) > 1 else outs[0] if outs else x.new_zeros((0, w2.shape[1]))
    if len(outs) < len(counts):
        # Idle experts (or no token at all): a zero term keeps every weight and the input in the graph,
        # so every rank's backward produces the same gradient tensors and runs the same collectives
        # (the dispatch all-to-all's backward would otherwise be skipped on a rank that got no token).
        out = out + 0.0 * (w13.sum() + w2.sum() + x.sum())
    return out


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with variable splits along dim 0; backward is the inverse exchange."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def _combine(x: torch.Tensor, y: torch.Tensor, token_of: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Sum each token's expert outputs ``y`` (one row per assignment) scaled by its routing weights."""
    return torch.zeros_like(x).index_add(0, token_of, (y * weights.unsqueeze(-1)).to(x.dtype))


def dispatch_alltoall(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                      w2: torch.Tensor, num_experts: int, group: Any = None) -> torch.Tensor:
    """This rank's MoE output ``[T, H]`` for tokens ``x [T, H]`` routed to ``experts [T, k]`` (see module doc)."""
    n, k = group_size(group), experts.shape[1]
    local = num_experts // n
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # assignments grouped by expert (and so by EP rank)
    token_of = order // k
    counts = torch.bincount(flat, minlength=num_experts)
    sent = x[token_of]
    if n == 1:
        y = expert_mlp(sent, counts.tolist(), w13, w2)
    else:
        recv_counts = torch.empty_like(counts)  # [n, local]: what source s sends to my expert j
        dist.all_to_all_single(recv_counts, counts, group=group)
        recv_counts = recv_counts.view(n, local)
        send_splits = counts.view(n, local).sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        received = _AllToAll.apply(sent, recv_splits, send_splits, group)  # by source, then by expert
        expert_of = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(n), recv_counts.reshape(-1))
        perm = torch.argsort(expert_of, stable=True)  # by expert, then by source
        y_local = expert_mlp(received[perm], recv_counts.sum(0).tolist(), w13, w2)
        y_back = y_local[torch.argsort(perm)]  # back to (source, expert) order
        y = _AllToAll.apply(y_back, send_splits, recv_splits, group)
    return _combine(x, y, token_of, weights.reshape(-1)[order])


def dispatch_allgather(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                       w2: torch.Tensor, num_experts: int, group: Any = None) -> torch.Tensor:
    """Same result as ``dispatch_alltoall`` by all-gathering the tokens of the EP group (see module doc)."""
    n, k = group_size(group), experts.shape[1]
    if n == 1:
        return dispatch_alltoall(x, experts, weights, w13, w2, num_experts)
    local = num_experts // n
    lo = group_rank(group) * local
    t = x.shape[0]
    sizes = all_gather_dim0(torch.tensor([t], device=x.device), group).tolist()
    longest = max(sizes)
    pad = longest - t
    xg = gather_from_sequence(F.pad(x, (0, 0, 0, pad)), group)  # [n * longest, H]; bwd: reduce-scatter
    wg = gather_from_sequence(F.pad(weights, (0, 0, 0, pad)), group)
    eg = all_gather_dim0(F.pad(experts, (0, 0, 0, pad), value=-1), group)  # -1: padding rows, no expert
    flat = eg.reshape(-1)
    mine = torch.nonzero((flat >= lo) & (flat < lo + local)).squeeze(-1)
    mine = mine[torch.argsort(flat[mine], stable=True)]  # my assignments grouped by expert
    counts = torch.bincount(flat[mine] - lo, minlength=local).tolist()
    y = expert_mlp(xg[mine // k], counts, w13, w2)
    partial = torch.zeros_like(xg).index_add(0, mine // k, (y * wg.reshape(-1)[mine].unsqueeze(-1)).to(x.dtype))
    return reduce_scatter_to_sequence(partial, group)[:t]


def dispatch(name: str):
    """The dispatcher function called ``name`` (one of ``DISPATCHERS``)."""
    if name == "alltoall":
        return dispatch_alltoall
    if name == "allgather":
        return dispatch_allgather
    raise ValueError(f"unknown MoE dispatcher {name!r} (choose one of {', '.join(DISPATCHERS)})")
