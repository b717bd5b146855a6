"""Cross entropy over vocabulary-sharded logits, never building full-vocab logits on one rank.

Each rank holds logits for its vocabulary slice ``[vocab_start, vocab_start + V_local)``. The
softmax normaliser and the target logit are combined with three small all-reduces over the TP
group (max, sum of exp, target logit), as Megatron does. Columns that are vocabulary padding are
masked out so they never change the loss.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from parallel.collectives import group_size


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, valid_columns, group, ignore_index):
        # logits [N, V_local] (any float dtype); target [N] global token ids.
        x = logits.float()
        if valid_columns < x.shape[-1]:
            x = x.clone()
            x[:, valid_columns:] = float("-inf")
        tp = group_size(group)
        row_max = x.max(dim=-1).values
        if tp > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        x = x - row_max.unsqueeze(-1)
        ignored = target == ignore_index
        local_t = target - vocab_start
        in_slice = (local_t >= 0) & (local_t < valid_columns) & ~ignored
        safe_t = local_t.masked_fill(~in_slice, 0)
        target_logit = x.gather(-1, safe_t.unsqueeze(-1)).squeeze(-1).masked_fill(~in_slice, 0.0)
        exp = x.exp_()  # x is a fresh fp32 tensor (the subtraction above), safe to reuse
        sum_exp = exp.sum(dim=-1)
        if tp > 1:
            both = torch.stack([target_logit, sum_exp])
            dist.all_reduce(both, group=group)
            target_logit, sum_exp = both[0], both[1]
        loss = (sum_exp.log() - target_logit).masked_fill(ignored, 0.0)
        exp.div_(sum_exp.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(exp, safe_t, in_slice, ignored)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, safe_t, in_slice, ignored = ctx.saved_tensors
        grad = softmax
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, safe_t] -= in_slice.to(grad.dtype)
        grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, vocab_start: int,
                                 valid_columns: int, group: Any = None, ignore_index: int = -100) -> torch.Tensor:
    """Per-token loss ``[N]`` (0 where ``target == ignore_index``).

    logits: ``[N, V_local]`` this rank's vocabulary slice (padding columns included).
    target: ``[N]`` global token ids or ``ignore_index``.
    valid_columns: how many of this rank's columns are real vocabulary (the rest is padding).
    """
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(f"expected logits [N, V] and target [N], got {tuple(logits.shape)} and {tuple(target.shape)}")
    return _VocabParallelCrossEntropy.apply(logits, target, vocab_start, valid_columns, group, ignore_index)
