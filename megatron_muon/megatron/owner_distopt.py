"""The owner engine next to megatron's DistributedOptimizer (DDP built with `use_distributed_optimizer=True`).

`muon` with `--use-distributed-optimizer` (and `dist_muon` on such a DDP) hands the Muon matrices to `OwnerMuon`
exactly as `dist_muon` does, and every other parameter to megatron's DistributedOptimizer, which shards the AdamW
state and master weights over data parallelism. DistributedOptimizer manages whole DDP buffers, so DDP must keep
Muon matrices and the other parameters in separate buffers: tag the parameters with `tag_params_for_owner_buffers`
(or megatron's `tag_params_for_buffer_routing`, which marks the same matrices) before wrapping them in DDP.

The Muon buffers never use DDP's reduce-scatter or parameter all-gather: their gradients go to owners
(`owner_grad_sync`), and the owners' updates reach every replica inside the engine's step, so the all-gather
megatron would run for them (after the step, or from the forward pre-hooks with `overlap_param_gather`) has
nothing left to bring and is skipped.
"""

from __future__ import annotations

import contextlib
import copy

import torch

from megatron_muon.megatron.owner_grad_sync import collective_group
from megatron_muon.optimizer.routing import is_muon_param

_TAG = "is_managed_by_layer_wise_optimizer"  # the attribute megatron's DDP splits its buffers by


def tag_params_for_owner_buffers(model_chunks) -> None:
    """Mark the Muon matrices (`is_muon_param`) so megatron's DDP gives them their own buffers.

    Call on the model chunks before wrapping them in `DistributedDataParallel(use_distributed_optimizer=True)`."""
    for chunk in model_chunks:
        for name, param in chunk.named_parameters():
            if param.requires_grad:
                setattr(param, _TAG, is_muon_param(param, name))


def ddp_uses_distributed_optimizer(model_chunks) -> bool:
    return any(getattr(getattr(chunk, "ddp_config", None), "use_distributed_optimizer", False)
               for chunk in model_chunks)


def check_ddp_for_owner_engine(model_chunks) -> None:
    for chunk in model_chunks:
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is not None and ddp_config.use_distributed_optimizer \
                and ddp_config.num_distributed_optimizer_instances != 1:
            raise ValueError("the Muon owner engine reduces gradients over the whole data-parallel group; set "
                             "num_distributed_optimizer_instances=1 (--num-distributed-optimizer-instances 1)")


def _ddp_buffers(chunk) -> list:
    return list(getattr(chunk, "buffers", [])) + list(getattr(chunk, "expert_parallel_buffers", []))


def scalar_buffers(model_chunks, scalar_params: set) -> dict[int, list]:
    """model chunk index -> the DDP buffers holding only non-Muon parameters (DistributedOptimizer's share)."""
    per_chunk = {}
    for index, chunk in enumerate(model_chunks):
        mine = []
        for buffer in _ddp_buffers(chunk):
            inside = sum(param in scalar_params for param in buffer.params)
            if 0 < inside < len(buffer.params):
                raise ValueError(
                    "DDP put Muon matrices and AdamW parameters into one gradient buffer, which megatron's "
                    "DistributedOptimizer cannot shard around. Tag the parameters before wrapping the model in "
                    "DistributedDataParallel (megatron_muon.megatron.owner_distopt.tag_params_for_owner_buffers"
                    "(model_chunks), or megatron's tag_params_for_buffer_routing), or drop "
                    "--use-distributed-optimizer (use_distributed_optimizer=False)"
                )
            if inside:
                mine.append(buffer)
        if mine:
            per_chunk[index] = mine
    return per_chunk


@contextlib.contextmanager
def scalar_groups_on_distributed_optimizer():
    """While megatron's emerging-optimizer factory runs, build its non-Muon groups as a DistributedOptimizer over
    the non-Muon DDP buffers (the arrangement megatron uses next to its layer-wise optimizer)."""
    import megatron.core.optimizer as mcore_optimizer
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.utils import get_pg_rank

    build_wrapped = mcore_optimizer._get_megatron_optimizer_based_on_param_groups

    def build(config, model_chunks, param_groups, **kwargs):
        if kwargs.get("skip_megatron_wrapping"):
            return build_wrapped(config, model_chunks, param_groups, **kwargs)
        if any(group["is_expert_parallel"] for group in param_groups):
            raise ValueError("AdamW expert parameters are not sharded next to the Muon owner engine yet; drop "
                             "--use-distributed-optimizer (use_distributed_optimizer=False) for MoE models")
        pg_collection = kwargs.get("pg_collection") or ProcessGroupCollection.use_mpu_process_groups()
        groups = ProcessGroupCollection.setup_process_groups_for_optimizer(
            pg_collection, model_chunks, use_gloo_process_groups=False)
        sharded_config = copy.copy(config)
        sharded_config.use_distributed_optimizer = True
        scalar_params = {param for group in param_groups for param in group["params"]}
        return build_wrapped(
            config=sharded_config, model_chunks=model_chunks, param_groups=param_groups,
            per_model_buffers=scalar_buffers(model_chunks, scalar_params),
            model_parallel_group=groups["mp_group"], data_parallel_group=groups["intra_dp_cp_group"],
            data_parallel_group_gloo=groups["intra_dp_cp_group_gloo"],
            data_parallel_group_idx=get_pg_rank(groups["mp_group"]),
            intra_dist_opt_group=groups["intra_dist_opt_group"], distributed_optimizer_instance_id=0,
            pg_collection=pg_collection,
        )

    mcore_optimizer._get_megatron_optimizer_based_on_param_groups = build
    try:
        yield
    finally:
        mcore_optimizer._get_megatron_optimizer_based_on_param_groups = build_wrapped


def _skip_param_all_gather(bucket_group) -> None:
    """The owners' updates are already in every replica's parameters when the step returns."""
    def start_param_sync(force_sync: bool = False):
        bucket_group.param_gather_dispatched = True

    def finish_param_sync(skip_next_bucket_dispatch: bool = False):
        bucket_group.param_gather_dispatched = True

    bucket_group.start_param_sync = start_param_sync
    bucket_group.finish_param_sync = finish_param_sync


def _always_all_reduce(bucket_group) -> None:
    """DDP's own sync for a Muon bucket group, all-reduced instead of reduce-scattered: the engine reads whole
    gradients wherever gradients are not routed to owners."""
    start, finish = bucket_group.start_grad_sync, bucket_group.finish_grad_sync
    bucket_group.start_grad_sync = lambda force_all_reduce=False: start(force_all_reduce=True)
    bucket_group.finish_grad_sync = lambda force_all_reduce=False: finish(force_all_reduce=True)


def install_owner_buffer_sync(muon_bucket_groups: list, owner_synced: set) -> None:
    """On a distributed-optimizer DDP: no parameter all-gather for Muon bucket groups, and an all-reduce for those
    whose gradients `owner_grad_sync` left to DDP (`owner_synced` holds the ids of the ones it took over)."""
    for bucket_group in muon_bucket_groups:
        if not bucket_group.ddp_config.use_distributed_optimizer:
            continue
        _skip_param_all_gather(bucket_group)
        if id(bucket_group) not in owner_synced and torch.distributed.get_world_size(
                collective_group(bucket_group)) > 1:
            _always_all_reduce(bucket_group)
