"""vLLM ``sharded_state`` checkpoints on the torch path: the writer (``pmz convert SRC DST --to vllm
--tp N [--pp M]``) and, beside it, the reader of such directories as a source (``VllmReader``).

One task per vLLM rank (pipeline stage ``p``, tensor rank ``t``): it reads the stage's units one at
a time from any reader, packs each weight-map entry into rank ``t``'s shard with the weight map's
rules at TP ``N`` (vLLM's vocabulary padding: ``models/common/vllm_format.py``) and writes
``model-rank-{t}-part-{k}.safetensors`` (``model-pp-{p}-tp-{t}-part-{k}.safetensors`` when pp > 1),
starting a new part when the next tensor would pass ``max_shard_size`` (vLLM's own rule). Keys are
exactly those vLLM's strict ``ShardedStateLoader`` expects, attention scales included. Memory: one
unit plus the part being filled.

Reading inverts the same rules: ``VllmReader`` takes everything from the format's validating reader
(``converters/formats/vllm_sharded.py``: files, headers, every rank's keys and shard shapes), and
for each unit gathers every TP rank's shard of an entry from the stage that holds it and merges them
with the entry's own rules (``Packed.merge``: q/k/v and gate/up blocks, replicated KV heads,
vocabulary padding dropped; fused expert stacks expert by expert). Memory: one unit of every rank.
"""

from __future__ import annotations

from pathlib import Path

import torch

from converters.formats.vllm_sharded import VllmShardedCheckpoint
from converters.layout.model import EMBED, FINAL, Unit, unit_entries
from converters.torch_path.reader import TORCH_DTYPES, CheckpointReader, ReaderInfo, reopen
from models.common import vllm_format
from models.common.weight_map import WeightEntry


class VllmReader(CheckpointReader):
    """A vLLM ``sharded_state`` directory as a source: HF-named full tensors, one unit at a time."""

    def __init__(self, path: str) -> None:
        self.path = str(path)
        self._remember_args(self.path)
        ckpt = VllmShardedCheckpoint(path)
        self.ckpt = ckpt
        self.hf_config, self.arch, self.cfg, self.wmap = ckpt.hf_config, ckpt.arch, ckpt.cfg, ckpt.wmap
        weights = [t for stage in ckpt.tensors.values() for key, t in stage.items() if ".attn._" not in key]
        dtype = TORCH_DTYPES.get(weights[0].dtype, torch.float32) if weights else torch.float32
        files = len({t.path for stage in ckpt.tensors.values() for t in stage.values()})
        self.info = ReaderInfo("vllm", self.arch.name, {"tp": ckpt.tp, "pp": ckpt.pp}, files, dtype)
        self._open: dict[str, object] = {}

    def validate(self) -> None:
        """Nothing left to check: ``VllmShardedCheckpoint`` checked files, keys and shard shapes."""

    def _shard(self, pp_rank: int, tp_rank: int, key: str) -> torch.Tensor:
        from safetensors import safe_open

        path = self.ckpt.tensors[(pp_rank, tp_rank)][key].path
        if path not in self._open:
            self._open[path] = safe_open(path, framework="pt")
        return self._open[path].get_tensor(key)

    def _merge(self, entry: WeightEntry, shards: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        shapes = self.hf_shapes()
        if entry.experts:
            out: dict[str, torch.Tensor] = {}
            for e in range(entry.experts):
                out.update(self._merge(entry.expert(e), [s[e] for s in shards]))
            return out
        parts = entry.packed.merge(shards, [shapes[name] for name in entry.hf])
        return dict(zip(entry.hf, parts))

    def read_unit(self, unit: Unit) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for entry in unit_entries(self.ckpt.vmap, unit):
            pp_rank, key = self.ckpt.locate(entry.param)
            out.update(self._merge(entry, [self._shard(pp_rank, t, key) for t in range(self.ckpt.tp)]))
        return out

    def close(self) -> None:
        self._open.clear()


def write_vllm_rank(reopen_args: tuple, directory: str, pp_rank: int, tp_rank: int, tp: int, pp: int,
                    dtype: torch.dtype, max_shard_bytes: int) -> int:
    """All files of one vLLM rank; returns the bytes written."""
    from safetensors.torch import save_file

    reader = reopen(reopen_args)
    try:
        cfg = reader.cfg
        vmap = vllm_format.vllm_weight_map(reader.wmap, cfg)
        wanted = vllm_format.stage_tensors(vmap, cfg, pp_rank, pp)
        layers = vllm_format.pp_layer_ranges(cfg.num_hidden_layers, pp)[pp_rank]
        first_params = {e.param for e in vmap.first_entries}  # the embedding and any vision tower
        units = ([EMBED] if any(t.entry is not None and t.entry.param in first_params for t in wanted) else []) \
            + list(layers) + ([FINAL] if pp_rank == pp - 1 else [])
        values: dict[str, torch.Tensor] = {}
        for unit in units:
            hf = reader.read_unit(unit)
            for t in wanted:
                if t.entry is not None and t.key not in values and all(n in hf for n in t.entry.hf):
                    values[t.key] = vllm_format.pack_shard(t.entry, hf, tp_rank, tp).to(dtype)
            del hf
        written = 0

        def write(tensors: dict, part: int) -> None:
            save_file(tensors, str(Path(directory) / vllm_format.vllm_file_name(tp_rank, part, pp_rank, pp)),
                      metadata={"format": "pt"})

        parts = vllm_format.PartSplitter(max_shard_bytes, write)
        for t in wanted:
            tensor = values.pop(t.key) if t.entry is not None else torch.ones((), dtype=torch.float32)
            parts.add(t.key, tensor.contiguous())
            written += tensor.numel() * tensor.element_size()
        parts.close()
        return written
    finally:
        reader.close()


def write_vllm(reader: CheckpointReader, directory: str, *, tp: int, pp: int, dtype: torch.dtype,
               max_shard_bytes: int, workers: int, progress: bool) -> None:
    """Every rank's files (tasks in worker processes); the caller writes config and tokenizer files."""
    from converters.runtime.tasks import run_tasks

    tasks = [(write_vllm_rank, (reader.reopen_args(), directory, p, t, tp, pp, dtype, max_shard_bytes))
             for p in range(pp) for t in range(tp)]
    run_tasks(tasks, workers, "writing vLLM shards", progress)
