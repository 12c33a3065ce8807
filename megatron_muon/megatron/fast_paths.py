"""The plugin's fast paths for a megatron optimizer that is already built, in one call.

Without Transformer Engine or Apex, megatron-core's mixed-precision step makes several passes over the fp32
master weights and gradients. Each fast path below replaces some of them on GPUs and does nothing elsewhere:
- `use_fused_torch_adam`: megatron's torch AdamW fallback on torch's fused kernel;
- `install_master_adamw`: the clip factor, the AdamW update and the bf16 model copy in one pass;
- `clip_deferral.install_for_muon`: the clip factor applied inside our Muon's fused momentum pass;
- `install_muon_model_copy`: the bf16 model copies written by our Muon's update pass;
- `install_main_grad_add`: autograd's bf16 gradients added into DDP's fp32 buffers in one vectorized pass;
- `install_first_grad_overwrite`: each step's first gradient overwrites those buffers, so they are not zeroed.

`megatron-muon pretrain` and `python -m megatron_muon.launch` (Megatron-LM's scripts) both call
`install_fast_paths`; each installer is idempotent, so a second call changes nothing.
"""

from __future__ import annotations

import functools

from megatron_muon.megatron import clip_deferral
from megatron_muon.megatron.fused_adam import use_fused_torch_adam
from megatron_muon.megatron.main_grad_add import install_first_grad_overwrite, install_main_grad_add
from megatron_muon.megatron.master_adamw import install_master_adamw
from megatron_muon.megatron.muon_model_copy import install_muon_model_copy


def install_fast_paths(optimizer, model_chunks=(), *, fused_adam: bool = True, one_pass_adamw: bool = True,
                       muon_clip_in_momentum: bool = True, muon_model_copy: bool = True,
                       main_grad_add: bool = True, first_grad_overwrite: bool = True) -> dict[str, int]:
    """Install every enabled fast path on `optimizer` (and, for the gradient add and overwrite, on megatron's DDP
    `model_chunks`, after the optimizer's own gradient-sync changes); returns how many param groups, wrappers,
    parameters or model chunks each one took over."""
    from megatron_muon.megatron.owner_optimizer import OwnerMuonOptimizer

    if any(isinstance(member, OwnerMuonOptimizer) for member in getattr(optimizer, "chained_optimizers", [])):
        first_grad_overwrite = False  # the owner engine leaves megatron's DDP (its zeroing and bucket syncs) as it is
    installed = {"fused_adam_groups": use_fused_torch_adam(optimizer) if fused_adam else 0}
    installed["one_pass_adamw"] = install_master_adamw(optimizer) if one_pass_adamw else 0
    installed["muon_clip_in_momentum"] = clip_deferral.install_for_muon(optimizer) if muon_clip_in_momentum else 0
    installed["muon_model_copy"] = install_muon_model_copy(optimizer) if muon_model_copy else 0
    on_gpu = [chunk for chunk in model_chunks if any(p.is_cuda for p in chunk.parameters())]
    installed["main_grad_add_params"] = sum(install_main_grad_add(chunk) for chunk in on_gpu) if main_grad_add else 0
    installed["first_grad_overwrite_chunks"] = sum(
        install_first_grad_overwrite(chunk) for chunk in on_gpu) if first_grad_overwrite else 0
    return installed


def install_after_every_optimizer_build() -> None:
    """Make megatron-core's `get_megatron_optimizer` install the fast paths on what it builds, for scripts that
    call it themselves (Megatron-LM's pretrain_gpt.py); megatron.training.training's name for it is replaced too
    when that module is already imported (a patched script)."""
    import sys

    import megatron.core.optimizer as mcore_optimizer

    build = mcore_optimizer.get_megatron_optimizer
    if getattr(build, "_megatron_muon_fast_paths", False):
        return

    def get_megatron_optimizer(config, model_chunks, *args, **kwargs):
        optimizer = build(config, model_chunks, *args, **kwargs)
        optimizer.megatron_muon_fast_paths = install_fast_paths(optimizer, list(model_chunks))
        return optimizer

    functools.update_wrapper(get_megatron_optimizer, build)
    get_megatron_optimizer._megatron_muon_fast_paths = True
    mcore_optimizer.get_megatron_optimizer = get_megatron_optimizer
    training = sys.modules.get("megatron.training.training")
    if training is not None and getattr(training, "get_megatron_optimizer", None) is build:
        training.get_megatron_optimizer = get_megatron_optimizer
