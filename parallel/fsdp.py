"""FSDP2 (``torch.distributed.fsdp.fully_shard``) over the ranks that hold the same parameters.

The shard mesh is ``ParallelGroups.replica_mesh``: the dp, cp and ulysses ranks of one tp/pp slot
flattened into one axis (cp/ulysses ranks hold identical parameters, so sharding over them too
saves memory exactly as Megatron's distributed optimizer shards over its dp x cp group). Each TP
rank's parameters are its own TP shards, so FSDP runs on plain local tensors, one FSDP group per
TP rank; no DTensor TP layout is involved.

Units: every decoder layer, then the root (embedding, final norm, head - one unit, so tied
embeddings share one tensor). Reductions are plain sums (gloo has no pre-multiplied sum), then
divided by ``set_replica_scale``'s factor: the DP size for ``model(...)`` (each DP rank's loss is
its own mean; cp/ulysses parts add up) or 1 for ``forward_backward`` (losses already over the
global token count). TP reductions (SP norms, replicated KV heads) still run in
``finalize_grads`` on the local FSDP shards. Attributes those reductions read are copied onto the
parameters FSDP2 creates.
"""

from __future__ import annotations

from torch import nn

from parallel.groups import ParallelGroups

_TAGS = ("sequence_parallel", "kv_replicas")


def shard_model(model: nn.Module, groups: ParallelGroups, *, layers_attr: str = "model.layers",
                forward_methods: tuple[str, ...] = ("packed_logits",)) -> None:
    """Apply ``fully_shard`` to each layer and the root of ``model`` over ``groups.replica_mesh``."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    mesh = groups.replica_mesh
    tags = {name: {a: getattr(p, a) for a in _TAGS if hasattr(p, a)} for name, p in model.named_parameters()}
    layers = model.get_submodule(layers_attr)
    for layer in layers.values() if isinstance(layers, nn.ModuleDict) else layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    for name in forward_methods:
        register_fsdp_forward_method(model, name)
    for name, p in model.named_parameters():
        for attr, value in tags.get(name, {}).items():
            setattr(p, attr, value)
    for module in _fsdp_modules(model):
        module.set_force_sum_reduction_for_comms(True)
    set_replica_scale(model, groups.dp_size)


def _fsdp_modules(model: nn.Module) -> list:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def set_replica_scale(model: nn.Module, divide_by: float | None) -> None:
    """Gradients are summed over the replica ranks, then divided by ``divide_by`` (None = 1)."""
    for module in _fsdp_modules(model):
        module.set_gradient_divide_factor(float(divide_by or 1))


def unshard(t):
    """A FSDP2 (DTensor) parameter or gradient as this TP rank's whole tensor (a collective over the
    replica mesh); plain tensors are returned as they are."""
    full = getattr(t, "full_tensor", None)
    return full() if full is not None else t
