"""The chunked form of the gated delta rule in pure torch (``parallel/gated_delta_rule.py`` dispatches
to it): chunks of ``C`` tokens, everything batched over all chunks of all rows and heads except one
small matmul per chunk for the state.

Inside a chunk, with ``G_t`` the cumulative sum of ``g`` from the chunk's start to ``t`` (inclusive)
and ``S`` the state entering it, the writes ``U = [u_t]`` solve a unit lower-triangular system::

    (I + A) U = beta * V - (beta * exp(G) * K) S,   A[t, i] = beta_t exp(G_t - G_i) k_t . k_i  (i < t)

so with ``T = (I + A)^-1``: ``U = U0 - W S`` (``U0 = T (beta V)``, ``W = T (beta e^G K)``), the
outputs are ``O = (Q e^G) S + ((Q K^T) * exp(G_t - G_i))_{i <= t} U``, and the state leaving the
chunk is an affine map of the one entering it::

    S_out = M S + Bm,   M = e^{G_last} I - Kd^T W,   Bm = Kd^T U0,   Kd = K * exp(G_last - G)

``T`` (``_UnitLowerInverse``: a blocked inverse made of batched matmuls), ``U0``, ``W``, ``M`` and
``Bm`` are computed for all chunks at once; ``_StateScan`` runs ``S <- M S + Bm`` chunk by chunk,
every packed sequence in step (the chunks are laid round-major: the ``r``-th chunk of every sequence
side by side, so one batched in-place GEMM per round each way, its own backward), and gives the state
entering every chunk, from which ``O`` is again one batched computation. Tensors are chunk-major,
``[n, rows * heads, C, d]``, so each round's states are one contiguous block.

Why not the textbook loop (transformers' ``torch_chunk_gated_delta_rule``)? On a CPU, torch's
batched ``solve_triangular`` calls LAPACK per 64 x 64 matrix (~20x slower than a bmm of the same
size here), and autograd through ``x[:, :, i]`` slices in a Python loop adds a full-size zero
gradient per chunk in the backward: quadratic in the chunk count (at 8192 tokens, most of the step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["chunked_delta_rule"]

_BASE = 16  # diagonal blocks of the triangular inverse done by forward substitution; larger ones by doubling


def _unit_lower_inverse(a: torch.Tensor) -> torch.Tensor:
    """``(I + a)^-1`` for strictly lower triangular ``a [..., C, C]`` (no autograd).

    A blocked triangular solve of batched matmuls: forward substitution inside diagonal blocks of
    16 rows, then neighbouring blocks merged pairwise, ``[[X1, 0], [-X2 A21 X1, X2]]``, until one
    block spans the chunk (``C`` padded to 16 * 2^j with identity rows)."""
    c = a.shape[-1]
    base = min(c, _BASE)
    size = base
    while size < c:
        size *= 2
    if size != c:
        a = F.pad(a, (0, size - c, 0, size - c))
    blocks = torch.stack([a[..., i:i + base, i:i + base] for i in range(0, size, base)], dim=-3)
    x = torch.eye(base, dtype=a.dtype, device=a.device).expand_as(blocks).clone()  # [..., size/base, b, b]
    for i in range(1, base):  # row i of L^-1 from the rows above it: x_i = e_i - a_i x
        x[..., i, :i] = -(blocks[..., i:i + 1, :i] @ x[..., :i, :i])[..., 0, :]
    s = base
    while s < size:
        x1, x2 = x[..., 0::2, :, :], x[..., 1::2, :, :]
        a21 = torch.stack([a[..., p + s:p + 2 * s, p:p + s] for p in range(0, size, 2 * s)], dim=-3)
        x = torch.cat([torch.cat([x1, torch.zeros_like(x1)], dim=-1), torch.cat([-(x2 @ a21 @ x1), x2], dim=-1)],
                      dim=-2)
        s *= 2
    return x[..., 0, :c, :c]


class _UnitLowerInverse(torch.autograd.Function):
    """``T = (I + a)^-1`` with ``da = -(T^T dT T^T)``, strictly lower part."""

    @staticmethod
    def forward(ctx, a):
        t = _unit_lower_inverse(a)
        ctx.save_for_backward(t)
        return t

    @staticmethod
    def backward(ctx, grad):
        (t,) = ctx.saved_tensors
        tt = t.transpose(-1, -2)
        return -(tt @ grad @ tt).tril(-1)


class _StateScan(torch.autograd.Function):
    """The only sequential step: the state entering each chunk, every sequence's chunks in step.

    Chunks are laid round-major: ``rounds[r] = (offset, count)`` holds the ``r``-th chunk of the
    ``count`` longest sequences at ``offset .. offset + count`` (sequences sorted by chunk count,
    longest first, so the ones that go on to round ``r + 1`` are its first ``rounds[r + 1][1]``).
    ``m [n, N, dk, dk]``, ``b [n, N, dk, dv]``: chunk ``c`` maps its entering state ``S`` to
    ``m_c S + b_c``; ``init [s, N, dk, dv]``: each sequence's initial state (sorted order). Returns
    ``(states [n, N, dk, dv], finals [s, N, dk, dv])``: the state entering every chunk and the one
    leaving each sequence. One batched in-place ``baddbmm_`` per round each way (over every sequence
    still running), into targets that already hold ``b``: ``R`` steps for sequences of at most ``R``
    chunks, however many are packed."""

    @staticmethod
    def forward(ctx, m, b, init, rounds):
        states = torch.empty_like(b)
        finals = torch.empty_like(init)
        first, count = rounds[0]
        states[first:first + count].copy_(init)
        for r, (a, k) in enumerate(rounds):
            nxt, go_on = rounds[r + 1] if r + 1 < len(rounds) else (0, 0)
            if go_on:  # sequences with another chunk: the state entering it
                _step(states[nxt:nxt + go_on], m[a:a + go_on], states[a:a + go_on], b[a:a + go_on])
            if k > go_on:  # sequences ending here: their final state
                _step(finals[go_on:k], m[a + go_on:a + k], states[a + go_on:a + k], b[a + go_on:a + k])
        ctx.save_for_backward(m, states)
        ctx.rounds = rounds
        return states, finals

    @staticmethod
    def backward(ctx, d_states, d_finals):
        m, states = ctx.saved_tensors
        rounds = ctx.rounds
        d_b = torch.empty_like(states)  # gradient of the state leaving each chunk (= of b)
        for r in reversed(range(len(rounds))):
            a, k = rounds[r]
            nxt, go_on = rounds[r + 1] if r + 1 < len(rounds) else (0, 0)
            d_b[a + go_on:a + k].copy_(d_finals[go_on:k])
            if go_on:  # leaving chunk r = entering chunk r + 1: its own gradient and, through m, the rest
                _step(d_b[a:a + go_on], m[nxt:nxt + go_on].transpose(-1, -2), d_b[nxt:nxt + go_on],
                      d_states[nxt:nxt + go_on])
        first, count = rounds[0]
        d_init = torch.empty_like(d_finals)
        _step(d_init, m[first:first + count].transpose(-1, -2), d_b[first:first + count],
              d_states[first:first + count])
        return d_b @ states.transpose(-1, -2), d_b, d_init, None


def _step(out, m, s, b):
    """``out = m @ s + b`` over ``[k, N, ...]`` blocks as one batched GEMM (``out`` may be a view)."""
    out.copy_(b)
    out.flatten(0, 1).baddbmm_(m.flatten(0, 1), s.flatten(0, 1))


def _chunk_core(q, k, v, g, beta, init, rounds):
    """``q/k [n, N, C, dk]``, ``v [n, N, C, dv]``, ``g/beta [n, N, C]`` (fp32, q scaled, padding
    rows zero, chunks laid by ``rounds`` as ``_StateScan`` reads them), ``init [s, N, dk, dv]`` ->
    ``(o [n, N, C, dv], finals)``."""
    c, dk = q.shape[-2:]
    cum = g.cumsum(-1)  # G_t
    incl = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~incl, float("-inf")).exp()  # exp(G_t - G_i), i <= t
    k_t = k.transpose(-1, -2)
    inverse = _UnitLowerInverse.apply((beta[..., None] * (k @ k_t) * decay).tril(-1))  # (I + A)^-1
    grow = cum.exp()
    writes = inverse @ (beta[..., None] * v)  # U0
    reads = inverse @ ((beta * grow)[..., None] * k)  # W
    kd_t = (k * (cum[..., -1:] - cum).exp()[..., None]).transpose(-1, -2)  # Kd^T
    eye = torch.eye(dk, dtype=q.dtype, device=q.device)
    maps = grow[..., -1, None, None] * eye - kd_t @ reads  # M
    states, finals = _StateScan.apply(maps, kd_t @ writes, init, rounds)
    o = (q * grow[..., None]) @ states + ((q @ k_t) * decay) @ (writes - reads @ states)
    return o, finals


def chunked_delta_rule(q, k, v, g, beta, init, spans, chunk_size):
    """The chunked form over prepared token-major tensors: ``q/k [B, T, H, dk]`` (value heads, fp32,
    normalised and scaled), ``v [B, T, H, dv]``, ``g/beta [B, T, H]``; each row one sequence
    (``spans`` None; ``init [B, H, dk, dv]`` or None) or one packed row of sequences ``spans``
    (``(start, end)`` token ranges; ``init [len(spans), H, dk, dv]`` or None). Each sequence is laid
    out in whole chunks (padding: ``k = v = 0``, ``beta = g = 0``, which changes nothing). Returns
    ``(o [B, T, H, dv], final)``: final state per row ``[B, H, dk, dv]`` or per sequence."""
    b, t, h, dk = q.shape
    dv, c = v.shape[-1], chunk_size
    if spans is None:
        laid, seqs = -(-t // c) * c, None
        rounds = tuple((r, 1) for r in range(laid // c))
        inits = (init if init is not None else q.new_zeros(b, h, dk, dv))[None]  # [1, B, H, dk, dv]

        def lay(x):  # [B, T, ...] -> [B, laid, ...], zeros after the end
            return F.pad(x, (0, 0) * (x.dim() - 2) + (0, laid - t)) if laid != t else x
    else:
        rounds, seqs, slots = _rounds(spans, c)
        laid = sum(k for _, k in rounds) * c
        pos = torch.cat(slots).to(q.device) if slots else torch.zeros(0, dtype=torch.int64, device=q.device)
        source = torch.full((laid,), t, dtype=torch.int64, device=q.device).index_copy(0, pos, torch.arange(
            t, device=q.device))  # laid slot -> token, or t: a zero row
        inits = (init[seqs] if init is not None else q.new_zeros(len(seqs), h, dk, dv))[:, None]

        def lay(x):  # [1, T, ...] -> [1, laid, ...] with zeros in the padding (a gather: keeps only the index)
            return F.pad(x, (0, 0) * (x.dim() - 2) + (0, 1)).index_select(1, source)
    n = laid // c
    if n == 0:
        o = v.new_zeros(b, t, h, dv)
        return o, (inits[0] if spans is None else _finals_per_sequence([], [], init, len(spans), (h, dk, dv), q))

    def chunks(x):  # [B, laid, H, d] -> [n, B * H, C, d]
        return x.reshape(b, n, c, h, -1).permute(1, 0, 3, 2, 4).reshape(n, b * h, c, x.shape[-1])

    def gates(x):  # [B, laid, H] -> [n, B * H, C]
        return x.reshape(b, n, c, h).permute(1, 0, 3, 2).reshape(n, b * h, c)

    o, finals = _chunk_core(chunks(lay(q)), chunks(lay(k)), chunks(lay(v)), gates(lay(g)), gates(lay(beta)),
                            inits.reshape(inits.shape[0], b * h, dk, dv), rounds)
    o = o.reshape(n, b, h, c, dv).permute(1, 0, 3, 2, 4).reshape(b, laid, h, dv)
    if spans is None:
        return o[:, :t], finals[0].reshape(b, h, dk, dv)
    return o.index_select(1, pos), _finals_per_sequence(finals, seqs, init, len(spans), (h, dk, dv), q)


def _rounds(spans, c):
    """The round-major chunk layout of a packed row: ``(rounds, seqs, slots)``. ``seqs``: the non-empty
    sequences, longest (in chunks) first (stable); ``rounds[r] = (offset, count)``: chunk ``r`` of the
    ``count`` first of them sits at chunk ``offset + rank``; ``slots``: each sequence's tokens' laid
    positions, in the order of ``spans`` (so ``torch.cat(slots)`` maps token order to laid slots)."""
    sizes = {j: -(-(e - a) // c) for j, (a, e) in enumerate(spans) if e > a}
    seqs = sorted(sizes, key=lambda j: -sizes[j])
    rounds, offset = [], 0
    for r in range(sizes[seqs[0]] if seqs else 0):
        count = sum(1 for j in seqs if sizes[j] > r)
        rounds.append((offset, count))
        offset += count
    offsets = torch.tensor([o for o, _ in rounds], dtype=torch.int64)
    rank = {j: i for i, j in enumerate(seqs)}
    slots = []
    for j, (a, e) in enumerate(spans):
        if e > a:
            i = torch.arange(e - a)
            slots.append((offsets[i // c] + rank[j]) * c + i % c)
    return tuple(rounds), seqs, slots


def _finals_per_sequence(finals, seqs, init, count, shape, like):
    """``[count, H, dk, dv]``: each non-empty sequence's final state, an empty one's initial state (or 0)."""
    out = list(init) if init is not None else [like.new_zeros(shape)] * count
    for j, seq in enumerate(seqs):
        out[seq] = finals[j].reshape(shape)
    return torch.stack(out)
