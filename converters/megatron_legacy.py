"""Megatron legacy ``torch`` checkpoints: one ``model_optim_rng.pt`` per (TP, PP) rank.

Reading memory-maps each rank file (``torch.load(mmap=True)`` with the restricted unpickler) once
per unit and drops the mapping after it, so resident memory stays at a few units. Layer numbers in
a rank file are local to its pipeline stage / virtual chunk (``model`` or ``model0``, ``model1``...);
``parallel.pipeline_layout.stage_layer_ranges`` maps them to global layers.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch

from converters.checkpoint import EMBED, FINAL, CheckpointReader, ReaderInfo, Unit
from converters.megatron_files import (
    RANK_DIR,
    args_layout,
    hf_config_from_args,
    legacy_rank_dir_name,
    resolve_iteration_dir,
)
from converters.megatron_layout import (
    COL1,
    GATE_UP,
    REPLICATED,
    ROW0,
    LayoutError,
    hf_row_ranges,
    megatron_to_hf,
    merge_tp,
    slices_of_shards,
    tp_split_kind,
)
from converters.megatron_moe import num_experts_of
from converters.megatron_stages import (
    RANK_FILE,
    TE_NORM_ALIASES,
    MegatronLayout,
    absent_tensors,
    chunk_state,
    lookup_key,
    unit_megatron_keys_ep,
)
from converters.safe_pickle import safe_torch_load
from models.common.sources import CheckpointError
from models.common.weights import PLAIN, WeightEntry


def load_rank_file(path: Path) -> dict:
    """A legacy rank file, memory-mapped; CheckpointError naming the file when unreadable."""
    if not path.is_file():
        raise CheckpointError(f"{path}: missing rank file")
    try:
        data = safe_torch_load(path, mmap=True)
    except Exception as exc:  # torch raises RuntimeError/EOFError/pickle errors for damaged files
        raise CheckpointError(f"{path}: unreadable or truncated ({type(exc).__name__}: {exc})") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: not a Megatron checkpoint (top level is {type(data).__name__})")
    return data


class LegacyReader(CheckpointReader):
    megatron = True
    def __init__(self, path: str | os.PathLike, *, arch: str | None = None, hf_config_dir: str | None = None,
                 vocab_size: int | None = None) -> None:
        self.path = str(path)
        self._remember_args(self.path, arch=arch, hf_config_dir=hf_config_dir, vocab_size=vocab_size)
        self.it_dir = resolve_iteration_dir(Path(path))
        names = sorted(p.name for p in self.it_dir.iterdir() if p.is_dir() and RANK_DIR.match(p.name))
        if not names:
            raise CheckpointError(f"{self.it_dir}: no mp_rank_* folders")
        # the first rank's folder: mp_rank_00, mp_rank_00_000 (PP or EP: the args say which) or
        # mp_rank_00_000_000 (PP and EP)
        first = next((n for n in ("mp_rank_00", "mp_rank_00_000", "mp_rank_00_000_000") if n in names), names[0])
        first_file = self.it_dir / first / RANK_FILE
        data = load_rank_file(first_file)
        self.args = data.get("args")
        if self.args is None:
            raise CheckpointError(f"{first_file}: no 'args' (not written by Megatron-LM?)")
        lay = args_layout(self.args)
        self.tp, self.pp, self.vpp, self.ep = lay["tp"], lay["pp"], lay["vpp"], lay["ep"]
        self._check_expert_layout(first_file)
        expected = {legacy_rank_dir_name(t, p, self.pp, e, self.ep)
                    for t in range(self.tp) for p in range(self.pp) for e in range(self.ep)}
        missing = sorted(expected - set(names))
        extra = sorted(set(names) - expected)
        shown = f"tp={self.tp} pp={self.pp}" + (f" ep={self.ep}" if self.ep > 1 else "")
        if missing:
            raise CheckpointError(f"{self.it_dir}: missing rank folder(s) {', '.join(missing)} for {shown}")
        if extra:
            raise CheckpointError(f"{self.it_dir}: unexpected rank folder(s) {', '.join(extra)} for {shown}")
        self._set_model(hf_config_from_args(self.args, arch=arch, hf_config_dir=hf_config_dir, vocab_size=vocab_size,
                                            where=str(self.it_dir)), self.path)
        experts = self.cfg.moe.num_experts if self.cfg.moe is not None else 0
        if self.ep > 1 and (not experts or experts % self.ep):
            raise CheckpointError(f"{first_file}: args say expert_model_parallel_size={self.ep}, but the model has "
                                  f"{experts} experts (not a multiple of it)")
        self.layout = MegatronLayout(self.cfg.num_hidden_layers, self.pp, self.vpp, lay["first"], lay["last"],
                                     str(self.it_dir))
        self.padded_vocab = int(getattr(self.args, "padded_vocab_size", 0) or self.cfg.vocab_size)
        dtype = next((v.dtype for v in chunk_state(data, 0, self.vpp, first_file).values()
                      if isinstance(v, torch.Tensor) and v.is_floating_point()), torch.float32)
        self.info = ReaderInfo("megatron", self.arch.name,
                               {"tp": self.tp, "pp": self.pp, "vpp": self.vpp, "padded_vocab": self.padded_vocab,
                                "iteration": getattr(self.args, "iteration", data.get("iteration")),
                                **({"ep": self.ep, "etp": self.tp} if self.cfg.moe is not None else {})},
                               self.tp * self.pp * self.ep, dtype)
        self._buffers: dict[tuple, torch.Tensor] = {}
        del data

    def _check_expert_layout(self, first_file: Path) -> None:
        """Only the expert layout megatron-core writes by default is read: experts split over TP
        (expert_tensor_parallel_size = tp), one SequentialMLP per expert."""
        if not num_experts_of(self.args):
            return
        etp = getattr(self.args, "expert_tensor_parallel_size", None)
        if etp is not None and int(etp) != self.tp:
            raise CheckpointError(f"{first_file}: expert_tensor_parallel_size={etp} with "
                                  f"tensor_model_parallel_size={self.tp}: only expert TP = TP (Megatron-LM's default) "
                                  f"legacy checkpoints are read (convert from torch_dist, which stores experts whole)")
        if getattr(self.args, "moe_grouped_gemm", False):
            raise CheckpointError(f"{first_file}: moe_grouped_gemm=True: legacy checkpoints with grouped-GEMM experts "
                                  f"(one weight{{e}} per expert in a grouped linear) are not read yet")

    def rank_file(self, t: int, p: int, e: int = 0) -> Path:
        return self.it_dir / legacy_rank_dir_name(t, p, self.pp, e, self.ep) / RANK_FILE

    def _expected_keys(self, p: int, v: int) -> list[tuple[Unit, WeightEntry, str, int | None]]:
        """(unit, entry, key, EP rank of an expert tensor or None) held by chunk ``v`` of stage ``p``."""
        return [(unit, e, k, r) for unit, local in self.layout.stage_units(p, v)
                for e, k, r in unit_megatron_keys_ep(self.wmap, unit, local, self.ep)]

    def validate(self) -> None:
        """Every rank file loads; every expected tensor is there, with one shape across TP ranks; nothing
        unused. With EP every file holds the stage's non-expert tensors and its own experts only."""
        for p in range(self.pp):
            states = []  # [e][t][v]
            for e in range(self.ep):
                states.append([])
                for t in range(self.tp):
                    path = self.rank_file(t, p, e)
                    data = load_rank_file(path)
                    states[e].append([(path, chunk_state(data, v, self.vpp, path)) for v in range(self.vpp)])
            for v in range(self.vpp):
                used: list[set[str]] = [set() for _ in range(self.ep)]
                for _unit, entry, key, ep_rank in self._expected_keys(p, v):
                    for e in range(self.ep) if ep_rank is None else (ep_rank,):
                        shapes = []
                        for t in range(self.tp):
                            path, state = states[e][t][v]
                            tensor = lookup_key(state, key)[1]
                            if tensor is None:
                                raise CheckpointError(f"{path}: missing tensor {key} (chunk {v})")
                            shapes.append(tuple(tensor.shape))
                        if len(set(shapes)) != 1:
                            raise CheckpointError(f"{self.it_dir}: tensor {key} (pp rank {p}, chunk {v}) has "
                                                  f"different shapes across TP ranks: {shapes}")
                        used[e].add(key)
                        self._check_shape(entry, key, shapes[0], p, e)
                for e in range(self.ep):
                    for t in range(self.tp):
                        path, state = states[e][t][v]
                        unused = sorted(k for k in state if k not in used[e] and not k.endswith("_extra_state")
                                        and not self._alias_used(k, used[e]) and not self._tied_copy(k, p, v))
                        if unused:
                            more = self._expert_count_hint(unused)
                            raise CheckpointError(f"{path}: unused tensor(s) {', '.join(unused[:8])}"
                                                  f"{' ...' if len(unused) > 8 else ''} "
                                                  f"(not part of a {self.arch.name} model{more})")
            del states

    def _expert_count_hint(self, unused: list[str]) -> str:
        if self.cfg.moe is None or not any(".local_experts." in k for k in unused):
            return ""
        return (f": {self.cfg.moe.num_experts} experts over ep={self.ep} give "
                f"{self.cfg.moe.num_experts // self.ep} local experts per file")

    def _alias_used(self, key: str, used: set[str]) -> bool:
        for local, te in TE_NORM_ALIASES.items():
            if key.endswith(te) and key[: -len(te)] + local in used:
                return True
        return False

    def _tied_copy(self, key: str, p: int, v: int) -> bool:
        """With tied embeddings and PP > 1 the last stage stores its own copy as output_layer.weight."""
        return self.cfg.tie_word_embeddings and key == "output_layer.weight" and p == self.pp - 1 and v == self.vpp - 1

    def _check_shape(self, entry: WeightEntry, key: str, shard_shape: tuple, p: int, e: int = 0) -> None:
        from converters.megatron_layout import megatron_full_shape

        full = megatron_full_shape(entry, self.hf_shapes(), self.cfg, self.padded_vocab)
        kind = tp_split_kind(entry, len(full))
        expected = list(full)
        if kind in (ROW0, GATE_UP):
            expected[0] //= self.tp
        elif kind == COL1:
            expected[1] //= self.tp
        if tuple(expected) != shard_shape:
            where = self.rank_file(0, p, e).parent if self.ep > 1 else self.rank_file(0, p).parent.parent
            raise CheckpointError(f"{where}: tensor {key} has shape {shard_shape} per "
                                  f"TP rank, the model config implies {tuple(expected)} (tp={self.tp})")

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
        keys = unit_megatron_keys_ep(self.wmap, unit, local, self.ep)
        ep_ranks = sorted({0} | {r for _, _, r in keys if r is not None})
        all_files = {e: [self.rank_file(t, p, e).resolve() for t in range(self.tp)] for e in ep_ranks}
        all_states = {e: [chunk_state(load_rank_file(f), v, self.vpp, f) for f in fs] for e, fs in all_files.items()}
        out: dict[str, list[torch.Tensor]] = {n: [torch.zeros(shape, dtype=self.info.dtype)]
                                              for n, shape in absent_tensors(self.wmap, unit).items()}
        for entry, key, ep_rank in keys:
            files, states = all_files[ep_rank or 0], all_states[ep_rank or 0]
            shards = [lookup_key(s, key)[1] for s in states]
            if any(s is None for s in shards):
                raise CheckpointError(f"{self.it_dir}: missing tensor {key} on pp rank {p}")
            kind = tp_split_kind(entry, shards[0].dim())
            try:
                if kind == ROW0:
                    ranges = hf_row_ranges(entry, self.cfg, shards[0].shape[0] * self.tp)
                    for name, r in zip(entry.hf, ranges):
                        out[name] = [_mapped(piece, files[self._shard_of(piece, shards)])
                                     for piece in slices_of_shards(shards, r)]
                elif kind == GATE_UP:
                    half = shards[0].shape[0] // 2
                    out.update(zip(entry.hf, ([_mapped(s[:half], files[t]) for t, s in enumerate(shards)],
                                              [_mapped(s[half:], files[t]) for t, s in enumerate(shards)])))
                elif kind == REPLICATED:
                    out[entry.hf[0]] = [shards[0].clone()]
                elif reuse_buffers and kind == COL1 and entry.megatron_layout == PLAIN:
                    shape = (shards[0].shape[0], shards[0].shape[1] * self.tp)
                    # one buffer per tensor of a unit (each expert its own), reused by the next layer
                    slot = (_LAYER_NUMBER.sub("", key), ep_rank, shape, shards[0].dtype)
                    buf = self._buffers.get(slot)
                    if buf is None:
                        buf = self._buffers[slot] = torch.empty(shape, dtype=shards[0].dtype)
                    out[entry.hf[0]] = [torch.cat(shards, dim=1, out=buf)]
                else:
                    full = merge_tp(kind, shards, key)
                    out.update((n, [t]) for n, t in zip(entry.hf, megatron_to_hf(entry, full, self.cfg)))
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

