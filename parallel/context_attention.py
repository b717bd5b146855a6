"""Context-parallel causal attention over the CP group: ring (P2P) and all-gather variants.

Each CP rank holds the queries, keys and values of its local tokens (``SequencePlan`` layout:
per sequence an early and a late chunk). Attention against another rank's keys is a list of
blocks (``SequencePlan.segments``), each computed by a flash-style kernel that also returns the
log-sum-exp of its scores; partial results are merged with the online-softmax rule
``lse = logaddexp(lse_a, lse_b)``, ``out = out_a * e^(lse_a - lse) + out_b * e^(lse_b - lse)``.

Backward recomputes each block from the saved local q/k/v, the final output and the final
log-sum-exp (flash-attention's backward needs nothing else), so the memory saved for backward per
rank is that of single-rank attention on its own tokens: q, k, v, out and lse, never a score
matrix and never another rank's keys.

* ``ring``: keys/values travel around the ring (step ``t`` computes on the block received at
  ``t - 1`` while block ``t + 1`` is in flight). In backward the key/value gradient accumulators
  travel one step behind their block and arrive at the owner after one last hop. Every exchange
  is one ``batch_isend_irecv`` of a send to the next rank and a receive from the previous one,
  posted in the same order on every rank, so messages match in order even where tags are ignored
  (NCCL) and paired sends/receives cannot block each other.
* ``allgather``: one all-gather of the keys/values, one all-to-all bringing every rank's key/value
  gradient contributions back to their owner (summed there). Simpler; holds all keys/values of
  the sequence at once while the layer runs (not saved for backward: gathered again there).

Kernels (``kernel=``; by default chosen from the tensors):
  * CUDA fp16/bf16 (``varlen_kernels.flash_kernel(need_lse=True)``): a flash varlen kernel - FA3/FA4
    where installed on Hopper/Blackwell, else torch's own - **all blocks of one step in one call**
    (``context_varlen.py``), the forward returning the log-sum-exp and the backward running from the
    final output and log-sum-exp; no Python loop per sequence.
  * everywhere else, block by block (``attend_segments``): on CPU
    ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward (what SDPA itself runs);
    on CUDA in fp32/fp64 an exact matmul/softmax form that materializes each block's score matrix
    transiently (flash kernels take half precision only).
  * ``kernel="reference"`` runs the one-call-per-step path with the exact varlen reference kernel,
    on any device: how CPU tests check that path; ``"torch"`` forces torch's flash kernels
    (``"fa3"``/``"fa4"`` FlashAttention-3/4 through torch's dispatcher),
    ``"segments"`` the block-by-block path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from parallel.collectives import all_gather_dim0, group_rank, group_size
from parallel.context_varlen import attend_step, step_backward, step_calls
from parallel.sequence_layout import Segment, SequencePlan
from parallel.varlen_kernels import acc_dtype, flash_kernel

_KV_TAG, _DKV_TAG = 17, 18


# ---------------------------------------------------------------------- one block
def _expand(x: torch.Tensor, groups: int) -> torch.Tensor:
    """KV heads ``[n, hkv, d]`` -> ``[n, hkv * groups, d]`` (query head h uses KV head h // groups)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _block_forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``q [nq, h, d]``, ``k/v [nk, h, d]`` -> ``out [nq, h, d]``, ``lse [h, nq]`` (fp32)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], 0.0, causal, scale=scale)
        return out[0].transpose(0, 1), lse[0]
    acc = acc_dtype(q)
    scores = torch.einsum("qhd,khd->hqk", q.to(acc), k.to(acc)) * scale
    if causal:
        mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("hqk,khd->qhd", torch.exp(scores - lse[..., None]), v.to(acc))
    return out, lse  # kept in the accumulation dtype for the merge


def _block_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    """Gradients of one block given the *final* out/lse of its query rows (flash backward)."""
    if q.device.type == "cpu":
        t = lambda x: x.transpose(0, 1)[None]  # noqa: E731
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            t(dout), t(q), t(k), t(v), t(out), lse[None], 0.0, causal, scale=scale)
        return dq[0].transpose(0, 1), dk[0].transpose(0, 1), dv[0].transpose(0, 1)
    acc = acc_dtype(q)
    qf, kf, vf, of, df = q.to(acc), k.to(acc), v.to(acc), out.to(acc), dout.to(acc)
    scores = torch.einsum("qhd,khd->hqk", qf, kf) * scale
    if causal:
        mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    p = torch.exp(scores - lse[..., None])
    dv = torch.einsum("hqk,qhd->khd", p, df)
    dp = torch.einsum("qhd,khd->hqk", df, vf)
    delta = (df * of).sum(-1).transpose(0, 1)  # [h, q]
    ds = p * (dp - delta[..., None]) * scale
    dq = torch.einsum("hqk,khd->qhd", ds, kf)
    dk = torch.einsum("hqk,qhd->khd", ds, qf)
    return dq, dk, dv


