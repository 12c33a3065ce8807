"""Distributed checkpoints (megatron dist_checkpointing) of model, optimizer, LR schedule, step and RNG state.

Resume continues exactly: data order is a function of the step, and the RNG states of every rank are restored
when the checkpoint was written with the same parallel layout. Each iter_NNNNNNN/ is written atomically by
megatron_muon.megatron.checkpointing; the tracker file names the latest one only after it is complete.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from megatron_muon.megatron import checkpointing as dist_checkpoint
from megatron_muon.training.resume import TRACKER_FILE, iteration_dir  # noqa: F401  (TRACKER_FILE: tests read it)


def _layout() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return {
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
    }


def _rng_object():
    """This rank's RNG states as a ShardedObject indexed by (pp, tp, dp) rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"cpu": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    layout = _layout()
    return ShardedObject(
        "rng_state",
        state,
        (layout["pp"], layout["tp"], layout["dp"]),
        (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank()),
        replica_id=0,
    )


def _restore_rng(state: dict) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _optimizer_metadata(use_distributed_optimizer: bool) -> dict:
    """megatron's fully-reshardable DistributedOptimizer format: model-space tensors that load at any tp/pp/dp
    (the owner engine's chain loads it itself where megatron-core 0.19 cannot, with torch's Adam)."""
    return {"distrib_optim_sharding_type": "fully_reshardable"} if use_distributed_optimizer else {}


def _training_state(scheduler, step: int, with_rng: bool, extra: dict | None = None) -> dict:
    """What a training run adds to the model + optimizer state: LR schedule, step, layout and RNG states."""
    state = {"scheduler": scheduler.state_dict(), "iteration": step, "layout": _layout()}
    if with_rng:
        state["rng_state"] = _rng_object()
    if extra:
        state.update(extra)
    return state


def save_checkpoint(root: str | Path, step: int, model, optimizer, scheduler, use_distributed_optimizer: bool,
                    extra: dict | None = None) -> Path:
    """Write iter_NNNNNNN/ under root atomically (collective: every rank calls it); then point the tracker at it."""
    target = iteration_dir(root, step)
    dist_checkpoint.save_checkpoint(
        model, optimizer, target, extra=_training_state(scheduler, step, True, extra),
        model_metadata=dist_checkpoint.DEFAULT_MODEL_METADATA,
        optimizer_metadata=_optimizer_metadata(use_distributed_optimizer),
    )
    if torch.distributed.get_rank() == 0:
        (Path(root) / TRACKER_FILE).write_text(str(step))
    torch.distributed.barrier()
    return target


def load_checkpoint(root: str | Path, step: int, model, optimizer, scheduler, use_distributed_optimizer: bool,
                    optimizer_state_transform=None) -> None:
    """Load iteration `step` under root (chosen and checked by `resume.choose_iteration`) into model, optimizer and
    scheduler."""
    from megatron.core import dist_checkpointing

    source = iteration_dir(root, step)
    common = dist_checkpointing.load_common_state_dict(str(source))
    same_layout = common.get("layout") == _layout()
    if not same_layout:
        warnings.warn(
            f"checkpoint layout {common.get('layout')} differs from this run's {_layout()}: loading weights and "
            "optimizer state resharded, RNG states start fresh."
        )
    loaded = dist_checkpoint.load_checkpoint(
        model, optimizer, source, extra=_training_state(scheduler, step, same_layout),
        model_metadata=dist_checkpoint.DEFAULT_MODEL_METADATA,
        optimizer_metadata=_optimizer_metadata(use_distributed_optimizer),
        optimizer_state_transform=optimizer_state_transform,
    )
    scheduler.load_state_dict(loaded["scheduler"])
    if same_layout:
        _restore_rng(loaded["rng_state"])
    assert int(loaded["iteration"]) == step, f"{source} holds iteration {loaded['iteration']}"
