"""Tests run their multi-process cases on ranks reused across the session (``tests/worker_pool.py``;
``PMZ_TEST_POOL=0``: fresh processes per call through the project's local launcher, gloo on CPU)."""

from parallel.launch import free_port
from tests.worker_pool import run as run_distributed

__all__ = ["free_port", "run_distributed"]
