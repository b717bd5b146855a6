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

Backward in bf16/fp16 on CUDA: each chunk's weight gradient is accumulated by the GEMM itself,
``addmm(grad_w, grad.T, x, out_dtype=float32, beta=1, out=grad_w)`` (cuBLAS reads and writes the
fp32 accumulator in its epilogue), instead of a ``[V, H]`` low-precision product plus a separate
fp32 add per chunk. Where that op is missing (CPU; CUDA torch before it takes an fp32 ``self``), a
one-time probe (``gemm_accumulates_fp32``) falls back to the product-then-add path, which is also
the CPU reference. Chunk size: ``default_chunk_tokens`` (CPU: a 256 MiB logits budget; CUDA: enough
rows for full-rate GEMMs, capped by a fraction of free memory, ``chunk_tokens_for``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel.collectives import all_gather_dim0, group_size, reduce_scatter_dim0

LOGITS_CHUNK_BYTES = 256 << 20  # default chunk on CPU: its fp32 logits take at most this many bytes (441
# tokens at vocab 151936; smaller chunks cost more passes over the weight gradient, docs/benchmarks.md)
MIN_CHUNK_TOKENS, MAX_CHUNK_TOKENS = 16, 8192
CUDA_CHUNK_TOKENS = 4096  # default chunk on CUDA: rows enough for every head GEMM to run at full rate
CUDA_FREE_FRACTION = 0.25  # ... unless one chunk's buffers would take more than this share of free memory
CUDA_ROW_MULTIPLE = 128  # CUDA chunks are a multiple of this many tokens (GEMM tile alignment) when >= it


def check_chunk_tokens(value: Any) -> int | None:
    """``value`` if it is a positive integer or None (the default chunk); a one-line ValueError otherwise."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ValueError(f"loss_chunk_tokens={value!r}: must be a positive integer (tokens per chunk of the fused "
                     f"LM-head loss) or None for the default")


def chunk_bytes_per_token(local_vocab: int, dtype: torch.dtype) -> int:
    """Bytes one token of a chunk takes at the chunk's peak: its logits in fp32 plus a second fp32
    buffer (entropy's probabilities) plus a copy in the model dtype (the head's output before the
    fp32 cast, or the softmax gradient cast back for the backward GEMMs)."""
    return max(local_vocab, 1) * (8 + torch.empty((), dtype=dtype).element_size())


def chunk_tokens_for(free_bytes: int | None, local_vocab: int, dtype: torch.dtype, device_type: str) -> int:
    """The default tokens per chunk, a pure function of the device's free memory (``free_bytes``,
    ignored off CUDA), this rank's vocabulary columns, the model dtype and the device kind.

    CPU (and anything but CUDA): one chunk's fp32 logits fit ``LOGITS_CHUNK_BYTES``, between
    ``MIN_CHUNK_TOKENS`` and ``MAX_CHUNK_TOKENS``. CUDA: ``CUDA_CHUNK_TOKENS`` (so the head's GEMMs
    have enough rows to run at full rate and the weight gradient is passed over few times), capped
    so that one chunk's buffers (``chunk_bytes_per_token``) take at most ``CUDA_FREE_FRACTION`` of
    ``free_bytes``, never below ``MIN_CHUNK_TOKENS``, rounded down to a multiple of ``CUDA_ROW_MULTIPLE``."""
    columns = max(local_vocab, 1)
    if device_type != "cuda" or free_bytes is None:
        return max(MIN_CHUNK_TOKENS, min(MAX_CHUNK_TOKENS, LOGITS_CHUNK_BYTES // (4 * columns)))
    cap = int(max(free_bytes, 0) * CUDA_FREE_FRACTION) // chunk_bytes_per_token(columns, dtype)
    tokens = max(MIN_CHUNK_TOKENS, min(CUDA_CHUNK_TOKENS, cap))
    return tokens - tokens % CUDA_ROW_MULTIPLE if tokens >= CUDA_ROW_MULTIPLE else tokens


def free_device_bytes(device: torch.device) -> int | None:
    """Memory a chunk could use on ``device``: the driver's free bytes plus what PyTorch's caching
    allocator holds but does not use; None off CUDA."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def default_chunk_tokens(local_vocab: int, dtype: torch.dtype = torch.float32,
                         device: torch.device | str | None = None) -> int:
    """Tokens per chunk for ``local_vocab`` columns on ``device`` (default CPU): ``chunk_tokens_for``
    with the device's free memory queried now."""
    device = torch.device(device if device is not None else "cpu")
    return chunk_tokens_for(free_device_bytes(device), local_vocab, dtype, device.type)


