"""The gated delta rule (Gated DeltaNet's linear attention) and its causal depthwise convolution:
architecture-free math behind one dispatch, for padded batches and packed ones (``cu_seqlens``).

Per value head, with a state ``S [dk, dv]`` that starts at 0 (or ``initial_state``) at the start of
every sequence, each token ``t`` does (``q_t`` scaled by ``dk ** -0.5``, q/k l2-normalised on request)::

    S   <- exp(g_t) * S                      decay (g_t <= 0, in log space)
    u_t  = beta_t * (v_t - S^T k_t)          the delta rule: write only what S does not predict
    S   <- S + k_t u_t^T
    o_t  = S^T q_t

Tensors are ``[B, T, heads, dim]`` (``g``, ``beta``: ``[B, T, Hv]``); ``q``/``k`` have ``Hk`` heads,
``v`` has ``Hv`` (a multiple of ``Hk``) and value head ``j`` reads key head ``j // (Hv / Hk)``.

Kernels (``kernel=``, or ``PMZ_GDN_KERNEL``; default: automatic):
  * ``"torch"``: the pure-torch forms, all arithmetic in fp32 (fp64 stays fp64), output in ``q``'s
    dtype: ``form="chunked"`` (training, prefill; ``parallel/gated_delta_chunk.py``) or
    ``form="recurrent"`` (token by token: the definition, and the tests' reference). What CPUs,
    fp32/fp64 and anything the other kernel does not take run.
  * ``"fla"``: flash-linear-attention's Triton kernels (the ``fla-core`` wheel, optional, never
    required): ``fla.ops.gated_delta_rule.chunk_gated_delta_rule`` for the delta rule and
    ``fla.modules.convolution.causal_conv1d`` for the conv, on CUDA bf16/fp16 tensors. Chosen
    automatically where installed; q/k are expanded to the value heads first (fla releases before
    grouped-value support take equal head counts), empty packed sequences are left out of its
    ``cu_seqlens`` (their final state is their initial one). tests/test_gpu_gdn.py checks it against
    the torch forms on CUDA.
``PMZ_GDN_KERNEL=torch`` keeps the torch forms everywhere; ``=fla`` insists on fla (an error where it is
not installed or there is no CUDA; a call it cannot take, fp32 or the recurrent form, stays on torch).

Packed batches (``B == 1``, ``cu_seqlens``): the state restarts at each sequence; the convolution's
window restarts at each sequence's first token.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os

import torch

from parallel.gated_delta_chunk import chunked_delta_rule

__all__ = ["KERNEL_ENV", "causal_conv1d", "delta_rule_kernel", "gated_delta_rule", "l2_normalize",
           "positions_in_sequence"]

KERNEL_ENV = "PMZ_GDN_KERNEL"
KERNELS = ("torch", "fla")


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (flash-linear-attention's and transformers' form)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def positions_in_sequence(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Each packed token's index inside its own sequence, ``[total]`` (int64)."""
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    return torch.arange(total, device=cu.device) - torch.repeat_interleave(cu[:-1], lengths, output_size=total)


# ---------------------------------------------------------------------- which kernel
@functools.cache
def _fla_delta_rule():
    """fla's ``chunk_gated_delta_rule``, or None where fla-core is absent or does not import."""
    try:
        return importlib.import_module("fla.ops.gated_delta_rule").chunk_gated_delta_rule
    except Exception:  # ImportError, or a Triton/fla that does not load on this machine
        return None


@functools.cache
def _fla_conv():
    """fla's sequence-first ``causal_conv1d(x [B, T, D], weight [D, W], ..., cu_seqlens=) -> (y, state)``,
    or None (absent, or a release with the older head-first API, told apart by its parameters)."""
    try:
        fn = importlib.import_module("fla.modules.convolution").causal_conv1d
        params = inspect.signature(fn).parameters
    except Exception:
        return None
    return fn if {"x", "weight", "residual", "activation", "cu_seqlens"} <= set(params) else None


