"""Qwen3 / Qwen3-MoE rank bodies: one spawned group runs the existing harnesses on the Qwen3 cases
(tests/cases.py ``qwen3_configs``) and returns their records as ``(kind, case, layout, metric, value)``;
tests/test_qwen3.py applies each harness's own bounds. Every harness compares with transformers (or
peft) loaded from the same directory in the same process."""

from __future__ import annotations

import torch.distributed as dist

from parallel import ParallelConfig


def _layout(kwargs: dict) -> str:
    return ParallelConfig(**kwargs).describe()


def run_item(item: tuple, dirs: dict[str, str]) -> list[tuple]:
    """One plan item: ``(kind, case, *arguments)``."""
    kind, case, *args = item
    path = dirs[case]
    world = dist.get_world_size()
    if kind in ("parity", "packed", "bf16"):
        from tests.workers import bf16_case, packed_case, parity_case

        (sp,) = args
        body = {"parity": parity_case, "packed": packed_case, "bf16": bf16_case}[kind]
        layout = _layout(dict(tp=world, sequence_parallel=sp))
        return [(kind, case, layout, r[3], r[4]) for r in body(case, path, world, sp)]
    if kind == "long":
        from tests.workers_long_context import long_context_suite

        (kwargs,) = args
        return [(kind, case, r[1], r[2], r[3]) for r in long_context_suite([(case, path, kwargs)])]
    if kind == "pipeline":
        from tests.workers_pipeline import pipeline_case

        kwargs, schedule, microbatches = args
        records = pipeline_case(case, path, ParallelConfig(**kwargs), schedule, microbatches)
        return [(kind, case, f"{r[1]} {schedule}", r[4], r[5]) for r in records]
    if kind == "lora":
        from tests.workers_lora import lora_case

        adapter, kwargs = args
        out = f"{adapter}_out_{world}_{_layout(kwargs).replace(' ', '_')}"
        return [(kind, case, r[1], r[3], r[4]) for r in lora_case(case, path, adapter, out, kwargs)]
    if kind == "moe":
        from tests.workers_moe import parity

        kwargs, *options = args
        records = parity(case, path, ParallelConfig(**kwargs), **(options[0] if options else {}))
        return [(kind, case, r[1], r[2], r[3]) for r in records]
    raise ValueError(f"unknown plan item kind {kind!r}")


def qwen3_suite(dirs: dict[str, str], plan: list[tuple]) -> list[tuple]:
    return [r for item in plan for r in run_item(item, dirs)]
