"""The copy path's sources: a checkpoint as planned byte ranges, one class per source format, each
built on its format's validating reader (``converters/formats``), so the copy path makes exactly
the checks the torch path makes (the same code) and adds none of its own.

The planner reads only metadata the readers already checked (safetensors headers, the pickles of
``torch.save`` archives, torch_dist ``.metadata``) and builds for every HF tensor the list of
``Copy`` / ``Interleave`` operations that produce its bytes (``converters/copy_path/ops``), before
anything is written. Sources the copy path does not cover (dtype changes, strided storages, expert
parallelism, mixture-of-experts models) raise ``Unsupported`` and the engine takes the torch path.
"""

from __future__ import annotations

from typing import Any

from converters.copy_path.ops import (
    Block,
    Copy,
    PlannedTensor,
    Unsupported,
    legacy_blocks,
    megatron_entry_ops,
)
from converters.formats import open_checkpoint
from converters.formats.hf import HFCheckpoint
from converters.formats.megatron_args import args_layout
from converters.formats.megatron_dist import DistCheckpoint
from converters.formats.megatron_legacy import LegacyCheckpoint
from converters.formats.tensors import TAG_TO_TORCH_NAME, RawTensor
from converters.layout.megatron import megatron_full_shape
from converters.layout.model import EMBED, FINAL, Unit
from converters.layout.stages import dist_key, unit_megatron_keys
from models.common.errors import CheckpointError
from models.common.weight_map import WeightEntry, hf_shapes


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

    def _set_model(self, checkpoint: Any) -> None:
        """The model of a format reader's checkpoint; ``Unsupported`` for mixture-of-experts models."""
        self.hf_config, self.arch, self.cfg, self.wmap = (checkpoint.hf_config, checkpoint.arch, checkpoint.cfg,
                                                          checkpoint.wmap)
        if self.cfg.moe is not None:
            raise Unsupported("mixture of experts (the torch path converts it)")

    def units(self) -> list[tuple[Unit, list[WeightEntry]]]:
        out: list[tuple[Unit, list[WeightEntry]]] = [(EMBED, list(self.wmap.first_entries))]
        out += [(i, [e.format(i) for e in self.wmap.layer_entries]) for i in range(self.cfg.num_hidden_layers)]
        out.append((FINAL, list(self.wmap.last_entries)))
        return out

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


class HFRawSource(RawSource):
    """An HF directory: each tensor one copy of its validated byte range."""

    format = "hf"

    def __init__(self, checkpoint: HFCheckpoint) -> None:
        self.path = checkpoint.path
        self.hf_config_dir = self.path
        self._set_model(checkpoint)
        self.planned = {n: PlannedTensor(t.shape, t.dtype, [Copy(t.path, t.offset, t.nbytes)])
                        for n in hf_shapes(self.cfg, self.wmap) for t in (checkpoint.tensors[n],)}


class LegacyRawSource(RawSource):
    """Megatron legacy rank files (``mp_rank_TT[_PPP]/model_optim_rng.pt``), read as byte ranges."""

    format = "megatron"

    def __init__(self, checkpoint: LegacyCheckpoint) -> None:
        ckpt = checkpoint
        self.path = ckpt.path
        self.layout, self.iteration = args_layout(ckpt.args), ckpt.iteration
        self._set_model(ckpt)
        if ckpt.ep > 1:
            raise Unsupported("expert parallel")
        ckpt.validate()
        shapes = hf_shapes(self.cfg, self.wmap)
        self.planned = {}
        for p in range(ckpt.pp):
            for v in range(ckpt.vpp):
                for unit, local in ckpt.layout.stage_units(p, v):
                    for entry, key in unit_megatron_keys(self.wmap, unit, local):
                        shards = ckpt.shards[(p, v, 0)][key]
                        if not all(isinstance(s, RawTensor) for s in shards):
                            raise Unsupported(f"{ckpt.rank_file(0, p)}: {key} is not a contiguous tensor")
                        full = megatron_full_shape(entry, shapes, self.cfg, ckpt.padded_vocab)
                        blocks = legacy_blocks(entry, shards, key)
                        self.planned.update(megatron_entry_ops(entry, blocks, full, self.cfg, str(ckpt.it_dir)))
        self.check_shapes()


class DistRawSource(RawSource):
    """A torch_dist checkpoint: global tensors stored as chunks of ``__R_I.distcp`` files."""

    format = "megatron-dist"

    def __init__(self, checkpoint: DistCheckpoint) -> None:
        ckpt = checkpoint
        self.path = str(ckpt.it_dir)
        self.layout, self.iteration = ckpt.layout, ckpt.iteration
        self._set_model(ckpt)
        ckpt.validate()
        shapes = hf_shapes(self.cfg, self.wmap)
        self.planned = {}
        for unit, _ in self.units():
            layer = None if unit in (EMBED, FINAL) else int(unit)
            templates = (self.wmap.first_entries if unit == EMBED else self.wmap.last_entries if unit == FINAL
                         else self.wmap.layer_entries)
            for tmpl in templates:
                entry = tmpl if layer is None else tmpl.format(layer)
                full = megatron_full_shape(entry, shapes, self.cfg, ckpt.padded_vocab)
                key, index = dist_key(tmpl.megatron, layer, ckpt.tensors)
                blocks = []
                for chunk in ckpt.tensors[key].chunks:
                    offs = chunk.offsets
                    if index is not None and not offs[0] <= index < offs[0] + chunk.sizes[0]:
                        continue
                    t = ckpt.chunk(key, chunk)
                    if not isinstance(t, RawTensor):
                        raise Unsupported(f"{ckpt.it_dir / chunk.file}: chunk of {key} is not a contiguous tensor")
                    if index is not None:
                        t, offs = t.index(index - offs[0]), offs[1:]
                    if len(offs) > 2 and any(offs[2:]):
                        raise Unsupported(f"{key}: chunked beyond dim 1")
                    col = offs[1] * _trailing(full[2:]) if len(offs) > 1 else 0
                    blocks.append(Block(offs[0] if offs else 0, col, t))
                self.planned.update(megatron_entry_ops(entry, blocks, full, self.cfg, str(ckpt.it_dir)))
        self.check_shapes()


def _trailing(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


# format name (converters.formats.detect_format) -> the copy path's source over its validating reader
RAW_SOURCES = {"hf": HFRawSource, "megatron": LegacyRawSource, "megatron-dist": DistRawSource}


def open_raw_source(path: str, *, arch: str | None = None, hf_config: str | None = None,
                    vocab_size: int | None = None) -> RawSource:
    """The copy path's view of a checkpoint; ``Unsupported`` where the torch path must read it.

    ``path`` is located as the torch path does (verl actor folders, Megatron-Bridge iterations: see
    ``converters/formats/locate``) and opened by its format's validating reader, the one the torch
    path's reader wraps; CheckpointError for a damaged or inconsistent source, from either."""
    from converters.formats.locate import locate_source

    location = locate_source(path, hf_config)
    path, hf_config = location.path, hf_config or location.hf_config_dir
    if location.format not in RAW_SOURCES:
        raise Unsupported(f"{location.format} sources")
    options = {} if location.format == "hf" else {"arch": arch, "hf_config_dir": hf_config, "vocab_size": vocab_size}
    source = RAW_SOURCES[location.format](open_checkpoint(location.format, path, **options))
    if location.format != "hf":
        source.hf_config_dir = hf_config
    return source


__all__ = ["RawSource", "HFRawSource", "LegacyRawSource", "DistRawSource", "RAW_SOURCES", "open_raw_source",
           "Unsupported"]
