"""Where units live in a Megatron checkpoint: pipeline stages, virtual chunks, stage-local layer keys.

Torch-free, shared by the readers (``megatron_legacy``), the torch writers (``megatron_write``)
and the copy path's writers (``copy_targets``).
"""

from __future__ import annotations

from typing import Union

from models.common.errors import CheckpointError
from models.common.weight_map import WeightEntry
from parallel.config import ParallelConfig, ParallelConfigError
from parallel.pipeline_layout import stage_layer_ranges

EMBED, FINAL = "embed", "final"
Unit = Union[int, str]
RANK_FILE = "model_optim_rng.pt"
# Megatron-LM saves an (empty) extra state for every linear layer; its strict load expects it.
LINEAR_MODULES = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


class MegatronLayout:
    """Where each global layer lives for a (pp, vpp, uneven) layout."""

    def __init__(self, num_layers: int, pp: int, vpp: int, first: int | None, last: int | None, where: str) -> None:
        try:
            pconfig = ParallelConfig(pp=pp, vpp=vpp, num_layers_in_first_pipeline_stage=first,
                                     num_layers_in_last_pipeline_stage=last)
            self.ranges = stage_layer_ranges(num_layers, pconfig)
        except ParallelConfigError as exc:
            raise CheckpointError(f"{where}: {exc}") from exc
        self.pp, self.vpp = pp, vpp
        self.where: dict[int, tuple[int, int, int]] = {}
        for p, chunks in enumerate(self.ranges):
            for v, layers in enumerate(chunks):
                for j, i in enumerate(layers):
                    self.where[i] = (p, v, j)

    def unit_location(self, unit: Unit) -> tuple[int, int]:
        """(pp rank, chunk) holding a unit."""
        if unit == EMBED:
            return 0, 0
        if unit == FINAL:
            return self.pp - 1, self.vpp - 1
        p, v, _ = self.where[int(unit)]
        return p, v

    def stage_units(self, p: int, v: int) -> list[tuple[Unit, int | None]]:
        """(unit, stage-local layer index or None) held by chunk ``v`` of stage ``p``, in order."""
        units: list[tuple[Unit, int | None]] = []
        if p == 0 and v == 0:
            units.append((EMBED, None))
        units += [(i, j) for j, i in enumerate(self.ranges[p][v])]
        if p == self.pp - 1 and v == self.vpp - 1:
            units.append((FINAL, None))
        return units


def unit_megatron_keys(reader_wmap, unit: Unit, local_index: int | None) -> list[tuple[WeightEntry, str]]:
    """(entry with global HF names, Megatron key with the stage-local layer number) for a unit."""
    if unit == EMBED:
        return [(e, e.megatron) for e in reader_wmap.first_entries]
    if unit == FINAL:
        return [(e, e.megatron) for e in reader_wmap.last_entries]
    return [(t.format(int(unit)), t.megatron.format(i=local_index)) for t in reader_wmap.layer_entries]


def extra_state_modules(unit: Unit, local_index: int | None) -> list[str]:
    """Modules whose (empty) ``_extra_state`` a Megatron-LM rank file holds for this unit."""
    if isinstance(unit, int):
        return [f"decoder.layers.{local_index}.{m}" for m in LINEAR_MODULES]
    return ["output_layer"] if unit == FINAL else []
