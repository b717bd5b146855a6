"""The test suite's reused rank processes (tests/worker_pool.py): a rank that raises, dies or hangs fails its call
with what happened on that rank, and the next call gets new, working ranks; ranks are forked from the session's
fork server with the heavy libraries already imported, and each call still starts from the parent's environment."""

from __future__ import annotations

import os
import sys
import time

import pytest
import torch.distributed as dist

from tests import worker_pool


def _rank_and_world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def _sum_of_ranks() -> float:
    import torch

    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def _raise_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank one's own failure")


def _die_on_rank_one() -> None:
    if dist.get_rank() == 1:
        os._exit(3)


def _hang_on_rank_one() -> None:
    if dist.get_rank() == 1:
        time.sleep(120)


def _preloaded_before_the_call() -> bool:
    # the fork server imported these before this process existed; the call itself imports nothing heavy
    return all(name in sys.modules for name in ("torch", "transformers", "tests.workers"))


def _env(name: str) -> str | None:
    return os.environ.get(name)


def test_ranks_run_the_function_in_a_fresh_group_and_are_reused():
    first = worker_pool.run(2, os.getpid)
    assert worker_pool.run(2, _rank_and_world) == [(0, 2), (1, 2)]
    assert worker_pool.run(2, _sum_of_ranks) == [1.0, 1.0]
    assert worker_pool.run(2, os.getpid) == first  # the same processes


def test_a_raising_rank_fails_the_call_with_its_traceback_and_is_replaced():
    before = worker_pool.run(2, os.getpid)
    with pytest.raises(RuntimeError, match=r"(?s)rank 1:.*ValueError: rank one's own failure"):
        worker_pool.run(2, _raise_on_rank_one)
    after = worker_pool.run(2, os.getpid)
    assert not set(after) & set(before)  # new processes: the old ones may still wait in a collective


def test_a_dead_rank_fails_the_call_and_is_replaced():
    with pytest.raises(RuntimeError, match=r"died or timed out: exit codes \[.*3.*\]"):
        worker_pool.run(2, _die_on_rank_one)
    assert worker_pool.run(2, _sum_of_ranks) == [1.0, 1.0]


def test_a_hung_rank_times_out_and_is_replaced():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"died or timed out"):
        worker_pool.run(2, _hang_on_rank_one, timeout=4.0)
    assert time.monotonic() - start < 60  # not the 120 s the rank sleeps
    assert worker_pool.run(2, _sum_of_ranks) == [1.0, 1.0]


@pytest.mark.skipif(os.environ.get("PMZ_TEST_POOL") == "0", reason="PMZ_TEST_POOL=0 spawns fresh processes")
def test_forked_ranks_start_with_the_libraries_loaded_and_the_callers_environment(monkeypatch):
    if os.environ.get("PMZ_TEST_POOL_START", "forkserver") == "forkserver":
        assert worker_pool.run(2, _preloaded_before_the_call) == [True, True]
    monkeypatch.setenv("PMZ_POOL_PROBE", "set after the fork server started")
    assert worker_pool.run(2, _env, "PMZ_POOL_PROBE") == ["set after the fork server started"] * 2