def _check_kernel(name: str | None, what: str) -> None:
    if name is not None and name not in KERNELS:
        raise ValueError(f"{what}={name!r}: expected one of {KERNELS}")


def delta_rule_kernel(x: torch.Tensor, kernel: str | None = None) -> str:
    """The kernel a call on tensors like ``x`` runs: ``kernel`` if given (an error where it cannot
    run), else ``PMZ_GDN_KERNEL`` (fla insisted on: an error where fla is absent or there is no CUDA),
    else fla on CUDA bf16/fp16 where installed, else torch."""
    _check_kernel(kernel, "kernel")
    takes = x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
    if kernel is not None:
        if kernel == "fla" and not (takes and _fla_delta_rule() is not None):
            raise ValueError(f"kernel='fla' needs CUDA bf16/fp16 tensors and fla-core installed; got {x.device} "
                             f"{x.dtype}, fla {'installed' if _fla_delta_rule() else 'absent'}")
        return kernel
    env = os.environ.get(KERNEL_ENV) or None
    _check_kernel(env, KERNEL_ENV)
    if env == "fla" and (_fla_delta_rule() is None or not torch.cuda.is_available()):
        raise ValueError(f"{KERNEL_ENV}=fla: fla-core is {'installed' if _fla_delta_rule() else 'not installed'} "
                         f"and CUDA is {'available' if torch.cuda.is_available() else 'not available'}")
    if env == "torch":
        return "torch"
    return "fla" if takes and _fla_delta_rule() is not None else "torch"


# ---------------------------------------------------------------------- the convolution
def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor | None = None, *,
                  cu_seqlens: torch.Tensor | None = None, kernel: str | None = None) -> torch.Tensor:
    """Causal depthwise convolution ``x [B, T, C]``, ``weight [C, K]`` -> ``[B, T, C]``:
    ``out[t] = sum_j weight[:, K-1-j] * x[t-j]`` over the ``j`` with ``positions[t] >= j``, i.e. the
    window never reaches before the token's own sequence (``positions [B, T]`` or ``[T]``: index of
    each token inside its sequence; None: every row is one sequence). The result is in ``weight``'s dtype;
    bf16/fp16 taps are summed in fp32 and rounded once, as transformers' ``F.conv1d`` and fla's kernel do (summed
    in bf16, K roundings put Qwen3.5's bf16 logits 3.5% of the largest logit away from transformers' bf16 ones,
    13.5% for Qwen3.5-MoE; summed in fp32 they are equal). ``cu_seqlens`` (the same sequences as ``positions``,
    B == 1) lets fla's kernel take a packed call."""
    packed_ok = positions is None or (cu_seqlens is not None and x.shape[0] == 1)
    if packed_ok and x.dtype == weight.dtype and delta_rule_kernel(x, kernel) == "fla" and _fla_conv() is not None:
        fn = _fla_conv()
        extra = {"backend": "triton"} if "backend" in inspect.signature(fn).parameters else {}
        cu = cu_seqlens.to(device=x.device, dtype=torch.long) if positions is not None else None
        y, _ = fn(x=x, weight=weight, bias=None, residual=None, activation=None, cu_seqlens=cu, **extra)
        return y.to(weight.dtype)
    if positions is not None and positions.dim() == 1:
        positions = positions[None]
    return _CausalConv.apply(x.to(weight.dtype), weight, positions)


