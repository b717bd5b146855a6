"""Process groups as explicit objects: built from a DeviceMesh, or adopted from megatron-core.

Modules receive a ``ParallelGroups`` and take the groups they need from it; nothing here is a
module-level global, so two models with different layouts can live in one process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from parallel.config import ParallelConfig, ParallelConfigError

# Mesh axis order, slowest to fastest: Megatron's default rank order "tp-cp-dp-pp" read backwards,
# with the Ulysses axis (absent in Megatron) between cp and tp.
MESH_AXES = ("pp", "dp", "cp", "ulysses", "tp")
# The ranks that hold the same parameters (same tp/pp coordinates): gradients of replicated
# parameters are reduced over them, and FSDP shards over them.
REPLICA_AXES = ("dp", "cp", "ulysses")


@dataclass
class ParallelGroups:
    """This rank's process groups and coordinates for one parallel layout.

    ``*_group`` is None when the axis has a single rank (collectives over it are no-ops), which
    keeps single-process use free of any process group.

    ``replica_group`` spans the dp, cp and ulysses ranks of this rank's tp/pp slot: the ranks that
    hold identical parameters. Gradients are summed over its cp/ulysses part (each of those ranks
    saw a different part of the same sequences) and summed or averaged over dp. ``replica_mesh`` is
    the same set as a 1-D DeviceMesh (what FSDP2 shards over).
    """

    config: ParallelConfig
    tp_group: Any = None
    pp_group: Any = None
    dp_group: Any = None
    cp_group: Any = None
    ep_group: Any = None
    edp_group: Any = None  # expert-data-parallel: the ranks of the replica group holding this rank's experts
    ulysses_group: Any = None
    replica_group: Any = None
    tp_rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    cp_rank: int = 0
    ep_rank: int = 0
    ulysses_rank: int = 0
    dp_size: int = 1
    mesh: Any = field(default=None, repr=False)
    replica_mesh: Any = field(default=None, repr=False)

    @property
    def tp_size(self) -> int:
        return self.config.tp

    @property
    def pp_size(self) -> int:
        return self.config.pp

    @property
    def cp_size(self) -> int:
        return self.config.cp

    @property
    def ep_size(self) -> int:
        return self.config.ep

    @property
    def ulysses_size(self) -> int:
        return self.config.ulysses

    @property
    def sequence_split(self) -> bool:
        """The sequence is split over cp and/or ulysses ranks (the model slices its inputs)."""
        return self.config.cp > 1 or self.config.ulysses > 1

    @property
    def sequence_parallel(self) -> bool:
        return self.config.sequence_parallel and self.config.tp > 1

    @classmethod
    def single(cls, config: ParallelConfig | None = None) -> "ParallelGroups":
        """Groups for one process (no torch.distributed needed); config must be all ones."""
        config = config or ParallelConfig()
        if config.model_parallel_size != 1:
            raise ParallelConfigError(f"ParallelGroups.single needs tp=pp=cp=1, got {config.describe()}")
        return cls(config=config)


def _device_type(device: torch.device | str | None) -> str:
    if device is not None:
        return torch.device(device).type
    backend = dist.get_backend() if dist.is_initialized() else "gloo"
    return "cuda" if backend == "nccl" else "cpu"


def build_groups(config: ParallelConfig, device: torch.device | str | None = None) -> ParallelGroups:
    """Create the process groups for ``config`` over the already-initialized default group.

    The caller runs ``torch.distributed.init_process_group`` (gloo on CPU, NCCL on GPU) first; in a
    single process without it, only an all-ones config is accepted. All ranks must call this in the
    same order (DeviceMesh creates subgroups collectively).
    """
    if not dist.is_initialized():
        if config.model_parallel_size == 1:
            return ParallelGroups.single(config)
        raise ParallelConfigError(
            f"{config.describe()} needs torch.distributed: call torch.distributed.init_process_group first"
        )
    world = dist.get_world_size()
    dp = config.dp_for(world)
    from torch.distributed.device_mesh import init_device_mesh

    shape = (config.pp, dp, config.cp, config.ulysses, config.tp)
    mesh = init_device_mesh(_device_type(device), shape, mesh_dim_names=MESH_AXES)
    coords = mesh.get_coordinate()
    assert coords is not None
    pp_rank, dp_rank, cp_rank, ulysses_rank, tp_rank = coords

    def group(axis: str, size: int) -> Any:
        return mesh.get_group(axis) if size > 1 else None

    replicas = dp * config.cp * config.ulysses
    replica_mesh = None
    if replicas > 1 or config.fsdp:
        # DeviceMesh._flatten (torch >= 2.5; private but what torchtitan uses for its dp_shard_cp mesh)
        replica_mesh = mesh[REPLICA_AXES]._flatten("replica")

    groups = ParallelGroups(
        config=config,
        tp_group=group("tp", config.tp),
        pp_group=group("pp", config.pp),
        dp_group=group("dp", dp),
        cp_group=group("cp", config.cp),
        ulysses_group=group("ulysses", config.ulysses),
        replica_group=replica_mesh.get_group() if replicas > 1 else None,
        tp_rank=tp_rank,
        pp_rank=pp_rank,
        dp_rank=dp_rank,
        cp_rank=cp_rank,
        ulysses_rank=ulysses_rank,
        dp_size=dp,
        mesh=mesh,
        replica_mesh=replica_mesh,
    )
    if config.ep > 1:
        # Experts are split over a sub-axis of the flattened (dp, cp) ranks of one TP/PP slot, as
        # Megatron's expert-parallel groups are: consecutive members of dp*cp form one EP group.
        dcp = dp * config.cp
        if dcp % config.ep:
            raise ParallelConfigError(f"ep={config.ep} does not divide dp*cp = {dp}*{config.cp}")
        ep_mesh = init_device_mesh(
            _device_type(device),
            (config.pp, dcp // config.ep, config.ep, config.tp),
            mesh_dim_names=("pp", "edp", "ep", "tp"),
        )
        groups.ep_group = ep_mesh.get_group("ep")
        groups.ep_rank = ep_mesh.get_coordinate()[2]
        groups.edp_group = ep_mesh.get_group("edp") if dcp // config.ep > 1 else None
    return groups


def groups_from_megatron(config: ParallelConfig | None = None) -> ParallelGroups:
    """Adopt the groups megatron-core's ``parallel_state`` already created in this process.

    For callers inside a Megatron training job: the model then shares Megatron's TP/PP/DP/CP groups
    instead of creating its own. ``config`` (optional) must agree with Megatron's sizes.
    """
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        raise ParallelConfigError("megatron-core parallel_state is not initialized (initialize_model_parallel first)")
    tp = ps.get_tensor_model_parallel_world_size()
    pp = ps.get_pipeline_model_parallel_world_size()
    cp = ps.get_context_parallel_world_size()
    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    ep = ps.get_expert_model_parallel_world_size()
    derived = ParallelConfig(tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep,
                             sequence_parallel=bool(config and config.sequence_parallel))
    if config is not None and (config.ulysses > 1 or config.fsdp):
        raise ParallelConfigError(f"{config.describe()}: megatron-core groups have no Ulysses axis and no FSDP mesh")
    if config is not None and (config.tp, config.pp, config.cp, config.ep) != (tp, pp, cp, ep):
        raise ParallelConfigError(
            f"ParallelConfig {config.describe()} disagrees with megatron-core parallel_state "
            f"(tp={tp}, pp={pp}, cp={cp}, ep={ep})"
        )
    config = config or derived
    dp = ps.get_data_parallel_world_size()
    return ParallelGroups(
        config=config,
        tp_group=ps.get_tensor_model_parallel_group() if tp > 1 else None,
        pp_group=ps.get_pipeline_model_parallel_group() if pp > 1 else None,
        dp_group=ps.get_data_parallel_group() if dp > 1 else None,
        cp_group=ps.get_context_parallel_group() if cp > 1 else None,
        replica_group=ps.get_data_parallel_group(with_context_parallel=True) if dp * cp > 1 else None,
        ep_group=ps.get_expert_model_parallel_group() if ep > 1 else None,
        edp_group=ps.get_expert_data_parallel_group() if ep > 1 and dp * cp > ep else None,
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        cp_rank=ps.get_context_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank() if ep > 1 else 0,
        dp_size=dp,
    )
