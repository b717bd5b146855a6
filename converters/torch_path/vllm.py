"""Writing vLLM ``sharded_state`` checkpoints (``pmz convert SRC DST --to vllm --tp N [--pp M]``).

One task per vLLM rank (pipeline stage ``p``, tensor rank ``t``): it reads the stage's units one at
a time from any reader, packs each weight-map entry into rank ``t``'s shard with the weight map's
rules at TP ``N`` (vLLM's vocabulary padding: ``models/common/vllm_format.py``) and writes
``model-rank-{t}-part-{k}.safetensors`` (``model-pp-{p}-tp-{t}-part-{k}.safetensors`` when pp > 1),
starting a new part when the next tensor would pass ``max_shard_size`` (vLLM's own rule). Keys are
exactly those vLLM's strict ``ShardedStateLoader`` expects, attention scales included. Memory: one
unit plus the part being filled.
"""

from __future__ import annotations

from pathlib import Path

import torch

from converters.layout.model import EMBED, FINAL
from converters.torch_path.reader import CheckpointReader, reopen
from models.common import vllm_format


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
