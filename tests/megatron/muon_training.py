"""Rank functions for the through-megatron Muon tests: tiny models trained by `get_megatron_optimizer`."""

from __future__ import annotations

import torch

from megatron_muon.testing.models import build_tiny_gpt, forward_backward, synthetic_batch, tiny_transformer_config
from megatron_muon.testing.parallel import init_model_parallel, layout


def _wrap_for_training(model, config, precision: str, use_distributed_optimizer: bool = False):
    """Float16Module (bf16/fp16) + DDP; with `use_distributed_optimizer` the params are first tagged so DDP puts
    Muon matrices and AdamW params in separate buffers (megatron's layer-wise + DistributedOptimizer layout)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer.layer_wise_optimizer import tag_params_for_buffer_routing
    from megatron.core.transformer.module import Float16Module

    if use_distributed_optimizer:
        tag_params_for_buffer_routing([model])
    if precision in ("bf16", "fp16"):
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=use_distributed_optimizer
    )
    model = DistributedDataParallel(config, ddp_config, model)
    config.finalize_model_grads_func = finalize_model_grads
    return model


def build_optimizer(model, name: str, precision: str, lr: float = 0.02, **muon_options):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ns_method = muon_options.pop("muon_ns_method", "standard")
    config = OptimizerConfig(
        optimizer=name,
        lr=lr,
        min_lr=lr,
        weight_decay=0.01,
        clip_grad=1.0,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        initial_loss_scale=2.0**12,
        adam_beta1=0.9,
        adam_beta2=0.95,
        muon_tp_mode="duplicated",
        **muon_options,
    )
    config.muon_ns_method = ns_method
    return get_megatron_optimizer(config, [model])


def _muon_members(optimizer):
    """The torch optimizers inside a megatron optimizer chain."""
    children = getattr(optimizer, "chained_optimizers", None)
    if children is not None:
        return [m for child in children for m in _muon_members(child)]
    inner = getattr(optimizer, "optimizer", None)
    return [inner] if inner is not None else []


def train_tiny_gpt(
    rank, world_size, tp: int, name: str, precision: str, steps: int, distributed_layout: bool = False, **muon_options
):
    """Train the tiny GPT `steps` steps; returns losses, optimizer types, and a TP-independent weight digest."""
    import megatron_muon

    megatron_muon.register()
    init_model_parallel(tp=tp)
    dtype_flags = {"bf16": dict(bf16=True), "fp16": dict(fp16=True), "fp32": {}}[precision]
    config = tiny_transformer_config(**dtype_flags)
    model = _wrap_for_training(build_tiny_gpt(config), config, precision, distributed_layout)
    optimizer = build_optimizer(model, name, precision, **muon_options)
    losses, skipped = [], 0
    for step in range(steps):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses.append(forward_backward(model, [synthetic_batch(step % 4)]))
        ok, _, _ = optimizer.step()
        skipped += int(not ok)
    return {
        "losses": losses,
        "skipped": skipped,
        "types": sorted({type(m).__module__ + "." + type(m).__name__ for m in _muon_members(optimizer)}),
        "layout": layout(),
        "digest": _full_weight_digest(model),
    }


def _full_weight_digest(model) -> dict[str, float]:
    """Per-parameter sums of the gathered (unsharded) weights: equal across TP layouts when training is."""
    from megatron.core import parallel_state as ps

    digest = {}
    group = ps.get_tensor_model_parallel_group()
    world = ps.get_tensor_model_parallel_world_size()
    for name, param in model.named_parameters():
        value = param.detach().float()
        if getattr(param, "tensor_model_parallel", False) and world > 1:
            shards = [torch.empty_like(value) for _ in range(world)]
            torch.distributed.all_gather(shards, value.contiguous(), group=group)
            value = torch.cat(shards, dim=param.partition_dim)
        digest[name] = float(value.double().pow(2).sum())
    return digest


def build_only(rank, world_size, name: str, precision: str):
    """Build the optimizer chain only; return its member types."""
    import megatron_muon

    megatron_muon.register()
    init_model_parallel(tp=1)
    dtype_flags = {"bf16": dict(bf16=True), "fp16": dict(fp16=True), "fp32": {}}[precision]
    config = tiny_transformer_config(**dtype_flags)
    model = _wrap_for_training(build_tiny_gpt(config), config, precision)
    optimizer = build_optimizer(model, name, precision)
    return [type(m) for m in _muon_members(optimizer)]
