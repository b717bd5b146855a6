"""The declarative weight map of a dense decoder, and the loader/exporter that read it.

One table per architecture says, for each parallel parameter: the HF tensors packed into it (in
order), the sharding rule of each, and the megatron-core name and layout it corresponds to. Model
loading (``load_weights``), live export (``export_hf_state``) and the offline converters all read
this same table, so "which rows go where" is written once (rules live in ``parallel/sharding.py``).

Internal names are vLLM's: ``model.layers.{i}.self_attn.qkv_proj`` holds this rank's
``[q | k | v]``, ``model.layers.{i}.mlp.gate_up_proj`` holds ``[gate | up]``.
"""

from __future__ import annotations

import mmap
import os
from typing import Any, Callable, Iterable, Iterator

import torch

from models.common.hf_files import SafetensorsFiles, StoredTensor, canonical_names, check_tensors, per_expert_views
from models.common.sources import CheckpointError, RenamedSource, SafetensorsSource, TensorSource
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
from parallel.sharding import Piece, Replicated, read_piece

_TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def checkpoint_source(directory: str | os.PathLike, cfg: Any, rename: Callable[[str], str] | None = None,
                      where: str | None = None, transposed_experts: bool = False) -> TensorSource:
    """The tensors of an HF directory as the loader reads them: the validated safetensors files
    (``hf_files.SafetensorsFiles``), under the weight map's names (``rename``: another key layout of the
    same model, ``Architecture.canonical_name``), and experts stored fused read per expert through
    ``hf_files.per_expert_views``, the rule the converters read them by (``ExpertViewSource``);
    ``transposed_experts`` (the weight map's ``fused_experts``): the original releases' transposed layout too."""
    where = where or str(directory)
    files = SafetensorsFiles(directory)
    source: TensorSource = SafetensorsSource(directory, files)
    stored_as = {name: name for name in files.names()}
    if rename is not None:
        source = RenamedSource(source, rename, where)
        stored_as = canonical_names(files.names(), rename, where)
    views, origin = per_expert_views(where, stored_as, files.tensors, cfg, transposed_experts)
    fused = {name: view for name, view in views.items() if name not in stored_as}
    if not fused:
        return source
    shapes = {name: tuple(view.shape) for name, view in views.items()}
    return ExpertViewSource(source, shapes, fused, {name: files.file_of(stored) for name, stored in origin.items()})


class ExpertViewSource(TensorSource):
    """A checkpoint whose experts are stored fused (``mlp.experts.gate_up_proj [E, 2F, H]``, ``down_proj
    [E, H, F]``), read under the weight map's per-expert names: each view is the byte range
    ``per_expert_views`` gives that expert's gate, up or down rows, mapped from its file, so a rank
    touches only the experts it loads (and, within one, only its TP rows). Other tensors come from
    ``source``."""

    def __init__(self, source: TensorSource, shapes: dict[str, tuple[int, ...]], views: dict[str, StoredTensor],
                 files: dict[str, str]) -> None:
        self.source, self.shapes, self.views, self.files = source, shapes, views, files
        self._maps: dict[str, mmap.mmap] = {}

    def names(self) -> set[str]:
        return set(self.shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def file_of(self, name: str) -> str:
        """The file (name within the directory) holding ``name``, or the fused tensor it is a view of."""
        return self.files[name]

    def read(self, name: str, piece: Piece, dtype: torch.dtype | None = None) -> torch.Tensor:
        view = self.views.get(name)
        if view is None:
            return self.source.read(name, piece, dtype)
        if view.dtype not in _TORCH_DTYPES:
            raise CheckpointError(f"{view.path}: {name} (a view of fused experts) is {view.dtype}, not a float dtype")
        if view.path not in self._maps:
            with open(view.path, "rb") as f:  # ACCESS_COPY: a writable buffer for frombuffer; nothing writes to it
                self._maps[view.path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        itemsize = torch.empty((), dtype=_TORCH_DTYPES[view.dtype]).element_size()
        full = torch.frombuffer(self._maps[view.path], dtype=_TORCH_DTYPES[view.dtype], count=view.span // itemsize,
                                offset=view.offset)
        # a release checkpoint's transposed expert: a strided view of its block (read one expert at a time)
        full = full.view(view.shape) if view.stride is None else full.as_strided(view.shape, view.stride)
        return read_piece(lambda idx: full[idx], view.shape, piece, dtype)


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