class _CausalConv(torch.autograd.Function):
    """The torch conv: ``out = x w_{K-1} + sum_j shift_j(x) w_{K-1-j}`` accumulated into slices, row
    ``t`` of ``shift_j`` kept where ``positions[t] >= j``. Keeps only ``x`` for the backward (autograd
    through padded shifted copies kept ``K - 1`` of them): ``dx = sum_j unshift_j(dy masked) w_{K-1-j}``,
    ``dw_{K-1-j} = sum_t dy_t x_{t-j}`` (masked)."""

    @staticmethod
    def forward(ctx, x, weight, positions):
        ctx.save_for_backward(x, weight, positions)  # in their own dtype: bf16 activations stay bf16 until backward
        dtype, work = weight.dtype, _conv_work(weight)
        x, weight = x.to(work), weight.to(work)
        t, k = x.shape[1], weight.shape[-1]
        out = x * weight[:, k - 1]
        for j in range(1, min(k, t)):
            term = x[:, : t - j] * weight[:, k - 1 - j]  # reaches row t from x[t - j]
            if positions is not None:
                term = term * (positions[:, j:, None] >= j).to(x.dtype)  # t - j still in t's sequence
            out[:, j:] += term
        return out.to(dtype)

    @staticmethod
    def backward(ctx, dy):
        x0, low, positions = ctx.saved_tensors
        work = _conv_work(low)
        x, weight, dy = x0.to(work), low.to(work), dy.to(work)
        t, k = x.shape[1], weight.shape[-1]
        dx = dy * weight[:, k - 1]
        dw = torch.empty_like(weight)
        dw[:, k - 1] = (dy * x).sum((0, 1))
        for j in range(1, k):
            if j >= t:
                dw[:, k - 1 - j] = 0
                continue
            d = dy[:, j:]
            if positions is not None:
                d = d * (positions[:, j:, None] >= j).to(dy.dtype)
            dx[:, : t - j] += d * weight[:, k - 1 - j]
            dw[:, k - 1 - j] = (d * x[:, : t - j]).sum((0, 1))
        return dx.to(x0.dtype), dw.to(low.dtype), None


def _conv_work(weight: torch.Tensor) -> torch.dtype:
    """The dtype the conv sums in: fp32 for half-precision weights, theirs otherwise (fp32, fp64: unchanged)."""
    return torch.float32 if weight.dtype in (torch.bfloat16, torch.float16) else weight.dtype


# ---------------------------------------------------------------------- the delta rule
def _check(q, k, v, g, beta) -> None:
    hk, hv = k.shape[2], v.shape[2]
    if hv % hk:
        raise ValueError(f"value heads {hv} must be a multiple of key heads {hk}")
    if q.shape[:3] != k.shape[:3] or v.shape[:2] != k.shape[:2]:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match")
    if tuple(g.shape) != tuple(v.shape[:3]) or tuple(beta.shape) != tuple(v.shape[:3]):
        raise ValueError(f"g {tuple(g.shape)} and beta {tuple(beta.shape)} must be [B, T, Hv] = {tuple(v.shape[:3])}")


def _prepare(q, k, v, g, beta, use_qk_l2norm: bool, scale: float | None):
    """fp32 (fp64 stays) ``[B, T, heads, d]`` tensors: q/k normalised, q scaled, both expanded to the value heads."""
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k = q.to(work), k.to(work)
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    rep = v.shape[2] // k.shape[2]
    if rep > 1:
        q, k = (x.repeat_interleave(rep, dim=2) for x in (q, k))
    return q, k, v.to(work), g.to(work), beta.to(work)


