"""The process groups this process has created and not destroyed: torch keeps that registry privately, so the one
place that reads it is here."""

from __future__ import annotations


def live_groups() -> list:
    """Every process group registered in this process (the world group included), in creation order."""
    from torch.distributed import distributed_c10d

    return list(distributed_c10d._world.pg_map)


def is_alive(group) -> bool:
    """Whether `group` is still registered (not destroyed; a rank outside a group holds a placeholder, not alive)."""
    from torch.distributed import distributed_c10d

    return group is not None and group in distributed_c10d._world.pg_map
