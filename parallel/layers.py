"""Tensor-parallel layers whose parameters hold this rank's shard (vLLM-style packing).

Activations are ``[seq, batch, hidden]``. With sequence parallelism (SP) the tensors between the
layers here are sharded along ``seq`` over the TP group (``[seq/tp, batch, hidden]``); the column
layers all-gather them and the row layers reduce-scatter back, as in Megatron.

Parameter attributes read by ``finalize_grads`` (parallel/grads.py):
  ``sequence_parallel = True``  the gradient is a partial sum over the TP group (SP norms, row bias)
  ``kv_replicas = (rows_q, rows_kv, replicas)``  on packed QKV params when tp > num_kv_heads
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from parallel.collectives import (
    all_gather_dim0,
    all_reduce_sum,
    copy_to_group,
    group_rank,
    group_size,
    reduce_from_group,
    reduce_scatter_dim0,
    reduce_scatter_to_sequence,
)
from parallel.fused_ops import rms_norm
from parallel.sharding import KVHeads, Vocab


class _SequenceGatherLinear(torch.autograd.Function):
    """``linear(all_gather(x), W, b)`` saving only the local sequence shard ``x`` (Megatron's way).

    A plain ``gather -> F.linear`` would save the gathered ``[s, b, in]`` input of every
    column-parallel layer under SP: tp times the activation memory SP exists to save. Backward
    gathers ``x`` again for the weight gradient and reduce-scatters the input gradient.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(all_gather_dim0(x, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_input = reduce_scatter_dim0(grad.matmul(weight), ctx.group) if ctx.needs_input_grad[0] else None
        grad2d = grad.reshape(-1, grad.shape[-1])
        grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:
            total = all_gather_dim0(x, ctx.group)
            grad_weight = grad2d.t().matmul(total.reshape(-1, total.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad2d.sum(0)
        return grad_input, grad_weight, grad_bias, None


def sequence_gather_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           group: Any) -> torch.Tensor:
    """Column-parallel matmul of a sequence-sharded ``x [s/tp, b, in]`` -> ``[s, b, out/tp]`` (see above)."""
    return _SequenceGatherLinear.apply(x, weight, bias, group)


def _partial_fp32(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x W^T`` of bf16/fp16 operands with an fp32 output (products exact in fp32, sums in fp32, no rounding to the
    operands' dtype). CUDA: ``torch.mm(out_dtype=torch.float32)`` (no upcast copy of the weight); where torch lacks
    it, and on CPU (its ``mm.dtype`` kernel is CUDA-only in torch 2.13), the operands are upcast, which on the
    development CPU gives bitwise transformers' one bf16 GEMM once rounded (tests/test_tp_parity.py)."""
    if x.is_cuda and _CUDA_MM_OUT_DTYPE[0]:
        try:
            y = torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32)
            return y.view(*x.shape[:-1], weight.shape[0])
        except torch.OutOfMemoryError:
            raise
        except (TypeError, RuntimeError):  # torch without mm's out_dtype, or a GPU its kernel refuses
            _CUDA_MM_OUT_DTYPE[0] = False
    return F.linear(x.float(), weight.float())


_CUDA_MM_OUT_DTYPE = [True]  # set to False the first time torch.mm(out_dtype=) is refused


class _RowLinearFp32Sum(torch.autograd.Function):
    """``round(sum_tp(x_r W_r^T) + b)`` with the partials, their TP sum and the bias add in fp32 (see
    ``row_parallel_linear``). Backward is the default path's (a row-parallel layer's backward has no partial
    sums: each rank's input and weight gradients are slices of the one-process ones): the incoming gradient in the
    activation dtype, all-gathered under SP, times the bf16 weight; the bias gradient from this rank's rows."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.sequence_parallel, ctx.has_bias = group, sequence_parallel, bias is not None
        y = _partial_fp32(x, weight)
        y = reduce_scatter_dim0(y, group) if sequence_parallel else all_reduce_sum(y, group)
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_bias = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad.sum(dim=tuple(range(grad.dim() - 1)))  # this rank's rows, as ``y + bias`` gives
        if ctx.sequence_parallel:
            grad = all_gather_dim0(grad, ctx.group)
        grad_input = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = grad.reshape(-1, grad.shape[-1]).t().matmul(x.reshape(-1, x.shape[-1]))
        return grad_input, grad_weight, grad_bias, None, None


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group: Any,
                        sequence_parallel: bool, reduce_in_fp32: bool = False) -> torch.Tensor:
    """``sum over the TP group of x_r W_r^T, + b``: all-reduced, or reduce-scattered along the sequence under SP.

    Default: each rank's partial leaves the GEMM in the activation dtype, the sum and the bias add each round again
    (Megatron's and vLLM's numerics). ``reduce_in_fp32`` (``ParallelConfig.tp_reduce_in_fp32``) for bf16/fp16
    activations: the partials in fp32, summed in fp32 (twice the bytes on the wire), the bias added in fp32, one
    rounding: what a single GEMM over the whole input computes, i.e. transformers' one-process numbers. fp32
    activations take the default path (nothing to round: the flag is a no-op there)."""
    if reduce_in_fp32 and x.element_size() < 4:
        return _RowLinearFp32Sum.apply(x, weight, bias, group, sequence_parallel)
    y = F.linear(x, weight)
    y = reduce_scatter_to_sequence(y, group) if sequence_parallel else reduce_from_group(y, group)
    return y + bias if bias is not None else y


def set_tp_reduce_in_fp32(module: nn.Module, enabled: bool) -> int:
    """Set ``reduce_in_fp32`` on every ``RowParallelLinear`` in ``module`` (their LoRA follows its layer); returns
    how many. ``build_model`` calls it once with ``ParallelConfig.tp_reduce_in_fp32``, for every model."""
    layers = [m for m in module.modules() if isinstance(m, RowParallelLinear)]
    for layer in layers:
        layer.reduce_in_fp32 = bool(enabled)
    return len(layers)


def _divide(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what}: {a} is not divisible by {b}")
    return a // b


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` split along its output rows; the output stays split.

    Input ``[s(/tp), b, in]`` (full, or sequence-sharded under SP) -> output ``[s, b, out/tp]``.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, tp_group: Any = None,
                 sequence_parallel: bool = False, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, local_out_features: int | None = None) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.tp_size = group_size(tp_group)
        self.tp_rank = group_rank(tp_group)
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        self.in_features = in_features
        self.out_features = out_features
        local = (local_out_features if local_out_features is not None
                 else _divide(out_features, self.tp_size, "ColumnParallelLinear out_features / tp"))
        self.weight = nn.Parameter(torch.empty(local, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(local, dtype=dtype, device=device)) if bias else None
        self.lora = None  # a parallel.lora.ColumnLoRA when LoRA adapts this layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            y = sequence_gather_linear(x, self.weight, self.bias, self.tp_group)
        else:
            y = F.linear(copy_to_group(x, self.tp_group), self.weight, self.bias)
        return y if self.lora is None else y + self.lora(x)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, local_out={self.weight.shape[0]}, "
                f"tp={self.tp_size}, sp={self.sequence_parallel}")


class QKVParallelLinear(ColumnParallelLinear):
    """Packed ``[q_r | k_r | v_r]`` projection with grouped-query attention.

    KV heads are split over TP when ``kv_heads % tp == 0``; when ``tp % kv_heads == 0`` each rank
    holds one KV head, head ``r // (tp / kv_heads)``, replicated ``tp / kv_heads`` times (vLLM's
    layout); the replicas' gradients are summed by ``finalize_grads``.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, *, bias: bool,
                 tp_group: Any = None, sequence_parallel: bool = False, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        tp = group_size(tp_group)
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.kv_rule = KVHeads(head_dim, num_kv_heads)
        self.kv_replicas = self.kv_rule.replicas(tp)
        self.num_local_heads = _divide(num_heads, tp, "num_attention_heads / tp")
        self.num_local_kv_heads = max(1, num_kv_heads // tp)
        local_out = (self.num_local_heads + 2 * self.num_local_kv_heads) * head_dim
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias=bias, tp_group=tp_group,
                         sequence_parallel=sequence_parallel, dtype=dtype, device=device, local_out_features=local_out)
        if self.kv_replicas > 1:
            q_rows = self.num_local_heads * head_dim
            kv_rows = self.num_local_kv_heads * head_dim
            for p in self.parameters():
                p.kv_replicas = (q_rows, kv_rows, self.kv_replicas, self.tp_rank // self.kv_replicas, num_kv_heads)

    def local_sizes(self) -> tuple[int, int, int]:
        """Rows of q, k, v in this rank's packed shard."""
        q = self.num_local_heads * self.head_dim
        kv = self.num_local_kv_heads * self.head_dim
        return q, kv, kv


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs packed along rows, e.g. ``[gate_r | up_r]``."""

    def __init__(self, in_features: int, out_sizes: Sequence[int], *, bias: bool, tp_group: Any = None,
                 sequence_parallel: bool = False, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        tp = group_size(tp_group)
        self.local_out_sizes = [_divide(o, tp, "MergedColumnParallelLinear output / tp") for o in out_sizes]
        super().__init__(in_features, sum(out_sizes), bias=bias, tp_group=tp_group, sequence_parallel=sequence_parallel,
                         dtype=dtype, device=device, local_out_features=sum(self.local_out_sizes))


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` split along its input columns; partial outputs are summed.

    Input ``[s, b, in/tp]`` -> output ``[s, b, out]`` (all-reduce) or ``[s/tp, b, out]`` under SP
    (reduce-scatter). The bias is whole on every rank and added once, after the reduction (at tp=1, inside
    the GEMM: a separate add and its backward sum cost ~6x the fused call on CPU, measured on the vision tower).
    ``reduce_in_fp32``: the partials summed in fp32 and rounded once (``row_parallel_linear``; set for a whole
    model from ``ParallelConfig.tp_reduce_in_fp32`` by ``set_tp_reduce_in_fp32``).
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, tp_group: Any = None,
                 sequence_parallel: bool = False, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, reduce_in_fp32: bool = False) -> None:
        super().__init__()
        self.reduce_in_fp32 = reduce_in_fp32
        self.tp_group = tp_group
        self.tp_size = group_size(tp_group)
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        self.in_features = in_features
        self.out_features = out_features
        local_in = _divide(in_features, self.tp_size, "RowParallelLinear in_features / tp")
        self.weight = nn.Parameter(torch.empty(out_features, local_in, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        if self.bias is not None and self.sequence_parallel:
            self.bias.sequence_parallel = True
        self.lora = None  # a parallel.lora.RowLoRA when LoRA adapts this layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:  # nothing to reduce: one fused GEMM with the bias (addmm), as nn.Linear computes
            y = F.linear(x, self.weight, self.bias)
        else:
            y = row_parallel_linear(x, self.weight, self.bias, self.tp_group, self.sequence_parallel,
                                    self.reduce_in_fp32)
        return y if self.lora is None else y + self.lora(x, reduce_in_fp32=self.reduce_in_fp32)

    def extra_repr(self) -> str:
        fp32 = ", reduce_in_fp32" if self.reduce_in_fp32 else ""
        return (f"in={self.in_features}, out={self.out_features}, local_in={self.weight.shape[1]}, "
                f"tp={self.tp_size}, sp={self.sequence_parallel}{fp32}")


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (padded vocabulary) are split over TP; lookups outside the slice give 0.

    ``ids [s, b]`` -> ``[s, b, hidden]`` (all-reduce) or ``[s/tp, b, hidden]`` under SP
    (reduce-scatter). Padding rows exist only so every rank holds the same number of rows.
    """

    def __init__(self, vocab_size: int, padded_vocab_size: int, hidden_size: int, *, tp_group: Any = None,
                 sequence_parallel: bool = False, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.tp_size = group_size(tp_group)
        self.tp_rank = group_rank(tp_group)
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        self.vocab_size = vocab_size
        self.padded_vocab_size = padded_vocab_size
        self.rule = Vocab(vocab_size, padded_vocab_size)
        piece = self.rule.piece((vocab_size, hidden_size), self.tp_rank, self.tp_size)
        self.vocab_start, self.vocab_end = piece.start, piece.stop
        self.weight = nn.Parameter(torch.empty(piece.stop - piece.start, hidden_size, dtype=dtype, device=device))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence(out, self.tp_group)
        return reduce_from_group(out, self.tp_group)


class ParallelLMHead(nn.Module):
    """Output projection onto this rank's vocabulary slice: ``[s(/tp), b, h] -> [s, b, V_pad/tp]``.

    May share its weight with a VocabParallelEmbedding (tied embeddings). Columns past the real
    vocabulary are padding; ``valid_columns`` says how many of this rank's columns are real.
    """

    def __init__(self, vocab_size: int, padded_vocab_size: int, hidden_size: int, *, tp_group: Any = None,
                 sequence_parallel: bool = False, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, tied_to: VocabParallelEmbedding | None = None) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.tp_size = group_size(tp_group)
        self.tp_rank = group_rank(tp_group)
        self.sequence_parallel = sequence_parallel and self.tp_size > 1
        self.vocab_size = vocab_size
        self.padded_vocab_size = padded_vocab_size
        piece = Vocab(vocab_size, padded_vocab_size).piece((vocab_size, hidden_size), self.tp_rank, self.tp_size)
        self.vocab_start, self.vocab_end = piece.start, piece.stop
        self.valid_columns = max(0, min(piece.stop, vocab_size) - piece.start)
        self.tied = tied_to is not None
        if tied_to is not None:
            # Not registered as a parameter here: the embedding owns it (one tensor, one gradient).
            self._tied = [tied_to]
        else:
            self.weight = nn.Parameter(torch.empty(piece.stop - piece.start, hidden_size, dtype=dtype, device=device))

    @property
    def shared_weight(self) -> torch.Tensor:
        return self._tied[0].weight if self.tied else self.weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return sequence_gather_linear(h, self.shared_weight, None, self.tp_group)
        return F.linear(copy_to_group(h, self.tp_group), self.shared_weight)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back, as transformers does (``w * (x / rms(x)).to(dtype)``);
    ``parallel.fused_ops.rms_norm`` runs it (Liger's kernel on CUDA where installed, else this torch code).

    Under SP the input is a sequence shard, so the weight gradient is a partial sum: the weight is
    tagged ``sequence_parallel`` and ``finalize_grads`` sums it over the TP group.
    """

    def __init__(self, hidden_size: int, eps: float, *, sequence_parallel: bool = False,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device))
        if sequence_parallel:
            self.weight.sequence_parallel = True

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``norm(x)``; with ``residual``: ``(norm(residual + x), residual + x)``, the decoder's residual
        add fused with the next pre-norm (one kernel on CUDA, see ``parallel.fused_ops``)."""
        out, new_residual = rms_norm(x, self.weight, self.eps, residual)
        return out if residual is None else (out, new_residual)


__all__ = [
    "ColumnParallelLinear",
    "QKVParallelLinear",
    "MergedColumnParallelLinear",
    "RowParallelLinear",
    "row_parallel_linear",
    "set_tp_reduce_in_fp32",
    "VocabParallelEmbedding",
    "ParallelLMHead",
    "RMSNorm",
]
