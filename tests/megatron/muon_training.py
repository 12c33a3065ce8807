"""Rank functions for the through-megatron Muon tests: tiny models trained by `get_megatron_optimizer`."""

from __future__ import annotations

import contextlib

import torch

from megatron_muon.testing.models import build_tiny_gpt, forward_backward, synthetic_batch, tiny_transformer_config
from megatron_muon.testing.parallel import init_model_parallel, layout


# A tiny GDN geometry: 2 key heads of 16, 4 value heads of 8, conv 4 (in_proj rows: q 32 | k 32 | v 32 | z 32 | 4 | 4).
GDN_SIZES = dict(
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)


def _build_model(model_kind: str, precision: str):
    """The tiny GPT, or a tiny "G*" hybrid (one GDN layer, one attention layer, each with an MLP)."""
    dtype_flags = {"bf16": dict(bf16=True), "fp16": dict(fp16=True), "fp32": {}}[precision]
    if model_kind == "gpt":
        config = tiny_transformer_config(**dtype_flags)
        return build_tiny_gpt(config), config
    from megatron_muon.specs import build_hybrid_model
    from megatron_muon.testing.models import SEQ_LENGTH, VOCAB_SIZE

    config = tiny_transformer_config(**dtype_flags, **GDN_SIZES)
    torch.manual_seed(1234)
    model = build_hybrid_model(config, "G*", vocab_size=VOCAB_SIZE, max_seq_len=SEQ_LENGTH, backend="local")
    return model, config


def _wrap_for_training(model, config, precision: str, layout: str | None = None):
    """Float16Module (bf16/fp16) + DDP. `layout`: None (all-reduce), "owner" (the plugin's owner layout) or
    "megatron" (megatron's own layer-wise layout and tags, as Megatron-LM builds DDP for `--optimizer muon
    --use-distributed-optimizer`)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer, tag_params_for_buffer_routing
    from megatron.core.transformer.module import Float16Module

    from megatron_muon.testing.training import wrap_in_ddp

    if precision in ("bf16", "fp16"):
        model = Float16Module(config, model)
    if layout == "megatron":
        tag_params_for_buffer_routing([model])
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
        full = LayerWiseDistributedOptimizer.compute_full_param_layout(
            [p for p in model.parameters() if p.requires_grad], None, ps.get_data_parallel_world_size(), ddp_config)
        model = DistributedDataParallel(config, ddp_config, model, full_param_layout=full)
    else:
        model = wrap_in_ddp(model, config, use_distributed_optimizer=layout == "owner", owner_layout=layout == "owner")
    config.finalize_model_grads_func = finalize_model_grads
    return model


def build_optimizer(model, name: str, precision: str, lr: float = 0.02, **muon_options):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ns_method = muon_options.pop("muon_ns_method", "standard")
    split_heads = muon_options.pop("muon_split_heads", False)  # this plugin's option, not an OptimizerConfig field
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
        **{"muon_tp_mode": "duplicated", **muon_options},
    )
    config.muon_ns_method = ns_method
    config.muon_split_heads = split_heads
    return get_megatron_optimizer(config, [model])


def _muon_members(optimizer):
    """The torch optimizers inside a megatron optimizer chain."""
    children = getattr(optimizer, "chained_optimizers", None)
    if children is not None:
        return [m for child in children for m in _muon_members(child)]
    inner = getattr(optimizer, "optimizer", None)
    return [inner] if inner is not None else []


def train_tiny_gpt(
    rank, world_size, tp: int, name: str, precision: str, steps: int, distributed_layout: bool = False,
    model_kind: str = "gpt", layer_wise: bool = False, **muon_options
):
    """Train the tiny GPT `steps` steps; returns losses, optimizer types, and a TP-independent weight digest.
    `distributed_layout`: DDP in the owner layout (what `dist_muon` always gets); `layer_wise`: in megatron's own
    layer-wise layout instead."""
    with one_thread():
        return _train_tiny_gpt(tp, name, precision, steps, distributed_layout, model_kind, layer_wise, **muon_options)


@contextlib.contextmanager
def one_thread():
    """Tiny matmuls on a loaded 2-core machine stall on intra-op thread wake-ups; one thread is 10x faster."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _train_tiny_gpt(tp, name, precision, steps, distributed_layout, model_kind="gpt", layer_wise=False,
                    **muon_options):
    import megatron_muon

    megatron_muon.register()
    init_model_parallel(tp=tp)
    model, config = _build_model(model_kind, precision)
    ddp_layout = "megatron" if layer_wise else "owner" if distributed_layout or name == "dist_muon" else None
    model = _wrap_for_training(model, config, precision, ddp_layout)
    optimizer = build_optimizer(model, name, precision, **muon_options)
    losses, skipped = [], 0
    for step in range(steps):
        model.zero_grad_buffer()
        optimizer.zero_grad()
        losses.append(forward_backward(model, [synthetic_batch(step % 4)]))
        ok, _, _ = optimizer.step()
        skipped += int(not ok)
    muon = [m for m in _muon_members(optimizer) if hasattr(m, "_plan_cache")]
    plan = muon[0]._plan_cache[1] if muon and muon[0]._plan_cache else None
    return {
        "bucket_shapes": sorted(b.shape for b in plan.buckets) if plan else [],
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


def scheduled_steps(rank, world_size, steps: int = 4):
    """Three short steps under megatron's OptimizerParamScheduler: the lr our Muon used vs the scheduler's."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_muon.optimizer import Muon

    with one_thread():
        import megatron_muon

        megatron_muon.register()
        init_model_parallel(tp=1)
        model, config = _build_model("gpt", "bf16")
        model = _wrap_for_training(model, config, "bf16")
        optimizer = build_optimizer(model, "muon", "bf16", lr=0.01)
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0, max_lr=0.01, min_lr=0.001, lr_warmup_steps=2, lr_decay_steps=steps,
            lr_decay_style="cosine", start_wd=0.01, end_wd=0.01, wd_incr_steps=steps, wd_incr_style="constant",
        )
        muon = next(m for m in _muon_members(optimizer) if isinstance(m, Muon))
        used, expected = [], []
        for step in range(steps):
            scheduler.step(1)
            model.zero_grad_buffer()
            optimizer.zero_grad()
            forward_backward(model, [synthetic_batch(step)])
            optimizer.step()
            used.append(muon.param_groups[0]["lr"])
            expected.append(scheduler.get_lr(muon.param_groups[0]))
        return used, expected
