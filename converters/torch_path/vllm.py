"""vLLM ``sharded_state`` checkpoints on the torch path: the writer (``pmz convert SRC DST --to vllm
--tp N [--pp M]``) and, beside it, the reader of such directories as a source (``VllmReader``).

One task per vLLM rank (pipeline stage ``p``, tensor rank ``t``): it reads the stage's units one at
a time from any reader, packs each weight-map entry into rank ``t``'s shard with vLLM's rules at TP ``N``
(``models/common/vllm_format.py``; a hybrid's MTP block is left out, with a note on stderr) and writes
``model-rank-{t}-part-{k}.safetensors`` (``model-pp-{p}-tp-{t}-part-{k}.safetensors`` when pp > 1),
starting a new part when the next tensor would pass ``max_shard_size`` (vLLM's own rule). Keys are
exactly those vLLM's strict ``ShardedStateLoader`` expects, attention scales included. Memory: one
unit plus the part being filled. ``--quantize fp8``: each shard is quantized as it is packed
(``models/common/export/fp8.py``, as ``save_vllm_sharded_state(quantization="fp8")`` does).

Reading inverts the same rules: ``VllmReader`` takes everything from the format's validating reader
(``converters/formats/vllm_sharded.py``: files, headers, every rank's keys and shard shapes), and
for each unit gathers every TP rank's shard of an entry from the stage that holds it and merges them
with the entry's own rules (``Packed.merge``: q/k/v and gate/up blocks, replicated KV heads,
vocabulary padding dropped; fused expert stacks expert by expert). Memory: one unit of every rank.

Conditional-generation checkpoints (Qwen3.5 / Qwen3.5-MoE with a vision tower) go both ways with the tower as
vLLM holds it (``vllm_format.vllm_map``: ``visual.*``, split over TP) and the text model under ``language_model.``;
what only their config.json says is checked by ``vllm_format.check_hf_config`` before anything is written. An MTP
block is never dropped silently: the writer notes that it leaves one out, and ``VllmReader`` notes, once, that a
directory whose config declares one (``mtp_num_hidden_layers``) does not hold it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from converters.formats.vllm_sharded import (
    VllmShardedCheckpoint,
    declared_mtp_layers,
    mtp_not_held_note,
    mtp_not_written_note,
)
from converters.layout.model import EMBED, FINAL, Unit, unit_entries
from converters.torch_path.reader import TORCH_DTYPES, CheckpointReader, ReaderInfo, mixed_dtypes, reopen
from models.common import vllm_format
from models.common.errors import CheckpointError
from models.common.weight_map import WeightEntry


class VllmReader(CheckpointReader):
    """A vLLM ``sharded_state`` directory as a source: HF-named full tensors, one unit at a time."""

    def __init__(self, path: str, note: bool = True) -> None:
        self.path = str(path)
        self._remember_args(self.path, False)  # a reopened reader (in a worker) says nothing again
        ckpt = VllmShardedCheckpoint(path)  # refuses FP8 tensors (converters/formats/quantized.py)
        self.ckpt = ckpt
        self.hf_config, self.arch, self.cfg, self.wmap = ckpt.hf_config, ckpt.arch, ckpt.cfg, ckpt.wmap
        declared = declared_mtp_layers(self.hf_config)
        if note and declared:
            import sys

            print(mtp_not_held_note(self.path, declared), file=sys.stderr)
        weights = [(key, t) for stage in ckpt.tensors.values() for key, t in stage.items() if ".attn._" not in key]
        dtype = TORCH_DTYPES.get(weights[0][1].dtype, torch.float32) if weights else torch.float32
        files = len({t.path for stage in ckpt.tensors.values() for t in stage.values()})
        self.info = ReaderInfo("vllm", self.arch.name, {"tp": ckpt.tp, "pp": ckpt.pp}, files, dtype,
                               mixed_dtypes((key, t.dtype, t.path) for key, t in weights))
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
                    dtype: torch.dtype, max_shard_bytes: int, quantization: str | None = None) -> int:
    """All files of one vLLM rank; returns the bytes written. ``quantization="fp8"``: each packed shard
    is stored as ``fp8.quantize_named`` makes it (a quantized entry's shard as one FP8 tensor plus its
    ``<key>_scale_inv``), and each attention layer gets ``fp8.vllm_attention_scales`` after its scales."""
    from models.common.hf_files import save_safetensors

    if quantization:
        from models.common.export import fp8

        def stored(key: str, entry: WeightEntry, shard: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
            return fp8.quantize_named([(key, shard)], fp8.is_quantized(entry), dtype)

        extra_scales = fp8.vllm_attention_scales(quantization)
    else:
        def stored(key: str, entry: WeightEntry, shard: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
            return [(key, shard.to(dtype))]

        extra_scales = []

    reader = reopen(reopen_args)
    try:
        cfg = reader.cfg
        vmap = vllm_format.vllm_map(reader.arch, cfg)
        wanted = vllm_format.stage_tensors(vmap, cfg, pp_rank, pp)
        layers = vllm_format.pp_layer_ranges(cfg.num_hidden_layers, pp)[pp_rank]
        # the stage's units as its listing has them (vllm_stages: some architectures hold the embedding, the final
        # norm and the head on every stage): the embedding and any vision tower, its layers, the norm and head
        def holds(entries) -> bool:
            params = {e.param for e in entries}
            return any(t.entry is not None and t.entry.param in params for t in wanted)

        units = ([EMBED] if holds(vmap.first_entries) else []) + list(layers) + \
            ([FINAL] if holds(vmap.last_entries) else [])
        written = 0

        def write(tensors: dict, part: int) -> None:
            save_safetensors(tensors, Path(directory) / vllm_format.vllm_file_name(tp_rank, part, pp_rank, pp),
                             metadata={"format": "pt"})

        parts = vllm_format.PartSplitter(max_shard_bytes, write)
        last_scale = vllm_format.ATTENTION_SCALES[-1]
        values: dict[str, list[tuple[str, torch.Tensor]]] = {}  # key -> what is stored for it, until added
        done = 0  # wanted[:done] are in the parts: tensors go out in state-dict order as soon as they exist
        for unit in units:
            reader.release_pages()  # pages of units already read leave resident memory
            hf = reader.read_unit(unit)
            for t in wanted[done:]:
                if t.entry is not None and t.key not in values and all(n in hf for n in t.entry.hf):
                    values[t.key] = stored(t.key, t.entry, vllm_format.pack_shard(t.entry, hf, tp_rank, tp))
            del hf
            while done < len(wanted) and (wanted[done].entry is None or wanted[done].key in values):
                t = wanted[done]
                if t.entry is not None:
                    tensors = values.pop(t.key)
                else:  # an attention scale scalar; after the layer's last one, the quantization's own
                    tensors = [(t.key, torch.ones((), dtype=torch.float32))]
                    if t.key.endswith(f".attn.{last_scale}"):
                        prefix = t.key.removesuffix(last_scale)
                        tensors += [(prefix + name, torch.full((), value, dtype=torch.float32))
                                    for name, value in extra_scales]
                for key, tensor in tensors:
                    parts.add(key, tensor.contiguous())
                    written += tensor.numel() * tensor.element_size()
                done += 1
        if done < len(wanted):
            raise CheckpointError(f"vLLM rank {tp_rank} (stage {pp_rank}): {wanted[done].key} never produced by "
                                  f"the reader")
        parts.close()
        return written
    finally:
        reader.close()


def write_vllm(reader: CheckpointReader, directory: str, *, tp: int, pp: int, dtype: torch.dtype,
               max_shard_bytes: int, workers: int, progress: bool, quantization: str | None = None) -> None:
    """Every rank's files (tasks in worker processes); the caller writes config and tokenizer files
    (and checks FP8 shards with ``fp8.vllm_block_check`` first). A hybrid's MTP block is not written
    (vLLM's main model holds none: ``vllm_format``), and a note on stderr says so."""
    import sys

    from converters.runtime.tasks import run_tasks

    try:  # a conditional-generation checkpoint's config.json: vision heads and tied head as vLLM reads them
        vllm_format.check_hf_config(reader.hf_config, reader.cfg, tp)
    except vllm_format.VllmLayoutError as exc:
        raise CheckpointError(f"{reader.path}: {exc}") from None
    mtp = getattr(reader.wmap, "mtp_layers", 0)
    if mtp:
        print(mtp_not_written_note(reader.path, mtp), file=sys.stderr)
    tasks = [(write_vllm_rank, (reader.reopen_args(), directory, p, t, tp, pp, dtype, max_shard_bytes,
                                quantization))
             for p in range(pp) for t in range(tp)]
    run_tasks(tasks, workers, "writing vLLM shards", progress)
