"""Tests run their multi-process cases on ranks reused across the session (``tests/worker_pool.py``;
``PMZ_TEST_POOL=0``: fresh processes per call through the project's local launcher, gloo on CPU)."""

from parallel.launch import free_port
from tests.worker_pool import run as run_distributed

__all__ = ["free_port", "records_on_ranks", "run_distributed"]


def records_on_ranks(world: int, fn, *args) -> list:
    """Every rank's list of records from ``fn(*args)``, concatenated in rank order; ``world == 1`` runs
    ``fn`` in this process (the single-process layouts need no process group)."""
    if world == 1:
        return fn(*args)
    return [rec for rank_records in run_distributed(world, fn, *args) for rec in rank_records]
