"""Save and load a megatron model + optimizer through dist_checkpointing (torch_dist), atomically.

A checkpoint is written into `<dir>.tmp-save` and renamed into place only after every rank finished writing, so a
failed or interrupted save never leaves a directory that looks loadable.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

_DONE_MARKER = "megatron_muon_complete"

# Hybrid layers differ in kind (GDN vs attention), so their tensors cannot be stacked along one layer axis:
# every layer is stored under its own global index instead (valid for homogeneous models too).
DEFAULT_MODEL_METADATA = {"non_homogeneous_layers": True}


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def _unwrap_chunks(model) -> list:
    """The bare model chunks (without DDP / FSDP / Float16Module wrappers), whose state-dict keys carry no `module.`."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(model if isinstance(model, list) else [model])


def _model_metadata(model_metadata: dict | None) -> dict:
    return dict(DEFAULT_MODEL_METADATA if model_metadata is None else model_metadata)


def default_optimizer_metadata(optimizer) -> dict:
    """megatron's fully-reshardable format where a DistributedOptimizer is in the chain (its default,
    fully_sharded_model_space, cannot be saved with megatron-core 0.19's flattened-range check), else none."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if any(isinstance(member, DistributedOptimizer) for member in _members(optimizer)):
        return {"distrib_optim_sharding_type": "fully_reshardable"}
    return {}


def sharded_state_dict(model, optimizer, is_loading: bool, extra: dict | None = None,
                       model_metadata: dict | None = None, optimizer_metadata: dict | None = None) -> dict:
    """The model's (all chunks) and optimizer's sharded state dicts, in the structure megatron's pretrain uses.

    `model_metadata` defaults to `DEFAULT_MODEL_METADATA`; save and load must use the same metadata."""
    chunks = _unwrap_chunks(model)
    metadata = _model_metadata(model_metadata)
    state = {}
    if len(chunks) == 1:
        state["model"] = chunks[0].sharded_state_dict(metadata=dict(metadata))
        model_state_for_optimizer = state["model"]
    else:
        for index, chunk in enumerate(chunks):
            state[f"model{index}"] = chunk.sharded_state_dict(metadata=dict(metadata))
        model_state_for_optimizer = {k: v for k, v in state.items()}
    if optimizer is not None:
        optimizer_metadata = default_optimizer_metadata(optimizer) if optimizer_metadata is None else optimizer_metadata
        optimizer_kwargs = {"metadata": dict(optimizer_metadata)} if optimizer_metadata else {}
        state["optimizer"] = optimizer.sharded_state_dict(
            model_state_for_optimizer, is_loading=is_loading, **optimizer_kwargs
        )
    if extra:
        state.update(extra)
    return state


def save_checkpoint(model, optimizer, directory: str | os.PathLike, extra: dict | None = None,
                    model_metadata: dict | None = None, optimizer_metadata: dict | None = None) -> Path:
    """Write a dist checkpoint to `directory` (replacing an older one there only once the new one is complete).

    Model and optimizer metadata are also stored as the checkpoint's content metadata, as megatron's pretrain does."""
    from megatron.core import dist_checkpointing

    final = Path(directory)
    staging = final.with_name(final.name + ".tmp-save")
    if _rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    _barrier()
    if optimizer is not None and optimizer_metadata is None:
        optimizer_metadata = default_optimizer_metadata(optimizer)
    state = sharded_state_dict(model, optimizer, False, extra, model_metadata, optimizer_metadata)
    content_metadata = {**_model_metadata(model_metadata), **(optimizer_metadata or {})}
    dist_checkpointing.save(state, str(staging), content_metadata=content_metadata)
    _barrier()
    if _rank() == 0:
        (staging / _DONE_MARKER).write_text("ok\n")
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
    _barrier()
    return final


def is_complete_checkpoint(directory: str | os.PathLike) -> bool:
    return (Path(directory) / _DONE_MARKER).is_file()


def _members(optimizer) -> list:
    children = getattr(optimizer, "chained_optimizers", None)
    return [m for child in children for m in _members(child)] if children is not None else [optimizer]


def _distributed_adams(optimizer) -> list:
    """The torch Adam(W) optimizers inside megatron DistributedOptimizers of `optimizer`."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return [member.optimizer for member in _members(optimizer) if isinstance(member, DistributedOptimizer)
            and isinstance(getattr(member, "optimizer", None), torch.optim.Adam | torch.optim.AdamW)]


