"""The gated delta rule (Gated DeltaNet's linear attention) and its causal depthwise convolution, in
pure torch: architecture-free math, a chunked form (training, prefill) and a recurrent form (the
definition; decoding), for padded batches and for packed ones (``cu_seqlens``).

Per value head, with a state ``S [dk, dv]`` that starts at 0 (or ``initial_state``) at the start of
every sequence, each token ``t`` does (``q_t`` scaled by ``dk ** -0.5``, q/k l2-normalised on request)::

    S   <- exp(g_t) * S                      decay (g_t <= 0, in log space)
    u_t  = beta_t * (v_t - S^T k_t)          the delta rule: write only what S does not predict
    S   <- S + k_t u_t^T
    o_t  = S^T q_t

Tensors are ``[B, T, heads, dim]`` (``g``, ``beta``: ``[B, T, Hv]``); ``q``/``k`` have ``Hk`` heads,
``v`` has ``Hv`` (a multiple of ``Hk``) and value head ``j`` reads key head ``j // (Hv / Hk)``. All
arithmetic runs in fp32 (fp64 stays fp64); the output comes back in ``q``'s dtype.

Chunked form (chunks of ``chunk_size`` tokens, 64 by default). Inside a chunk, with ``G_t`` the
cumulative sum of ``g`` from the chunk's start to ``t`` (inclusive) and ``S0`` the state entering it,
the writes ``U = [u_t]`` solve a unit lower-triangular system::

    (I + A) U = beta * V - (beta * exp(G) * K) S0,   A[t, i] = beta_t exp(G_t - G_i) k_t . k_i  (i < t)

so ``U = U0 - W S0`` with ``U0``, ``W`` from two triangular solves that run for all chunks at once;
then ``O = (Q * exp(G)) S0 + ((Q K^T) * exp(G_t - G_i))_{i <= t} U`` and the state leaving the chunk
is ``exp(G_last) S0 + (K * exp(G_last - G))^T U``. Only that last step is sequential over chunks.

Packed batches (``B == 1``, ``cu_seqlens``): each sequence is laid out padded to whole chunks
(padding has ``k = v = 0``, ``beta = 0``, ``g = 0``: it changes nothing), and the state restarts
at each sequence's first chunk; the convolution's window restarts at each sequence's first token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["causal_conv1d", "gated_delta_rule", "l2_normalize", "positions_in_sequence"]


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (flash-linear-attention's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def positions_in_sequence(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Each packed token's index inside its own sequence, ``[total]`` (int64)."""
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    return torch.arange(total, device=cu.device) - torch.repeat_interleave(cu[:-1], lengths, output_size=total)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Causal depthwise convolution ``x [B, T, C]``, ``weight [C, K]`` -> ``[B, T, C]``:
    ``out[t] = sum_j weight[:, K-1-j] * x[t-j]`` over the ``j`` with ``positions[t] >= j``, i.e. the
    window never reaches before the token's own sequence (``positions [B, T]`` or ``[T]``: index of
    each token inside its sequence; None: every row is one sequence). Computed in ``weight``'s dtype."""
    b, t, c = x.shape
    k = weight.shape[-1]
    x = x.to(weight.dtype)
    out = x * weight[:, k - 1]
    for j in range(1, min(k, t)):
        shifted = F.pad(x[:, : t - j], (0, 0, j, 0))  # x[t - j], zeros before the row's start
        if positions is not None:
            inside = (positions >= j).to(x.dtype)  # t - j is still in the token's sequence
            shifted = shifted * (inside[:, :, None] if inside.dim() == 2 else inside[None, :, None])
        out = out + shifted * weight[:, k - 1 - j]
    return out


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _prepare(q, k, v, g, beta, use_qk_l2norm: bool, scale: float | None):
    """fp32 ``[B, H, T, d]`` tensors with q/k expanded to the value heads, normalised and scaled."""
    hk, hv = k.shape[2], v.shape[2]
    if hv % hk:
        raise ValueError(f"value heads {hv} must be a multiple of key heads {hk}")
    if q.shape[:3] != k.shape[:3] or v.shape[:2] != k.shape[:2]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match")
    if tuple(g.shape) != tuple(v.shape[:3]) or tuple(beta.shape) != tuple(v.shape[:3]):
        raise ValueError(f"g {tuple(g.shape)} and beta {tuple(beta.shape)} must be [B, T, Hv] = {tuple(v.shape[:3])}")
    work = _work_dtype(q.dtype)
    if hv != hk:
        q, k = (x.repeat_interleave(hv // hk, dim=2) for x in (q, k))
    q, k, v = (x.transpose(1, 2).to(work) for x in (q, k, v))  # [B, H, T, d]
    g, beta = (x.transpose(1, 2).to(work) for x in (g, beta))  # [B, H, T]
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    return q, k, v, g, beta


def _bounds(cu_seqlens: torch.Tensor, total: int) -> list[tuple[int, int]]:
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if not bounds or bounds[0] != 0 or bounds[-1] != total or any(b < a for a, b in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to the token count {total}, got {bounds}")
    return list(zip(bounds[:-1], bounds[1:]))


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                     cu_seqlens: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                     output_final_state: bool = False, use_qk_l2norm: bool = False, scale: float | None = None,
                     chunk_size: int = 64, form: str = "chunked"):
    """The gated delta rule over a padded batch (each of the ``B`` rows one sequence) or a packed one
    (``B == 1`` and ``cu_seqlens [n + 1]``); see the module docstring.

    ``initial_state``/the returned final state: ``[n, Hv, dk, dv]`` fp32 per sequence (``n = B`` for a
    padded batch). Returns ``o [B, T, Hv, dv]`` in ``q``'s dtype, and with ``output_final_state`` also
    the final states. ``form``: "chunked" or "recurrent" (token by token; the definition)."""
    if form not in ("chunked", "recurrent"):
        raise ValueError(f"form must be 'chunked' or 'recurrent', got {form!r}")
    out_dtype = q.dtype
    b, total = q.shape[:2]
    if cu_seqlens is not None and b != 1:
        raise ValueError(f"packed input (cu_seqlens) expects batch 1 (flat tokens), got batch {b}")
    q, k, v, g, beta = _prepare(q, k, v, g, beta, use_qk_l2norm, scale)
    spans = _bounds(cu_seqlens, total) if cu_seqlens is not None else None
    n_seq = len(spans) if spans is not None else b
    h, dk, dv = q.shape[1], q.shape[-1], v.shape[-1]
    if initial_state is not None and tuple(initial_state.shape) != (n_seq, h, dk, dv):
        raise ValueError(f"initial_state has shape {tuple(initial_state.shape)}, expected {(n_seq, h, dk, dv)}")
    init = initial_state.to(q.dtype) if initial_state is not None else None
    if spans is None:
        o, final = (_chunked if form == "chunked" else _recurrent)(q, k, v, g, beta, init, chunk_size)
    else:
        o, final = _packed(q, k, v, g, beta, init, spans, chunk_size, form)
    o = o.transpose(1, 2).to(out_dtype)  # [B, T, H, dv]
    return (o, final) if output_final_state else o


def _recurrent(q, k, v, g, beta, init, chunk_size=None):
    """Token by token, ``[B, H, T, d]`` rows each one sequence starting from ``init`` (or 0)."""
    b, h, t, dk = q.shape
    state = init if init is not None else q.new_zeros(b, h, dk, v.shape[-1])
    outs = []
    for i in range(t):
        state = state * g[:, :, i].exp()[..., None, None]
        kt = k[:, :, i]
        u = beta[:, :, i, None] * (v[:, :, i] - (state * kt[..., None]).sum(-2))
        state = state + kt[..., None] * u[..., None, :]
        outs.append((state * q[:, :, i, :, None]).sum(-2))
    o = torch.stack(outs, dim=2) if outs else v.new_zeros(v.shape)
    return o, state


def _chunked(q, k, v, g, beta, init, chunk_size, first_chunks=None):
    """Chunked form over rows ``[B, H, T, d]``. ``first_chunks``: ``{chunk: sequence}`` where a new
    sequence starts (state from ``init[sequence]`` or 0; packed layout, B == 1), None: every row one
    sequence from chunk 0. Returns ``(o, final)``: final state per row, or per sequence when
    ``first_chunks`` is given (the state after each sequence's last chunk)."""
    b, h, t, dk = q.shape
    dv = v.shape[-1]
    c = chunk_size
    pad = (-t) % c
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (t + pad) // c
    q, k, v = (x.reshape(b, h, n, c, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(b, h, n, c) for x in (g, beta))
    cum = g.cumsum(-1)  # G_t, [B, H, N, C]
    incl = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~incl, float("-inf")).exp()  # exp(G_t - G_i), i <= t
    system = (beta[..., None] * (k @ k.transpose(-1, -2)) * decay).tril(-1)  # A, strictly lower
    writes = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)  # U0
    reads = torch.linalg.solve_triangular(system, (beta * cum.exp())[..., None] * k, upper=False,
                                          unitriangular=True)  # W
    inner = (q @ k.transpose(-1, -2)) * decay  # within-chunk attention, i <= t
    q_decayed = q * cum.exp()[..., None]
    k_decayed = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [B, H, N, 1, 1]

    zero = q.new_zeros(b, h, dk, dv)
    state = init if (init is not None and first_chunks is None) else zero
    finals: dict[int, torch.Tensor] = {}
    current = None
    outs = []
    for i in range(n):
        if first_chunks is not None and i in first_chunks:
            if current is not None:
                finals[current] = state
            current = first_chunks[i]
            state = init[current:current + 1] if init is not None else zero
        u = writes[:, :, i] - reads[:, :, i] @ state
        outs.append(q_decayed[:, :, i] @ state + inner[:, :, i] @ u)
        state = state * chunk_decay[:, :, i] + k_decayed[:, :, i].transpose(-1, -2) @ u
    if first_chunks is None:
        final = state
    else:
        if current is not None:
            finals[current] = state
        final = finals
    o = torch.stack(outs, dim=2).reshape(b, h, n * c, dv)[:, :, :t] if outs else v.new_zeros(b, h, 0, dv)
    return o, final


def _packed(q, k, v, g, beta, init, spans, chunk_size, form):
    """Packed sequences ``[1, H, T, d]``: per sequence (recurrent), or laid out in whole chunks with the
    state restarting at each sequence (chunked). Empty sequences keep their initial state."""
    h, dk, dv = q.shape[1], q.shape[-1], v.shape[-1]

    def start_state(j):
        return init[j:j + 1] if init is not None else q.new_zeros(1, h, dk, dv)

    if form == "recurrent":
        outs, finals = [], []
        for j, (a, e) in enumerate(spans):
            o, s = _recurrent(q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], g[:, :, a:e], beta[:, :, a:e], start_state(j))
            outs.append(o)
            finals.append(s)
        return torch.cat(outs, dim=2), torch.cat(finals, dim=0)
    c = chunk_size
    index, first_chunks, offset = [], {}, 0
    for j, (a, e) in enumerate(spans):
        if e > a:
            first_chunks[offset // c] = j
            index.append(torch.arange(offset, offset + e - a))
            offset += -(-(e - a) // c) * c
    laid = offset
    pos = torch.cat(index).to(q.device) if index else torch.zeros(0, dtype=torch.int64, device=q.device)

    def lay(x):  # [1, H, T, ...] -> [1, H, laid, ...] with zeros in the padding
        out = x.new_zeros(*x.shape[:2], laid, *x.shape[3:])
        return out.index_copy(2, pos, x)

    o, finals = _chunked(lay(q), lay(k), lay(v), lay(g), lay(beta), init, c, first_chunks)
    o = o.index_select(2, pos)
    final = torch.cat([finals[j] if j in finals else start_state(j) for j in range(len(spans))], dim=0)
    return o, final
