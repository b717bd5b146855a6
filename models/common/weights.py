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


def validate_source(source: TensorSource, expected: dict[str, tuple[int, ...]], where: str,
                    allowed_extra: Iterable[str] = ()) -> None:
    """Every expected tensor present with its shape, nothing unexplained left over; else CheckpointError."""
    names = source.names()
    missing = sorted(set(expected) - names)
    wrong = sorted(f"{n} {source.shape(n)} (expected {expected[n]})" for n in set(expected) & names
                   if tuple(source.shape(n)) != tuple(expected[n]))
    extra = sorted(n for n in names - set(expected) - set(allowed_extra) if not n.endswith(IGNORED_SUFFIXES))
    problems = []
    if missing:
        more = " ..." if len(missing) > 8 else ""
        problems.append(f"{len(missing)} missing tensor(s): {', '.join(missing[:8])}{more}")
    if wrong:
        problems.append(f"{len(wrong)} tensor(s) with the wrong shape: {'; '.join(wrong[:8])}")
    if extra:
        problems.append(f"{len(extra)} unexpected tensor(s): {', '.join(extra[:8])}{' ...' if len(extra) > 8 else ''}")
    if problems:
        raise CheckpointError(f"{where}: " + "; ".join(problems))


@torch.no_grad()
def load_weights(params: dict[str, torch.nn.Parameter], entries: list[WeightEntry], source: TensorSource,
                 tp_rank: int, tp_size: int) -> None:
    """Fill each parameter with this rank's pieces of its HF tensors (read lazily from ``source``)."""
    for entry in entries:
        param = params[entry.param]
        pieces = [source.read(name, rule.piece(source.shape(name), tp_rank, tp_size), param.dtype)
                  for name, rule in zip(entry.hf, entry.rules)]
        value = torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0]
        if tuple(value.shape) != tuple(param.shape):
            raise CheckpointError(f"{entry.param}: checkpoint gives shape {tuple(value.shape)} for this rank, "
                                  f"the model expects {tuple(param.shape)} (HF tensors {', '.join(entry.hf)})")
        param.copy_(value)


@torch.no_grad()
def export_hf_state(params: dict[str, torch.nn.Parameter], entries: list[WeightEntry],
                    shapes: dict[str, tuple[int, ...]], tp_group) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full_tensor)`` gathered over TP, merged with the same rules (every rank gets all).

    A collective per parameter: every TP rank must iterate to the end in the same order.
    """
    for entry in entries:
        gathered = gather_shards(params[entry.param].detach(), tp_group)
        full = entry.packed.merge(gathered, [shapes[n] for n in entry.hf])
        yield from zip(entry.hf, full)