# ---------------------------------------------------------------------- lists of blocks
def attend_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: list[Segment], scale: float,
                    out: torch.Tensor, lse: torch.Tensor) -> None:
    """Add the blocks ``segments`` of ``q [Lq, hq, d]`` against ``k/v [Lk, hkv, d]`` into the fp32
    accumulators ``out [Lq, hq, d]`` and ``lse [hq, Lq]`` (online softmax; -inf = nothing yet)."""
    groups = q.shape[1] // k.shape[1]
    for s in segments:
        qa, qb, ka, kb = s.q_start, s.q_start + s.q_len, s.k_start, s.k_start + s.k_len
        o, block_lse = _block_forward(q[qa:qb], _expand(k[ka:kb], groups), _expand(v[ka:kb], groups), s.causal, scale)
        old = lse[:, qa:qb]
        new = torch.logaddexp(old, block_lse)
        out[qa:qb] = (out[qa:qb] * torch.exp(old - new).t()[..., None]
                      + o.to(out.dtype) * torch.exp(block_lse - new).t()[..., None])
        lse[:, qa:qb] = new


def segments_backward(dout, q, k, v, out, lse, segments: list[Segment], scale: float, dq: torch.Tensor,
                      dkv: torch.Tensor) -> None:
    """Accumulate the blocks' gradients into ``dq [Lq, hq, d]`` and ``dkv [2, Lk, hkv, d]`` (fp32)."""
    hkv = k.shape[1]
    groups = q.shape[1] // hkv
    for s in segments:
        qa, qb, ka, kb = s.q_start, s.q_start + s.q_len, s.k_start, s.k_start + s.k_len
        gq, gk, gv = _block_backward(dout[qa:qb], q[qa:qb], _expand(k[ka:kb], groups), _expand(v[ka:kb], groups),
                                     out[qa:qb], lse[:, qa:qb].contiguous(), s.causal, scale)
        dq[qa:qb] += gq.to(dq.dtype)
        n = kb - ka
        dkv[0, ka:kb] += gk.to(dkv.dtype).reshape(n, hkv, groups, -1).sum(2)
        dkv[1, ka:kb] += gv.to(dkv.dtype).reshape(n, hkv, groups, -1).sum(2)


def _attend(q, kv, plan: SequencePlan, r: int, src: int, scale: float, out, lse, kernel: str) -> None:
    """Step (r, src) forward: ``kv [2, L, hkv, d]`` is rank ``src``'s keys and values."""
    if kernel == "segments":
        attend_segments(q, kv[0], kv[1], plan.segments(r, src), scale, out, lse)
    else:
        attend_step(q, kv, step_calls(plan, r, src, q.device), scale, out, lse, kernel)


def _attend_backward(dout, q, kv, out, lse, plan: SequencePlan, r: int, src: int, scale: float, dq, dkv,
                     kernel: str) -> None:
    """Step (r, src) backward into ``dq`` and ``dkv [2, L, hkv, d]`` (rank ``src``'s block)."""
    if kernel == "segments":
        segments_backward(dout, q, kv[0], kv[1], out, lse, plan.segments(r, src), scale, dq, dkv)
    else:
        step_backward(dout, q, kv, out, lse, step_calls(plan, r, src, q.device), scale, dq, dkv, kernel)


