"""The copy path's source base class: a checkpoint as planned byte ranges (``RawSource``), which every
source format's planner fills (``copy_path.sources`` for HF, legacy and torch_dist; ``copy_path.vllm_source``
for vLLM ``sharded_state``), with what all of them share: the units in the torch path's order, the
``minus_one`` values (``layout.megatron.shift_bytes``), absent tensors as zeros, the one-dtype check."""

from __future__ import annotations

from typing import Any

from converters.copy_path.io import read_ops
from converters.copy_path.ops import Data, PlannedTensor, Unsupported, Zeros
from converters.formats.hf import nbytes
from converters.formats.tensors import TAG_TO_TORCH_NAME
from converters.layout.hybrid import unit_absent
from converters.layout.megatron import LayoutError, shift_bytes
from converters.layout.model import Unit, all_units, is_qwen3_vl, megatron_weight_map, unit_entries
from models.common.errors import CheckpointError
from models.common.weight_map import MINUS_ONE, WeightEntry, hf_shapes


class RawSource:
    """A checkpoint as planned byte ranges. Subclasses fill ``planned`` (HF name -> PlannedTensor)."""

    format: str
    path: str
    hf_config: Any
    cfg: Any
    wmap: Any
    planned: dict[str, PlannedTensor]
    hf_config_dir: str | None = None
    iteration: int | None = None  # Megatron sources: the iteration recorded in the checkpoint
    layout: dict | None = None  # Megatron sources with args: megatron_args.args_layout (tp, pp, vpp, ...)
    notes: list[str] = []  # what the user is told on stderr once the copy path writes (the torch path's reader
    # says the same when it takes over, so a source says nothing until the copy path commits)

    def say_notes(self) -> None:
        import sys

        for line in self.notes:
            print(line, file=sys.stderr)

    def _set_model(self, checkpoint: Any) -> None:
        """The model of a format reader's checkpoint."""
        self.hf_config, self.arch, self.cfg, self.wmap = (checkpoint.hf_config, checkpoint.arch, checkpoint.cfg,
                                                          checkpoint.wmap)

    def units(self) -> list[tuple[Unit, list[WeightEntry]]]:
        """(unit, its weight-map entries with global names) in order: the torch path's units, so both
        paths lay out the same HF files (MoE layers: experts expanded to every expert's names)."""
        return [(unit, unit_entries(self.wmap, unit)) for unit in all_units(self.cfg)]

    def _plan_hf_values(self) -> None:
        """A Megatron source's ``minus_one`` tensors: the stored bytes kept as ``megatron_ops`` (a Megatron
        target carries them as stored, as the torch path does), the HF value computed from them
        (``layout.megatron.shift_bytes``, + 1 in fp32)."""
        for entry in _minus_one_entries(self):
            pt = self.planned[entry.hf[0]]
            pt.megatron_ops = pt.ops
            pt.ops = [Data(_shift(read_ops(pt.ops), pt.dtype, 1.0, entry.hf[0]))]

    def plan_megatron_values(self) -> None:
        """The Megatron values of the ``minus_one`` tensors (HF - 1, in fp32, rounded) for a Megatron target,
        computed now, before anything is written: ``Unsupported`` where there is no one answer (a NaN). Qwen3-VL's
        map becomes the one with its Megatron names (the tower's ``vision_model.*``: ``layout.model.
        megatron_weight_map``; an HF source's map names only HF tensors there), as the torch path's writers take."""
        if is_qwen3_vl(self.cfg):
            self.wmap = megatron_weight_map(self.arch, self.cfg)
        for entry in _minus_one_entries(self):
            pt = self.planned[entry.hf[0]]
            if pt.megatron_ops is None:
                pt.megatron_ops = [Data(_shift(read_ops(pt.ops), pt.dtype, -1.0, entry.hf[0]))]

    def _plan_absent(self, tag: str) -> None:
        """Zeros for the HF tensors a Megatron checkpoint does not store (``absent_tensors``: the
        gate of a Qwen2-MoE shared expert of width 0), in the checkpoint's dtype as the torch path's
        readers make them."""
        for unit in all_units(self.cfg):
            for name, shape in unit_absent(self.wmap, unit).items():
                self.planned[name] = PlannedTensor(tuple(shape), tag, [Zeros(nbytes(shape, tag))])

    def dtype(self) -> str:
        """The one dtype tag of every tensor; ``Unsupported`` for several, or one torch cannot name."""
        dtypes = {p.dtype for p in self.planned.values()}
        if len(dtypes) != 1:
            raise Unsupported(f"{self.path}: tensors in several dtypes {sorted(dtypes)}")
        tag = next(iter(dtypes))
        if tag not in TAG_TO_TORCH_NAME:
            raise Unsupported(f"{self.path}: dtype {tag}")
        return tag

    def check_shapes(self) -> None:
        """The plan produces every HF tensor of the model with its shape (an invariant of planning:
        the format reader checked the source)."""
        expected = hf_shapes(self.cfg, self.wmap)
        for name, shape in expected.items():
            got = self.planned.get(name)
            if got is None:
                raise CheckpointError(f"{self.path}: no source for tensor {name}")
            if tuple(got.shape) != tuple(shape):
                raise CheckpointError(f"{self.path}: {name} would have shape {got.shape}, the config implies {shape}")


def _minus_one_entries(source: RawSource) -> list[WeightEntry]:
    """The weight-map entries (global names) whose Megatron value is the HF value minus one."""
    return [e for _, entries in source.units() for e in entries if e.megatron_layout == MINUS_ONE]


def _shift(data: bytes, tag: str, delta: float, name: str) -> bytes:
    try:
        return shift_bytes(data, tag, delta)
    except LayoutError as exc:  # a NaN, or a dtype without the rule: the torch path's arithmetic decides
        raise Unsupported(f"{name}: {exc}") from None