def fill_empty_adam_state(optimizer) -> None:
    """Give a fresh DistributedOptimizer's torch Adam(W) zero state with a `step`: without TE/Apex, megatron reads
    the step count from that state while building the template a checkpoint loads into (the values are replaced)."""
    for adam in _distributed_adams(optimizer):
        for group in adam.param_groups:
            for param in group["params"]:
                state = adam.state[param]
                if not state:
                    state.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(param),
                                 exp_avg_sq=torch.zeros_like(param))


def detach_adam_steps(optimizer) -> dict:
    """Take the per-parameter `step` tensors out of the DistributedOptimizers' torch Adam(W) state: megatron's
    fully-reshardable load copies every tensor of that state from the checkpoint, which holds no per-parameter step
    (megatron-core 0.19 raises KeyError 'step'). `restore_adam_steps` puts them back."""
    detached = {}
    for adam in _distributed_adams(optimizer):
        for state in adam.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                detached[id(state)] = (state, state.pop("step"))
    return detached


def restore_adam_steps(optimizer, detached: dict | None = None) -> None:
    """Without TE/Apex, megatron's DistributedOptimizer keeps the step count in each parameter's torch Adam(W)
    state, but its checkpoints restore the count only into the param groups: the per-parameter copies come back from
    the load template (the fresh optimizer's value), and all share one tensor that torch would advance once per
    parameter. Give every parameter its own copy of the loaded count (and back its `detach_adam_steps` tensor)."""
    for state, step in (detached or {}).values():
        state["step"] = step
    for adam in _distributed_adams(optimizer):
        for group in adam.param_groups:
            if group.get("step") is None:
                continue
            for param in group["params"]:
                state = adam.state[param]
                if "step" in state:
                    state["step"] = torch.full_like(state["step"], float(group["step"]))


def load_checkpoint(model, optimizer, directory: str | os.PathLike, extra: dict | None = None,
                    model_metadata: dict | None = None, optimizer_metadata: dict | None = None,
                    optimizer_state_transform=None) -> dict:
    """Load a checkpoint written by `save_checkpoint` into `model` and `optimizer` (any tp/pp/dp layout the state
    dicts can reshard to); returns the loaded state dict (for `extra` entries such as the iteration).
    `optimizer_state_transform(state)` may edit the loaded optimizer state before the optimizer takes it."""
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    if not is_complete_checkpoint(directory):
        raise ValueError(
            f"{directory} is not a complete megatron_muon checkpoint (missing {_DONE_MARKER}); "
            "point --load at a directory written by a finished save."
        )
    if optimizer is not None:
        fill_empty_adam_state(optimizer)
    template = sharded_state_dict(model, optimizer, True, extra, model_metadata, optimizer_metadata)
    state = dist_checkpointing.load(template, str(directory))
    chunks = _unwrap_chunks(model)
    if len(chunks) == 1:
        chunks[0].load_state_dict(state["model"])
    else:
        for index, chunk in enumerate(chunks):
            chunk.load_state_dict(state[f"model{index}"])
    if optimizer is not None:
        if optimizer_state_transform is not None:
            optimizer_state_transform(state["optimizer"])
        detached = detach_adam_steps(optimizer)
        with torch.no_grad():  # the distributed optimizer copies into views of the (leaf) fp32 parameters
            optimizer.load_state_dict(state["optimizer"])
        restore_adam_steps(optimizer, detached)
    return state