_IN_GEMM: dict[tuple[str, int | None, torch.dtype], bool] = {}


def gemm_accumulates_fp32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.addmm(acc, a.T, b, out_dtype=torch.float32, out=acc)`` adds the low-precision
    product into the fp32 ``acc`` in one GEMM on ``device`` (CUDA with bf16/fp16 only: CPU keeps the
    reference path). Probed once per device and dtype on a small case, checked against the exact
    answer; any error (the op missing, an older torch wanting ``acc`` in the input dtype) means no."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    key = (device.type, device.index, dtype)
    if key not in _IN_GEMM:
        try:
            a = torch.arange(6, dtype=torch.float32, device=device).reshape(3, 2)  # used transposed, as grad.T
            b = torch.arange(12, dtype=torch.float32, device=device).reshape(3, 4) - 5
            acc = torch.full((2, 4), 0.5, dtype=torch.float32, device=device)
            want = acc + a.t() @ b  # small integers: exact in any precision
            torch.addmm(acc, a.to(dtype).t(), b.to(dtype), out_dtype=torch.float32, out=acc)
            _IN_GEMM[key] = acc.dtype == torch.float32 and bool(torch.equal(acc, want))
        except (RuntimeError, NotImplementedError, TypeError):
            _IN_GEMM[key] = False
    return _IN_GEMM[key]


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
        grad_x = torch.zeros(x.shape, dtype=x.dtype, device=x.device) if want_x else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        if valid > 0 and (want_x or want_w):
            fp32 = x.dtype == torch.float32
            in_gemm = want_w and not fp32 and gemm_accumulates_fp32(x.device, x.dtype)
            acc = grad_w[:valid] if want_w else None  # rows [0, valid): contiguous
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
                        torch.mm(grad, w, out=grad_x[a:b]).mul_(scale)  # straight into grad_x's rows
                    if want_w:
                        acc.addmm_(grad.t(), x[a:b] * scale)  # in place: no weight-sized temporary
                else:
                    grad = grad.mul_(scale).to(x.dtype)
                    if want_x:
                        torch.mm(grad, w, out=grad_x[a:b])
                    if in_gemm:  # low-precision operands, fp32 accumulation inside the GEMM (beta=1)
                        torch.addmm(acc, grad.t(), x[a:b], out_dtype=torch.float32, out=acc)
                    elif want_w:  # low-precision products, accumulated over chunks in fp32
                        acc.add_(grad.t().matmul(x[a:b]))
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
    chunk_tokens: tokens per chunk (None: ``default_chunk_tokens`` for ``valid_columns`` on
    ``hidden``'s device and dtype).
    """
    chunk = check_chunk_tokens(chunk_tokens) or default_chunk_tokens(valid_columns, hidden.dtype, hidden.device)
    rows = hidden.shape[0] * (group_size(group) if sequence_parallel else 1)
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] or target.shape != (rows,):
        raise ValueError(f"expected hidden [N, H], weight [V, H] and target [N{'*tp' if sequence_parallel else ''}], "
                         f"got {tuple(hidden.shape)}, {tuple(weight.shape)} and {tuple(target.shape)}")
    return _LinearCrossEntropy.apply(hidden, weight, target, vocab_start, valid_columns, group, sequence_parallel,
                                     ignore_index, chunk, entropy)


__all__ = ["LOGITS_CHUNK_BYTES", "check_chunk_tokens", "chunk_bytes_per_token", "chunk_tokens_for",
           "default_chunk_tokens", "gemm_accumulates_fp32", "linear_cross_entropy"]
