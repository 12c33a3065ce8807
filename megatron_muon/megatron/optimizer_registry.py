"""Registration of the plugin's Muon into megatron-core's emerging-optimizer registry.

After `register_optimizers()`:
- `OptimizerConfig(optimizer="muon")` (Megatron-LM's `--optimizer muon`) builds `megatron_muon.optimizer.Muon`
  for the matrices and megatron's scalar optimizer (AdamW by default) for everything else, in bf16, fp16 (with
  loss scaling) or fp32, without the emerging-optimizers package;
- `muon` with `use_distributed_optimizer` or `use_layer_wise_distributed_optimizer` (in the config or in DDP's
  config), and its deprecated alias `dist_muon`, build the owner engine (`dist_muon.build_owner_muon`);
- upstream's TensorParallelMuon stays available as `mcore_muon` / `dist_mcore_muon` for comparison.
"""

from __future__ import annotations

import contextlib

from megatron_muon.megatron.loss_scaling import attach_fp16_loss_scaling, bf16_twin
from megatron_muon.megatron.muon_config import muon_kwargs_from_config
from megatron_muon.optimizer.muon import Muon
from megatron_muon.optimizer.routing import is_muon_param

MUON_NAME = "muon"
UPSTREAM_MUON_NAME = "mcore_muon"
_NOT_A_MATRIX_PREDICATE = "megatron_muon_not_a_muon_matrix"

# megatron-core's own factory, kept so names that are not ours go through it unchanged.
_upstream_build = None


def init_muon_state(optimizer, config=None) -> None:
    """Create every momentum buffer (megatron's checkpoint loading needs state before the first step)."""
    for group in optimizer.param_groups:
        optimizer._init_group(group, skip_non_grad_params=False)


def _routing_overrides():
    from megatron.core.optimizer.optimizer_config import ParamKey, ParamWithNamePredicate

    predicate = ParamWithNamePredicate(
        name=_NOT_A_MATRIX_PREDICATE, fn=lambda param, name: not is_muon_param(param, name)
    )
    return {ParamKey(with_name_predicate=predicate): {"optimizer": "adam"}}


@contextlib.contextmanager
def _emerging_optimizers_not_required():
    """megatron-core refuses every emerging optimizer without the emerging-optimizers package; ours needs none."""
    import megatron.core.optimizer as mcore_optimizer

    saved = mcore_optimizer.HAVE_EMERGING_OPTIMIZERS
    mcore_optimizer.HAVE_EMERGING_OPTIMIZERS = True
    try:
        yield
    finally:
        mcore_optimizer.HAVE_EMERGING_OPTIMIZERS = saved


def _uses_distributed_optimizer(config, model_chunks) -> bool:
    """megatron's DDP reduce-scatters gradients for its distributed optimizer: single-process Muon would read
    partly reduced gradients, so this also selects the distributed builder."""
    return config.use_distributed_optimizer or any(
        getattr(getattr(chunk, "ddp_config", None), "use_distributed_optimizer", False) for chunk in model_chunks)


def _is_ours(optimizer_name: str) -> bool:
    return optimizer_name in (MUON_NAME, "dist_" + MUON_NAME)


def build_emerging_optimizer(config, model_chunks, config_overrides=None, pg_collection=None):
    """Stand-in for megatron's `_get_megatron_emerging_optimizer` that adds what ours supports beyond upstream."""
    if not _is_ours(config.optimizer):
        return _upstream_build(config, model_chunks, config_overrides, pg_collection)
    import megatron.core.optimizer as mcore_optimizer

    if config.muon_scalar_optimizer == "lion" and not mcore_optimizer.HAVE_EMERGING_OPTIMIZERS:
        raise ImportError(
            "muon_scalar_optimizer='lion' needs the emerging-optimizers package "
            "(`pip install emerging-optimizers`); or use muon_scalar_optimizer='adam'"
        )
    if config_overrides is None:
        config_overrides = mcore_optimizer.get_standard_config_overrides(config)
    distributed = (config.optimizer.startswith("dist_") or config.use_layer_wise_distributed_optimizer
                   or _uses_distributed_optimizer(config, model_chunks))
    if config.fp16 and distributed:
        raise ValueError("dist_muon (and muon with use_distributed_optimizer) supports bf16 and fp32; for fp16 use "
                         "optimizer='muon' without --use-distributed-optimizer (loss scaling included)")
    if distributed:
        from megatron_muon.megatron.dist_muon import build_owner_muon as builder
    else:
        builder = _upstream_build
    build_config = bf16_twin(config) if config.fp16 else config
    with _emerging_optimizers_not_required():
        optimizer = builder(build_config, model_chunks, config_overrides, pg_collection)
    if config.fp16:
        optimizer = attach_fp16_loss_scaling(optimizer, config)
    return optimizer


def register_optimizers() -> None:
    """Put our Muon into megatron-core's registry as `muon` (idempotent); upstream's stays as `mcore_muon`."""
    global _upstream_build
    import megatron.core.optimizer as mcore_optimizer
    from megatron.core.optimizer import emerging_optimizers as mcore_registry

    registry = mcore_registry._EMERGING_OPTIMIZERS
    if _upstream_build is None:
        _upstream_build = mcore_optimizer._get_megatron_emerging_optimizer
    upstream_entry = registry.get(MUON_NAME)
    if upstream_entry is not None and upstream_entry.optimizer_cls is not Muon:
        registry.setdefault(UPSTREAM_MUON_NAME, upstream_entry)
    registry[MUON_NAME] = mcore_registry.EmergingOptimizerEntry(
        optimizer_cls=Muon,
        init_state_fn=init_muon_state,
        config_to_kwargs=muon_kwargs_from_config,
        default_param_overrides=_routing_overrides(),
    )
    mcore_optimizer._get_megatron_emerging_optimizer = build_emerging_optimizer


def is_registered() -> bool:
    """Whether megatron-core's `muon` currently builds ours."""
    from megatron.core.optimizer import emerging_optimizers as mcore_registry

    entry = mcore_registry._EMERGING_OPTIMIZERS.get(MUON_NAME)
    return entry is not None and entry.optimizer_cls is Muon
