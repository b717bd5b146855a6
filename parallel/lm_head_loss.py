"""The LM head fused with vocab-parallel cross entropy (and entropy), computed in chunks of tokens.

Full logits are ``[tokens, vocab/tp]`` fp32: 2.5 GB at vocab 151936 and 4096 tokens, and as much
again for their gradient. Here the head's matmul and the loss run over ``chunk_tokens`` tokens at a
time, so at most one chunk's logits exist (``chunk_tokens * vocab/tp`` fp32, plus one more buffer
of that size when entropy is asked for).

Forward keeps, per token, only the log-sum-exp. Backward recomputes each chunk's logits from the
saved hidden states and the weight (one more matmul per chunk than the plain path) and turns them
in place into the softmax gradient. Liger's fused linear cross entropy instead computes the
gradients during the forward; that cannot serve a per-token ``grad_output`` (the weight gradient
``sum_t g_t dL_t/dW`` cannot be rescaled afterwards unless every ``g_t`` is equal, which a
per-token RL loss breaks) and it holds a weight-sized fp32 gradient from each micro-batch's forward
to its backward (GPipe keeps every micro-batch in flight). Recomputing costs ~1/3 more head FLOPs
in training and nothing in a forward-only pass.

Vocabulary parallel (Megatron's cross entropy, with fewer collectives): each rank keeps, per token,
over its own columns only, the max ``m``, ``s = sum exp(x - m)``, ``u = sum exp(x - m) (x - m)``
(entropy only) and the target's logit when the target is in its slice. After all chunks one MAX
and one SUM all-reduce over TP combine them (``M = max m``, ``S = sum s e^(m - M)``):
``lse = M + log S``, ``loss = lse - x_target``, ``entropy = lse - E_p[x] = log S - U / S`` with
``U = sum (u + s (m - M)) e^(m - M)``. Columns past the real vocabulary (padding) are never
computed. Backward needs no collective per chunk: each rank's softmax over its columns is
``exp(x - lse)``.

Hidden states: under sequence parallelism ``hidden`` is this rank's sequence shard; it is
all-gathered here (again in backward, as Megatron's column layers do, so only the shard is saved)
and its gradient reduce-scattered. Plain TP: ``hidden`` is replicated and its gradient, partial
over vocabulary slices, is all-reduced (``copy_to_group``'s backward).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel.collectives import all_gather_dim0, group_size, reduce_scatter_dim0

LOGITS_CHUNK_BYTES = 256 << 20  # default chunk: its fp32 logits take at most this many bytes (441 tokens at
# vocab 151936; smaller chunks cost more passes over the weight gradient, docs/benchmarks.md)
MIN_CHUNK_TOKENS, MAX_CHUNK_TOKENS = 16, 8192


def check_chunk_tokens(value: Any) -> int | None:
    """``value`` if it is a positive integer or None (the default chunk); a one-line ValueError otherwise."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ValueError(f"loss_chunk_tokens={value!r}: must be a positive integer (tokens per chunk of the fused "
                     f"LM-head loss) or None for the default")


