"""Which decoder layers each pipeline stage (and virtual chunk) holds, as Megatron assigns them.

Pure arithmetic, no process groups: converters use it to map Megatron's stage-local layer numbers
to global ones, and models use it to build only this rank's layers.

Even split: every (rank, chunk) holds ``L / (pp * vpp)`` consecutive layers, and chunk ``v`` of
pipeline rank ``p`` starts at ``v * (L / vpp) + p * (L / (pp * vpp))`` (interleaved assignment).
Uneven split (no VPP): the first/last stage hold the given counts, the middle stages share the rest
evenly.
"""

from __future__ import annotations

from typing import Protocol

from parallel.errors import ParallelConfigError


class StageLayout(Protocol):
    """What the split reads of a layout (``parallel.config.ParallelConfig`` has it; that module imports this one)."""

    pp: int
    vpp: int
    num_layers_in_first_pipeline_stage: int | None
    num_layers_in_last_pipeline_stage: int | None


def stage_layer_ranges(num_layers: int, config: StageLayout) -> list[list[range]]:
    """``ranges[pp_rank][vpp_chunk]`` = the global layer indices that chunk holds.

    Raises ParallelConfigError naming the numbers when the layers cannot be split that way.
    """
    pp, vpp = config.pp, config.vpp
    first = config.num_layers_in_first_pipeline_stage
    last = config.num_layers_in_last_pipeline_stage
    if num_layers < 1:
        raise ParallelConfigError(f"num_layers={num_layers} must be positive")
    if first is None and last is None:
        if num_layers % (pp * vpp):
            raise ParallelConfigError(
                f"num_layers={num_layers} is not divisible by pp*vpp = {pp}*{vpp} = {pp * vpp}; "
                f"set num_layers_in_first/last_pipeline_stage for an uneven split"
            )
        per_chunk = num_layers // (pp * vpp)
        per_model_chunk = num_layers // vpp
        return [
            [range(v * per_model_chunk + p * per_chunk, v * per_model_chunk + (p + 1) * per_chunk) for v in range(vpp)]
            for p in range(pp)
        ]
    if vpp > 1:
        raise ParallelConfigError(
            f"uneven pipeline stages (first={first}, last={last}) are not supported together with vpp={vpp}"
        )
    counts: list[int | None] = [None] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    fixed = sum(c for c in counts if c is not None)
    free = [i for i, c in enumerate(counts) if c is None]
    rest = num_layers - fixed
    if rest < 0 or (free and (rest % len(free) or rest // len(free) < 1)) or (not free and rest != 0):
        raise ParallelConfigError(
            f"cannot split num_layers={num_layers} over pp={pp} with first stage={first}, last stage={last}: "
            f"{rest} layers left for {len(free)} other stage(s) must divide evenly, at least one each"
        )
    for i in free:
        counts[i] = rest // len(free)
    ranges, start = [], 0
    for c in counts:
        assert c is not None
        ranges.append([range(start, start + c)])
        start += c
    return ranges
