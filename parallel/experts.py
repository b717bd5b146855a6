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

Expert compute (``expert_compute``) has two kernels with the same result:

  ``loop``       the reference: assignments sorted by expert once, each local expert runs two
                 ``F.linear`` on its contiguous rows (a Python loop over experts; the row counts
                 come to the host).
  ``grouped``    ``expert_mlp_grouped``: the gate/up and the down projection of all local experts are
                 one ``torch._grouped_mm`` each (``torch.nn.functional.grouped_mm``), the groups
                 given by device-side cumulative row counts, so no count comes to the host; its
                 backward (``_GroupedExperts``) is grouped GEMMs too (input gradient: grouped_mm
                 with the weights; weight gradients: the 2D x 2D form whose groups run along the
                 token dimension), the SwiGLU recomputed from the saved gate/up output (saves the
                 activation's memory). torch's own autograd formula for ``_grouped_mm`` fails on CPU
                 when the incoming gradient is not contiguous (an expanded ``.sum()`` gradient;
                 torch 2.13); this one makes it contiguous and runs on both.

``choose_kernel`` picks ``grouped`` on CUDA for bf16 on sm90/sm100 (where torch runs its CUTLASS
grouped kernel; fp16/fp32 or other GPUs get torch's per-group fallback, no faster than the loop)
when hidden and expert widths are multiples of 16 bytes and the operands 16-byte aligned, and the
loop elsewhere: on CPU the grouped kernel is no faster (tools/bench_moe.py ``--experts-kernel``),
so the CPU default stays the reference. Either can be forced (``kernel=`` of the dispatchers,
``ParallelMoE.experts_kernel``). An expert that receives no token still gets a (zero) gradient
(the loop adds a zero term, the grouped weight gradient of an empty group is zero), so gradient
reductions see the same tensors on every rank.
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
    """SwiGLU experts on rows grouped by expert: rows ``[sum(counts[:j]), sum(counts[:j+1]))`` go to local expert j.

    The reference kernel (``"loop"``): one pair of ``F.linear`` per expert that received rows."""
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


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` (2D x 3D: rows of ``a`` grouped by ``offs``; 2D x 2D: the shared dimension grouped)."""
    return torch._grouped_mm(a, b, offs=offs)


class _GroupedExperts(torch.autograd.Function):
    """SwiGLU experts as two grouped GEMMs; backward is four grouped GEMMs (see module doc).

    ``x [T, H]`` rows grouped by expert, ``offs [E]`` int32 cumulative row ends (``offs[-1] == T``),
    ``w13 [E, 2I, H]``, ``w2 [E, H, I]``. Saves ``x`` and the gate/up output ``h13 [T, 2I]``; the
    activation is recomputed in backward (the same operations as the loop's autograd: ``silu``,
    product, ``silu_backward``), so in fp32 only the GEMMs' summation order can differ from it."""

    @staticmethod
    def forward(ctx, x, offs, w13, w2):
        if x.shape[0] == 0:  # no rows: no kernel call (a grouped GEMM over nothing), zero gradients below
            ctx.save_for_backward(x, offs, w13, w2, x.new_empty((0, w13.shape[1])))
            return x.new_zeros((0, w2.shape[1]))
        h13 = _grouped_mm(x, w13.transpose(1, 2), offs)  # [T, 2I]: rows of expert e times w13[e]^T
        gate, up = h13.chunk(2, dim=-1)
        y = _grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs)  # [T, H]
        ctx.save_for_backward(x, offs, w13, w2, h13)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, offs, w13, w2, h13 = ctx.saved_tensors
        if x.shape[0] == 0:
            return x.new_zeros(x.shape), None, torch.zeros_like(w13), torch.zeros_like(w2)
        grad_y = grad_y.contiguous()
        gate, up = h13.chunk(2, dim=-1)
        silu = F.silu(gate)
        act = silu * up
        grad_act = _grouped_mm(grad_y, w2, offs)  # [T, I]
        # [E, H, I]: per expert grad_y^T @ act over its rows; an expert with no row gets zeros
        grad_w2 = _grouped_mm(grad_y.t(), act, offs)
        grad_h13 = torch.cat([torch.ops.aten.silu_backward(grad_act * up, gate), grad_act * silu], dim=-1)
        grad_x = _grouped_mm(grad_h13, w13, offs) if ctx.needs_input_grad[0] else None  # [T, H]
        grad_w13 = _grouped_mm(grad_h13.t(), x, offs)  # [E, 2I, H]
        if x.is_cuda:
            # An expert with no row is a K = 0 group of the 2D x 2D GEMM: its output block is never
            # written on some CUDA kernels (torch allocates it uninitialized; garbage on B200/sm100,
            # pytorch/pytorch#172439). Zero it on the device (a select, so NaN garbage goes too; no sync).
            idle = (torch.diff(offs, prepend=offs.new_zeros(1)) == 0)[:, None, None]
            grad_w2 = grad_w2.masked_fill_(idle, 0.0)
            grad_w13 = grad_w13.masked_fill_(idle, 0.0)
        return grad_x, None, grad_w13, grad_w2


def expert_offsets(counts: torch.Tensor) -> torch.Tensor:
    """``counts [E]`` (rows per expert, any integer dtype, on the device) -> int32 cumulative ends, on the device."""
    return torch.cumsum(counts, dim=0, dtype=torch.int32)


def expert_mlp_grouped(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """``expert_mlp`` with grouped GEMMs (kernel ``"grouped"``): ``counts`` rows per local expert as a tensor
    on ``x``'s device (or a list), never brought to the host."""
    if not torch.is_tensor(counts):
        counts = torch.tensor(counts, device=x.device)
    return _GroupedExperts.apply(x, expert_offsets(counts), w13, w2)


EXPERT_KERNELS = ("grouped", "loop")


def grouped_supported(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these operands: same floating dtype, contiguous weights, the
    hidden and expert widths multiples of 16 bytes (the kernel's stride rule) and 16-byte aligned data."""
    if not hasattr(torch, "_grouped_mm") or not (x.dtype == w13.dtype == w2.dtype):
        return False
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    size = x.element_size()
    widths = (w13.shape[2], w13.shape[1] // 2, w2.shape[1])  # H, I, H
    return (all(w * size % 16 == 0 for w in widths) and w13.is_contiguous() and w2.is_contiguous()
            and all(t.data_ptr() % 16 == 0 for t in (w13, w2)))


def choose_kernel(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, kernel: str | None = None) -> str:
    """The expert kernel for these operands: ``kernel`` when given (``"grouped"`` refused by name where
    ``torch._grouped_mm`` cannot run it), else ``"grouped"`` on CUDA in bf16 on sm90/sm100 when
    ``grouped_supported``, else the ``"loop"`` reference (see module doc)."""
    if kernel is not None:
        if kernel not in EXPERT_KERNELS:
            raise ValueError(f"unknown experts kernel {kernel!r} (choose one of {', '.join(EXPERT_KERNELS)})")
        if kernel == "grouped" and not grouped_supported(x, w13, w2):
            raise ValueError(f"experts kernel 'grouped' needs torch._grouped_mm operands of one dtype with widths "
                             f"of multiples of 16 bytes: x {x.dtype}, w13 {tuple(w13.shape)} {w13.dtype}, "
                             f"w2 {tuple(w2.shape)} {w2.dtype}")
        return kernel
    if (x.is_cuda and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] in (9, 10)
            and grouped_supported(x, w13, w2)):
        return "grouped"
    return "loop"


def expert_counts(experts: torch.Tensor, num: int) -> torch.Tensor:
    """Assignments per expert (``bincount`` with ``minlength=num``) without a host sync: CUDA's ``bincount``
    reads the largest index on the host; a scatter-add of ones does not (integers: exact in any order)."""
    return torch.zeros(num, dtype=torch.long, device=experts.device).scatter_add_(0, experts, torch.ones_like(experts))


def expert_compute(x: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, kernel: str,
                   host_counts: list[int] | None = None) -> torch.Tensor:
    """Local experts on rows grouped by expert (``counts [E_local]`` on the device) with ``kernel``;
    ``host_counts``: the same counts when already on the host (the loop needs them there)."""
    if kernel == "grouped":
        return expert_mlp_grouped(x, counts, w13, w2)
    return expert_mlp(x, host_counts if host_counts is not None else counts.tolist(), w13, w2)


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
                      w2: torch.Tensor, num_experts: int, group: Any = None, kernel: str | None = None) -> torch.Tensor:
    """This rank's MoE output ``[T, H]`` for tokens ``x [T, H]`` routed to ``experts [T, k]`` (see module doc);
    ``kernel``: the expert kernel (``choose_kernel``; ``None``: chosen for the device and dtype)."""
    n, k = group_size(group), experts.shape[1]
    local = num_experts // n
    kernel = choose_kernel(x, w13, w2, kernel)
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # assignments grouped by expert (and so by EP rank)
    token_of = order // k
    counts = expert_counts(flat, num_experts)
    sent = x[token_of]
    if n == 1:
        y = expert_compute(sent, counts, w13, w2, kernel)  # grouped: no host sync at all
    else:
        recv_counts = torch.empty_like(counts)  # [n, local]: what source s sends to my expert j
        dist.all_to_all_single(recv_counts, counts, group=group)
        recv_counts = recv_counts.view(n, local)
        send_splits = counts.view(n, local).sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        received = _AllToAll.apply(sent, recv_splits, send_splits, group)  # by source, then by expert
        expert_of = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(n), recv_counts.reshape(-1),
                                            output_size=received.shape[0])  # output_size: no host sync
        perm = torch.argsort(expert_of, stable=True)  # by expert, then by source
        y_local = expert_compute(received[perm], recv_counts.sum(0), w13, w2, kernel)
        inverse = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.shape[0], device=perm.device))
        y_back = y_local[inverse]  # back to (source, expert) order (inverse permutation: no second sort)
        y = _AllToAll.apply(y_back, send_splits, recv_splits, group)
    return _combine(x, y, token_of, weights.reshape(-1)[order])


def dispatch_allgather(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                       w2: torch.Tensor, num_experts: int, group: Any = None,
                       kernel: str | None = None) -> torch.Tensor:
    """Same result as ``dispatch_alltoall`` by all-gathering the tokens of the EP group (see module doc)."""
    n, k = group_size(group), experts.shape[1]
    if n == 1:
        return dispatch_alltoall(x, experts, weights, w13, w2, num_experts, kernel=kernel)
    kernel = choose_kernel(x, w13, w2, kernel)
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
    counts = expert_counts(flat[mine] - lo, local)
    y = expert_compute(xg[mine // k], counts, w13, w2, kernel)
    partial = torch.zeros_like(xg).index_add(0, mine // k, (y * wg.reshape(-1)[mine].unsqueeze(-1)).to(x.dtype))
    return reduce_scatter_to_sequence(partial, group)[:t]


def dispatch(name: str):
    """The dispatcher function called ``name`` (one of ``DISPATCHERS``)."""
    if name == "alltoall":
        return dispatch_alltoall
    if name == "allgather":
        return dispatch_allgather
    raise ValueError(f"unknown MoE dispatcher {name!r} (choose one of {', '.join(DISPATCHERS)})")
