"""A tiny megatron training setup (DDP + get_megatron_optimizer) and one step, for layout-equivalence tests."""

from __future__ import annotations

from typing import Any, Callable

import torch

from megatron_muon.testing.models import (
    GDN_SIZES,
    build_tiny_gpt,
    build_tiny_hybrid,
    forward_backward,
    global_parameter_names,
    synthetic_batch,
    tiny_transformer_config,
)


def uses_owner_engine(optimizer: str, use_distributed_optimizer: bool) -> bool:
    """`dist_muon`, or `muon` with the distributed optimizer: DDP needs the owner layout."""
    return optimizer == "dist_muon" or (optimizer == "muon" and use_distributed_optimizer)


def wrap_in_ddp(model, config, *, use_distributed_optimizer: bool, owner_layout: bool, overlap_grad_reduce: bool = False,
                bucket_size: int | None = None, overlap_param_gather: bool = False, check_for_nan_in_grad: bool = False):
    """megatron DDP with fp32 gradient buffers (fp64 ones for fp64 models); `owner_layout`: Muon matrices tagged
    and laid out by owner (megatron_muon.megatron.owner_layout), what `muon` with the distributed optimizer needs."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=config.params_dtype != torch.float64, overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=use_distributed_optimizer or owner_layout, bucket_size=bucket_size,
        overlap_param_gather=overlap_param_gather, check_for_nan_in_grad=check_for_nan_in_grad,
    )
    layout = None
    if owner_layout:
        from megatron_muon.megatron.owner_layout import compute_full_param_layout, tag_params_for_owner_buffers

        tag_params_for_owner_buffers([model])
        params = [p for p in model.parameters() if p.requires_grad]
        layout = compute_full_param_layout(params, bucket_size if overlap_grad_reduce else None,
                                           ps.get_data_parallel_world_size(with_context_parallel=True), ddp_config)
    return DistributedDataParallel(config, ddp_config, model, full_param_layout=layout)


def build_training_setup(
    optimizer: str = "adam",
    bf16: bool = False,
    use_distributed_optimizer: bool = False,
    lr: float = 1e-2,
    model_builder: Callable[..., Any] = build_tiny_gpt,
    config_overrides: dict | None = None,
    ddp_overrides: dict | None = None,
    **optimizer_overrides: Any,
):
    """Model wrapped the way megatron's pretrain does it (Float16Module for bf16, then DDP) plus its optimizer.
    `ddp_overrides`: `wrap_in_ddp` options (overlap_grad_reduce, bucket_size, overlap_param_gather,
    check_for_nan_in_grad)."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    config = tiny_transformer_config(bf16=bf16, **(config_overrides or {}))
    model = model_builder(config)
    if config.params_dtype == torch.float64:  # megatron's torch-norm fallback makes its weights in the default dtype
        model.double()
    if not _on_gpu():  # fp64 runs shard with megatron's DistributedOptimizer; every other run sees fp64 as fp64
        from megatron_muon._cpu import report_float64_as_float32

        report_float64_as_float32(config.params_dtype == torch.float64)
    if _on_gpu():  # as megatron's get_model does; weights were initialized on CPU, identically for every layout
        model.cuda(torch.cuda.current_device())
    if bf16:
        model = Float16Module(config, model)
    owner = uses_owner_engine(optimizer, use_distributed_optimizer)
    use_distributed_optimizer = use_distributed_optimizer or owner
    model = wrap_in_ddp(model, config, use_distributed_optimizer=use_distributed_optimizer, owner_layout=owner,
                        **(ddp_overrides or {}))
    config.finalize_model_grads_func = finalize_model_grads
    settings = dict(optimizer=optimizer, lr=lr, min_lr=lr, weight_decay=0.01, bf16=bf16, clip_grad=1.0,
                    use_distributed_optimizer=use_distributed_optimizer)
    settings.update(optimizer_overrides)
    opt = get_megatron_optimizer(OptimizerConfig(**settings), [model])
    return model, opt


def _on_gpu() -> bool:
    from megatron_muon._cpu import cpu_mode_enabled

    return torch.cuda.is_available() and not cpu_mode_enabled()


PRECISIONS = ("fp32", "bf16", "fp64")


