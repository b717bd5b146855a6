"""Writing Megatron checkpoints (legacy ``torch`` and ``torch_dist``) at any TP/PP/VPP from any reader.

The target layout is validated against the model before anything is written. Legacy output is
written one rank file per task: the stage's units are read one at a time, turned into Megatron
full tensors (``megatron_layout.hf_to_megatron``), and only this TP rank's shard is kept; the file
is saved with ``torch.save`` (a legacy rank file must be pickled whole, so a task holds one file),
through a Python file object so that a failed write keeps its errno (see ``converters.tasks.os_error_of``).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from converters.checkpoint import EMBED, CheckpointReader, Unit, reopen
from converters.megatron_files import HF_CONFIG_DIR, args_for_target, legacy_rank_dir_name
from converters.megatron_layout import hf_to_megatron, megatron_padded_vocab, split_tp, tp_split_kind
from converters.megatron_stages import (
    RANK_FILE,
    MegatronLayout,
    extra_state_modules,
    iteration_folder,
    unit_megatron_keys_ep,
)
from parallel.config import ParallelConfig


@dataclass
class MegatronTarget:
    tp: int
    pp: int
    vpp: int
    padded_vocab: int
    dtype: torch.dtype
    layout: MegatronLayout
    args: argparse.Namespace
    iteration: int | None
    ep: int = 1  # expert parallel (MoE): rank files mp_rank_TT[_PPP]_EEE, experts split over TP too


def plan_megatron_target(reader: CheckpointReader, *, tp: int, pp: int, vpp: int, dtype: torch.dtype,
                         divisible_by: int = 128, first: int | None = None, last: int | None = None,
                         fmt: str = "torch", ep: int = 1) -> MegatronTarget:
    """Validate the target layout for this model (ParallelConfigError / ValueError name the numbers)."""
    from converters.checkpoint import require_megatron_layout
    from converters.megatron_moe import check_ep_target

    cfg = reader.cfg
    require_megatron_layout(cfg, reader.path)
    pconfig = ParallelConfig(tp=tp, pp=pp, vpp=vpp, num_layers_in_first_pipeline_stage=first,
                             num_layers_in_last_pipeline_stage=last)
    pconfig.validate(cfg)
    check_ep_target(cfg, tp, ep)
    padded = megatron_padded_vocab(cfg.vocab_size, tp, divisible_by)
    args = args_for_target(reader.hf_config, cfg, tp=tp, pp=pp, vpp=vpp, padded_vocab=padded, dtype=dtype, fmt=fmt,
                           divisible_by=divisible_by, first=first, last=last, ep=ep)
    layout = MegatronLayout(cfg.num_hidden_layers, pp, vpp, first, last, "target")
    iteration = reader.info.layout.get("iteration")
    return MegatronTarget(tp, pp, vpp, padded, dtype, layout, args, iteration if isinstance(iteration, int) else None,
                          ep)


def megatron_unit_tensors(reader: CheckpointReader, unit: Unit, local_index: int | None,
                          padded_vocab: int, dtype: torch.dtype, ep: int = 1,
                          ep_rank: int | None = None) -> list[tuple[Any, str, torch.Tensor]]:
    """(entry, Megatron key with local layer number, Megatron full tensor) for one unit.

    Experts: one plain entry per expert (``entry.megatron`` holds the global id); the key holds the
    local id at expert parallelism ``ep``; ``ep_rank`` given: only that EP rank's experts."""
    hf = reader.read_unit(unit)
    out = []
    for entry, key, rank in unit_megatron_keys_ep(reader.wmap, unit, local_index, ep):
        if rank is not None and ep_rank is not None and rank != ep_rank:
            continue
        full = hf_to_megatron(entry, [hf[n] for n in entry.hf], reader.cfg, padded_vocab).to(dtype)
        out.append((entry, key, full))
    return out


def _stage_units(target: MegatronTarget, p: int, v: int) -> list[tuple[Unit, int | None]]:
    return target.layout.stage_units(p, v)


def write_legacy_rank(reopen_args: tuple, target: MegatronTarget, directory: str, p: int, t: int, e: int = 0) -> int:
    """The rank file of TP rank ``t`` in pipeline stage ``p`` (and EP rank ``e``); returns bytes written.

    One task per rank file: it holds only that file's shards (a legacy file is pickled whole, so
    this is the least memory a writer can use), reading each unit of the stage once.
    """
    reader = reopen(reopen_args)

    def shard_of(entry, key: str, full: torch.Tensor) -> torch.Tensor:
        # a clone: a view would make torch.save write the whole storage
        return split_tp(tp_split_kind(entry, full.dim()), full, target.tp, key)[t].clone()

    state: dict[str, dict] = {}
    for v in range(target.vpp):
        chunk = state.setdefault("model" if target.vpp == 1 else f"model{v}", {})
        for unit, local in _stage_units(target, p, v):
            for entry, key, full in megatron_unit_tensors(reader, unit, local, target.padded_vocab, target.dtype,
                                                          target.ep, e):
                chunk[key] = shard_of(entry, key, full)
                del full
            chunk.update({f"{m}._extra_state": None
                          for m in extra_state_modules(unit, local, reader.wmap, target.ep, e)})
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
        torch.save({"args": target.args, "checkpoint_version": 3.0, "iteration": target.iteration or 0, **state}, f)
    return path.stat().st_size


def write_megatron(reader: CheckpointReader, target: MegatronTarget, directory: str, *, fmt: str, workers: int,
                   progress: bool, hf_config_dir: str | None = None) -> None:
    from converters.tasks import run_tasks

    root = Path(directory)
    folder = iteration_folder(root, target.iteration)
    if fmt == "megatron":
        tasks = [(write_legacy_rank, (reader.reopen_args(), target, str(folder), p, t, e))
                 for p in range(target.pp) for e in range(target.ep) for t in range(target.tp)]
        run_tasks(tasks, workers, "writing Megatron rank files", progress)
    else:
        from converters.megatron_dist import write_dist

        write_dist(reader, target, str(folder), workers=workers, progress=progress)
    # The HF config beside the iteration folders keeps what Megatron args cannot say (real vocab size,
    # RoPE scaling, token ids); our readers pick it up, Megatron ignores it.
    hf_dir = root / HF_CONFIG_DIR
    hf_dir.mkdir()
    reader.hf_config.save(hf_dir)
