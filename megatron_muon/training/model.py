"""Builds the recipe's model from megatron-core (GPTModel) or our hybrid specs, wrapped as megatron's pretrain does."""

from __future__ import annotations

import importlib.util
from dataclasses import replace

import torch
import torch.nn.functional as F

from megatron_muon.ops.kernel_choice import set_gdn_kernels
from megatron_muon.training.config import Recipe, RecipeError
from megatron_muon.training.validation import full_layer_pattern, kv_channels

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def transformer_engine_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def spec_backend(recipe: Recipe) -> str:
    """'te' or 'local': 'auto' picks Transformer Engine when it is importable, except for a compiled hybrid: TE's
    linears are dynamo-disabled (each call breaks the layer's graph), while our local hybrid spec compiles whole,
    with the same cuDNN attention kernels through SDPA. `te` still builds TE's modules, compiled or not."""
    backend = recipe.model.spec_backend
    if backend == "auto":
        if recipe.model.kind == "hybrid" and recipe.training.torch_compile:
            return "local"
        return "te" if transformer_engine_available() else "local"
    if backend == "te" and not transformer_engine_available():
        raise RecipeError(
            "model.spec_backend=te needs Transformer Engine; install `megatron-muon[te]` "
            "or set model.spec_backend=local."
        )
    return backend


def transformer_config(recipe: Recipe, on_gpu: bool):
    """megatron-core TransformerConfig for the recipe and the current parallel_state layout."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer import TransformerConfig

    model, precision = recipe.model, recipe.training.precision
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=kv_channels(recipe),
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        sequence_parallel=recipe.parallel.sequence_parallel,
        normalization=model.normalization,
        gated_linear_unit=model.swiglu,
        activation_func=F.silu if model.swiglu else F.gelu,
        add_bias_linear=False,
        hidden_dropout=model.dropout,
        attention_dropout=model.dropout,
        init_method_std=model.init_method_std,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        params_dtype=DTYPES[precision],
        pipeline_dtype=DTYPES[precision],
        # The CPU path initializes on CPU so every tp layout starts from the same full weights.
        use_cpu_initialization=not on_gpu,
        bias_activation_fusion=on_gpu and model.swiglu,
        masked_softmax_fusion=False,
        bias_dropout_fusion=on_gpu,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
        linear_conv_kernel_dim=model.gdn_conv_kernel,
        linear_key_head_dim=model.gdn_key_head_dim,
        linear_value_head_dim=model.gdn_value_head_dim,
        linear_num_key_heads=model.gdn_num_key_heads,
        linear_num_value_heads=model.gdn_num_value_heads,
        qk_clip=model.qk_clip,
        qk_clip_threshold=model.qk_clip_threshold,
        qk_clip_alpha=model.qk_clip_alpha,
        log_max_attention_logit=model.log_max_attention_logit,
    )


def build_model(recipe: Recipe, config):
    """This rank's pipeline stage of the recipe's model (unwrapped)."""
    from megatron.core import parallel_state as ps

    model = recipe.model
    backend = spec_backend(recipe)
    if backend == "te" and torch.cuda.is_available():
        from megatron_muon.training.te_cudnn import check_same_cudnn

        check_same_cudnn()
    if model.gdn_kernels is not None:
        set_gdn_kernels(model.gdn_kernels)
    if model.kind == "gpt":
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_local_spec,
            get_gpt_layer_with_transformer_engine_spec,
        )

        from megatron_muon.specs import with_piecewise_swiglu

        layer_spec = with_piecewise_swiglu(
            get_gpt_layer_with_transformer_engine_spec(normalization=model.normalization)
            if backend == "te"
            else get_gpt_layer_local_spec(normalization=model.normalization)
        )
        return GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=model.vocab_size,
            max_sequence_length=model.seq_length,
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=not model.untie_embeddings,
            position_embedding_type=model.position_embedding,
            rotary_base=model.rotary_base,
        )
    from megatron_muon.specs import build_hybrid_model

    return build_hybrid_model(
        config,
        full_layer_pattern(recipe),
        vocab_size=model.vocab_size,
        max_seq_len=model.seq_length,
        backend=backend,
        position_embedding_type=model.position_embedding,
        share_embeddings_and_output_weights=not model.untie_embeddings,
        rotary_base=model.rotary_base,
        keep_gdn_chunk_states=model.gdn_keep_chunk_states,
    )


def uses_owner_engine(recipe: Recipe) -> bool:
    """`muon` with the distributed optimizer (or `dist_muon`): DDP lays the Muon matrices out by owner."""
    name = recipe.optimizer.name
    return name == "dist_muon" or (name == "muon" and recipe.parallel.use_distributed_optimizer)


def _owner_layout(module, ddp_config, recipe: Recipe, owner_plan=None):
    """The owner-planned DDP layout, with DDP's own bucket size rule; `owner_plan` (an `OwnerPlanSettings`) without a
    cost gets the cost of the recipe's Newton–Schulz settings."""
    from megatron.core import parallel_state as ps

    from megatron_muon.distributed.cost import AnalyticCost
    from megatron_muon.megatron.muon_config import MuonConfig
    from megatron_muon.megatron.owner_layout import (
        OwnerPlanSettings,
        compute_full_param_layout,
        tag_params_for_owner_buffers,
    )

    tag_params_for_owner_buffers([module])
    dp = ps.get_data_parallel_world_size(with_context_parallel=True, partial_data_parallel=True)
    bucket_size = ddp_config.bucket_size or max(40_000_000, 1_000_000 * dp)
    if not ddp_config.overlap_grad_reduce or ps.get_pipeline_model_parallel_rank() > 0:
        bucket_size = None  # as DDP does: one bucket when nothing overlaps the backward
    params = [p for p in module.parameters() if p.requires_grad]
    plan = owner_plan or OwnerPlanSettings()
    if plan.cost is None:
        orthogonalizer = MuonConfig.from_options(recipe.optimizer).orthogonalizer  # what the optimizer will run
        plan = replace(plan, cost=AnalyticCost.for_orthogonalizer(orthogonalizer))
    plan = replace(plan, split_heads=recipe.optimizer.muon_split_heads)
    return compute_full_param_layout(params, bucket_size, dp, ddp_config, plan_settings=plan)