def build_muon_setup(name: str, precision: str, model: str, lr: float = 0.01, clip_grad: float | None = None,
                     config_overrides: dict | None = None, ddp_overrides: dict | None = None):
    """The tiny `model` ("gpt" or "hybrid") with megatron optimizer `name` (e.g. "dist_muon", "muon") in
    `precision` on the parallel_state already set; Muon's TP mode is "duplicated".

    `precision`: "bf16" (megatron's mixed precision), "fp32", or "fp64": parameters, gradient buffers, momentum
    and the Newton–Schulz iteration all in float64, so that layout-dependent rounding (~1e-16) stays far below
    what cross-layout parity tests resolve. `clip_grad` defaults to 1.0, and to 0.0 (no clipping) in fp64:
    megatron-core clips fp32 gradients only (`clip_grad_by_total_norm_fp32` asserts FloatTensor gradients).
    """
    import megatron_muon

    if model not in ("gpt", "hybrid"):
        raise ValueError(f"model must be 'gpt' or 'hybrid', got {model!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if clip_grad is None:
        clip_grad = 0.0 if precision == "fp64" else 1.0
    if precision == "fp64" and clip_grad > 0.0:
        raise ValueError(f"clip_grad={clip_grad} with precision 'fp64': megatron-core clips fp32 gradients only; "
                         "pass clip_grad=0.0 (no clipping) for fp64 runs")
    megatron_muon.register()
    options = dict(muon_tp_mode="duplicated", muon_fp32_matmul_prec="medium" if precision == "bf16" else "highest",
                   clip_grad=clip_grad)
    builder = {"gpt": dict(config_overrides={}),
               "hybrid": dict(model_builder=build_tiny_hybrid, config_overrides=dict(GDN_SIZES))}[model]
    if precision == "fp64":
        builder["config_overrides"]["params_dtype"] = torch.float64
    builder["config_overrides"].update(config_overrides or {})
    model_, optimizer = build_training_setup(name, bf16=precision == "bf16", lr=lr, ddp_overrides=ddp_overrides,
                                             **builder, **options)
    if precision == "fp64":
        _iterate_newton_schulz_in_fp64(optimizer)
    return model_, optimizer


def muon_engines(optimizer) -> list:
    """The megatron_muon Muon optimizers inside a megatron (chained) optimizer."""
    from megatron_muon.optimizer import Muon

    engines, stack = [], [optimizer]
    while stack:
        item = stack.pop()
        children = getattr(item, "chained_optimizers", None)
        if children is not None:
            stack.extend(children)
        elif isinstance(getattr(item, "optimizer", None), Muon):
            engines.append(item.optimizer)
    return engines


def _iterate_newton_schulz_in_fp64(optimizer) -> None:
    """megatron's `muon_fp32_matmul_prec` goes up to fp32 only; set the Muon engines' iteration dtype to fp64."""
    engines = muon_engines(optimizer)
    if not engines:
        raise ValueError("precision 'fp64' needs a Muon optimizer (muon, dist_muon) in the megatron optimizer")
    for engine in engines:
        engine.compute_dtype = torch.float64


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
        loss_tensor = torch.tensor([loss], dtype=torch.float64, device=next(model.parameters()).device)
        torch.distributed.all_reduce(loss_tensor, group=ps.get_data_parallel_group())
        loss = float(loss_tensor) / dp
    return loss


def _sectioned_parameters(model) -> dict[int, list[int]]:
    """Local row sections of parameters made of sections that are each split across tp (GDN's in_proj q|k|v|z|b|a
    and its conv q|k|v), by parameter id: gathering those in plain chunks would interleave the sections wrongly."""
    sections = {}
    for module in model.modules():
        if callable(getattr(module, "in_proj_sections", None)) and hasattr(module, "conv1d"):
            for param in (module.in_proj.weight, getattr(module.in_proj, "bias", None)):
                if param is not None:
                    sections[id(param)] = list(module.in_proj_sections())
            conv = [size // module.tp_size for size in module.shape.conv_sections]
            for param in (module.conv1d.weight, module.conv1d.bias):
                if param is not None:
                    sections[id(param)] = conv
    return sections


def full_parameters(model) -> dict[str, torch.Tensor]:
    """Every parameter of this rank's stage gathered across tp into its unsharded form (fp32, or fp64 for fp64
    parameters), keyed by global name.

    Lets a test compare parameters of runs with different (tp, pp) layouts directly.
    """
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    tp = ps.get_tensor_model_parallel_world_size()
    sectioned = _sectioned_parameters(model) if tp > 1 else {}
    result = {}
    for name, param in global_parameter_names(model).items():
        tensor = param.detach().to(torch.promote_types(param.dtype, torch.float32))
        if tp > 1 and getattr(param, "tensor_model_parallel", False):
            parts = [torch.empty_like(tensor) for _ in range(tp)]
            torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
            dim = param.partition_dim
            if id(param) in sectioned:  # each section is split across ranks on its own
                chunks = [part.split(sectioned[id(param)], dim=dim) for part in parts]
            else:  # a strided shard (e.g. SwiGLU's fc1 holds [gate_r; up_r]) is `stride` chunks split across ranks
                chunks = [part.chunk(getattr(param, "partition_stride", 1), dim=dim) for part in parts]
            tensor = torch.cat([chunks[r][j] for j in range(len(chunks[0])) for r in range(tp)], dim=dim)
        result[name] = tensor.clone()
    return result


def merged_params(results, key=None) -> dict:
    """Parameters of every rank's result merged by global name (`key`: the run inside each result, if any)."""
    merged = {}
    for result in results:
        merged.update(result[key]["params"] if key else result["params"])
    return merged


def max_relative_error(reference: dict, other: dict) -> tuple[str, float]:
    """(name, error) of the parameter furthest from the reference, relative to the reference's max magnitude."""
    assert reference.keys() == other.keys()
    errors = {n: float((other[n] - t).abs().max() / t.abs().max().clamp_min(1e-12)) for n, t in reference.items()}
    worst = max(errors, key=errors.get)
    return worst, errors[worst]