def default_chunk_tokens(local_vocab: int) -> int:
    """Tokens per chunk such that one chunk's fp32 logits over ``local_vocab`` columns fit
    ``LOGITS_CHUNK_BYTES`` (between ``MIN_CHUNK_TOKENS`` and ``MAX_CHUNK_TOKENS``)."""
    return max(MIN_CHUNK_TOKENS, min(MAX_CHUNK_TOKENS, LOGITS_CHUNK_BYTES // (4 * max(local_vocab, 1))))


def _chunk_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [c, H] @ weight[V, H].T`` in the model's dtype (the plain head's rounding), as fp32."""
    return F.linear(x, weight).float()


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, vocab_start, valid_columns, group, sequence_parallel, ignore_index,
                chunk, want_entropy):
        tp = group_size(group)
        x = all_gather_dim0(hidden, group) if sequence_parallel and tp > 1 else hidden
        n = x.shape[0]
        w = weight[:valid_columns]
        ignored = target == ignore_index
        local_t = target - vocab_start
        in_slice = (local_t >= 0) & (local_t < valid_columns) & ~ignored
        safe_t = local_t.masked_fill(~in_slice, 0)
        f32 = dict(dtype=torch.float32, device=x.device)
        row_max = torch.full((n,), float("-inf"), **f32)
        sums = torch.zeros(3, n, **f32)  # [sum exp(x - m), target logit, sum exp(x - m) (x - m)]
        if valid_columns > 0:
            for a in range(0, n, chunk):
                b = min(a + chunk, n)
                logits = _chunk_logits(x[a:b], w)
                sums[1, a:b] = logits.gather(-1, safe_t[a:b, None]).squeeze(-1).masked_fill(~in_slice[a:b], 0.0)
                m = logits.max(dim=-1).values
                row_max[a:b] = m
                logits.sub_(m[:, None])
                if want_entropy:
                    p = torch.exp(logits)
                    sums[0, a:b] = p.sum(-1)
                    sums[2, a:b] = torch.bmm(p[:, None, :], logits[:, :, None]).reshape(-1)
                    del p
                else:
                    sums[0, a:b] = logits.exp_().sum(-1)
                del logits
        top = row_max.clone()
        if tp > 1:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        scale = torch.exp(row_max - top)  # 0 on a rank with no real columns (row_max = -inf)
        shift = torch.where(scale > 0, row_max - top, torch.zeros_like(top))
        sums[2].add_(sums[0] * shift).mul_(scale)
        sums[0].mul_(scale)
        if tp > 1:
            dist.all_reduce(sums, group=group)
        lse = top + sums[0].log()
        loss = (lse - sums[1]).masked_fill(ignored, 0.0)
        ctx.save_for_backward(hidden, weight, safe_t, in_slice, ignored, lse)
        ctx.group, ctx.sequence_parallel, ctx.valid_columns, ctx.chunk = group, sequence_parallel, valid_columns, chunk
        if not want_entropy:
            return loss
        entropy = sums[0].log() - sums[2] / sums[0]
        ctx.mark_non_differentiable(entropy)
        return loss, entropy

    @staticmethod
    def backward(ctx, grad_loss, *_):
        hidden, weight, safe_t, in_slice, ignored, lse = ctx.saved_tensors
        group, valid, chunk = ctx.group, ctx.valid_columns, ctx.chunk
        tp = group_size(group)
        gather = ctx.sequence_parallel and tp > 1
        x = all_gather_dim0(hidden, group) if gather else hidden
        w = weight[:valid]
        g = grad_loss.float().masked_fill(ignored, 0.0)
        want_x, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = torch.zeros_like(x) if want_x else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        if valid > 0 and (want_x or want_w):
            fp32 = x.dtype == torch.float32
            for a in range(0, x.shape[0], chunk):
                b = min(a + chunk, x.shape[0])
                if fp32:  # logits - lse in the matmul's output pass
                    grad = torch.addmm(lse[a:b, None].neg(), x[a:b], w.t())
                else:  # the model dtype's logits (the plain head's rounding), then fp32
                    grad = _chunk_logits(x[a:b], w).sub_(lse[a:b, None])
                grad.exp_()  # this rank's columns of the softmax
                rows = torch.arange(b - a, device=grad.device)
                grad[rows, safe_t[a:b]] -= in_slice[a:b].to(grad.dtype)
                scale = g[a:b, None]
                if fp32:  # d loss_t / d logits_t scaled by g_t through the small [c, H] operands
                    if want_x:
                        grad_x[a:b] = grad.matmul(w).mul_(scale)
                    if want_w:
                        grad_w[:valid].addmm_(grad.t(), x[a:b] * scale)  # in place: no weight-sized temporary
                else:
                    grad = grad.mul_(scale).to(x.dtype)
                    if want_x:
                        grad_x[a:b] = grad.matmul(w)
                    if want_w:  # low-precision products, accumulated over chunks in fp32
                        grad_w[:valid].add_(grad.t().matmul(x[a:b]))
                del grad
        if want_x and tp > 1:
            if gather:
                grad_x = reduce_scatter_dim0(grad_x, group)
            else:
                dist.all_reduce(grad_x, group=group)
        if want_w:
            grad_w = grad_w.to(weight.dtype)
        return grad_x, grad_w, None, None, None, None, None, None, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *, vocab_start: int,
                         valid_columns: int, group: Any = None, sequence_parallel: bool = False,
                         ignore_index: int = -100, chunk_tokens: int | None = None, entropy: bool = False):
    """Per-token cross entropy ``[N]`` fp32 of the LM head ``hidden @ weight.T`` against ``target``
    (0 where ``target == ignore_index``), never holding more than one chunk of logits; with
    ``entropy=True`` also the entropy ``[N]`` of each token's predicted distribution (every token,
    targets or not; not differentiable).

    hidden: ``[N, H]`` final-norm hidden states (``[N/tp, H]``, this rank's rows, under
    ``sequence_parallel``: all-gathered over ``group`` along dim 0).
    weight: ``[V_local, H]`` this rank's vocabulary slice of the head, ``valid_columns`` of its rows
    real vocabulary starting at global id ``vocab_start`` (the rest padding).
    target: ``[N]`` global token ids or ``ignore_index``.
    chunk_tokens: tokens per chunk (None: ``default_chunk_tokens(valid_columns)``).
    """
    chunk = check_chunk_tokens(chunk_tokens) or default_chunk_tokens(valid_columns)
    rows = hidden.shape[0] * (group_size(group) if sequence_parallel else 1)
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] or target.shape != (rows,):
        raise ValueError(f"expected hidden [N, H], weight [V, H] and target [N{'*tp' if sequence_parallel else ''}], "
                         f"got {tuple(hidden.shape)}, {tuple(weight.shape)} and {tuple(target.shape)}")
    return _LinearCrossEntropy.apply(hidden, weight, target, vocab_start, valid_columns, group, sequence_parallel,
                                     ignore_index, chunk, entropy)


__all__ = ["LOGITS_CHUNK_BYTES", "check_chunk_tokens", "default_chunk_tokens", "linear_cross_entropy"]
