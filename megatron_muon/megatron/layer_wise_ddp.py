"""DDP in the owner layout on both of Megatron-LM's model-building paths.

For `--optimizer muon --use-distributed-optimizer` Megatron-LM's argument checks turn on its layer-wise optimizer
(`args.use_layer_wise_distributed_optimizer`, with `use_layer_wise_param_layout` by default). Its `get_model` path
then wraps DDP for it (`megatron.training.training.wrap_model_chunks_with_ddp`: the distributed optimizer's
buffers, the parameters tagged by optimizer, the layout from `LayerWiseDistributedOptimizer`, which the launcher
makes the owner layout). The config-container path that `pretrain_gpt.py` takes at megatron-core 0.19
(`megatron.training.models.dist_utils._ddp_wrap`) has no such branch: it wraps plain DDP, and the owner engine
refuses it. `wrap_layer_wise_as_get_model_does` fills that gap by handing those chunks to megatron's own
`wrap_model_chunks_with_ddp`, with the bucket sizes `_ddp_wrap` would have used; every other case runs megatron's
`_ddp_wrap` unchanged.
"""

from __future__ import annotations

import functools


def _layer_wise_layout_requested() -> bool:
    from megatron.training.global_vars import get_args

    try:
        args = get_args()
    except AssertionError:  # megatron's arguments not parsed: not a Megatron-LM script
        return False
    return bool(getattr(args, "use_layer_wise_distributed_optimizer", False)
                and getattr(args, "use_layer_wise_param_layout", True))


def _bucket_size(model, ddp_config, pg_collection) -> int | None:
    """What `_ddp_wrap` sets on `ddp_config` before wrapping (megatron-core 0.19.2), for the same chunks."""
    if ddp_config.num_buckets is not None:
        ddp_config.bucket_size = sum(p.nelement() for chunk in model for p in chunk.parameters()) \
            // ddp_config.num_buckets
    if ddp_config.bucket_size is None:
        ddp_config.bucket_size = max(40000000, 1000000 * pg_collection.dp_cp.size())
    if not ddp_config.overlap_grad_reduce:
        ddp_config.bucket_size = None
    return ddp_config.bucket_size


def wrap_layer_wise_as_get_model_does(original):
    """`_ddp_wrap` that takes megatron's layer-wise wiring where Megatron-LM asked for it (module docstring)."""

    @functools.wraps(original)
    def wrap(model, data_parallel_random_init, ddp_config, overlap_param_gather_with_optimizer_step,
             use_megatron_fsdp=False, use_torch_fsdp2=False, *, pg_collection):
        if use_megatron_fsdp or use_torch_fsdp2 or not _layer_wise_layout_requested():
            return original(model, data_parallel_random_init, ddp_config, overlap_param_gather_with_optimizer_step,
                            use_megatron_fsdp=use_megatron_fsdp, use_torch_fsdp2=use_torch_fsdp2,
                            pg_collection=pg_collection)
        from megatron.core.distributed import DistributedDataParallel
        from megatron.core.utils import get_model_config
        from megatron.training.training import wrap_model_chunks_with_ddp

        bucket_size = _bucket_size(model, ddp_config, pg_collection)
        disable = [index > 0 or overlap_param_gather_with_optimizer_step for index in range(len(model))]
        wrapped = wrap_model_chunks_with_ddp(
            model, get_model_config(model[0]), ddp_config, use_layer_wise_distributed_optimizer=True,
            use_layer_wise_param_layout=True, DP=DistributedDataParallel, pg_collection=pg_collection,
            bucket_sizes=[None if off or pg_collection.pp.rank() > 0 else bucket_size for off in disable],
            disable_bucketing_per_chunk=disable)
        if data_parallel_random_init:
            for chunk in wrapped:
                chunk.broadcast_params()
        return wrapped

    wrap._megatron_muon = True
    return wrap


def use_layer_wise_wiring_on_the_config_path() -> None:
    """Install `wrap_layer_wise_as_get_model_does` over megatron's `_ddp_wrap` (idempotent)."""
    from megatron.training.models import dist_utils

    if not getattr(dist_utils._ddp_wrap, "_megatron_muon", False):
        dist_utils._ddp_wrap = wrap_layer_wise_as_get_model_does(dist_utils._ddp_wrap)
