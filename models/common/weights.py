"""The declarative weight map of a dense decoder, and the loader/exporter that read it.

One table per architecture says, for each parallel parameter: the HF tensors packed into it (in
order), the sharding rule of each, and the megatron-core name and layout it corresponds to. Model
loading (``load_weights``), live export (``export_hf_state``) and the offline converters all read
this same table, so "which rows go where" is written once (rules live in ``parallel/sharding.py``).

Internal names are vLLM's: ``model.layers.{i}.self_attn.qkv_proj`` holds this rank's
``[q | k | v]``, ``model.layers.{i}.mlp.gate_up_proj`` holds ``[gate | up]``.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from models.common.hf_files import check_tensors
from models.common.sources import CheckpointError, TensorSource
from models.common.weight_map import (  # noqa: F401
    GATE_UP_STACKED,
    IGNORED_SUFFIXES,
    PLAIN,
    QKV_INTERLEAVED,
    VOCAB_PADDED,
    WeightEntry,
    WeightMap,
    dense_decoder_weight_map,
    hf_shapes,
)
from parallel.collectives import gather_shards
from parallel.sharding import Replicated


def validate_source(source: TensorSource, expected: dict[str, tuple[int, ...]], where: str,
                    allowed_extra: Iterable[str] = ()) -> None:
    """Every expected tensor present with its shape, nothing unexplained left over; else CheckpointError
    (``hf_files.check_tensors``, the check the converters' HF reader makes too)."""
    names = source.names()
    file_of = getattr(source, "file_of", None)  # safetensors sources say which file holds each tensor
    files = {n: file_of(n) for n in names} if file_of is not None else None
    check_tensors({n: source.shape(n) for n in names}, expected, where, allowed_extra, files)


@torch.no_grad()
def load_weights(params: dict[str, torch.nn.Parameter], entries: list[WeightEntry], source: TensorSource,
                 tp_rank: int, tp_size: int, ep_rank: int = 0, ep_size: int = 1) -> None:
    """Fill each parameter with this rank's pieces of its HF tensors (read lazily from ``source``).

    Expert entries fill ``[E/ep, ...]`` stacks with experts ``[ep_rank*E/ep, (ep_rank+1)*E/ep)``.
    """
    for entry in entries:
        param = params[entry.param]
        if entry.experts:
            local = entry.experts // ep_size
            value = torch.stack([_packed_piece(source, entry.expert(ep_rank * local + j), param.dtype, tp_rank, tp_size)
                                 for j in range(local)])
        else:
            value = _packed_piece(source, entry, param.dtype, tp_rank, tp_size)
        if tuple(value.shape) != tuple(param.shape):
            raise CheckpointError(f"{entry.param}: checkpoint gives shape {tuple(value.shape)} for this rank, "
                                  f"the model expects {tuple(param.shape)} (HF tensors {', '.join(entry.hf[:4])})")
        param.copy_(value)


def _packed_piece(source: TensorSource, entry: WeightEntry, dtype: torch.dtype, tp_rank: int,
                  tp_size: int) -> torch.Tensor:
    pieces = [source.read(name, rule.piece(source.shape(name), tp_rank, tp_size), dtype)
              for name, rule in zip(entry.hf, entry.rules)]
    return torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0]


@torch.no_grad()
def export_hf_state(params: dict[str, torch.nn.Parameter], entries: list[WeightEntry],
                    shapes: dict[str, tuple[int, ...]], tp_group, ep_group=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` gathered over TP (and EP for experts), merged with the same rules
    (every rank gets all).

    A collective per parameter: every TP (and EP) rank must iterate to the end in the same order.
    Expert stacks are gathered one parameter (one layer's experts) at a time.
    """
    for entry in entries:
        local = params[entry.param].detach()
        if not entry.experts:
            full = entry.packed.merge(gather_shards(local, tp_group), [shapes[n] for n in entry.hf])
            yield from zip(entry.hf, full)
            continue
        stacked = torch.cat(gather_shards(local, ep_group), dim=0)  # [E, ...] in expert order
        replicated = all(isinstance(rule, Replicated) for rule in entry.rules)  # no TP gather needed
        for e in range(entry.experts):
            expert = entry.expert(e)
            shards = [stacked[e]] if replicated else gather_shards(stacked[e], tp_group)
            full = expert.packed.merge(shards, [shapes[n] for n in expert.hf])
            yield from zip(expert.hf, full)
