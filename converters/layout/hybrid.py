"""Where a Gated DeltaNet hybrid's tensors are in Megatron checkpoints (torch-free): the MTP block on the last
pipeline stage, torch_dist's per-layer keys and split components, the modules with an ``_extra_state``.

What megatron-core 0.19.2 saves for these models (Transformer-Engine spec, ``GatedDeltaNet``, read from its
``gdn.py`` / ``transformer_block.py`` / ``multi_token_prediction.py``):

* every layer under its own global number in torch_dist (``decoder.layers.{g}.*``: the block is
  ``non_homogeneous_layers`` whenever ``linear_attention_freq`` mixes layer kinds, and Megatron-Bridge sets
  ``hetereogenous_dist_checkpoint``); experts ``[E, ...]`` per layer (``mlp.experts.experts.*``);
* ``in_proj.weight`` as six global tensors ``in_proj.weight.{query,key,value,z,beta,alpha}`` and
  ``conv1d.weight`` as ``conv1d.weight.{query,key,value}`` (``_split_tensor_factory``): the ``PACKED``
  layout's components (``WeightEntry.megatron_parts``);
* the MTP layer's decoder layer, ``mtp.layers.{k}.mtp_model_layer.*`` in memory (and in legacy rank
  files), saved as ``mtp.layers.{k}.transformer_layer.*`` in torch_dist (its backward-compatible name).

A conditional-generation checkpoint (Megatron-Bridge's ``Qwen3VLModel``) holds all of that under
``language_model.`` and its vision tower under ``vision_model.`` (``models/common/hybrid/vision``): in torch_dist
the tower's blocks are stacked (``vision_model.decoder.layers.<param>`` ``[depth, ...]``, ``dist_unit_keys``
gives the block's index), its ``qkv`` per head ``[q_h; k_h; v_h]`` (layout ``TOWER_QKV``: ``to_megatron`` /
``to_hf`` place rows by ``row_ranges``, the one statement of that order, which the copy path reads too, and
tests/test_copy_path_hybrid.py holds the two paths' outputs equal).

The rest (legacy local layer numbers, TP splits, expert files) is ``converters/layout/stages``' and
``converters/layout/megatron``'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from converters.layout.megatron import LayoutError, hf_row_ranges, hf_to_megatron, megatron_to_hf, packed_components
from converters.layout.model import EMBED, FINAL, Unit, is_hybrid
from converters.layout.stages import absent_tensors, unit_megatron_keys_ep
from models.common.hybrid.vision import (
    MEGATRON_TOWER,
    TOWER_BLOCK_MODULES,
    TOWER_DEEPSTACK,
    TOWER_DEEPSTACK_MODULES,
    TOWER_LAYERS,
    TOWER_OTHER_MODULES,
    TOWER_QKV,
    TOWER_STACKS,
)
from models.common.weight_map import PACKED, WeightEntry, WeightMap

if TYPE_CHECKING:  # the key functions serve torch-free readers
    import torch

MTP_DIST_LAYER = (".mtp_model_layer.", ".transformer_layer.")  # torch_dist's name of the MTP decoder layer
_LOCAL_EXPERTS, _DIST_EXPERTS = ".mlp.experts.local_experts.", ".mlp.experts.experts."


def _mtp_view(wmap: Any) -> WeightMap:
    """The MTP layers' templates as a map of their own: layer k is MTP layer k."""
    return WeightMap(wmap.mtp_layer_entries, (), ())


def unit_keys(wmap: Any, unit: Unit, local_index: int | None, ep: int) -> list[tuple[WeightEntry, str, int | None]]:
    """``stages.unit_megatron_keys_ep`` plus, on the ``FINAL`` unit of a hybrid carrying it, the MTP block:
    its fc and norms, then each MTP layer (experts expanded per EP rank as a decoder layer's)."""
    keys = unit_megatron_keys_ep(wmap, unit, local_index, ep)
    if unit == FINAL and is_hybrid(wmap) and wmap.mtp_layers:
        keys += [(e, e.megatron, None) for e in wmap.mtp_head_entries]
        view = _mtp_view(wmap)
        for k in range(wmap.mtp_layers):
            keys += unit_megatron_keys_ep(view, k, k, ep)
    return keys


def unit_absent(wmap: Any, unit: Unit) -> dict[str, tuple[int, ...]]:
    """``stages.absent_tensors`` of a unit, the MTP layers' included."""
    out = absent_tensors(wmap, unit)
    if unit == FINAL and is_hybrid(wmap) and wmap.mtp_layers:
        view = _mtp_view(wmap)
        for k in range(wmap.mtp_layers):
            out.update(absent_tensors(view, k))
    return out