def wrap_model(module, config, recipe: Recipe, fast_main_grad_add: bool = True, owner_plan=None):
    """Float16Module for bf16/fp16, then megatron DDP with fp32 grad reduction: the pretrain_gpt.py wrapping.
    fast_main_grad_add: accumulate gradients into DDP's fp32 buffers in one vectorized pass
    (`megatron.main_grad_add`) instead of megatron's mixed-dtype `add_`; with the owner engine the first gradient of
    each step also overwrites those buffers instead of a zeroing pass (`megatron.overwriting_ddp`). owner_plan: how
    the owner engine's layout plans owners (`megatron.owner_layout.OwnerPlanSettings`; default: MILP on the recipe's
    Newton–Schulz FLOPs)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    if torch.cuda.is_available():
        module = module.cuda(torch.cuda.current_device())
    owner = uses_owner_engine(recipe)
    distributed = recipe.parallel.use_distributed_optimizer or owner
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=recipe.parallel.overlap_grad_reduce,
        use_distributed_optimizer=distributed,
        overlap_param_gather=recipe.parallel.overlap_param_gather and distributed,
        check_for_nan_in_grad=recipe.parallel.check_for_nan_in_grad,
    )
    if recipe.training.precision in ("bf16", "fp16"):
        module = Float16Module(config, module)
    layout = _owner_layout(module, ddp_config, recipe, owner_plan) if owner else None  # after the cast: buffers key on dtype
    if owner and fast_main_grad_add:  # the owner path takes no patch of DDP: the first-gradient overwrite as a class
        from megatron_muon.megatron.overwriting_ddp import OverwritingDistributedDataParallel as DistributedDataParallel
    model = DistributedDataParallel(config, ddp_config, module, full_param_layout=layout)
    model.broadcast_params()
    if fast_main_grad_add:
        from megatron_muon.megatron.main_grad_add import install_main_grad_add

        install_main_grad_add(model)
    return model


def count_parameters(model) -> int:
    """Parameters of this rank's shard (tp/pp local)."""
    return sum(p.numel() for p in model.parameters())