# ---------------------------------------------------------------------- communication
def _peer(group: Any, rank: int) -> int:
    return dist.get_global_rank(group, rank % group_size(group))


def _shift(send: torch.Tensor, recv: torch.Tensor, group: Any, tag: int) -> list:
    """Start sending ``send`` to the next ring rank and receiving ``recv`` from the previous one
    (one batched pair, the same on every rank)."""
    r = group_rank(group)
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, _peer(group, r + 1), group, tag),
                                   dist.P2POp(dist.irecv, recv, _peer(group, r - 1), group, tag)])


def _wait(works: list) -> None:
    for w in works:
        w.wait()


# ---------------------------------------------------------------------- autograd functions
def _accumulators(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty online-softmax state for ``q [L, h, d]``: ``out`` zeros, ``lse [h, L]`` -inf."""
    out = torch.zeros(q.shape, dtype=acc_dtype(q), device=q.device)
    return out, torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=acc_dtype(q), device=q.device)


def _restore(ctx, dout: torch.Tensor):
    """Backward's view of ``_save``: q, k, v, out, lse, plan, group, scale, contiguous dout, empty dq."""
    q, k, v, out, lse = ctx.saved_tensors
    dq = torch.zeros(q.shape, dtype=acc_dtype(q), device=q.device)
    return q, k, v, out, lse, ctx.plan, ctx.group, ctx.scale, dout.contiguous(), dq


def _save(ctx, q, k, v, out, lse, plan: SequencePlan, group, scale: float, kernel: str) -> torch.Tensor:
    """What backward needs (this rank's q/k/v, the final output and log-sum-exp); returns the output."""
    out = out.to(q.dtype)
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.plan, ctx.group, ctx.scale, ctx.kernel = plan, group, scale, kernel
    return out


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: SequencePlan, group, scale: float, kernel: str):
        n, r = group_size(group), group_rank(group)
        out, lse = _accumulators(q)
        cur = torch.stack([k, v]).contiguous()  # [2, L, hkv, d]: one message per step
        for step in range(n):
            nxt = torch.empty_like(cur) if step < n - 1 else None
            works = _shift(cur, nxt, group, _KV_TAG) if nxt is not None else []
            _attend(q, cur, plan, r, (r - step) % n, scale, out, lse, kernel)
            _wait(works)
            cur = nxt if nxt is not None else cur
        return _save(ctx, q, k, v, out, lse, plan, group, scale, kernel)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, plan, group, scale, dout, dq = _restore(ctx, dout)
        n, r = group_size(group), group_rank(group)
        cur = torch.stack([k, v]).contiguous()
        # incoming: the gradient accumulated so far (by the ranks before us) of the block we hold now
        incoming, dkv_works, sending = None, [], None
        for step in range(n):
            nxt = torch.empty_like(cur) if step < n - 1 else None
            kv_works = _shift(cur, nxt, group, _KV_TAG) if nxt is not None else []
            dkv = torch.zeros((2, *k.shape), dtype=acc_dtype(q), device=k.device)
            _attend_backward(dout, q, cur, out, lse, plan, r, (r - step) % n, scale, dq, dkv, ctx.kernel)
            _wait(dkv_works)  # the previous exchange: its receive is this block's accumulator
            if incoming is not None:
                dkv += incoming
            sending, incoming = dkv, torch.empty_like(dkv)
            dkv_works = _shift(sending, incoming, group, _DKV_TAG)  # on to the block's next holder
            _wait(kv_works)
            cur = nxt if nxt is not None else cur
        _wait(dkv_works)  # after n hops the accumulator received is our own block's gradient
        return dq.to(q.dtype), incoming[0].to(k.dtype), incoming[1].to(v.dtype), None, None, None, None


