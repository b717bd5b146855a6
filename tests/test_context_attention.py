"""Ring and all-gather context-parallel attention, and the Ulysses all-to-alls, against torch's SDPA
on the whole batch (fp64 unless named): outputs and q/k/v gradients, packed sequences of unequal
lengths (including empty ones and ones shorter than 2*cp), GQA, local padding."""

from __future__ import annotations

import functools

import pytest

from tests.distributed import run_distributed
from tests.workers_context import ring_suite, ulysses_suite


@functools.lru_cache(maxsize=None)
def _ring(world: int):
    return [r for rank in run_distributed(world, ring_suite) for r in rank]


@functools.lru_cache(maxsize=None)
def _ulysses(world: int):
    return [r for rank in run_distributed(world, ulysses_suite) for r in rank]


def _bad(records, tol64=1e-10, tol32=2e-5):
    bad = []
    for rec in records:
        value = rec[-1]
        tol = tol32 if "torch.float32" in rec else tol64
        if not value <= tol:
            bad.append(f"{rec[:-2]} {rec[-2]}={value:.3g} (max {tol})")
    return bad


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_attention_matches_sdpa(cp):
    records = _ring(cp)
    assert {r[3] for r in records} == {"ring", "allgather"} and len(records) >= 5 * 13
    bad = _bad(records)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("u", [2, 4])
def test_ulysses_all_to_all_matches_whole_sequence_attention(u):
    records = _ulysses(u)
    assert records
    bad = [f"{r[:-2]} {r[-2]}={r[-1]:.3g}" for r in records if not r[-1] <= 1e-10]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("dtype,tol", [("float64", 1e-12), ("bfloat16", 2e-2)])
def test_block_kernels_and_merge_match_sdpa_in_one_process(dtype, tol):
    """cp=1 through the block kernels: each sequence as an early and a late half merged by the
    online-softmax rule, forward and backward, against SDPA per sequence (bf16: relative)."""
    import torch

    from parallel.context_attention import context_parallel_attention
    from parallel.sequence_layout import plan_sequences
    from tests.workers_context import reference_attention

    dt = getattr(torch, dtype)
    lengths = [9, 1, 0, 16, 4]
    gen = torch.Generator().manual_seed(2)
    q, k, v, dout = (torch.randn(sum(lengths), h, 16, generator=gen, dtype=torch.float64) for h in (4, 2, 2, 4))
    ref_in = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = reference_attention(*ref_in, lengths)
    ref.backward(dout)
    plan = plan_sequences(lengths, cp=1, total=sum(lengths) + 3)  # 3 tokens of local padding
    pad = plan.local_len - sum(lengths)
    mine = [torch.cat([x, x.new_zeros(pad, *x.shape[1:])]).to(dt).requires_grad_() for x in (q, k, v)]
    out = context_parallel_attention(*mine, plan, None)
    out.backward(torch.cat([dout, dout.new_zeros(pad, *dout.shape[1:])]).to(dt))
    n = sum(lengths)

    def err(a, b):
        return ((a[:n].double() - b).abs().max() / b.abs().max()).item()

    assert err(out.detach(), ref.detach()) <= tol
    assert err(mine[0].grad, ref_in[0].grad) <= tol
    assert err(mine[1].grad, ref_in[1].grad) <= tol
    assert err(mine[2].grad, ref_in[2].grad) <= tol
    assert out[n:].abs().max().item() == 0.0  # padding rows see nothing
