"""Per-test model-parallel layouts inside a rank of the pool (the world process group stays up between tests)."""

from __future__ import annotations

import torch


_current_layout: tuple | None = None


def init_model_parallel(tp: int = 1, pp: int = 1, seed: int = 1234, **kwargs) -> None:
    """Set megatron's parallel_state to this (tp, pp) layout (dp is what remains of the world) and reseed.

    An unchanged layout keeps its process groups (each new set costs every rank dozens of gloo threads); a changed
    one destroys the previous groups first, so long test sessions do not accumulate threads.
    """
    global _current_layout
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    world_size = torch.distributed.get_world_size()
    if world_size % (tp * pp) != 0:
        raise ValueError(f"tp*pp = {tp * pp} must divide the world size {world_size}")
    layout_key = (tp, pp, tuple(sorted(kwargs.items())))
    # Code under test (the training loop) may have set parallel_state itself: trust only what it reports now.
    unchanged = (
        layout_key == _current_layout
        and parallel_state.model_parallel_is_initialized()
        and parallel_state.get_tensor_model_parallel_world_size() == tp
        and parallel_state.get_pipeline_model_parallel_world_size() == pp
    )
    if not unchanged:
        destroy_model_parallel()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, **kwargs
        )
        _current_layout = layout_key
    destroy_num_microbatches_calculator()
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def destroy_model_parallel() -> None:
    """Tear down parallel_state, its process groups and the global caches of the previous layout."""
    global _current_layout
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator

    from megatron_muon.distributed.process_groups import live_groups

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    for group in live_groups():
        if group is not torch.distributed.group.WORLD:
            torch.distributed.destroy_process_group(group)
    destroy_num_microbatches_calculator()
    _current_layout = None


def layout() -> dict[str, int]:
    """This rank's coordinates, handy for asserting a test really ran the layout it claims."""
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "tp_rank": ps.get_tensor_model_parallel_rank(),
        "pp_rank": ps.get_pipeline_model_parallel_rank(),
        "dp_rank": ps.get_data_parallel_rank(),
    }
