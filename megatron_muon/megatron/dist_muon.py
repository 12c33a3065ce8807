"""Building the owner engine for `muon` with megatron's distributed optimizer (`dist_muon` is the same, deprecated).

megatron-core builds `muon` + `use_layer_wise_distributed_optimizer` as its LayerWiseDistributedOptimizer around
the emerging optimizer, next to a DistributedOptimizer for the AdamW parameters. This builder assembles the same
arrangement from megatron's own pieces (its param groups, its DistributedOptimizer, its LayerWise class through
`OwnerMuonOptimizer`) with our `WaveMuon` as the emerging optimizer. DDP must have been built for it: with
`use_distributed_optimizer=True` and a layout that keeps each Muon matrix whole in one shard
(`owner_layout.compute_full_param_layout`, or megatron's layer-wise layout).
"""

from __future__ import annotations

import copy
from collections import defaultdict

import torch

from megatron_muon.distributed.process_groups import is_alive
from megatron_muon.megatron.nonfinite_check import DEFAULT_NONFINITE_CHECK
from megatron_muon.megatron.owner_layout import TAG, tag_fused_projections
from megatron_muon.megatron.owner_chain import OwnerMuonChain
from megatron_muon.megatron.owner_optimizer import DEFAULT_NEWTON_SCHULZ_START, OwnerMuonOptimizer
from megatron_muon.optimizer.wave_muon import WaveMuon

_WRAP_HINT = ("wrap the model the way Megatron-LM does for `--optimizer muon --use-distributed-optimizer`: tag the "
              "Muon matrices (megatron_muon.megatron.owner_layout.tag_params_for_owner_buffers(model_chunks)) and build "
              "DistributedDataParallel(..., ddp_config with use_distributed_optimizer=True, full_param_layout="
              "megatron_muon.megatron.owner_layout.compute_full_param_layout(params, bucket_size, dp_size, ddp_config))")


def check_ddp_for_owner_engine(model_chunks, muon_params: set, other_params: set) -> None:
    """Clear errors for DDP wrappings the owner engine cannot run on."""
    for chunk in model_chunks:
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is None or not ddp_config.use_distributed_optimizer:
            raise ValueError("muon with the distributed optimizer (or dist_muon) needs megatron's DDP built with "
                             f"use_distributed_optimizer=True; {_WRAP_HINT}")
        if ddp_config.num_distributed_optimizer_instances != 1:
            raise ValueError("the Muon owner engine shards over the whole data-parallel group; set "
                             "num_distributed_optimizer_instances=1 (--num-distributed-optimizer-instances 1)")
        for buffer in list(chunk.buffers) + list(chunk.expert_parallel_buffers):
            tagged = bool(buffer.params) and getattr(buffer.params[0], TAG, False)
            wrong = [p for p in buffer.params if (p in other_params if tagged else p in muon_params)]
            if wrong:
                raise ValueError(
                    f"{len(wrong)} parameters sit in a DDP buffer of the other optimizer ({'Muon' if tagged else 'AdamW'} "
                    f"buffer, e.g. shape {tuple(wrong[0].shape)}): the Muon matrices must be tagged before DDP is "
                    f"built; {_WRAP_HINT}")
            if tagged:
                _check_whole_matrices(buffer)


def _check_whole_matrices(buffer) -> None:
    """Each Muon matrix must lie inside one data-parallel shard of its bucket (its owner's)."""
    dp = buffer.data_parallel_world_size
    for bucket in buffer.buckets:
        shard = bucket.grad_data.numel() // dp
        for param in bucket.params_list:
            start, end = bucket.param_to_index[param]
            if start // shard != (end - 1) // shard:
                raise ValueError(
                    f"a Muon matrix of shape {tuple(param.shape)} crosses a data-parallel shard boundary of its DDP "
                    f"bucket, so no single rank owns it: the DDP layout is not an owner layout; {_WRAP_HINT}")


_DUPLICATES: dict[tuple[int, ...], object] = {}  # ranks -> the duplicate group made for them, while it lives


