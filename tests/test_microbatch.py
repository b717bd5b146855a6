"""Micro-batch planning: every sample exactly once, budget respected, balanced, order restorable."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parallel.microbatch import MicrobatchError, karmarkar_karp, plan_microbatches
from parallel.pipeline import ScheduleError, check_schedule

lengths = st.lists(st.integers(min_value=1, max_value=64), min_size=1, max_size=40)


@settings(max_examples=80, deadline=None)
@given(lengths, st.integers(1, 4), st.integers(1, 3), st.one_of(st.none(), st.integers(64, 400)))
def test_plan_keeps_every_sample_once_and_respects_budget(lens, nmb, multiple, budget):
    try:
        plan = plan_microbatches(lens, max_tokens_per_microbatch=budget, num_microbatches=nmb, multiple_of=multiple)
    except MicrobatchError:
        # only legitimate when there are too few samples for the needed count
        needed = max(nmb, -(-sum(lens) // budget) if budget else 1)
        assert len(lens) < -(-needed // multiple) * multiple
        return
    flat = sorted(i for g in plan.groups for i in g)
    assert flat == list(range(len(lens)))
    assert all(g for g in plan.groups)
    assert plan.count % multiple == 0 and plan.count >= nmb
    assert list(plan.tokens) == [sum(lens[i] for i in g) for g in plan.groups]
    if budget is not None:
        assert max(plan.tokens) <= budget
    work = [sum(lens[i] ** 2 for i in g) for g in plan.groups]
    assert work == sorted(work, reverse=True)  # heaviest first
    restored = plan.restore_order([[lens[i] for i in g] for g in plan.groups])
    assert restored == list(lens)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=2, max_size=9), st.integers(2, 3))
def test_karmarkar_karp_is_near_optimal_on_small_inputs(weights, k):
    if len(weights) < k:
        return
    groups = karmarkar_karp(weights, k)
    spread = max(sum(weights[i] for i in g) for g in groups) - min(sum(weights[i] for i in g) for g in groups)
    # brute force optimum of the max-min spread
    best = min(
        max(sums) - min(sums)
        for assign in itertools.product(range(k), repeat=len(weights))
        if len(set(assign)) == k
        for sums in [[sum(w for w, a in zip(weights, assign) if a == j) for j in range(k)]]
    )
    assert spread <= best + max(weights)  # KK's guarantee is heuristic; never worse than one item off
    assert sorted(i for g in groups for i in g) == list(range(len(weights)))


def test_sample_longer_than_budget_is_named():
    with pytest.raises(MicrobatchError, match="100 tokens exceeds max_tokens_per_microbatch=50"):
        plan_microbatches([10, 100], max_tokens_per_microbatch=50)


def test_too_few_samples_for_the_schedule():
    with pytest.raises(MicrobatchError, match="3 samples cannot fill 4"):
        plan_microbatches([5, 5, 5], num_microbatches=3, multiple_of=2)


def test_schedule_checks():
    with pytest.raises(ScheduleError, match="unknown schedule"):
        check_schedule("nope", 1, 2, 2)
    with pytest.raises(ScheduleError, match="vpp=2"):
        check_schedule("gpipe", 2, 2, 2)
    with pytest.raises(ScheduleError, match="multiple of pp=2"):
        check_schedule("interleaved_1f1b", 2, 3, 2)


def _round_robin_spread(weights, k: int) -> int:
    """The naive alternative: weights dealt heaviest first, one group after another."""
    sums = [0] * k
    for j, i in enumerate(sorted(range(len(weights)), key=lambda i: -weights[i])):
        sums[j % k] += weights[i]
    return max(sums) - min(sums)


def _adversarial_instances(count: int = 200):
    import random

    rng = random.Random(0)
    for _ in range(count):
        yield [rng.randint(1, 1000) for _ in range(rng.randint(12, 40))], rng.choice([2, 3, 4])


def test_karmarkar_karp_beats_round_robin_on_every_instance():
    """KK's spread is never above round-robin's on seeded random instances, and on average a small
    fraction of it (measured: mean 11 vs 619 tokens; bound 5%): a round-robin planner fails this."""
    kk_total = rr_total = 0
    for weights, k in _adversarial_instances():
        groups = karmarkar_karp(weights, k)
        sums = [sum(weights[i] for i in g) for g in groups]
        kk, rr = max(sums) - min(sums), _round_robin_spread(weights, k)
        assert kk <= rr, (weights, k, kk, rr)
        kk_total, rr_total = kk_total + kk, rr_total + rr
    assert kk_total <= 0.05 * rr_total, (kk_total, rr_total)


def test_planner_balances_tokens_like_karmarkar_karp():
    """plan_microbatches' token counts are balanced as well as KK's (not just any valid split)."""
    kk_total = rr_total = 0
    for lens, k in _adversarial_instances(100):
        plan = plan_microbatches(lens, num_microbatches=k)
        assert plan.count == k
        spread, rr = max(plan.tokens) - min(plan.tokens), _round_robin_spread(lens, k)
        assert spread <= rr, (lens, k, spread, rr)
        kk_total, rr_total = kk_total + spread, rr_total + rr
    assert kk_total <= 0.05 * rr_total, (kk_total, rr_total)
