"""Megatron-LM legacy ``torch`` checkpoints: the validating reader (``LegacyCheckpoint``), without torch.

Layout: ``<root>/latest_checkpointed_iteration.txt``, ``iter_XXXXXXX/`` (or ``release/``) holding
one folder per rank, ``mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt``: a ``torch.save``
archive of ``{"args", "checkpoint_version", "iteration", "model"}`` (``model0``, ``model1``, ... per
virtual chunk); layer numbers are local to the stage/chunk (``converters/layout/stages``).

``LegacyCheckpoint`` checks everything once, for both conversion paths: the rank files are
``torch.save`` archives (``torch_zip``: storages inside the file, tensors inside their storages,
restricted unpickling); ``args`` is Megatron-LM's namespace with integer sizes; the rank folders
are exactly those tp x pp x ep of the args; the layers the files hold are the config's; and, in
``validate()``, every tensor the model needs is in every file that should hold it, with one shape
across TP ranks, the shape the config implies, and nothing unused. Tensors come back as byte
locations (``RawTensor``, or ``StridedTensor`` for a view saved with its storage).

Writers: the torch path's ``converters/torch_path/megatron_legacy.write_legacy_rank`` and the
copy path's ``converters/copy_path/megatron`` write the same structure (``rank_file_object``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from converters.formats.megatron_args import (
    RANK_DIR,
    args_layout,
    check_args,
    hf_config_from_args,
    legacy_rank_dir_name,
    resolve_iteration_dir,
)
from converters.formats.megatron_moe import arg_value, num_experts_of
from converters.formats.tensors import RawTensor, StridedTensor
from converters.formats.torch_zip import read_torch_archive
from converters.layout.experts import SEQUENTIAL, fc_of, grouped_shape, layout_of_keys, stored_key
from converters.layout.hybrid import unit_keys
from converters.layout.megatron import BLOCKS, COL1, GATE_UP, ROW0, megatron_full_shape, tp_split_kind
from converters.layout.model import Unit, model_from_config
from converters.layout.stages import (
    RANK_FILE,
    TE_NORM_ALIASES,
    MegatronLayout,
    chunk_state,
    lookup_key,
)
from models.common.errors import CheckpointError
from models.common.weight_map import WeightEntry, hf_shapes

MAX_RANK_FILES = 1 << 16  # tp x pp x ep of any real job is far below
_LOCAL_LAYER = re.compile(r"^(?:language_model\.)?decoder\.layers\.(\d+)\.")


def rank_file_object(args: Any, iteration: int | None, state: dict) -> dict:
    """What a legacy rank file pickles (writing): args, version, iteration and the chunks' state dicts."""
    return {"args": args, "checkpoint_version": 3.0, "iteration": iteration or 0, **state}


