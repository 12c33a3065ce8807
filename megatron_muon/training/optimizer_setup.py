"""The megatron optimizer config and LR schedule a recipe asks for."""

from __future__ import annotations

from megatron_muon.training.config import Recipe
from megatron_muon.training.model import DTYPES, uses_owner_engine


def optimizer_config(recipe: Recipe):
    """megatron OptimizerConfig from the recipe; `optimizer.name` picks the registered optimizer (muon = ours)."""
    from megatron.core.optimizer import OptimizerConfig

    opt, precision = recipe.optimizer, recipe.training.precision
    # As Megatron-LM does: `dist_X` is X inside megatron's layer-wise distributed optimizer.
    layer_wise = opt.name.startswith("dist_")
    config = OptimizerConfig(
        optimizer=opt.name.removeprefix("dist_"),
        use_layer_wise_distributed_optimizer=layer_wise,
        lr=opt.lr,
        min_lr=opt.min_lr,
        weight_decay=opt.weight_decay,
        clip_grad=opt.clip_grad,
        adam_beta1=opt.adam_beta1,
        adam_beta2=opt.adam_beta2,
        adam_eps=opt.adam_eps,
        muon_momentum=opt.muon_momentum,
        muon_nesterov=opt.muon_nesterov,
        muon_num_ns_steps=opt.muon_num_ns_steps,
        muon_coefficient_type=opt.muon_coefficient_type,
        muon_scale_mode=opt.muon_scale_mode,
        muon_extra_scale_factor=opt.muon_extra_scale_factor,
        muon_split_qkv=opt.muon_split_qkv,
        muon_tp_mode=opt.muon_tp_mode,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        params_dtype=DTYPES[precision],
        use_distributed_optimizer=recipe.parallel.use_distributed_optimizer and not layer_wise,
        overlap_param_gather=recipe.parallel.overlap_param_gather,
    )
    config.muon_newton_schulz_start = opt.muon_newton_schulz_start  # the owner engine's (not a megatron option)
    config.muon_graph_newton_schulz = opt.muon_graph_newton_schulz  # this plugin's (not a megatron option)
    config.muon_nonfinite_check = opt.muon_nonfinite_check  # the owner engine's (not a megatron option)
    config.muon_split_heads = opt.muon_split_heads  # this plugin's (not a megatron option)
    return config


def sharded_optimizer(recipe: Recipe) -> bool:
    """Whether megatron's DistributedOptimizer holds the AdamW state (its checkpoint format)."""
    return recipe.parallel.use_distributed_optimizer or uses_owner_engine(recipe)


def lr_scheduler(recipe: Recipe, optimizer):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    opt, iters = recipe.optimizer, recipe.training.train_iters
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if opt.lr_warmup_iters else opt.lr,
        max_lr=opt.lr,
        min_lr=opt.min_lr,
        lr_warmup_steps=opt.lr_warmup_iters,
        lr_decay_steps=opt.lr_decay_iters or iters,
        lr_decay_style=opt.lr_decay_style,
        start_wd=opt.weight_decay,
        end_wd=opt.weight_decay,
        wd_incr_steps=iters,
        wd_incr_style="constant",
        # a resumed run takes the checkpoint's schedule (and says so), or the recipe's with override_lr_schedule
        use_checkpoint_opt_param_scheduler=not recipe.checkpoint.override_lr_schedule,
        override_opt_param_scheduler=recipe.checkpoint.override_lr_schedule,
    )
