"""Where the copy path puts a mixture-of-experts model's tensors in a ``torch_dist`` target, without torch:
the same placement the torch path's writer (``converters/torch_path/megatron_dist.write_dist_units``) gives.

megatron-core stacks the layers of a torch_dist checkpoint only when they are uniform. Every MoE layer
(or no MoE at all): ``decoder.layers.<param>`` ``[L, ...]`` and the experts ``decoder.layers.mlp.experts.
experts.linear_fc{1,2}.weight`` ``[L, E, ...]`` (one chunk per layer and expert). Dense layers between
MoE ones (Qwen2-MoE's ``mlp_only_layers``): every key carries its global layer number and experts are
``[E, ...]`` per layer. The norms are stored under the fused Transformer-Engine names
(``layout.stages.writer_norm_aliases``). Each layer also holds an empty ``_extra_state`` per linear
module, per expert linear for MoE layers (``dist_extra_states``).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from converters.copy_path.megatron_ops import select
from converters.copy_path.ops import Op, PlannedTensor, Transposed
from converters.copy_path.transpose import preload_numpy
from converters.formats.tensors import ITEMSIZE
from converters.layout.stages import LOCAL_EXPERT, stacked_key, writer_norm_aliases


def dist_placement(wmap: Any, key: str, layer: int, full: tuple[int, ...], *, num_layers: int, experts: int,
                   stacked: bool, args: dict, prefix: str) -> tuple[str, tuple, tuple, tuple]:
    """(global key, global shape, chunk offsets, chunk shape) of the Megatron full tensor ``full`` of layer
    ``layer`` (``key``: its Megatron key with the global layer number; experts numbered globally)."""
    zeros = (0,) * len(full)
    expert = LOCAL_EXPERT.search(key)
    if expert is not None:
        e = int(expert.group(1))
        gkey = key.replace(expert.group(0), ".mlp.experts.experts.")
        if stacked:
            return (gkey.replace(f"layers.{layer}.", "layers.", 1), (num_layers, experts, *full), (layer, e, *zeros),
                    (1, 1, *full))
        return gkey, (experts, *full), (e, *zeros), (1, *full)
    aliases = writer_norm_aliases(wmap, layer, bridge=False, args=SimpleNamespace(**args), fmt="torch_dist")
    gkey = stacked_key(key.replace(f"layers.{layer}.", "layers.{i}.", 1), aliases)
    if stacked:
        return gkey, (num_layers, *full), (layer, *zeros), (1, *full)
    return gkey.replace(prefix, f"{prefix}{layer}.", 1), full, zeros, full


TRANSPOSE_BYTES = 4 << 20  # input bytes of one Transposed op: what a worker thread holds while it runs


def transposed_ops(shape: tuple[int, int], tag: str, ops: list[Op], limit: int | None = None) -> list[Op]:
    """Operations producing the transpose of the ``[rows, cols]`` matrix ``ops`` produce: ``Transposed`` ops
    of consecutive column bands of it (rows of the transpose), each reading at most ``limit`` bytes
    (default ``TRANSPOSE_BYTES``; one column at least)."""
    limit = limit or TRANSPOSE_BYTES
    preload_numpy()  # on the planning thread (transpose.preload_numpy)
    rows, cols = shape
    size = ITEMSIZE[tag]
    band = max(1, limit // max(1, rows * size))
    whole = PlannedTensor((rows, cols), tag, ops)
    out: list[Op] = []
    for c0 in range(0, cols, band):
        c1 = min(cols, c0 + band)
        part = ops if (c0, c1) == (0, cols) else select(whole, 0, rows, c0 * size, c1 * size)
        out.append(Transposed(rows, c1 - c0, size, tuple(part)))
    return out


def grouped_weight(fc: int, shards: list[tuple[tuple[int, ...], list[Op]]],
                   tag: str) -> tuple[tuple[int, int], list[Op]]:
    """(shape, operations) of ``GroupedMLP``'s ``weight{fc}`` from the SequentialMLP shards (shape, ops) of
    its local experts in order: each shard transposed, one after the other (``layout.experts.pack_grouped``:
    ``weight1`` ``[H, E_local*2F/tp]``, ``weight2`` ``[E_local*F/tp, H]``)."""
    ops: list[Op] = []
    for shape, shard in shards:
        ops += transposed_ops((shape[0], shape[1]), tag, shard)
    first = shards[0][0]
    n = len(shards)
    return ((first[1], n * first[0]) if fc == 1 else (n * first[1], first[0])), ops


__all__ = ["dist_placement", "transposed_ops", "grouped_weight", "TRANSPOSE_BYTES"]