def dist_name(key: str) -> str:
    """A hybrid's Megatron key (global layer number) as torch_dist stores it (the MTP layer renamed)."""
    if key.startswith(("mtp.", "language_model.mtp.")):
        return key.replace(*MTP_DIST_LAYER, 1)
    return key


def _tower_stack(key: str) -> str | None:
    """The tower's stacked module list (``TOWER_STACKS``) a Megatron key is under, else None."""
    return next((s for s in TOWER_STACKS if key.startswith(s)), None)


def tower_block(key: str) -> tuple[str, int] | None:
    """(torch_dist's stacked key, index) of a vision-tower block tensor's Megatron key (or of a Qwen3-VL DeepStack
    merger's: ``TOWER_STACKS``), else None."""
    stack = _tower_stack(key)
    if stack is None:
        return None
    block, rest = key[len(stack):].split(".", 1)
    return stack + rest, int(block)


_DEPTHS: list[tuple[Any, dict[str, int]]] = []  # (map, its stacks' depths): the last few maps asked about
_DEPTHS_KEPT = 4


def tower_depth(wmap: Any, key: str = TOWER_LAYERS) -> int:
    """How many modules the tower's stack holding ``key`` has in a map (default its blocks; a DeepStack key: the
    mergers); 0 without a tower. Counted once per map: the planners ask for every tower tensor and every
    module's ``_extra_state`` (434 times for a Qwen3.5 tower, each a scan of the map's ~650 entries: 0.3 s of a
    2 GB conversion), so the depths of the last few maps are kept, found by identity (each kept pair holds a
    reference to its map, so no other map can take its place at that address while it is kept)."""
    stack = _tower_stack(key) or TOWER_LAYERS
    depths = next((d for m, d in _DEPTHS if m is wmap), None)
    if depths is None:
        entries = tuple(getattr(wmap, "carried_entries", ())) + tuple(wmap.first_entries)
        blocks: dict[str, set[int]] = {s: set() for s in TOWER_STACKS}
        for e in entries:
            held_in = _tower_stack(e.megatron) if e.megatron else None
            if held_in is not None:
                blocks[held_in].add(tower_block(e.megatron)[1])
        depths = {s: len(b) for s, b in blocks.items()}
        _DEPTHS.insert(0, (wmap, depths))
        del _DEPTHS[_DEPTHS_KEPT:]
    return depths.get(stack, 0)


def vision_heads_of(cfg: Any) -> int:
    """The tower's attention heads: a hybrid's ``vision_heads``, Qwen3-VL's ``vision.num_heads``; 0 without."""
    vision = getattr(cfg, "vision", None)
    return int(vision.num_heads if vision is not None else getattr(cfg, "vision_heads", 0) or 0)


def _tower_qkv_heads(entry: WeightEntry, cfg: Any, rows: int) -> tuple[int, int]:
    heads = vision_heads_of(cfg)
    if heads < 1 or rows % (3 * heads):
        raise LayoutError(f"{entry.megatron}: {rows} rows are not 3 x {heads} vision heads")
    return heads, rows // (3 * heads)


def to_megatron(entry: WeightEntry, tensors: Sequence[torch.Tensor], cfg: Any, padded_vocab: int) -> torch.Tensor:
    """``layout.megatron.hf_to_megatron`` plus the tower's ``TOWER_QKV``: HF ``[q; k; v]`` -> per head
    ``[q_h; k_h; v_h]`` (Bridge's ``ConcatenatedQKVMapping`` with one query group per head), placed by
    ``row_ranges`` (the one statement of that order, which the copy path reads too)."""
    if entry.megatron_layout != TOWER_QKV:
        return hf_to_megatron(entry, tensors, cfg, padded_vocab)
    import torch

    t = tensors[0]
    out = torch.empty_like(t)
    rows = 0
    for a, b in row_ranges(entry, cfg, t.shape[0])[0]:
        out[a:b] = t[rows:rows + b - a]
        rows += b - a
    return out


def to_hf(entry: WeightEntry, full: torch.Tensor, cfg: Any) -> list[torch.Tensor]:
    """``layout.megatron.megatron_to_hf`` plus the inverse of ``to_megatron``'s ``TOWER_QKV`` (``row_ranges``)."""
    if entry.megatron_layout != TOWER_QKV:
        return megatron_to_hf(entry, full, cfg)
    import torch

    return [torch.cat([full[a:b] for a, b in row_ranges(entry, cfg, full.shape[0])[0]])]


