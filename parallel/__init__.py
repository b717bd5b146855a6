"""Architecture-agnostic parallel core: layouts, process groups, collectives, layers, sharding rules."""

from parallel.config import ParallelConfig, ParallelConfigError
from parallel.groups import ParallelGroups, build_groups, groups_from_megatron

__all__ = ["ParallelConfig", "ParallelConfigError", "ParallelGroups", "build_groups", "groups_from_megatron"]
