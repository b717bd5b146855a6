"""The copy path's sources: a checkpoint as planned byte ranges, one class per source format, each
built on its format's validating reader (``converters/formats``), so the copy path makes exactly
the checks the torch path makes (the same code) and adds none of its own.

The planner reads only metadata the readers already checked (safetensors headers, the pickles of
``torch.save`` archives, torch_dist ``.metadata``) and builds for every HF tensor the list of
``Copy`` / ``Interleave`` operations that produce its bytes (``converters/copy_path/ops``), before
anything is written. Sources the copy path does not cover (dtype changes, strided storages) raise
``Unsupported`` and the engine takes the torch path. Grouped-GEMM ``GroupedMLP`` experts, whose blocks
are each expert's shard transposed, are planned as ``Transposed`` operations (``copy_path.grouped_moe``):
read and transposed in memory a bounded block at a time.

Dense Gated DeltaNet hybrids (Qwen3.5 text, MTP block included) are planned from the same rules as the
torch path: ``layout.megatron.hf_row_ranges`` places the gated ``linear_qkv`` and the packed ``in_proj``
/ ``conv1d`` components (legacy TP shards: ``blocks_shard_rows``; torch_dist: one tensor per component,
``DistCheckpoint.unit_keys``); the output norm, which Megatron holds minus one, is read while planning and
its other value computed on its bytes (``layout.megatron.shift_bytes``, ``ops.Data``), the stored one kept
for Megatron targets (``PlannedTensor.megatron_ops``). Conditional-generation checkpoints carry their vision
tower (per-head ``qkv``: ``layout.hybrid.row_ranges``; torch_dist's stacked blocks). Mixture-of-experts hybrids
(Qwen3.5-MoE, Qwen3-Next) add their experts as the other MoE models do (legacy: SequentialMLP or Transformer
Engine's grouped names; torch_dist: ``[E, ...]`` per layer).

Mixture-of-experts models (Qwen2-MoE, Qwen3-MoE) are planned like dense ones: every expert is a
plain weight-map entry of its own (``WeightEntry.expert``), so its TP shards are byte ranges (fc1
``[gate_r; up_r]``: row ranges; fc2: rows interleaved over TP) like a dense MLP's. Legacy files
with EP: each expert from the file of its EP rank, everything else from EP rank 0 (every EP rank
holds a copy), as the legacy reader lists them (``LegacyCheckpoint.expected_keys``); SequentialMLP
and Transformer Engine's grouped layout (``linear_fc1.weight{i}``, the same tensors renamed) alike.
torch_dist: experts at ``[layer, expert]`` of the stacked tensors, or ``[expert]`` of per-layer
ones (``DistCheckpoint.layer_keys``). Tensors Megatron does not store (the gate of a Qwen2-MoE
shared expert of width 0) are zeros, as the torch path's readers give them (``absent_tensors``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from converters.copy_path.ops import Block, Copy, PlannedTensor, Unsupported, legacy_blocks, megatron_entry_ops
from converters.copy_path.raw_source import RawSource
from converters.formats import open_checkpoint
from models.common.weight_map import hf_shapes

if TYPE_CHECKING:  # each source's format modules load with it (pmz's start-up: tests/test_startup_imports.py)
    from converters.formats.hf import HFCheckpoint
    from converters.formats.megatron_dist import DistCheckpoint, DistTensor
    from converters.formats.megatron_legacy import LegacyCheckpoint


class HFRawSource(RawSource):
    """An HF directory: each tensor one copy of its validated byte range."""

    format = "hf"

    def __init__(self, checkpoint: HFCheckpoint) -> None:
        self.path = checkpoint.path
        self.hf_config_dir = self.path
        self._set_model(checkpoint)
        names = hf_shapes(self.cfg, self.wmap)
        strided = next((n for n in names if checkpoint.tensors[n].stride is not None), None)
        if strided is not None:  # a release checkpoint's transposed experts: no byte range to copy
            raise Unsupported(f"{self.path}: {strided} is a transposed view of fused experts")
        self.planned = {n: PlannedTensor(t.shape, t.dtype, [Copy(t.path, t.offset, t.nbytes)])
                        for n in names for t in (checkpoint.tensors[n],)}


class LegacyRawSource(RawSource):
    """Megatron legacy rank files (``mp_rank_TT[_PPP]/model_optim_rng.pt``), read as byte ranges."""

    format = "megatron"

    def __init__(self, checkpoint: LegacyCheckpoint) -> None:
        from converters.copy_path.grouped_moe import grouped_expert_ops
        from converters.formats.megatron_args import args_layout
        from converters.formats.tensors import RawTensor
        from converters.layout.experts import source_grouped_gemm, stored_key
        from converters.layout.megatron import megatron_full_shape
        ckpt = checkpoint
        self.path = ckpt.path
        self.layout, self.iteration = args_layout(ckpt.args), ckpt.iteration
        self._set_model(ckpt)
        self.layout["grouped_gemm"] = self.cfg.moe is not None and source_grouped_gemm(ckpt.args, ckpt.expert_layout)
        ckpt.validate()
        shapes = hf_shapes(self.cfg, self.wmap)
        self.planned = {}
        for p in range(ckpt.pp):
            for v in range(ckpt.vpp):
                # experts from the file of their EP rank; the rest from EP rank 0 (each EP rank holds a copy)
                for _unit, entry, key, ep_rank in ckpt.expected_keys(p, v):
                    e = ep_rank or 0
                    shards = ckpt.shards[(p, v, e)][key]
                    stored, slot = stored_key(key, ckpt.expert_layout)
                    if slot is not None:  # a GroupedMLP block: the transpose of the expert's shard
                        self.planned.update(grouped_expert_ops(entry, stored, shards, slot, self.cfg.hidden_size,
                                                               self.cfg.moe.moe_intermediate_size))
                        continue
                    if not all(isinstance(s, RawTensor) for s in shards):
                        raise Unsupported(f"{ckpt.rank_file(0, p, e)}: {key} is not a contiguous tensor")
                    full = megatron_full_shape(entry, shapes, self.cfg, ckpt.padded_vocab)
                    blocks = legacy_blocks(entry, shards, key)
                    self.planned.update(megatron_entry_ops(entry, blocks, full, self.cfg, str(ckpt.it_dir)))
        self._plan_absent(ckpt.dtype)
        self.check_shapes()
        self._plan_hf_values()


class DistRawSource(RawSource):
    """A torch_dist checkpoint: global tensors stored as chunks of ``__R_I.distcp`` files."""

    format = "megatron-dist"

    def __init__(self, checkpoint: DistCheckpoint) -> None:
        from converters.formats.tensors import RawTensor
        from converters.layout.experts import source_grouped_gemm
        from converters.layout.megatron import megatron_full_shape
        from converters.layout.model import all_units
        ckpt = checkpoint
        self.path = str(ckpt.it_dir)
        self.layout, self.iteration = ckpt.layout, ckpt.iteration
        self._set_model(ckpt)
        if self.layout is not None and ckpt.args is not None:  # the expert layout a reshard keeps (by the args)
            self.layout = {**self.layout, "grouped_gemm": self.cfg.moe is not None and source_grouped_gemm(
                ckpt.args, getattr(ckpt, "expert_layout", None))}
        ckpt.validate()
        shapes = hf_shapes(self.cfg, self.wmap)
        self.planned = {}
        by_lead: dict[str, dict[tuple[int, ...], list]] = {}
        for unit in all_units(self.cfg):
            # the torch path's keys: stacked or per layer, experts at [layer, expert] or [expert]; a hybrid's
            # per layer, ``in_proj`` / ``conv1d`` one tensor per component (rows of the full tensor, in order)
            for entry, keys, index in ckpt.unit_keys(unit):
                full = megatron_full_shape(entry, shapes, self.cfg, ckpt.padded_vocab)
                lead = () if index is None else (index,) if isinstance(index, int) else tuple(index)
                blocks, start = [], 0
                for key, rows in keys:
                    if key not in by_lead:
                        by_lead[key] = _chunks_by_lead(ckpt.tensors[key], len(lead))
                    for chunk in by_lead[key].get(lead, ()):
                        t = ckpt.chunk(key, chunk)
                        if not isinstance(t, RawTensor):
                            raise Unsupported(f"{ckpt.it_dir / chunk.file}: chunk of {key} is not a contiguous tensor")
                        offs = chunk.offsets
                        for d, i in enumerate(lead):  # drop the leading dims: this layer's (and expert's) slice
                            t = t.index(i - offs[d])
                        offs = offs[len(lead):]
                        if len(offs) > 2 and any(offs[2:]):
                            raise Unsupported(f"{key}: chunked beyond dim 1")
                        col = offs[1] * _trailing(full[2:]) if len(offs) > 1 else 0
                        blocks.append(Block(start + (offs[0] if offs else 0), col, t))
                    start += rows or 0
                self.planned.update(megatron_entry_ops(entry, blocks, full, self.cfg, str(ckpt.it_dir)))
        self._plan_absent(ckpt.dtype)
        self.check_shapes()
        self._plan_hf_values()


def _chunks_by_lead(tensor: DistTensor, n: int) -> dict[tuple[int, ...], list]:
    """The chunks of a torch_dist tensor by the index along its first ``n`` dims (layer, expert)
    they hold, each chunk under every such index it spans: one pass per tensor instead of a scan
    of all its chunks for every layer and expert."""
    from itertools import product

    out: dict[tuple[int, ...], list] = {}
    for chunk in tensor.chunks:
        if any(s == 0 for s in chunk.sizes):
            continue
        spans = [range(chunk.offsets[d], chunk.offsets[d] + chunk.sizes[d]) for d in range(n)]
        for lead in product(*spans):
            out.setdefault(lead, []).append(chunk)
    return out


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
    if location.format == "vllm":  # converters/copy_path/vllm_source.py
        from converters.copy_path.vllm_source import VllmRawSource
        source = VllmRawSource(open_checkpoint("vllm", path), note=False)  # said once the copy path writes
        source.hf_config_dir = hf_config
        return source
    if location.format not in RAW_SOURCES:
        raise Unsupported(f"{location.format} sources")
    options = {} if location.format == "hf" else {"arch": arch, "hf_config_dir": hf_config, "vocab_size": vocab_size}
    source = RAW_SOURCES[location.format](open_checkpoint(location.format, path, **options))
    if location.format != "hf":
        source.hf_config_dir = hf_config
    return source


__all__ = ["RawSource", "HFRawSource", "LegacyRawSource", "DistRawSource", "RAW_SOURCES", "open_raw_source",
           "Unsupported"]