class LegacyCheckpoint:
    """A legacy checkpoint folder, opened and checked (see the module docstring). Fields: ``it_dir``,
    ``args``, ``tp``/``pp``/``vpp``/``ep``, ``hf_config``, ``arch``, ``cfg``, ``wmap``, ``layout``
    (stages), ``padded_vocab``, ``iteration``, ``dtype`` (tag of the stored floating tensors);
    after ``validate()``, ``shards[(p, v, e)][key]``: the locations of a tensor on every TP rank."""

    format = "megatron"

    def __init__(self, path: str, *, arch: str | None = None, hf_config_dir: str | None = None,
                 vocab_size: int | None = None) -> None:
        self.path = str(path)
        self.it_dir = it_dir = resolve_iteration_dir(Path(path))
        self._archives: dict[Path, dict] = {}
        self.shards: dict[tuple[int, int, int], dict[str, list[RawTensor | StridedTensor]]] = {}
        names = sorted(p.name for p in it_dir.iterdir() if p.is_dir() and RANK_DIR.match(p.name))
        if not names:
            raise CheckpointError(f"{it_dir}: no mp_rank_* folders")
        # the first rank's folder: mp_rank_00, mp_rank_00_000 (PP or EP: the args say which) or
        # mp_rank_00_000_000 (PP and EP)
        first = next((n for n in ("mp_rank_00", "mp_rank_00_000", "mp_rank_00_000_000") if n in names), names[0])
        first_file = it_dir / first / RANK_FILE
        data = self.archive(first_file)
        args = data.get("args")
        if args is None:
            raise CheckpointError(f"{first_file}: no 'args' (not written by Megatron-LM?)")
        check_args(args, str(first_file))
        self.args = args
        lay = args_layout(args)
        self.tp, self.pp, self.vpp, self.ep = lay["tp"], lay["pp"], lay["vpp"], lay["ep"]
        shown = f"tp={self.tp} pp={self.pp}" + (f" ep={self.ep}" if self.ep > 1 else "")
        if min(self.tp, self.pp, self.vpp, self.ep) < 1 or self.tp * self.pp * self.ep > MAX_RANK_FILES:
            raise CheckpointError(f"{first_file}: args say {shown} vpp={self.vpp}: not a layout of "
                                  f"{len(names)} rank folder(s)")
        self._check_expert_layout(first_file)
        expected = {legacy_rank_dir_name(t, p, self.pp, e, self.ep)
                    for t in range(self.tp) for p in range(self.pp) for e in range(self.ep)}
        missing = sorted(expected - set(names))
        extra = sorted(set(names) - expected)
        if missing:
            raise CheckpointError(f"{it_dir}: missing rank folder(s) {', '.join(missing)} for {shown}")
        if extra:
            raise CheckpointError(f"{it_dir}: unexpected rank folder(s) {', '.join(extra)} for {shown}")
        self.hf_config = hf_config_from_args(args, arch=arch, hf_config_dir=hf_config_dir, vocab_size=vocab_size,
                                             where=str(it_dir))
        # a hybrid's MTP block (on the last stage) as the args record it; the files are checked in validate()
        mtp = int(arg_value(args, "mtp_num_layers", 0) or 0)
        if mtp > 1:
            raise CheckpointError(f"{first_file}: args say mtp_num_layers={mtp}: pmz carries exactly one MTP layer "
                                  f"(mtp.layers.0, the layout Megatron-Bridge maps)")
        self.arch, self.cfg, self.wmap = model_from_config(self.hf_config, self.path, megatron=True, mtp_layers=mtp)
        experts = self.cfg.moe.num_experts if self.cfg.moe is not None else 0
        if self.ep > 1 and (not experts or experts % self.ep):
            raise CheckpointError(f"{first_file}: args say expert_model_parallel_size={self.ep}, but the model has "
                                  f"{experts} experts (not a multiple of it)")
        self._check_layer_count()  # before the stage tables below are sized by the config
        self.layout = MegatronLayout(self.cfg.num_hidden_layers, self.pp, self.vpp, lay["first"], lay["last"],
                                     str(it_dir))
        self.padded_vocab = int(getattr(args, "padded_vocab_size", 0) or self.cfg.vocab_size)
        # SequentialMLP, GroupedMLP or TEGroupedMLP experts (converters/layout/experts): the file's keys decide
        self.expert_layout = SEQUENTIAL if self.cfg.moe is None else layout_of_keys(
            (k for v in range(self.vpp) for k in chunk_state(data, v, self.vpp, first_file)), args)
        stored = chunk_state(data, 0, self.vpp, first_file).values()
        self.dtype = next((t.dtype for t in stored if isinstance(t, (RawTensor, StridedTensor))
                           and t.dtype in ("F64", "F32", "F16", "BF16")), "F32")
        iteration = getattr(args, "iteration", None)
        if iteration is None:
            iteration = data.get("iteration")
        self.iteration = iteration if isinstance(iteration, int) and not isinstance(iteration, bool) else None

    def rank_file(self, t: int, p: int, e: int = 0) -> Path:
        return self.it_dir / legacy_rank_dir_name(t, p, self.pp, e, self.ep) / RANK_FILE

    def archive(self, path: Path) -> dict:
        """A rank file's object, its archive read and checked once (cached)."""
        found = self._archives.get(path)
        if found is None:
            if not path.is_file():
                raise CheckpointError(f"{path}: missing rank file")
            found = read_torch_archive(path)
            if not isinstance(found, dict):
                raise CheckpointError(f"{path}: not a Megatron checkpoint (top level is {type(found).__name__})")
            self._archives[path] = found
        return found

    def state(self, t: int, p: int, e: int, v: int) -> dict:
        """The state dict of chunk ``v`` in the rank file of (tp ``t``, pp ``p``, ep ``e``)."""
        path = self.rank_file(t, p, e)
        return chunk_state(self.archive(path), v, self.vpp, path)

    def locate(self, t: int, p: int, e: int, v: int, key: str) -> tuple[str, Any, int | None]:
        """(key stored, its location or None, GroupedMLP block or None) of the weight-map key ``key``
        in the file of (tp ``t``, pp ``p``, ep ``e``), chunk ``v`` (experts per ``expert_layout``)."""
        key, slot = stored_key(key, self.expert_layout)
        found, tensor = lookup_key(self.state(t, p, e, v), key)
        return found, tensor, slot

    def _check_expert_layout(self, first_file: Path) -> None:
        """Experts split over TP (expert_tensor_parallel_size = tp, Megatron-LM's default) are read, in
        any of megatron-core's expert modules (``expert_layout``)."""
        if not num_experts_of(self.args):
            return
        etp = getattr(self.args, "expert_tensor_parallel_size", None)
        if etp is not None and int(etp) != self.tp:
            raise CheckpointError(f"{first_file}: expert_tensor_parallel_size={etp} with "
                                  f"tensor_model_parallel_size={self.tp}: only expert TP = TP (Megatron-LM's default) "
                                  f"legacy checkpoints are read (convert from torch_dist, which stores experts whole)")

    def _check_layer_count(self) -> None:
        """The layers the rank files of TP rank 0 hold (distinct local numbers per stage and chunk)
        must be the config's ``num_hidden_layers``."""
        found, per_stage = 0, []
        for p in range(self.pp):
            counts = []
            for v in range(self.vpp):
                local = {m.group(1) for k in self.state(0, p, 0, v) if (m := _LOCAL_LAYER.match(k))}
                counts.append(len(local))
            found += sum(counts)
            per_stage.append("+".join(map(str, counts)))
        if found != self.cfg.num_hidden_layers:
            raise CheckpointError(f"{self.it_dir}: num_hidden_layers={self.cfg.num_hidden_layers}, but the rank files "
                                  f"hold {found} layer(s) (per pipeline stage: {', '.join(per_stage)})")

    def expected_keys(self, p: int, v: int) -> list[tuple[Unit, WeightEntry, str, int | None]]:
        """(unit, entry, key, EP rank of an expert tensor or None) held by chunk ``v`` of stage ``p``."""
        return [(unit, e, k, r) for unit, local in self.layout.stage_units(p, v)
                for e, k, r in unit_keys(self.wmap, unit, local, self.ep)]

    def validate(self) -> None:
        """Every rank file reads; every expected tensor is there, with one shape across TP ranks and
        the shape the config implies; nothing unused. With EP every file holds the stage's
        non-expert tensors and its own experts only. Fills ``shards``."""
        for p in range(self.pp):
            for v in range(self.vpp):
                used: list[set[str]] = [set() for _ in range(self.ep)]
                for e in range(self.ep):
                    self.shards[(p, v, e)] = {}
                for _unit, entry, key, ep_rank in self.expected_keys(p, v):
                    for e in range(self.ep) if ep_rank is None else (ep_rank,):
                        found = []
                        for t in range(self.tp):
                            stored, tensor, slot = self.locate(t, p, e, v, key)
                            if tensor is None:
                                raise CheckpointError(f"{self.rank_file(t, p, e)}: missing tensor {stored} (chunk {v})")
                            if not isinstance(tensor, (RawTensor, StridedTensor)):
                                raise CheckpointError(f"{self.rank_file(t, p, e)}: {key} (chunk {v}) is a "
                                                      f"{type(tensor).__name__}, not a tensor")
                            found.append(tensor)
                        shapes = [x.shape for x in found]
                        if len(set(shapes)) != 1:
                            each = ", ".join(f"{self.rank_file(t, p, e).parent.name} {tuple(s)}"
                                             for t, s in enumerate(shapes))
                            raise CheckpointError(f"{self.it_dir}: tensor {stored} (pp rank {p}, chunk {v}) has "
                                                  f"different shapes across TP ranks: {each}")
                        # the key as stored: a GroupedMLP / Transformer Engine file's SequentialMLP-named copy of an
                        # expert is a stray tensor (unused), not the one read
                        used[e].add(stored)
                        if slot is None:
                            self._check_shape(entry, stored, shapes[0], p, e)
                        else:
                            self._check_grouped_shape(stored, shapes[0], p, e)
                        self.shards[(p, v, e)][key] = found
                for e in range(self.ep):
                    for t in range(self.tp):
                        state = self.state(t, p, e, v)
                        unused = sorted(k for k in state if k not in used[e] and not k.endswith("_extra_state")
                                        and not self._alias_used(k, used[e]) and not self._tied_copy(k, p, v))
                        if unused:
                            more = self._expert_count_hint(unused)
                            raise CheckpointError(f"{self.rank_file(t, p, e)}: unused tensor(s) {', '.join(unused[:8])}"
                                                  f"{' ...' if len(unused) > 8 else ''} "
                                                  f"(not part of a {self.arch.name} model{more})")
            for e in range(self.ep):  # the next stage's files: this stage's archives are no longer needed
                for t in range(self.tp):
                    self._archives.pop(self.rank_file(t, p, e), None)

    def _expert_count_hint(self, unused: list[str]) -> str:
        if self.cfg.moe is None or not any(".mlp.experts." in k for k in unused):
            return ""
        if self.expert_layout != SEQUENTIAL and any(".mlp.experts.local_experts." in k for k in unused):
            return f": SequentialMLP expert names in a checkpoint of {self.expert_layout} experts, two layouts mixed"
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

    def _check_grouped_shape(self, key: str, shard_shape: tuple, p: int, e: int) -> None:
        """A GroupedMLP ``weight1`` / ``weight2`` holds E_local experts of the config's width."""
        moe, fc = self.cfg.moe, fc_of(key)
        local = moe.num_experts // self.ep
        expected = grouped_shape(fc, local, self.cfg.hidden_size, moe.moe_intermediate_size, self.tp)
        if tuple(shard_shape) != expected:
            width = f"2*moe_ffn_hidden_size/tp = 2*{moe.moe_intermediate_size}/{self.tp}" if fc == 1 else \
                f"moe_ffn_hidden_size/tp = {moe.moe_intermediate_size}/{self.tp}"
            raise CheckpointError(f"{self.rank_file(0, p, e)}: grouped-GEMM tensor {key} has shape "
                                  f"{tuple(shard_shape)}, the config implies {expected}: {moe.num_experts} experts "
                                  f"over ep={self.ep} = {local} local experts x {width} "
                                  f"{'columns' if fc == 1 else 'rows'}")

    def _check_shape(self, entry: WeightEntry, key: str, shard_shape: tuple, p: int, e: int = 0) -> None:
        if "_hf_shapes" not in self.__dict__:
            self._hf_shapes = hf_shapes(self.cfg, self.wmap)
        full = megatron_full_shape(entry, self._hf_shapes, self.cfg, self.padded_vocab)
        kind = tp_split_kind(entry, len(full))
        expected = list(full)
        if kind in (ROW0, GATE_UP, BLOCKS):
            expected[0] //= self.tp
        elif kind == COL1:
            expected[1] //= self.tp
        if tuple(expected) != tuple(shard_shape):
            raise CheckpointError(f"{self.rank_file(0, p, e)}: tensor {key} has shape {tuple(shard_shape)} per "
                                  f"TP rank, the model config implies {tuple(expected)} (tp={self.tp})")
