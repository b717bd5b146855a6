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

import re
from types import SimpleNamespace
from typing import Any

from converters.layout.stages import LINEAR_MODULES, stacked_key, stores_shared_expert, writer_norm_aliases

_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def stacks_layers(wmap: Any, num_layers: int) -> bool:
    """Whether megatron-core stacks this model's layers (uniform layers: all MoE, or none)."""
    return not wmap.has_experts or len(wmap.moe_layers) == num_layers


def dist_placement(wmap: Any, key: str, layer: int, full: tuple[int, ...], *, num_layers: int, experts: int,
                   stacked: bool, args: dict, prefix: str) -> tuple[str, tuple, tuple, tuple]:
    """(global key, global shape, chunk offsets, chunk shape) of the Megatron full tensor ``full`` of layer
    ``layer`` (``key``: its Megatron key with the global layer number; experts numbered globally)."""
    zeros = (0,) * len(full)
    expert = _EXPERT.search(key)
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


def layer_extra_states(wmap: Any, layer: int, *, num_layers: int, experts: int, stacked: bool,
                      prefix: str) -> list[tuple[str, str]]:
    """(module, shard suffix) of the empty ``_extra_state`` items megatron-core writes for a layer:
    ``shard_{layer}_{L}`` stacked, ``shard_0_1`` per layer; expert linears ``shard_{layer}.{e}_{L}.{E}``
    stacked, ``shard_{e}_{E}`` per layer; the shared expert's linears where Megatron stores one."""
    head = prefix if stacked else f"{prefix}{layer}."
    where = f"shard_{layer}_{num_layers}" if stacked else "shard_0_1"
    if layer not in wmap.moe_layers:
        return [(head + m, where) for m in LINEAR_MODULES]
    out = [(head + m, where) for m in LINEAR_MODULES[:2]]
    for j in (1, 2):
        out += [(f"{head}mlp.experts.experts.linear_fc{j}",
                 f"shard_{layer}.{e}_{num_layers}.{experts}" if stacked else f"shard_{e}_{experts}")
                for e in range(experts)]
    if stores_shared_expert(wmap.moe_layer_entries):
        out += [(f"{head}mlp.shared_experts.linear_fc{j}", where) for j in (1, 2)]
    return out


__all__ = ["stacks_layers", "dist_placement", "layer_extra_states"]
