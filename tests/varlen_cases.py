"""Independent references and cases for the varlen attention tests (CPU: tests/test_varlen_attention.py,
CUDA: tests/test_gpu.py). The references are plain torch on the host in fp64 (SDPA per sequence with an
explicit mask, log-sum-exp from the score matrix), never the code under test."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


def sequence_reference(q, k, v, cu_q, cu_k, causal: bool, scale: float | None = None):
    """Per sequence: SDPA output ``[Tq, hq, d]`` and log-sum-exp ``[hq, Tq]`` in fp64 on the host, with
    flash's bottom-right causal mask (query i sees key j <= i + k_len - q_len). Differentiable in q/k/v."""
    d = q.shape[-1]
    scale = d ** -0.5 if scale is None else scale
    outs, lses = [], []
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for (qa, qb), (ka, kb) in zip(zip(bq[:-1], bq[1:]), zip(bk[:-1], bk[1:])):
        if qb == qa:
            continue
        qs, ks, vs = q[qa:qb].transpose(0, 1), k[ka:kb].transpose(0, 1), v[ka:kb].transpose(0, 1)  # [h, n, d]
        nq, nk = qb - qa, kb - ka
        mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device)
        if causal:
            mask = torch.arange(nk, device=q.device)[None, :] <= torch.arange(nq, device=q.device)[:, None] + nk - nq
        outs.append(F.scaled_dot_product_attention(qs[None], ks[None], vs[None], attn_mask=mask, scale=scale,
                                                   enable_gqa=True)[0].transpose(0, 1))
        groups = q.shape[1] // k.shape[1]
        scores = torch.einsum("hqd,hkd->hqk", qs, ks.repeat_interleave(groups, dim=0)) * scale
        lses.append(torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1))
    return torch.cat(outs), torch.cat(lses, dim=1)


def masked_reference(q, k, v, mask):
    """Padded ``[s, b, h, d]`` batch, row by row: causal SDPA (fp64, host) over the row's real tokens
    only (``mask [b, s]``, 1 = real; None = all real); ``[s, b, hq * d]``, padding rows 0."""
    s, b, hq, d = q.shape
    out = torch.zeros(s, b, hq, d, dtype=torch.float64)
    q, k, v = (x.double().cpu() for x in (q, k, v))
    for r in range(b):
        keep = mask[r].bool().cpu().nonzero()[:, 0] if mask is not None else torch.arange(s)
        if keep.numel():
            cu = torch.tensor([0, keep.numel()])
            out[keep, r] = sequence_reference(q[keep, r], k[keep, r], v[keep, r], cu, cu, causal=True)[0]
    return out.reshape(s, b, hq * d)


def packed_inputs(lengths, hq, hkv, d, dtype, device="cpu", seed=0, k_lengths=None):
    """Random ``q [Tq, hq, d]``, ``k/v [Tk, hkv, d]``, ``dout`` and int32 ``cu_q``/``cu_k`` on ``device``."""
    gen = torch.Generator().manual_seed(seed)
    k_lengths = lengths if k_lengths is None else k_lengths
    tq, tk = sum(lengths), sum(k_lengths)
    q, k, v = (torch.randn(t, h, d, generator=gen, dtype=torch.float64) for t, h in ((tq, hq), (tk, hkv), (tk, hkv)))
    dout = torch.randn(tq, hq, d, generator=gen, dtype=torch.float64)
    cu = lambda lens: torch.tensor([0, *lens]).cumsum(0).to(device=device, dtype=torch.int32)  # noqa: E731
    return [x.to(device=device, dtype=dtype) for x in (q, k, v, dout)] + [cu(lengths), cu(k_lengths)]


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (b the reference), on the host in fp64."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def global_inputs(lengths, hq, hkv, d, seed=3):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    return [torch.randn(t, h, d, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv, hq)]


