"""One process as one rank of a W-rank data-parallel group: torch's fake process-group backend (its collectives do
nothing), and megatron's bucket reduce-scatter and all-gather replaced by local copies of the same bytes, so the rank
does the memory traffic of its collectives without a network (used by `dist_sim_step.py`)."""

from __future__ import annotations

import torch

_MEGATRON_COLLECTIVES: dict = {}  # megatron's own bucket collectives while local copies stand in for them


def local_collectives(world: int) -> None:
    """megatron's bucket reduce-scatter and all-gather as local copies of the same bytes (fake group only)."""
    from megatron.core.distributed import param_and_grad_buffer

    def reduce_scatter(output, input, op=None, group=None, async_op=False):
        torch.sum(input.view(world, -1), dim=0, out=output)

    def all_gather(output, input, group=None, async_op=False):
        output.view(world, -1).copy_(input.view(1, -1).expand(world, -1))

    for name in ("dist_reduce_scatter_func", "dist_all_gather_func"):
        _MEGATRON_COLLECTIVES.setdefault(name, getattr(param_and_grad_buffer, name))
    param_and_grad_buffer.dist_reduce_scatter_func = reduce_scatter
    param_and_grad_buffer.dist_all_gather_func = all_gather


def join_fake_group(world: int, rank: int) -> None:
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    leave_fake_group()
    torch.distributed.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    parallel_state.initialize_model_parallel(1, 1, create_gloo_process_groups=False)
    local_collectives(world)


def leave_fake_group() -> None:
    """Undo `join_fake_group` (groups and megatron's collectives), so a caller in the same process (a test session)
    can build its own groups."""
    from megatron.core import parallel_state
    from megatron.core.distributed import param_and_grad_buffer

    for name, function in _MEGATRON_COLLECTIVES.items():
        setattr(param_and_grad_buffer, name, function)
    _MEGATRON_COLLECTIVES.clear()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
