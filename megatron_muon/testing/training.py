"""A tiny megatron training setup (DDP + get_megatron_optimizer) and one step, for layout-equivalence tests."""

from __future__ import annotations

from typing import Any, Callable

import torch

from megatron_muon.testing.models import (
    build_tiny_gpt,
    forward_backward,
    global_parameter_names,
    synthetic_batch,
    tiny_transformer_config,
)


def build_training_setup(
    optimizer: str = "adam",
    bf16: bool = False,
    use_distributed_optimizer: bool = False,
    lr: float = 1e-2,
    model_builder: Callable[..., Any] = build_tiny_gpt,
    config_overrides: dict | None = None,
    **optimizer_overrides: Any,
):
    """Model wrapped the way megatron's pretrain does it (Float16Module for bf16, then DDP) plus its optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    config = tiny_transformer_config(bf16=bf16, **(config_overrides or {}))
    model = model_builder(config)
    if bf16:
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=use_distributed_optimizer
    )
    model = DistributedDataParallel(config, ddp_config, model)
    config.finalize_model_grads_func = finalize_model_grads
    settings = dict(optimizer=optimizer, lr=lr, min_lr=lr, weight_decay=0.01, bf16=bf16, clip_grad=1.0,
                    use_distributed_optimizer=use_distributed_optimizer)
    settings.update(optimizer_overrides)
    opt = get_megatron_optimizer(OptimizerConfig(**settings), [model])
    return model, opt


def train_step(model, optimizer, step: int, global_microbatches: int = 4, micro_batch_size: int = 2) -> float:
    """One step over the step's global batch; each dp rank takes its contiguous slice of micro-batches, so any dp
    size sees the same global batch. Returns the loss averaged over the global batch (last pipeline stage)."""
    from megatron.core import parallel_state as ps

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    if global_microbatches % dp != 0:
        raise ValueError(f"global_microbatches={global_microbatches} must be divisible by dp={dp}")
    local = global_microbatches // dp
    first = step * global_microbatches + dp_rank * local
    batches = [synthetic_batch(first + i, micro_batch_size=micro_batch_size) for i in range(local)]
    model.zero_grad_buffer()
    optimizer.zero_grad()
    loss = forward_backward(model, batches)
    optimizer.step()
    if ps.is_pipeline_last_stage():
        loss_tensor = torch.tensor([loss], dtype=torch.float64)
        torch.distributed.all_reduce(loss_tensor, group=ps.get_data_parallel_group())
        loss = float(loss_tensor) / dp
    return loss


def full_parameters(model) -> dict[str, torch.Tensor]:
    """Every parameter of this rank's stage gathered across tp into its unsharded fp32 form, keyed by global name.

    Lets a test compare parameters of runs with different (tp, pp) layouts directly.
    """
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    tp = ps.get_tensor_model_parallel_world_size()
    result = {}
    for name, param in global_parameter_names(model).items():
        tensor = param.detach().float()
        if tp > 1 and getattr(param, "tensor_model_parallel", False):
            parts = [torch.empty_like(tensor) for _ in range(tp)]
            torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
            # A strided shard (e.g. SwiGLU's fc1 holds [gate_r; up_r]) is `stride` chunks, each split across ranks.
            stride, dim = getattr(param, "partition_stride", 1), param.partition_dim
            chunks = [part.chunk(stride, dim=dim) for part in parts]
            tensor = torch.cat([chunks[r][j] for j in range(stride) for r in range(tp)], dim=dim)
        result[name] = tensor.clone()
    return result
