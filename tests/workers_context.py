"""Rank bodies for the context-parallel attention and Ulysses unit tests (gloo, CPU)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from parallel.context_attention import context_parallel_attention
from parallel.sequence_layout import plan_sequences
from parallel.ulysses import heads_to_seq, qkv_to_heads


def reference_attention(q, k, v, lengths):
    """Causal attention per sequence with torch's SDPA: q ``[T, hq, d]``, k/v ``[T, hkv, d]``."""
    outs, start = [], 0
    for n in lengths:
        if n:
            qs, ks, vs = (x[start:start + n].transpose(0, 1)[None] for x in (q, k, v))
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)[0].transpose(0, 1))
        start += n
    return torch.cat(outs)


def _local(x, index):
    return torch.where((index >= 0)[:, None, None], x[index.clamp(min=0)], torch.zeros((), dtype=x.dtype))


def ring_case(lengths, hq, hkv, comm, dtype=torch.float64):
    """Max |difference| of output and q/k/v gradients against SDPA on the whole batch."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(11)
    total = sum(lengths)
    q = torch.randn(total, hq, 16, generator=gen, dtype=dtype)
    k = torch.randn(total, hkv, 16, generator=gen, dtype=dtype)
    v = torch.randn(total, hkv, 16, generator=gen, dtype=dtype)
    dout = torch.randn(total, hq, 16, generator=gen, dtype=dtype)
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = reference_attention(*ref_in, lengths)
    ref.backward(dout)

    plan = plan_sequences(lengths, cp=cp, multiple=3)  # multiple=3: local padding exercised
    index = plan.cp_index(rank)
    mine = [_local(x, index).requires_grad_() for x in (q, k, v)]
    out = context_parallel_attention(*mine, plan, dist.group.WORLD, comm=comm)
    out.backward(_local(dout, index))

    def restore(x):
        gathered = [torch.empty_like(x) for _ in range(cp)]
        dist.all_gather(gathered, x.detach().contiguous())
        return plan.restore(torch.stack(gathered))

    pad = index < 0
    tag = (tuple(lengths), hq, hkv, comm, str(dtype))
    return [(*tag, "out", (restore(out) - ref).abs().max().item()),
            (*tag, "dq", (restore(mine[0].grad) - ref_in[0].grad).abs().max().item()),
            (*tag, "dk", (restore(mine[1].grad) - ref_in[1].grad).abs().max().item()),
            (*tag, "dv", (restore(mine[2].grad) - ref_in[2].grad).abs().max().item()),
            (*tag, "padding_out", out[pad].abs().max().item() if bool(pad.any()) else 0.0)]


def ring_suite() -> list[tuple]:
    records = []
    for lengths in ([37], [13, 1, 0, 22, 5], [3, 2]):
        for hq, hkv in ((4, 2), (2, 2)):
            for comm in ("ring", "allgather"):
                records += ring_case(lengths, hq, hkv, comm)
    records += ring_case([29, 6], 4, 1, "ring", torch.float32)
    return records


def ulysses_case(hq, hkv):
    """seq_to_heads then heads_to_seq is the identity; attention on the exchanged heads equals
    attention on the whole sequence; gradients flow back exactly."""
    u, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(5)
    s = 6 * u
    q = torch.randn(s, 1, hq, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(s, 1, hkv, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(s, 1, hkv, 8, generator=gen, dtype=torch.float64)
    dout = torch.randn(s, 1, hq, 8, generator=gen, dtype=torch.float64)
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = reference_attention(*(x[:, 0] for x in ref_in), [s])
    ref.backward(dout[:, 0])
    mine = slice(rank * s // u, (rank + 1) * s // u)
    local = [x[mine].clone().requires_grad_() for x in (q, k, v)]
    qh, kh, vh = qkv_to_heads(*local, dist.group.WORLD)
    out_h = reference_attention(qh[:, 0], kh[:, 0], vh[:, 0], [s])[:, None]
    out = heads_to_seq(out_h, dist.group.WORLD)
    out.backward(dout[mine])
    tag = ("ulysses", hq, hkv, u)
    return [(*tag, "out", (out[:, 0] - ref[mine]).abs().max().item()),
            (*tag, "dq", (local[0].grad - ref_in[0].grad[mine]).abs().max().item()),
            (*tag, "dk", (local[1].grad - ref_in[1].grad[mine]).abs().max().item()),
            (*tag, "dv", (local[2].grad - ref_in[2].grad[mine]).abs().max().item())]


def ulysses_suite() -> list[tuple]:
    u = dist.get_world_size()
    records = []
    for hq, hkv in ((4, 4), (4, 2), (4, 1), (8, 2)):
        if hq % u == 0:
            records += ulysses_case(hq, hkv)
    return records
