"""Running stage modules under ``torch.distributed.pipelining`` schedules (architecture-agnostic).

The project computes which layers each stage holds; the schedules themselves (GPipe, 1F1B,
interleaved 1F1B, looped BFS, interleaved zero-bubble) are torch's. Micro-batches are prepared by
the caller (variable-length packed batches padded to one shape), so the schedule is driven with
its per-micro-batch entry point instead of ``step``'s even split of one tensor.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

SINGLE_STAGE = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}
MULTI_STAGE = {"interleaved_1f1b": "ScheduleInterleaved1F1B", "looped_bfs": "ScheduleLoopedBFS",
               "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble"}
SCHEDULES = tuple(SINGLE_STAGE) + tuple(MULTI_STAGE)


class ScheduleError(ValueError):
    """A schedule that does not fit the layout (named)."""


def check_schedule(name: str, vpp: int, num_microbatches: int, pp: int) -> None:
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r} (choose {', '.join(SCHEDULES)})")
    if name in SINGLE_STAGE and vpp > 1:
        raise ScheduleError(f"schedule {name!r} runs one stage per rank; "
                            f"vpp={vpp} needs one of {', '.join(MULTI_STAGE)}")
    if name in MULTI_STAGE and num_microbatches % pp:
        raise ScheduleError(f"schedule {name!r} needs the micro-batch count ({num_microbatches}) "
                            f"to be a multiple of pp={pp}")


def resolve_schedule(name: str, vpp: int) -> str:
    """The schedule that runs: "1f1b" with virtual stages is the interleaved 1F1B."""
    return "interleaved_1f1b" if name == "1f1b" and vpp > 1 else name


def microbatch_multiple(name: str, pp: int) -> int:
    """What the micro-batch count must be a multiple of for ``name``."""
    return pp if name in MULTI_STAGE else 1


def microbatch_minimum(name: str, pp: int) -> int:
    """The fewest micro-batches ``name`` runs with (torch's 1F1B needs at least one per stage)."""
    return pp if name == "1f1b" else 1


class PipelineRunner:
    """A schedule and its ``PipelineStage``s built once for one shape (micro-batch count and tensor
    sizes) and reused across steps, so shape inference and buffer set-up happen once, not per step."""

    def __init__(self, chunks: Sequence[nn.Module], *, stage_indices: Sequence[int], num_stages: int, pp_group: Any,
                 device: torch.device, schedule: str, n_microbatches: int,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        from torch.distributed import pipelining as pl

        self.chunks = list(chunks)
        self.loss_fn = loss_fn
        self.stages = [pl.PipelineStage(chunk, idx, num_stages, device, group=pp_group)
                       for chunk, idx in zip(self.chunks, stage_indices)]
        if schedule in SINGLE_STAGE:
            self.schedule = getattr(pl, SINGLE_STAGE[schedule])(self.stages[0], n_microbatches=n_microbatches,
                                                                 loss_fn=loss_fn, scale_grads=False)
        else:
            self.schedule = getattr(pl, MULTI_STAGE[schedule])(self.stages, n_microbatches=n_microbatches,
                                                               loss_fn=loss_fn, scale_grads=False)

    def run(self, arg_mbs: list, kwarg_mbs: list, target_mbs: list | None, has_backward: bool) -> list:
        """One step over the micro-batches; returns the per-micro-batch loss_fn outputs (last stage)."""
        self.schedule._has_backward = has_backward
        for stage in self.stages:
            stage.has_backward = has_backward
            stage.clear_runtime_states()
        losses: list = []
        with torch.set_grad_enabled(has_backward):
            self.schedule._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs=False)
        return losses
