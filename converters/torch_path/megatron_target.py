"""The Megatron target of a torch-path conversion: its layout validated against the model before
anything is written (``plan_megatron_target``), and a unit's Megatron full tensors
(``megatron_unit_tensors``), which the legacy and torch_dist writers both cut from."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch

from converters.formats.megatron_args import args_for_target
from converters.formats.megatron_moe import check_ep_target
from converters.layout.hybrid import LayoutError, check_tower_tp, to_megatron, unit_keys
from converters.layout.megatron import megatron_padded_vocab
from converters.layout.model import Unit, require_megatron_layout
from converters.layout.stages import (
    MegatronLayout,
    check_target_stages,
    validate_target_layout,
)
from converters.torch_path.reader import CheckpointReader


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
    bridge: bool = False  # Megatron-Bridge's layout (torch_dist, its names; ``megatron_bridge.write_bridge``)


def plan_megatron_target(reader: CheckpointReader, *, tp: int, pp: int, vpp: int, dtype: torch.dtype,
                         divisible_by: int = 128, first: int | None = None, last: int | None = None,
                         fmt: str = "torch", ep: int = 1, grouped_gemm: bool = False) -> MegatronTarget:
    """Validate the target layout for this model (ParallelConfigError / ValueError name the numbers)."""
    cfg = reader.cfg
    require_megatron_layout(cfg, reader.path)
    check_target_stages(cfg.num_hidden_layers, pp, vpp, first, last)
    validate_target_layout(cfg, "megatron" if fmt == "torch" else "megatron-dist", tp=tp, pp=pp, vpp=vpp,
                           first=first, last=last)
    check_ep_target(cfg, tp, ep, grouped_gemm)
    try:
        check_tower_tp(cfg, tp, reader.path)  # a conditional-generation hybrid's vision tower
    except LayoutError as exc:
        raise ValueError(str(exc)) from None
    padded = megatron_padded_vocab(cfg.vocab_size, tp, divisible_by)
    args = args_for_target(reader.hf_config, cfg, tp=tp, pp=pp, vpp=vpp, padded_vocab=padded, dtype=dtype, fmt=fmt,
                           divisible_by=divisible_by, first=first, last=last, ep=ep, grouped_gemm=grouped_gemm,
                           mtp_layers=getattr(reader.wmap, "mtp_layers", 0))
    layout = MegatronLayout(cfg.num_hidden_layers, pp, vpp, first, last, "target")
    iteration = reader.info.layout.get("iteration")
    return MegatronTarget(tp, pp, vpp, padded, dtype, layout, args, iteration if isinstance(iteration, int) else None,
                          ep)


def megatron_unit_tensors(reader: CheckpointReader, unit: Unit, local_index: int | None,
                          padded_vocab: int, dtype: torch.dtype, ep: int = 1,
                          ep_rank: int | None = None, wmap: Any = None) -> list[tuple[Any, str, torch.Tensor]]:
    """(entry, Megatron key with local layer number, Megatron full tensor) for one unit.

    Experts: one plain entry per expert (``entry.megatron`` holds the global id); the key holds the
    local id at expert parallelism ``ep``; a hybrid's ``FINAL`` unit carries its MTP block (``layout.hybrid``);
    ``ep_rank`` given: only that EP rank's experts. ``wmap``:
    the Megatron names to write (default the reader's; Megatron-Bridge's for ``layout.model.megatron_weight_map``)."""
    reader.release_pages()  # pages of units already read leave resident memory (what was taken stays readable)
    hf = reader.read_unit(unit)
    out = []
    for entry, key, rank in unit_keys(wmap or reader.wmap, unit, local_index, ep):
        if rank is not None and ep_rank is not None and rank != ep_rank:
            continue
        # detach(): a new tensor object over the same data, without the Python attributes readers tag their
        # views with (``_pmz_mapped``...), which torch.save would otherwise pickle as a tensor subclass
        full = to_megatron(entry, [hf[n] for n in entry.hf], reader.cfg, padded_vocab).to(dtype).detach()
        out.append((entry, key, full))
    return out