def _duplicate_group(group):
    """A process group with the same ranks as `group` (every rank of the world takes part), so the optimizer's
    collectives during the backward queue apart from the model's own on that group. Made once per set of ranks and
    reused by later optimizers while every rank still has it (each group costs a communicator, or gloo's threads)."""
    ranks = tuple(torch.distributed.get_process_group_ranks(group))
    world_size = torch.distributed.get_world_size()
    everyone = [None] * world_size
    torch.distributed.all_gather_object(everyone, ranks)
    candidates = sorted(set(everyone))
    # new_group is collective: reuse only where every rank still has its own duplicate (a rank outside a group holds
    # a non-member placeholder for it)
    reusable = [None] * world_size
    torch.distributed.all_gather_object(reusable, all(c in _DUPLICATES for c in candidates)
                                        and is_alive(_DUPLICATES[ranks]))
    if not all(reusable):
        for candidate in candidates:
            _DUPLICATES[candidate] = torch.distributed.new_group(list(candidate))
    return _DUPLICATES[ranks]


def build_owner_muon(config, model_chunks, config_overrides, pg_collection):
    """`OwnerMuonChain([OwnerMuonOptimizer(WaveMuon), DistributedOptimizer(AdamW)...])` for megatron's factory."""
    import megatron.core.optimizer as mcore
    from megatron.core.optimizer.emerging_optimizers import _EMERGING_OPTIMIZERS
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.utils import get_pg_rank, get_pg_size

    if config.overlap_param_gather_with_optimizer_step:
        raise ValueError("muon with the distributed optimizer does not overlap the parameter all-gather with the "
                         "optimizer step; set overlap_param_gather_with_optimizer_step=False")
    if pg_collection is None:
        pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    tag_fused_projections(model_chunks)
    entry = _EMERGING_OPTIMIZERS["muon"]
    overrides = dict(config_overrides or {})
    for key, override in copy.deepcopy(entry.default_param_overrides).items():
        if override.get("optimizer") in ("adam", "lion"):
            override["optimizer"] = config.muon_scalar_optimizer
        overrides[key] = override
    groups = mcore._get_param_groups(model_chunks, config, overrides)
    if any(group["is_expert_parallel"] for group in groups):
        raise ValueError("expert-parallel parameters are not supported by the Muon owner engine yet; use "
                         "--optimizer muon without --use-distributed-optimizer for MoE models")
    muon_groups = [g for g in groups if g.get("optimizer", "muon") == "muon"]
    other_groups: dict[str, list] = defaultdict(list)
    for group in groups:
        if group.get("optimizer", "muon") != "muon":
            other_groups[group["optimizer"]].append(group)
    check_ddp_for_owner_engine(model_chunks, {p for g in muon_groups for p in g["params"]},
                               {p for gs in other_groups.values() for g in gs for p in g["params"]})

    kwargs = entry.config_to_kwargs(config, model_chunks, pg_collection)
    if get_pg_size(pg_collection.tp) > 1:  # TP gathers run from backward hooks: keep them off the model's TP queue
        tp_group = _duplicate_group(pg_collection.tp)
        kwargs["tp_group_fn"] = lambda param: tp_group
    engine = WaveMuon(muon_groups, **kwargs)
    muon = OwnerMuonOptimizer([engine], config, pg_collection, [entry.init_state_fn], list(model_chunks),
                              newton_schulz_start=getattr(config, "muon_newton_schulz_start",
                                                          DEFAULT_NEWTON_SCHULZ_START),
                              graph_newton_schulz=kwargs.get("graph_newton_schulz", False),
                              nonfinite_check=getattr(config, "muon_nonfinite_check", DEFAULT_NONFINITE_CHECK))
    chained = [muon]
    if other_groups:
        process_groups = ProcessGroupCollection.setup_process_groups_for_optimizer(
            pg_collection, model_chunks, use_gloo_process_groups=False)
        buffers = {}
        for index, chunk in enumerate(model_chunks):
            mine = [b for b in chunk.buffers if b.params and not getattr(b.params[0], TAG, False)]
            if mine:
                buffers[index] = mine
        for name, member_groups in other_groups.items():
            scalar_config = copy.copy(config)
            scalar_config.optimizer = name
            scalar_config.use_distributed_optimizer = True
            result = mcore._get_megatron_optimizer_based_on_param_groups(
                config=scalar_config, model_chunks=model_chunks, param_groups=member_groups,
                per_model_buffers=buffers, model_parallel_group=process_groups["mp_group"],
                data_parallel_group=process_groups["intra_dp_cp_group"],
                data_parallel_group_gloo=process_groups["intra_dp_cp_group_gloo"],
                data_parallel_group_idx=get_pg_rank(process_groups["mp_group"]),
                intra_dist_opt_group=process_groups["intra_dist_opt_group"], distributed_optimizer_instance_id=0,
                pg_collection=pg_collection)
            result.config = config  # megatron's ChainedOptimizer asserts one config
            chained.append(result)
    return OwnerMuonChain(chained)
