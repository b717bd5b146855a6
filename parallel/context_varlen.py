"""Context-parallel attention blocks as varlen kernel calls: all blocks of one ring step in one call.

A step is the attention of query rank ``r``'s local tokens against key rank ``src``'s
(``SequencePlan.segments(r, src)``: per sequence, chunk pairs that are fully visible or causal).
Each block becomes one varlen "sequence": its query rows and key rows are gathered into packed
buffers (``StepCall.q_rows`` / ``k_rows``), one ``varlen_forward`` runs them all, and the result is
merged into the fp32 accumulators with the online-softmax rule; backward runs one ``varlen_backward``
from the final output and log-sum-exp and adds the gradients back by the same rows.

One call needs one ``causal`` flag. Off the diagonal (``r != src``) every block is fully visible.
On the diagonal a sequence has three blocks, early/early (causal), late/early (full) and late/late
(causal); the last two share their queries and their keys are contiguous (the rank's early chunk,
then its late chunk), so they are one block of the late queries against both chunks under flash's
**bottom-right** causal mask: late query ``i`` sees all ``ka`` early keys and late keys ``0..i``,
i.e. key ``j <= i + ka``, exactly what the two blocks together see. So every step is one call, and
each query row appears at most once per call (the merge writes rows by index).

The calls of every (r, src) are built once per plan and device (the plan is the same for every layer
and for backward) and kept in the plan's memo.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from parallel.sequence_layout import Segment, SequencePlan
from parallel.varlen_kernels import varlen_backward, varlen_forward


class Block(NamedTuple):
    """Queries ``[q_start, q_start + q_len)`` against keys ``[k_start, k_start + k_len)``; ``causal``:
    bottom-right aligned (query ``i`` sees key ``j <= i + k_len - q_len``)."""

    q_start: int
    q_len: int
    k_start: int
    k_len: int
    causal: bool


class StepCall(NamedTuple):
    """One varlen call: block ``i`` is packed queries ``cu_q[i]:cu_q[i+1]`` (local rows ``q_rows``)
    against packed keys ``cu_k[i]:cu_k[i+1]`` (local rows ``k_rows``). Rows are a slice where they
    are one contiguous run, else a long tensor on the device."""

    q_rows: slice | torch.Tensor
    k_rows: slice | torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    causal: bool


def merge_blocks(segments: list[Segment]) -> list[Block]:
    """The plan's segments as varlen blocks: runs of segments with the same queries and contiguous
    keys become one block; a causal segment (top-left, square) may only end such a run, and then the
    whole run is one bottom-right causal block."""
    blocks: list[Block] = []
    for s in segments:
        last = blocks[-1] if blocks else None
        if (last is not None and (last.q_start, last.q_len) == (s.q_start, s.q_len)
                and last.k_start + last.k_len == s.k_start and not last.causal):
            blocks[-1] = Block(s.q_start, s.q_len, last.k_start, last.k_len + s.k_len, s.causal)
        else:
            blocks.append(Block(s.q_start, s.q_len, s.k_start, s.k_len, s.causal))
        if s.causal and s.q_len != s.k_len:
            raise ValueError(f"a causal segment must be square (a chunk against itself), got {s}")
    return blocks


def _rows(ranges: list[tuple[int, int]], device) -> slice | torch.Tensor:
    if all(a == b for (_, a), (b, _) in zip(ranges[:-1], ranges[1:])):
        return slice(ranges[0][0], ranges[-1][1])
    return torch.cat([torch.arange(a, b) for a, b in ranges]).to(device)


def _call(blocks: list[Block], causal: bool, device) -> StepCall:
    q_lens, k_lens = [b.q_len for b in blocks], [b.k_len for b in blocks]
    cu = lambda lens: torch.tensor([0] + lens).cumsum(0).to(device=device, dtype=torch.int32)  # noqa: E731
    return StepCall(_rows([(b.q_start, b.q_start + b.q_len) for b in blocks], device),
                    _rows([(b.k_start, b.k_start + b.k_len) for b in blocks], device),
                    cu(q_lens), cu(k_lens), max(q_lens), max(k_lens), causal)


def step_calls(plan: SequencePlan, q_rank: int, kv_rank: int, device) -> tuple[StepCall, ...]:
    """The varlen calls of step (``q_rank``, ``kv_rank``): one per causal flag present (one for
    every plan ``plan_sequences`` makes; none when the ranks share no visible block)."""
    key = ("varlen_calls", q_rank, kv_rank, str(device))
    if key not in plan._memo:
        blocks = merge_blocks(plan.segments(q_rank, kv_rank))
        calls = []
        for causal in (False, True):
            mine = [b for b in blocks if b.causal == causal]
            rows = sorted((b.q_start, b.q_start + b.q_len) for b in mine)
            if any(a < prev_end for (_, prev_end), (a, _) in zip(rows[:-1], rows[1:])):
                raise ValueError(f"step ({q_rank}, {kv_rank}): a query row is in two blocks of one call")
            if mine:
                calls.append(_call(mine, causal, device))
        plan._memo[key] = tuple(calls)
    return plan._memo[key]


def attend_step(q: torch.Tensor, kv: torch.Tensor, calls: tuple[StepCall, ...], scale: float, out: torch.Tensor,
                lse: torch.Tensor, kernel: str) -> None:
    """Add step ``calls`` of ``q [Lq, hq, d]`` against ``kv [2, Lk, hkv, d]`` into the accumulators
    ``out [Lq, hq, d]`` and ``lse [hq, Lq]`` (online softmax; -inf = nothing yet)."""
    for c in calls:
        kvs = kv[:, c.k_rows]
        o, block_lse = varlen_forward(q[c.q_rows], kvs[0], kvs[1], c.cu_q, c.cu_k, c.max_q, c.max_k, c.causal,
                                      scale, kernel)
        old = lse[:, c.q_rows]
        new = torch.logaddexp(old, block_lse.to(lse.dtype))
        out[c.q_rows] = (out[c.q_rows] * torch.exp(old - new).t()[..., None]
                         + o.to(out.dtype) * torch.exp(block_lse - new).t()[..., None])
        lse[:, c.q_rows] = new


def step_backward(dout: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  calls: tuple[StepCall, ...], scale: float, dq: torch.Tensor, dkv: torch.Tensor, kernel: str) -> None:
    """Accumulate step ``calls``' gradients into ``dq [Lq, hq, d]`` and ``dkv [2, Lk, hkv, d]`` (fp32),
    from the final ``out`` (q's dtype) and ``lse [hq, Lq]``."""
    for c in calls:
        kvs = kv[:, c.k_rows]
        gq, gk, gv = varlen_backward(dout[c.q_rows], q[c.q_rows], kvs[0], kvs[1], out[c.q_rows],
                                     lse[:, c.q_rows].contiguous(), c.cu_q, c.cu_k, c.max_q, c.max_k, c.causal,
                                     scale, kernel)
        if isinstance(c.q_rows, slice):
            dq[c.q_rows] += gq.to(dq.dtype)
        else:
            dq.index_add_(0, c.q_rows, gq.to(dq.dtype))
        gkv = torch.stack([gk, gv]).to(dkv.dtype)
        if isinstance(c.k_rows, slice):
            dkv[:, c.k_rows] += gkv
        else:
            dkv.index_add_(1, c.k_rows, gkv)