def local_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a global ``[T, ...]`` tensor (zeros at padding, index -1)."""
    keep = (index >= 0).reshape(-1, *([1] * (x.dim() - 1)))
    return torch.where(keep, x[index.clamp(min=0)], torch.zeros((), dtype=x.dtype))


def cp_steps_in_one_process(lengths, hq, hkv, d, cp, kernel, dtype, device="cpu"):
    """Every CP rank's ring steps run one after another in this process through the one-call-per-step
    path (``attend_step``/``step_backward``, the same calls the ring makes), then restored to the global
    order: output, dq, dk, dv, each against ``sequence_reference`` on the whole batch (max_rel)."""
    from parallel.context_varlen import attend_step, step_backward, step_calls
    from parallel.sequence_layout import plan_sequences
    from parallel.varlen_kernels import acc_dtype

    q, k, v, dout = global_inputs(lengths, hq, hkv, d)
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    cu = torch.tensor([0, *lengths]).cumsum(0)
    ref, _ = sequence_reference(*ref_in, cu, cu, causal=True)
    ref.backward(dout)
    plan = plan_sequences(lengths, cp=cp, multiple=3)  # local padding exercised
    idx = [plan.cp_index(r) for r in range(cp)]
    mine = {n: [local_rows(x, i).to(device=device, dtype=dtype) for i in idx] for n, x in zip("qkvo", (q, k, v, dout))}
    kv = [torch.stack([mine["k"][r], mine["v"][r]]) for r in range(cp)]
    acc = acc_dtype(mine["q"][0])
    outs, dqs, dkvs = [], [], [torch.zeros(kv[0].shape, dtype=acc, device=device) for _ in range(cp)]
    scale = d ** -0.5
    for r in range(cp):
        out = torch.zeros(mine["q"][r].shape, dtype=acc, device=device)
        lse = torch.full((hq, plan.local_len), float("-inf"), dtype=acc, device=device)
        for src in range(cp):
            attend_step(mine["q"][r], kv[src], step_calls(plan, r, src, device), scale, out, lse, kernel)
        out = out.to(dtype)
        dq = torch.zeros(out.shape, dtype=acc, device=device)
        for src in range(cp):
            step_backward(mine["o"][r], mine["q"][r], kv[src], out, lse, step_calls(plan, r, src, device), scale,
                          dq, dkvs[src], kernel)
        outs.append(out)
        dqs.append(dq)
    glob = lambda xs: plan.restore(torch.stack([x.double().cpu() for x in xs]))  # noqa: E731
    return {"out": max_rel(glob(outs), ref), "dq": max_rel(glob(dqs), ref_in[0].grad),
            "dk": max_rel(glob([x[0] for x in dkvs]), ref_in[1].grad),
            "dv": max_rel(glob([x[1] for x in dkvs]), ref_in[2].grad),
            "padding_out": max(o[i < 0].abs().max().item() if bool((i < 0).any()) else 0.0
                               for o, i in zip(outs, idx))}


def cp_kernels_rank(cases):
    """Rank body (gloo): ring and all-gather context-parallel attention with the one-call-per-step path
    (``kernel="reference"``) against the block-by-block path (``"segments"``) and against the whole
    batch (``sequence_reference``): output and q/k/v gradients, max_rel per case."""
    from parallel.context_attention import context_parallel_attention
    from parallel.sequence_layout import plan_sequences

    cp, rank = dist.get_world_size(), dist.get_rank()
    records = []
    for lengths, hq, hkv, comm in cases:
        q, k, v, dout = global_inputs(lengths, hq, hkv, 16)
        ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
        cu = torch.tensor([0, *lengths]).cumsum(0)
        ref, _ = sequence_reference(*ref_in, cu, cu, causal=True)
        ref.backward(dout)
        plan = plan_sequences(lengths, cp=cp, multiple=3)
        index = plan.cp_index(rank)
        got = {}
        for kernel in ("reference", "segments"):
            mine = [local_rows(x, index).requires_grad_() for x in (q, k, v)]
            out = context_parallel_attention(*mine, plan, dist.group.WORLD, comm=comm, kernel=kernel)
            out.backward(local_rows(dout, index))
            got[kernel] = [_restore(out.detach(), plan)] + [_restore(x.grad, plan) for x in mine]
        tag = (tuple(lengths), hq, hkv, comm)
        for name, a, b, r in zip(("out", "dq", "dk", "dv"), got["reference"], got["segments"],
                                 (ref, *(x.grad for x in ref_in))):
            records.append((*tag, name, max_rel(a, r), max_rel(a, b)))
    return records


def _restore(x, plan):
    gathered = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, x.contiguous())
    return plan.restore(torch.stack(gathered))
