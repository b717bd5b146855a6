"""Architecture-agnostic parallel core: layouts, process groups, collectives, layers, sharding rules.

``ParallelConfig`` is imported eagerly (plain data); the process-group helpers load torch.distributed
on first use, so the torch-free parts (config, sharding rules) can be imported without torch.
"""

from parallel.config import ParallelConfig, ParallelConfigError

__all__ = ["ParallelConfig", "ParallelConfigError", "ParallelGroups", "build_groups", "groups_from_megatron"]


def __getattr__(name: str):
    if name in ("ParallelGroups", "build_groups", "groups_from_megatron"):
        from parallel import groups

        return getattr(groups, name)
    raise AttributeError(f"module 'parallel' has no attribute {name!r}")
