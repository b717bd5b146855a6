"""The copy path's vLLM ``sharded_state`` writer (not built yet: every vLLM target takes the torch path)."""

from __future__ import annotations

from typing import Any

from converters.copy_path.ops import Unsupported


def plan_vllm_target(source: Any, *, tp: int, pp: int) -> Any:
    raise Unsupported("vLLM targets (the torch path writes them)")


def write_vllm_by_copy(source: Any, target: Any, directory: str, *, max_shard_bytes: int, workers: int,
                       progress: bool, files_from: str | None) -> None:
    raise Unsupported("vLLM targets (the torch path writes them)")
