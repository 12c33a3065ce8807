"""Per-test model-parallel layouts inside a rank of the pool (the world process group stays up between tests)."""

from __future__ import annotations

import torch


def init_model_parallel(tp: int = 1, pp: int = 1, seed: int = 1234, **kwargs) -> None:
    """(Re)initialize megatron's parallel_state for this (tp, pp) layout; dp is what remains of the world."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    world_size = torch.distributed.get_world_size()
    if world_size % (tp * pp) != 0:
        raise ValueError(f"tp*pp = {tp * pp} must divide the world size {world_size}")
    destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, **kwargs
    )
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def destroy_model_parallel() -> None:
    """Tear down parallel_state and the global caches that hold tensors or groups of the previous layout."""
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    destroy_num_microbatches_calculator()


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