def _bounds(cu_seqlens: torch.Tensor, total: int) -> list[tuple[int, int]]:
    bounds = [int(x) for x in cu_seqlens.tolist()]
    if not bounds or bounds[0] != 0 or bounds[-1] != total or any(b < a for a, b in zip(bounds[:-1], bounds[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to the token count {total}, got {bounds}")
    return list(zip(bounds[:-1], bounds[1:]))


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                     cu_seqlens: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                     output_final_state: bool = False, use_qk_l2norm: bool = False, scale: float | None = None,
                     chunk_size: int = 64, form: str = "chunked", kernel: str | None = None):
    """The gated delta rule over a padded batch (each of the ``B`` rows one sequence) or a packed one
    (``B == 1`` and ``cu_seqlens [n + 1]``); see the module docstring.

    ``initial_state``/the returned final state: ``[n, Hv, dk, dv]`` fp32 per sequence (``n = B`` for a
    padded batch). Returns ``o [B, T, Hv, dv]`` in ``q``'s dtype, and with ``output_final_state`` also
    the final states. ``form``: "chunked" or "recurrent" (token by token; the definition, torch only).
    ``kernel``: "torch" or "fla" (None: ``delta_rule_kernel``'s choice)."""
    if form not in ("chunked", "recurrent"):
        raise ValueError(f"form must be 'chunked' or 'recurrent', got {form!r}")
    b, total = q.shape[:2]
    if cu_seqlens is not None and b != 1:
        raise ValueError(f"packed input (cu_seqlens) expects batch 1 (flat tokens), got batch {b}")
    _check(q, k, v, g, beta)
    spans = _bounds(cu_seqlens, total) if cu_seqlens is not None else None
    n_seq = len(spans) if spans is not None else b
    h, dk, dv = v.shape[2], q.shape[-1], v.shape[-1]
    if initial_state is not None and tuple(initial_state.shape) != (n_seq, h, dk, dv):
        raise ValueError(f"initial_state has shape {tuple(initial_state.shape)}, expected {(n_seq, h, dk, dv)}")
    if form == "recurrent" and kernel == "fla":
        raise ValueError("kernel='fla' runs the chunked form only")
    if form == "chunked" and total and delta_rule_kernel(q, kernel) == "fla":
        o, final = _fla_rule(q, k, v, g, beta, spans, initial_state, output_final_state, use_qk_l2norm, scale)
        return (o, final) if output_final_state else o
    out_dtype = q.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, use_qk_l2norm, scale)
    init = initial_state.to(q.dtype) if initial_state is not None else None
    if form == "chunked":
        o, final = chunked_delta_rule(q, k, v, g, beta, init, spans, chunk_size)
    else:
        o, final = _recurrent_rows(q, k, v, g, beta, init, spans)
    o = o.to(out_dtype)
    return (o, final) if output_final_state else o


def _recurrent_rows(q, k, v, g, beta, init, spans):
    """The recurrent form over ``[B, T, H, d]`` rows, or per packed sequence (an empty one keeps its state)."""
    def run(sl, state):
        return _recurrent(*(x[:, sl].transpose(1, 2) for x in (q, k, v, g, beta)), state)

    if spans is None:
        o, final = run(slice(None), init)
        return o.transpose(1, 2), final
    h, dk, dv = v.shape[2], q.shape[-1], v.shape[-1]
    outs, finals = [], []
    for j, (a, e) in enumerate(spans):
        o, s = run(slice(a, e), init[j:j + 1] if init is not None else q.new_zeros(1, h, dk, dv))
        outs.append(o.transpose(1, 2))
        finals.append(s)
    return torch.cat(outs, dim=1), torch.cat(finals, dim=0)


def _recurrent(q, k, v, g, beta, init):
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


def _fla_rule(q, k, v, g, beta, spans, initial_state, output_final_state, use_qk_l2norm, scale):
    """flash-linear-attention's chunked kernel on the same contract as the torch forms."""
    rep = v.shape[2] // k.shape[2]
    if rep > 1:
        q, k = (x.repeat_interleave(rep, dim=2) for x in (q, k))
    init, cu, kept = initial_state, None, None
    if spans is not None:
        kept = [j for j, (a, e) in enumerate(spans) if e > a]  # fla gets the non-empty sequences only
        cu = torch.tensor([0] + [spans[j][1] for j in kept], dtype=torch.long, device=q.device)
        init = initial_state[kept] if initial_state is not None else None
    o, final = _fla_delta_rule()(q, k, v.to(q.dtype), g.float(), beta, scale=q.shape[-1] ** -0.5 if scale is None
                                 else scale, initial_state=None if init is None else init.float().contiguous(),
                                 output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm,
                                 cu_seqlens=cu)
    if output_final_state and kept is not None and len(kept) != len(spans):
        full = (initial_state.float().clone() if initial_state is not None
                else final.new_zeros(len(spans), *final.shape[1:]))
        full[kept] = final
        final = full
    return o.to(q.dtype), final
