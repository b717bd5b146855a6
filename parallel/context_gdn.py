"""The gated delta rule and its causal conv across a context-parallel sequence split, exactly.

Under CP (``sequence_layout.py``) a CP rank holds, per sequence, two contiguous chunks (``r`` and
``2*cp - 1 - r`` of ``2*cp``), any of them possibly empty or shorter than the conv kernel; its local
tokens are those chunks in order (early, late per sequence), then padding. Both recurrences of a
Gated DeltaNet layer need what came before a chunk, which other ranks hold:

* **conv halo**: a chunk's first ``K-1`` tokens read the ``K-1`` tokens before the chunk in its
  sequence. Each of those is among the last ``K-1`` tokens of its own chunk, so every rank
  all-gathers the last ``K-1`` (pre-conv) rows of each of its chunks (``[2 n_seq, K-1, C]``, fixed
  shape) and builds each chunk's halo from them (zeros before the sequence's start).
* **state**: the delta rule is affine in the state, token by token ``S <- A_t S + b_t`` with
  ``A_t = exp(g_t) (I - beta_t k_t k_t^T)`` and ``b_t = beta_t k_t v_t^T``, so a chunk is
  ``S_out = P S_in + D`` (``P [dk, dk]``, ``D [dk, dv]`` per head). Columns of the state evolve
  independently, so one kernel run over the chunk with the state widened to ``[dk, dk + dv]``,
  starting at ``[I | 0]`` with values ``[0 | v]``, ends at ``[P | D]`` and outputs
  ``[R | O0]``: ``O0`` the chunk's outputs from a zero state and ``R`` (``[T, dk]``) such that
  the true output is ``O0 + R S_in``. Every rank all-gathers its ``[P | D]`` (``[2 n_seq, H, dk,
  dk + dv]``), composes the maps of the chunks before each of its own in sequence order (at most
  ``2 cp - 1`` small matmuls per sequence, batched over sequences) and adds ``R S_in``.

Both all-gathers are ``gather_from_sequence`` (backward: reduce-scatter), so gradients flow to the
ranks that own the halo rows and chunk maps. The pure pieces (``chunk_table``, ``conv_with_tails``,
``incoming_states``, ``chunk_maps``/``apply_states``) take gathered tensors as arguments, so a
single process can check the composition by simulating every rank (tests/test_gated_delta_rule_cp).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from parallel.collectives import gather_from_sequence, group_size
from parallel.gated_delta_rule import causal_conv1d, gated_delta_rule
from parallel.sequence_layout import SequencePlan

__all__ = ["ChunkTable", "apply_states", "chunk_maps", "chunk_table", "context_conv", "context_delta_rule",
           "conv_with_tails", "incoming_states", "local_tails"]


@dataclass(frozen=True)
class ChunkTable:
    """One CP rank's local chunks: slot ``2i`` / ``2i+1`` = early / late chunk of sequence ``i``.

    ``starts``/``lengths``: local offset and size of each slot (then one tail slot: the padding);
    ``cu``: local cu_seqlens over the slots (tail included); ``tail_rows [2n, K-1]``: local row of each
    slot's last ``K-1`` tokens (-1: the chunk is shorter); ``halo [2n, K-1]``: row, in the all-gathered
    tails ``[cp * 2n * (K-1)]`` + one zero row, of the ``K-1`` tokens before each slot (the zero row
    before the sequence's start)."""

    starts: tuple[int, ...]
    lengths: tuple[int, ...]
    cu: torch.Tensor
    tail_rows: torch.Tensor
    halo: torch.Tensor


def _slots(plan: SequencePlan, rank: int) -> list[tuple[int, int, int]]:
    """``(chunk, global start, global end)`` of each of ``rank``'s slots, in local order."""
    out = []
    for i in range(len(plan.lengths)):
        for chunk in (rank, 2 * plan.cp - 1 - rank):
            out.append((chunk, *plan.chunk_range(i, chunk)))
    return out


def chunk_table(plan: SequencePlan, rank: int, kernel: int) -> ChunkTable:
    """``rank``'s ``ChunkTable`` for a conv of ``kernel`` taps (memoised on the plan)."""
    key = ("gdn_chunks", rank, kernel)
    if key in plan._memo:
        return plan._memo[key]
    h = kernel - 1
    n_slots = 2 * len(plan.lengths)
    owner = {}  # global token -> row in the gathered tails
    for r in range(plan.cp):
        for slot, (_, a, b) in enumerate(_slots(plan, r)):
            for m in range(h):
                token = b - h + m
                if token >= a:
                    owner[token] = (r * n_slots + slot) * h + m
    zero_row = plan.cp * n_slots * h
    starts, lengths, tail_rows, halo = [], [], [], []
    offset = 0
    for slot, (_, a, b) in enumerate(_slots(plan, rank)):
        seq_start = plan.starts[slot // 2]
        starts.append(offset)
        lengths.append(b - a)
        tail_rows.append([offset + (b - a) - h + m if (b - a) - h + m >= 0 else -1 for m in range(h)])
        halo.append([owner[a - h + m] if a - h + m >= seq_start else zero_row for m in range(h)])
        offset += b - a
    starts.append(offset)
    lengths.append(plan.local_len - offset)
    cu = torch.tensor([0, *lengths], dtype=torch.long).cumsum(0)
    table = ChunkTable(tuple(starts), tuple(lengths), cu,
                       torch.tensor(tail_rows, dtype=torch.long).reshape(n_slots, h),
                       torch.tensor(halo, dtype=torch.long).reshape(n_slots, h))
    plan._memo[key] = table
    return table


def local_tails(x: torch.Tensor, table: ChunkTable) -> torch.Tensor:
    """``x [L, C]`` -> the last ``K-1`` rows of each slot, ``[2n * (K-1), C]`` (zeros where the chunk is shorter)."""
    rows = table.tail_rows.reshape(-1).to(x.device)
    picked = x[rows.clamp(min=0)]
    return picked * (rows >= 0).to(x.dtype)[:, None]


def conv_with_tails(x: torch.Tensor, weight: torch.Tensor, table: ChunkTable, tails: torch.Tensor) -> torch.Tensor:
    """The causal depthwise conv of this rank's tokens ``x [L, C]`` (``weight [C, K]``) given every rank's
    ``tails`` (``[cp * 2n * (K-1), C]``, rank order): each slot's window reaches into the tokens before
    it in its sequence, the padding slot's restarts. Returns ``[L, C]`` in ``weight``'s dtype."""
    k = weight.shape[-1]
    h = k - 1
    device = x.device
    pos = torch.cat([torch.arange(n, device=device) for n in table.lengths])
    out = causal_conv1d(x[None], weight, pos)[0]  # every slot restarting
    n_slots = table.halo.shape[0]
    if n_slots == 0 or h == 0:
        return out
    source = torch.cat([tails.to(weight.dtype), tails.new_zeros(1, tails.shape[1]).to(weight.dtype)])
    halo = source[table.halo.reshape(-1).to(device)].reshape(n_slots, h, -1)  # [2n, K-1, C]
    heads = torch.tensor([[s + m if m < n else -1 for m in range(h)]
                          for s, n in zip(table.starts[:-1], table.lengths[:-1])], dtype=torch.long, device=device)
    first = x[heads.clamp(min=0).reshape(-1)].reshape(n_slots, h, -1).to(weight.dtype)
    window = causal_conv1d(torch.cat([halo, first], dim=1), weight)[:, h:]  # [2n, K-1, C]: first rows, with halo
    keep = heads.reshape(-1) >= 0
    return out.index_copy(0, heads.reshape(-1)[keep], window.reshape(n_slots * h, -1)[keep])


def context_conv(x: torch.Tensor, weight: torch.Tensor, plan: SequencePlan, rank: int, group: Any) -> torch.Tensor:
    """``conv_with_tails`` with the tails all-gathered over the CP ``group`` (backward: reduce-scatter)."""
    table = chunk_table(plan, rank, weight.shape[-1])
    return conv_with_tails(x, weight, table, gather_from_sequence(local_tails(x, table), group))


def chunk_maps(q, k, v, g, beta, table: ChunkTable, scale: float | None = None):
    """Run every slot of ``[1, L, heads, d]`` inputs (q/k l2-normalised inside) from ``[I | 0]`` over
    ``[0 | v]``; returns ``(maps [2n, Hv, dk, dk + dv], out [1, L, Hv, dk + dv])`` in fp32 (fp64 stays)."""
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v, g, beta = (t.to(work) for t in (q, k, v, g, beta))
    hv, dk, dv = v.shape[2], q.shape[-1], v.shape[-1]
    wide = torch.cat([v.new_zeros(*v.shape[:3], dk), v], dim=-1)
    eye = torch.eye(dk, dk + dv, dtype=work, device=v.device)
    n = table.cu.numel() - 1
    init = eye.expand(n, hv, dk, dk + dv)
    out, final = gated_delta_rule(q, k, wide, g, beta, cu_seqlens=table.cu.to(v.device), initial_state=init,
                                  output_final_state=True, use_qk_l2norm=True, scale=scale)
    return final[:-1], out


def incoming_states(maps: torch.Tensor, plan: SequencePlan, rank: int) -> torch.Tensor:
    """Every rank's ``maps [cp * 2n, H, dk, dk + dv]`` (rank order) -> the state entering each of
    ``rank``'s slots, ``[2n, H, dk, dv]``, composed in sequence order."""
    cp, n = plan.cp, len(plan.lengths)
    dk = maps.shape[-2]
    maps = maps.reshape(cp, 2 * n, *maps.shape[1:])
    state = maps.new_zeros(n, *maps.shape[2:-1], maps.shape[-1] - dk)
    early = late = None
    for chunk in range(2 * cp - rank):
        if chunk == rank:
            early = state
        if chunk == 2 * cp - 1 - rank:
            late = state
            break
        owner, which = (chunk, 0) if chunk < cp else (2 * cp - 1 - chunk, 1)
        step = maps[owner, which::2]  # [n, H, dk, dk + dv]
        state = step[..., :dk] @ state + step[..., dk:]
    return torch.stack([early, late], dim=1).reshape(2 * n, *state.shape[1:])


def apply_states(out: torch.Tensor, states: torch.Tensor, table: ChunkTable) -> torch.Tensor:
    """``out [1, L, Hv, dk + dv]`` = ``[R | O0]`` and ``states [2n, Hv, dk, dv]`` -> ``O0 + R S_in`` per slot."""
    dk = states.shape[-2]
    r, o = out[0, ..., :dk], out[0, ..., dk:]
    parts = []
    for slot, (start, n) in enumerate(zip(table.starts[:-1], table.lengths[:-1])):
        if n:
            rows = slice(start, start + n)
            parts.append(o[rows] + torch.einsum("thk,hkv->thv", r[rows], states[slot]))
    parts.append(o[table.starts[-1]:])  # padding: whatever it computed
    return torch.cat(parts)[None]


def context_delta_rule(q, k, v, g, beta, plan: SequencePlan, rank: int, group: Any, kernel: int,
                       scale: float | None = None) -> torch.Tensor:
    """The gated delta rule (q/k l2-normalised) of this CP rank's tokens ``[1, L, heads, d]``, each
    chunk starting from the exact state its sequence's earlier chunks (any rank's) leave."""
    table = chunk_table(plan, rank, kernel)
    maps, out = chunk_maps(q, k, v, g, beta, table, scale)
    if group_size(group) > 1:
        maps = gather_from_sequence(maps.contiguous(), group)
    return apply_states(out, incoming_states(maps, plan, rank), table).to(q.dtype)