def _all_gather_kv(k: torch.Tensor, v: torch.Tensor, group: Any) -> torch.Tensor:
    kv = torch.stack([k, v])
    return all_gather_dim0(kv, group).view(group_size(group), *kv.shape)  # [cp, 2, L, hkv, d]


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: SequencePlan, group, scale: float, kernel: str):
        n, r = group_size(group), group_rank(group)
        kv = _all_gather_kv(k, v, group)
        out, lse = _accumulators(q)
        for j in range(n):
            _attend(q, kv[j], plan, r, j, scale, out, lse, kernel)
        return _save(ctx, q, k, v, out, lse, plan, group, scale, kernel)  # local k/v only: gathered again in backward

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, plan, group, scale, dout, dq = _restore(ctx, dout)
        n, r = group_size(group), group_rank(group)
        kv = _all_gather_kv(k, v, group)
        dkv = torch.zeros((n, 2, *k.shape), dtype=acc_dtype(q), device=k.device)
        for j in range(n):
            _attend_backward(dout, q, kv[j], out, lse, plan, r, j, scale, dq, dkv[j], ctx.kernel)
        del kv
        received = torch.empty_like(dkv)
        dist.all_to_all_single(received, dkv, group=group)  # received[j] = rank j's share for my block
        own = received.sum(0)
        return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None, None, None, None


CP_KERNELS = ("segments", "torch", "reference", "fa3", "fa4")


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: SequencePlan, group: Any,
                               comm: str = "ring", scale: float | None = None,
                               kernel: str | None = None) -> torch.Tensor:
    """Causal attention of this CP rank's local tokens against the whole sequences.

    ``q [L, hq, d]``, ``k/v [L, hkv, d]`` (GQA: hq a multiple of hkv), ``L = plan.local_len``;
    returns ``[L, hq, d]`` (zeros at padding). Collective over ``group`` (the CP group, size
    ``plan.cp``): every member calls it with the same plan and kernel. ``kernel``: one of
    ``CP_KERNELS`` (module docstring); None picks a flash kernel where one takes the tensors,
    else ``"segments"``.
    """
    if group_size(group) != plan.cp:
        raise ValueError(f"the plan is for cp={plan.cp} but the group has {group_size(group)} ranks")
    if q.shape[0] != plan.local_len or k.shape[0] != plan.local_len:
        raise ValueError(f"q/k hold {q.shape[0]}/{k.shape[0]} tokens, the plan {plan.local_len} per rank")
    kernel = kernel or flash_kernel(q, need_lse=True) or "segments"
    if kernel not in CP_KERNELS:
        raise ValueError(f"context-parallel attention kernel {kernel!r}: one of {', '.join(CP_KERNELS)} (the "
                         f"blocks need a backward from a given log-sum-exp, which flash_attn keeps private)")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if plan.cp == 1:
        return _SingleRankAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), plan, scale, kernel)
    fn = {"ring": _RingAttention, "allgather": _AllGatherAttention}[comm]
    return fn.apply(q.contiguous(), k.contiguous(), v.contiguous(), plan, group, scale, kernel)


class _SingleRankAttention(torch.autograd.Function):
    """cp == 1 through the same block kernels (a plan of one rank: the early and late halves of
    each sequence as blocks). The model uses ``causal_attention`` at cp == 1; this path lets the
    block kernels and their merge be checked in one process."""

    @staticmethod
    def forward(ctx, q, k, v, plan: SequencePlan, scale: float, kernel: str):
        out, lse = _accumulators(q)
        _attend(q, torch.stack([k, v]), plan, 0, 0, scale, out, lse, kernel)
        return _save(ctx, q, k, v, out, lse, plan, None, scale, kernel)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, plan, _, scale, dout, dq = _restore(ctx, dout)
        dkv = torch.zeros((2, *k.shape), dtype=acc_dtype(q), device=k.device)
        _attend_backward(dout, q, torch.stack([k, v]), out, lse, plan, 0, 0, scale, dq, dkv, ctx.kernel)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None