def row_ranges(entry: WeightEntry, cfg: Any, full_rows: int) -> list[list[tuple[int, int]]]:
    """``layout.megatron.hf_row_ranges`` plus ``TOWER_QKV``: HF ``[q; k; v]``'s rows, in order, as row ranges of
    the per-head ``[q_h; k_h; v_h]`` Megatron tensor (the torch path's ``to_megatron`` / ``to_hf`` and the copy
    path both read it)."""
    if entry.megatron_layout != TOWER_QKV:
        return hf_row_ranges(entry, cfg, full_rows)
    heads, hd = _tower_qkv_heads(entry, cfg, full_rows)
    return [[((3 * h + part) * hd, (3 * h + part + 1) * hd) for part in range(3) for h in range(heads)]]


def dist_lead(wmap: Any, key: str, index: tuple | None) -> tuple[int, ...]:
    """The leading dims of the torch_dist tensor ``key`` that ``dist_unit_keys`` indexes with ``index``: the
    tower's blocks ``(depth,)``, a layer's experts ``(E,)``, none without an index."""
    if index is None:
        return ()
    return (tower_depth(wmap, key),) if key.startswith(TOWER_STACKS) else (_experts(wmap),)


def check_tower_tp(cfg: Any, tp: int, where: str) -> None:
    """megatron-core splits the tower's attention by heads: ``tp`` must divide the vision heads."""
    heads = vision_heads_of(cfg)
    if (getattr(cfg, "carried", ()) or getattr(cfg, "vision", None) is not None) and heads and heads % tp:
        raise LayoutError(f"{where}: --tp {tp} does not divide the vision tower's num_heads={heads} (megatron-core "
                          f"splits its attention by heads)")


def dist_components(entry: WeightEntry, key: str) -> list[tuple[str, int | None]]:
    """(torch_dist key, rows) of each global tensor holding ``entry``'s Megatron tensor ``key``: one per
    component of a ``PACKED`` entry (rows of the full tensor, in order), else the key itself (rows None)."""
    key = dist_name(key)
    if entry.megatron_layout != PACKED:
        return [(key, None)]
    return [(f"{key}.{name}", rows) for name, rows in zip(entry.megatron_parts, packed_components(entry))]


def dist_expert(key: str) -> tuple[str, int] | None:
    """(torch_dist key, expert) of a per-expert legacy key (``...local_experts.{e}...``), else None."""
    if _LOCAL_EXPERTS not in key:
        return None
    head, rest = dist_name(key).split(_LOCAL_EXPERTS, 1)
    expert, tail = rest.split(".", 1)
    return f"{head}{_DIST_EXPERTS}{tail}", int(expert)


# Megatron tensors of a hybrid that are not Transformer-Engine modules (no ``_extra_state``)
_NOT_TE = (".mlp.router.", ".conv1d.", "embedding.", "output_layer.")


def _te_modules(entries) -> list[str]:
    """The Transformer-Engine modules holding ``entries``' Megatron tensors (templates kept): every ``*.weight``
    but the router, the conv1d and the embedding / output layer (megatron-core's own modules). Megatron-Bridge
    0.6.2 writes an empty ``_extra_state`` for each (linears, grouped linears and norms alike)."""
    mods: dict[str, None] = {}
    for t in entries:
        name = t.megatron
        if name and name.endswith(".weight") and not any(x in name for x in _NOT_TE):
            mods[name[:-len(".weight")]] = None
    return list(mods)


def _unit_modules(wmap: Any, unit: Unit, index: int | None) -> list[tuple[str, bool]]:
    """(TE module of ``unit`` with layer ``index`` filled in, whether it is a per-expert ``{e}`` template): the
    layer's modules, on ``FINAL`` the final norm and the MTP block's, on ``EMBED`` the vision tower's."""
    if unit == EMBED:
        return [(m, False) for m in tower_modules(wmap)]
    if isinstance(unit, int):
        groups = [(wmap.layer_templates(unit), index)]
    elif unit == FINAL:
        groups = [(wmap.last_entries, None)]
        if is_hybrid(wmap) and wmap.mtp_layers:
            groups.append((wmap.mtp_head_entries, None))
            groups += [(wmap.mtp_layer_entries, k) for k in range(wmap.mtp_layers)]
    else:
        return []
    return [(m.replace("{i}", str(i)), "{e}" in m) for entries, i in groups for m in _te_modules(entries)]


