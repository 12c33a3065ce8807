"""`dist_muon` on the owner-centric engine: each matrix orthogonalized once per step, by a cost-balanced owner.

megatron builds it like its plain `muon` (megatron's mixed-precision wrapper keeps the fp32 master weights, AdamW
takes the non-matrix parameters); the torch optimizer for the matrices is `OwnerMuon` instead of `Muon`, and the
DDP bucket groups holding Muon matrices get their gradient sync from `owner_grad_sync`: Muon gradients are
reduce-scattered to the data-parallel row of their owner instead of all-reduced (the rest of such a bucket stays
all-reduced). Momentum lives on owners only and is handed to checkpoints as parameter-shaped shards, so
checkpoints of `muon` and `dist_muon` interchange and reshard to any tp/pp/dp layout.

The same builder serves `muon` with `use_distributed_optimizer=True`: on a DDP built for megatron's distributed
optimizer the non-Muon parameters go to megatron's DistributedOptimizer instead (see `owner_distopt`).
"""

from __future__ import annotations

import contextlib
import copy

from megatron_muon.distributed.owner_muon import OwnerMuon
from megatron_muon.megatron import optimizer_registry
from megatron_muon.megatron.muon_config import muon_kwargs_from_config
from megatron_muon.megatron.owner_distopt import (
    check_ddp_for_owner_engine,
    ddp_uses_distributed_optimizer,
    install_owner_buffer_sync,
    scalar_groups_on_distributed_optimizer,
)
from megatron_muon.megatron.owner_grad_sync import install_owner_grad_sync, muon_bucket_groups

# How the engines built from now on choose owners (`set_owner_plan`); empty: OwnerMuon's defaults.
_owner_plan: dict = {}


def set_owner_plan(method: str = "auto", cost_model=None) -> None:
    """Owner planning for `dist_muon` optimizers built after this call: `method` "auto", "milp" or "lpt" (see
    `distributed.plan.plan_owners`); `cost_model` None (Newton–Schulz FLOPs), "profile" (each shape timed once on
    the device at the first step) or a `distributed.plan.CostModel`."""
    if method not in ("auto", "milp", "lpt"):
        raise ValueError(f"owner plan method must be 'auto', 'milp' or 'lpt', got {method!r}")
    if isinstance(cost_model, str) and cost_model != "profile":
        raise ValueError(f"cost_model must be None, 'profile' or a CostModel, got {cost_model!r}")
    _owner_plan.clear()
    _owner_plan.update(plan_method=method, cost_model=cost_model)


def owner_muon_kwargs(config, model_chunks, pg_collection) -> dict:
    """`OwnerMuon` arguments: the `Muon` ones plus this stage's TP and DP (with context parallel) groups."""
    kwargs = muon_kwargs_from_config(config, model_chunks, pg_collection)
    kwargs.pop("tp_group_fn", None)
    kwargs["tp_mode"] = "duplicated"  # owners always orthogonalize whole matrices: TP-invariant by construction
    if pg_collection is not None:
        kwargs.update(
            tp_group=getattr(pg_collection, "tp", None),
            dp_group=getattr(pg_collection, "dp_cp", None),
            expert_tp_group=getattr(pg_collection, "expt_tp", None),
            expert_dp_group=getattr(pg_collection, "expt_dp", None),
        )
    kwargs.update(_owner_plan)
    return kwargs


@contextlib.contextmanager
def _muon_entry_builds_owner_muon():
    from megatron.core.optimizer import emerging_optimizers as mcore_registry

    registry = mcore_registry._EMERGING_OPTIMIZERS
    saved = registry[optimizer_registry.MUON_NAME]
    registry[optimizer_registry.MUON_NAME] = mcore_registry.EmergingOptimizerEntry(
        optimizer_cls=OwnerMuon,
        init_state_fn=optimizer_registry.init_muon_state,
        config_to_kwargs=owner_muon_kwargs,
        default_param_overrides=saved.default_param_overrides,
    )
    try:
        yield
    finally:
        registry[optimizer_registry.MUON_NAME] = saved


def build_owner_dist_muon(config, model_chunks, config_overrides, pg_collection):
    """The `dist_muon` builder handed to `optimizer_registry.set_dist_muon_builder` (also `muon` with
    `use_distributed_optimizer=True`)."""
    check_ddp_for_owner_engine(model_chunks)
    if config.overlap_param_gather_with_optimizer_step:
        raise ValueError("dist_muon does not overlap a parameter all-gather with the optimizer step; set "
                         "overlap_param_gather_with_optimizer_step=False")
    muon_config = copy.copy(config)
    muon_config.optimizer = optimizer_registry.MUON_NAME
    muon_config.use_layer_wise_distributed_optimizer = False
    sharded = ddp_uses_distributed_optimizer(model_chunks)
    muon_config.use_distributed_optimizer = sharded
    scalar_placement = scalar_groups_on_distributed_optimizer() if sharded else contextlib.nullcontext()
    with _muon_entry_builds_owner_muon(), scalar_placement:
        optimizer = optimizer_registry._upstream_build(muon_config, model_chunks, config_overrides, pg_collection)
    syncs = install_owner_grad_sync(optimizer, model_chunks)
    install_owner_buffer_sync(muon_bucket_groups(optimizer, model_chunks), {id(sync.group) for sync in syncs})
    return optimizer


def register_dist_muon() -> None:
    """Make `dist_muon` build the owner-centric engine (idempotent)."""
    optimizer_registry.set_dist_muon_builder(build_owner_dist_muon)
