"""Rank functions: `muon` with megatron's distributed optimizer (owner engine + DistributedOptimizer for AdamW)."""

from __future__ import annotations

import torch

from megatron_muon.testing.parallel import init_model_parallel, layout
from megatron_muon.testing.training import full_parameters, train_step
from tests.distributed.dist_training import build, owner_engines
from tests.megatron.muon_training import one_thread

# The DistributedOptimizer checkpoint format that works with torch's AdamW (no TE/Apex fused Adam).
DISTOPT_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def build_sharded(tp: int, pp: int, precision: str, tagged: bool = True, lr: float = 0.01, clip_grad: float = 0.0,
                  overlap_param_gather: bool = False):
    """`muon` + use_distributed_optimizer=True through megatron's factory, DDP built for the distributed optimizer
    (with `overlap_param_gather`, DDP gathers parameters from forward pre-hooks instead of after the step)."""
    import megatron_muon
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from megatron_muon.megatron.owner_distopt import tag_params_for_owner_buffers
    from megatron_muon.testing.models import build_tiny_gpt, tiny_transformer_config

    megatron_muon.register()
    init_model_parallel(tp=tp, pp=pp)
    bf16 = precision == "bf16"
    config = tiny_transformer_config(bf16=bf16)
    model = build_tiny_gpt(config)
    if tagged:
        tag_params_for_owner_buffers([model])
    if bf16:
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True,
                                               overlap_param_gather=overlap_param_gather)
    model = DistributedDataParallel(config, ddp_config, model)
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="muon", lr=lr, min_lr=lr, weight_decay=0.01, bf16=bf16, clip_grad=clip_grad,
        use_distributed_optimizer=True, muon_tp_mode="duplicated",
        muon_fp32_matmul_prec="highest" if precision == "fp32" else "medium"), [model])
    return model, optimizer


def _members(optimizer) -> list:
    children = getattr(optimizer, "chained_optimizers", None)
    return [m for child in children for m in _members(child)] if children is not None else [optimizer]


def _adamw_shard_numel(optimizer) -> tuple[int, int]:
    """(AdamW elements this rank's DistributedOptimizer updates, elements of every non-Muon parameter it manages)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    shard, whole = 0, 0
    for member in _members(optimizer):
        if isinstance(member, DistributedOptimizer):
            shard += sum(p.numel() for g in member.optimizer.param_groups for p in g["params"])
            whole += sum(p.numel() for buffer in member.buffers for p in buffer.params)
    return shard, whole


def train_sharded_and_replicated(rank, world_size, tp: int, pp: int, precision: str, steps: int,
                                 overlap_param_gather: bool = False):
    """The same layout, weights and batches: `muon` with the distributed optimizer, then `dist_muon` without it."""
    results = {"layout": None}
    with one_thread():
        for name in ("sharded", "dist_muon"):
            if name == "sharded":
                model, optimizer = build_sharded(tp, pp, precision, overlap_param_gather=overlap_param_gather)
            else:
                model, optimizer = build(tp, pp, "dist_muon", precision, "gpt", clip_grad=0.0)
            losses = [train_step(model, optimizer, step) for step in range(steps)]
            if name == "sharded" and overlap_param_gather:  # AdamW shards arrive at the next forward: gather now
                model.disable_forward_pre_hook(param_sync=True)
            results[name] = {
                "losses": losses,
                "params": full_parameters(model),
                "types": sorted(type(m).__name__ for m in _members(optimizer)),
                "orthogonalized": sum(e.orthogonalized_matrices for e in owner_engines(optimizer)),
                "adamw_numel": _adamw_shard_numel(optimizer),
            }
    results["layout"] = layout()
    return results


def sharded_checkpoint_then_continue(rank, world_size, tp: int, directory: str, save_at: int, total: int,
                                     load: bool):
    """Train `save_at` steps, save and go on to `total`; or load that checkpoint into a fresh setup and go on."""
    from megatron_muon.megatron.checkpointing import load_checkpoint, save_checkpoint

    with one_thread():
        model, optimizer = build_sharded(tp, 1, "fp32")
        if load:
            load_checkpoint(model, optimizer, directory, optimizer_metadata=DISTOPT_METADATA)
        else:
            for step in range(save_at):
                train_step(model, optimizer, step)
            save_checkpoint(model, optimizer, directory, optimizer_metadata=DISTOPT_METADATA)
        losses = [train_step(model, optimizer, step) for step in range(save_at, total)]
        return {"losses": losses, "params": full_parameters(model)}


def build_error(rank, world_size, tagged: bool, precision: str = "fp32") -> str:
    """The ValueError message building `muon` + distributed optimizer raises here ('' when it builds)."""
    try:
        with one_thread():
            build_sharded(1, 1, precision, tagged=tagged)
    except ValueError as error:
        torch.distributed.barrier()
        return str(error)
    return ""