def tower_modules(wmap: Any) -> list[str]:
    """The vision tower's Transformer-Engine modules (an empty ``_extra_state`` each, as Bridge writes them): each
    block's four linears, the merger's norm and linears, each Qwen3-VL DeepStack merger's; none without a tower."""
    depth = tower_depth(wmap)
    if not depth:
        return []
    deepstack = tower_depth(wmap, TOWER_DEEPSTACK)
    return ([f"{TOWER_LAYERS}{b}.{m}" for b in range(depth) for m in TOWER_BLOCK_MODULES]
            + [MEGATRON_TOWER + m for m in TOWER_OTHER_MODULES]
            + [f"{TOWER_DEEPSTACK}{k}.{m}" for k in range(deepstack) for m in TOWER_DEEPSTACK_MODULES])


def dist_tower_extra_states(wmap: Any) -> list[tuple[str, str]]:
    """(module, shard suffix) of the tower's empty ``_extra_state`` items in torch_dist: a stacked module's
    ``shard_{b}_{n}`` (blocks, DeepStack mergers), the merger's ``shard_0_1``."""
    out = []
    for module in tower_modules(wmap):
        block = tower_block(module + ".")
        out.append((block[0][:-1], f"shard_{block[1]}_{tower_depth(wmap, module)}") if block is not None
                   else (module, "shard_0_1"))
    return out


def legacy_extra_states(wmap: Any, unit: Unit, local_index: int | None, ep: int, sequential: bool) -> list[str]:
    """Modules whose (empty) ``_extra_state`` a legacy rank file of a hybrid holds for ``unit`` (its stage-local
    layer number; experts: this file's local ones, or one grouped linear each with ``sequential`` False)."""
    out = []
    local = _experts(wmap) // ep
    for module, per_expert in _unit_modules(wmap, unit, local_index):
        if not per_expert:
            out.append(module)
        elif sequential:
            out += [module.replace("{e}", str(e)) for e in range(local)]
        else:  # Transformer Engine's TEGroupedMLP: mlp.experts.linear_fc{1,2}
            out.append(module.replace("local_experts.{e}.", ""))
    return list(dict.fromkeys(out))


def dist_extra_states(wmap: Any, unit: Unit) -> list[tuple[str, str]]:
    """(module, shard suffix) of the empty ``_extra_state`` items a torch_dist checkpoint of a hybrid holds
    for ``unit``, as Megatron-Bridge writes them: per-layer keys ``shard_0_1``, experts
    ``mlp.experts.experts.linear_fc{j}`` ``shard_{e}_{E}``, the MTP layer under ``transformer_layer``."""
    E = _experts(wmap)
    out = []
    for module, per_expert in _unit_modules(wmap, unit, unit if isinstance(unit, int) else None):
        module = dist_name(module)
        block = tower_block(module + ".")
        if block is not None:  # the tower's blocks are stacked
            out.append((block[0][:-1], f"shard_{block[1]}_{tower_depth(wmap, module)}"))
        elif per_expert:
            head, tail = module.split("local_experts.{e}.")
            out += [(f"{head}experts.{tail}", f"shard_{e}_{E}") for e in range(E)]
        else:
            out.append((module, "shard_0_1"))
    return out


def _experts(wmap: Any) -> int:
    """The number of experts of a map's sparse layers (0 without)."""
    return next((t.experts for t in wmap.moe_layer_entries if t.experts), 0)


def dist_unit_keys(wmap: Any, unit: Unit) -> list[tuple[WeightEntry, list[tuple[str, int | None]], tuple | None]]:
    """(entry, its torch_dist tensors as (key, component rows or None), index into them) of every Megatron
    tensor of a hybrid's ``unit``: per-layer keys with the global layer number, ``PACKED`` entries one tensor
    per component, experts ``(e,)`` of their layer's ``[E, ...]`` tensor, the MTP layer renamed, the vision
    tower's blocks ``(b,)`` of the stacked ``[depth, ...]`` tensor."""
    layer = unit if isinstance(unit, int) else None
    out = []
    for entry, key, _ in unit_keys(wmap, unit, layer, 1):
        expert, block = dist_expert(key), tower_block(key)
        if block is not None:
            out.append((entry, [(block[0], None)], (block[1],)))
        elif expert is not None:
            out.append((entry, [(expert[0], None)], (expert[1],)))
        else:
            out.append((entry, dist_components(entry, key), None))
    return out
