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
