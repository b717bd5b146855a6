"""Tests run their multi-process cases with the project's local launcher (gloo on CPU)."""

from parallel.launch import free_port, run_distributed

__all__ = ["free_port", "run_distributed"]
