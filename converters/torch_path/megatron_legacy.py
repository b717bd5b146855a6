"""Megatron-LM legacy ``torch`` checkpoints on the torch path: a reader over the format's validating
reader, and the rank-file writer.

Layout (see ``converters/formats/megatron_legacy``): ``<root>/latest_checkpointed_iteration.txt``,
``<root>/iter_XXXXXXX/mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` holding ``args``, ``iteration``,
``checkpoint_version`` and ``model`` (or ``model0``, ``model1``... per virtual chunk).

Reading: ``LegacyCheckpoint`` checked every file and tensor and lists them as byte locations; the
reader maps them as tensors (``MappedFiles``) and hands the writers row pieces that are views of
the mapped TP shards where the layout allows. Writing: one rank file per task (a legacy file must
be pickled whole), each unit of the stage read once, only this TP rank's shards kept; saved with
``torch.save`` through a Python file object so that a failed write keeps its errno (see
``converters.runtime.tasks.os_error_of``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from converters.formats.megatron_args import legacy_rank_dir_name
from converters.formats.megatron_legacy import LegacyCheckpoint, rank_file_object
from converters.layout.experts import (
    GROUPED_GEMM,
    SEQUENTIAL,
    TE_GROUPED,
    fc_of,
    grouped_block,
    pack_grouped,
    stored_key,
)
from converters.layout.hybrid import legacy_extra_states, to_hf, tower_modules, unit_absent, unit_keys
from converters.layout.megatron import (
    COL1,
    GATE_UP,
    REPLICATED,
    ROW0,
    LayoutError,
    hf_row_ranges,
    legacy_shards,
    merge_legacy,
    slices_of_shards,
    tp_split_kind,
)
from converters.layout.model import EMBED, FINAL, Unit, is_hybrid, is_qwen3_vl, megatron_weight_map
from converters.layout.stages import RANK_FILE, extra_state_modules, writes_te_norms
from converters.torch_path.megatron_target import MegatronTarget, megatron_unit_tensors
from converters.torch_path.reader import TORCH_DTYPES, CheckpointReader, MappedFiles, ReaderInfo, reopen
from models.common.errors import CheckpointError
from models.common.hybrid.vision import TOWER_QKV
from models.common.weight_map import PLAIN


class LegacyReader(CheckpointReader):
    megatron = True

    def __init__(self, path: str | os.PathLike, *, arch: str | None = None, hf_config_dir: str | None = None,
                 vocab_size: int | None = None) -> None:
        self.path = str(path)
        self._remember_args(self.path, arch=arch, hf_config_dir=hf_config_dir, vocab_size=vocab_size)
        self.ckpt = ckpt = LegacyCheckpoint(self.path, arch=arch, hf_config_dir=hf_config_dir, vocab_size=vocab_size)
        self.it_dir, self.args = ckpt.it_dir, ckpt.args
        self.tp, self.pp, self.vpp, self.ep = ckpt.tp, ckpt.pp, ckpt.vpp, ckpt.ep
        self.hf_config, self.arch, self.cfg, self.wmap = ckpt.hf_config, ckpt.arch, ckpt.cfg, ckpt.wmap
        self.layout, self.padded_vocab = ckpt.layout, ckpt.padded_vocab
        self.info = ReaderInfo("megatron", self.arch.name,
                               {"tp": self.tp, "pp": self.pp, "vpp": self.vpp, "padded_vocab": self.padded_vocab,
                                "iteration": ckpt.iteration,
                                **({"ep": self.ep, "etp": self.tp, "experts": ckpt.expert_layout}
                                   if self.cfg.moe is not None else {})},
                               self.tp * self.pp * self.ep, TORCH_DTYPES.get(ckpt.dtype, torch.float32))
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._files = MappedFiles()

    def rank_file(self, t: int, p: int, e: int = 0) -> Path:
        return self.ckpt.rank_file(t, p, e)

    def validate(self) -> None:
        """``LegacyCheckpoint.validate``: every rank file, tensor and shape (see there)."""
        self.ckpt.validate()

    def _shards(self, key: str, p: int, e: int, v: int) -> tuple[list[torch.Tensor], bool]:
        """The TP shards of ``key`` in chunk ``v`` of stage ``p`` (EP rank ``e``), mapped from the files,
        and whether they are GroupedMLP blocks (views cut from ``weight1``/``weight2``, not file ranges)."""
        out, grouped = [], False
        for t in range(self.tp):
            stored, location, slot = self.ckpt.locate(t, p, e, v, key)
            if location is None:
                raise CheckpointError(f"{self.it_dir}: missing tensor {stored} on pp rank {p}")
            tensor = self._files.tensor(location)
            if slot is not None:
                tensor, grouped = grouped_block(tensor, slot, self.cfg.moe.num_experts // self.ep,
                                                self.cfg.hidden_size, fc_of(stored)), True
            out.append(tensor)
        return out, grouped

    @staticmethod
    def _shard_of(piece: torch.Tensor, shards: list[torch.Tensor]) -> int:
        """Which TP shard a row slice was cut from (same storage)."""
        ptr = piece.untyped_storage().data_ptr()
        return next(t for t, s in enumerate(shards) if s.untyped_storage().data_ptr() == ptr)

    def read_unit(self, unit: Unit) -> dict[str, torch.Tensor]:
        return {name: pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
                for name, pieces in self.read_unit_pieces(unit, reuse_buffers=False).items()}

    def read_unit_pieces(self, unit: Unit, reuse_buffers: bool = True) -> dict[str, list[torch.Tensor]]:
        """HF tensors as views into the memory-mapped TP shards where the layout allows (no copy);
        column-split tensors are concatenated, replicated ones copied out of the mapping.

        ``reuse_buffers``: column-split tensors are concatenated into buffers reused by the next
        call (no fresh memory per layer); the caller must be done with this unit's pieces by then.
        """
        p, v = self.layout.unit_location(unit)
        local = None if unit in (EMBED, FINAL) else self.layout.where[int(unit)][2]
        keys = unit_keys(self.wmap, unit, local, self.ep)
        ep_ranks = sorted({0} | {r for _, _, r in keys if r is not None})
        # resolved: the name /proc/self/maps gives the mapping (see torch_path/hf.py's _Copier)
        all_files = {e: [self.rank_file(t, p, e).resolve() for t in range(self.tp)] for e in ep_ranks}
        out: dict[str, list[torch.Tensor]] = {n: [torch.zeros(shape, dtype=self.info.dtype)]
                                              for n, shape in unit_absent(self.wmap, unit).items()}
        for entry, key, ep_rank in keys:
            files = all_files[ep_rank or 0]
            shards, grouped = self._shards(key, p, ep_rank or 0, v)
            kind = tp_split_kind(entry, shards[0].dim())
            try:
                if grouped:  # transposed blocks of a GroupedMLP tensor: merged into new tensors
                    full = merge_legacy(entry, [s.contiguous() for s in shards], key)
                    out.update((n, [t]) for n, t in zip(entry.hf, to_hf(entry, full, self.cfg)))
                elif kind == ROW0 and entry.megatron_layout != TOWER_QKV:
                    ranges = hf_row_ranges(entry, self.cfg, shards[0].shape[0] * self.tp)
                    for name, r in zip(entry.hf, ranges):
                        out[name] = [_mapped(piece, files[self._shard_of(piece, shards)])
                                     for piece in slices_of_shards(shards, r)]
                elif kind == GATE_UP:
                    half = shards[0].shape[0] // 2
                    out.update(zip(entry.hf, ([_mapped(s[:half], files[t]) for t, s in enumerate(shards)],
                                              [_mapped(s[half:], files[t]) for t, s in enumerate(shards)])))
                elif kind == REPLICATED and entry.megatron_layout == PLAIN:
                    out[entry.hf[0]] = [shards[0].clone()]
                elif reuse_buffers and kind == COL1 and entry.megatron_layout == PLAIN:
                    shape = (shards[0].shape[0], shards[0].shape[1] * self.tp)
                    # one buffer per tensor of a unit (each expert its own), reused by the next layer
                    slot = (_LAYER_NUMBER.sub("", key), ep_rank, shape, shards[0].dtype)
                    buf = self._buffers.get(slot)
                    if buf is None:
                        buf = self._buffers[slot] = torch.empty(shape, dtype=shards[0].dtype)
                    out[entry.hf[0]] = [torch.cat(shards, dim=1, out=buf)]
                else:  # a whole tensor first: column splits, packed components, values Megatron holds minus one
                    full = merge_legacy(entry, [s.clone() if kind == REPLICATED else s for s in shards], key)
                    out.update((n, [t]) for n, t in zip(entry.hf, to_hf(entry, full, self.cfg)))
            except LayoutError as exc:
                raise CheckpointError(f"{self.it_dir}: {exc}") from exc
        return out


_LAYER_NUMBER = re.compile(r"^decoder\.layers\.\d+\.")


def _mapped(piece: torch.Tensor, source: Path) -> torch.Tensor:
    """Tag a view into the read-only mapping of ``source`` so a writer may copy its bytes straight
    from the file, or drop its pages once written."""
    piece._pmz_mapped = True
    piece._pmz_source = str(source)
    return piece



# ---------------------------------------------------------------------------------------------- writing


def write_legacy_rank(reopen_args: tuple, target: MegatronTarget, directory: str, p: int, t: int, e: int = 0) -> int:
    """The rank file of TP rank ``t`` in pipeline stage ``p`` (and EP rank ``e``); returns bytes written.

    One task per rank file: it holds only that file's shards (a legacy file is pickled whole, so
    this is the least memory a writer can use), reading each unit of the stage once.
    """
    reader = reopen(reopen_args)

    def shard_of(entry, key: str, full: torch.Tensor) -> torch.Tensor:
        # a clone: a view would make torch.save write the whole storage
        return legacy_shards(entry, full, target.tp, key)[t].clone()

    hybrid = is_hybrid(reader.wmap)
    # Qwen3-VL: Megatron-Bridge's Qwen3VLModel names (the tower under vision_model.), whatever the source's map
    wmap = megatron_weight_map(reader.arch, reader.cfg) if is_qwen3_vl(reader.cfg) else reader.wmap
    experts = SEQUENTIAL
    if getattr(target.args, "moe_grouped_gemm", False):  # the Transformer-Engine spec's module for the hybrids
        experts = TE_GROUPED if hybrid else GROUPED_GEMM
    state: dict[str, dict] = {}
    for v in range(target.vpp):
        chunk = state.setdefault("model" if target.vpp == 1 else f"model{v}", {})
        for unit, local in target.layout.stage_units(p, v):
            blocks: dict[str, dict[int, torch.Tensor]] = {}  # GroupedMLP weight1/weight2: local expert -> shard
            for entry, key, full in megatron_unit_tensors(reader, unit, local, target.padded_vocab, target.dtype,
                                                          target.ep, e, wmap=wmap):
                stored, slot = stored_key(key, experts)
                if slot is None:
                    chunk[stored] = shard_of(entry, key, full)
                else:
                    blocks.setdefault(stored, {})[slot] = shard_of(entry, key, full)
                del full
            for stored, by_slot in blocks.items():
                chunk[stored] = pack_grouped([by_slot[i] for i in sorted(by_slot)], fc_of(stored))
            modules = (legacy_extra_states(reader.wmap, unit, local, target.ep, experts == SEQUENTIAL) if hybrid
                       else extra_state_modules(unit, local, wmap, target.ep, e, experts,
                                                te_norms=writes_te_norms(bridge=target.bridge, args=target.args)))
            if unit == EMBED and not hybrid:  # Qwen3-VL's tower (Transformer-Engine modules in Bridge's model)
                modules = modules + tower_modules(wmap)
            chunk.update({f"{m}._extra_state": None for m in modules})
        if reader.cfg.tie_word_embeddings and target.pp > 1 and p == target.pp - 1 and v == target.vpp - 1:
            # Megatron's last stage keeps its own copy of the tied embedding as output_layer.weight.
            entry, key, full = megatron_unit_tensors(reader, EMBED, None, target.padded_vocab, target.dtype)[0]
            chunk["output_layer.weight"] = shard_of(entry, key, full)
    reader.close()
    rank_dir = Path(directory) / legacy_rank_dir_name(t, p, target.pp, e, target.ep)
    rank_dir.mkdir(parents=True, exist_ok=True)
    path = rank_dir / RANK_FILE
    # Saved through a Python file object: a failed write (disk full) then surfaces as the OSError
    # with its errno (as the context of torch's RuntimeError), where saving to a path gives only
    # torch's opaque "inline_container" error.
    with open(path, "wb") as f:
        torch.save(rank_file_object(target.args, target.iteration, state), f)
    return path.stat().st_size
