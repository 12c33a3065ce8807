"""megatron's mixed-precision AdamW step (fp32 master weights) as one Triton pass per param group: the gradient clip
factor, the AdamW update and the 16-bit model copy together.

megatron-core runs three passes over the fp32 master weights per step: the clip multiply of every gradient, the
AdamW step (torch's fused AdamW, or Transformer Engine's FusedAdam when TE is installed) and the copy of every master
weight into its bf16 model parameter. Here `clip_grad_by_total_norm_fp32` leaves the clip factor on the device for
the optimizer instead of multiplying, and one pass reads each gradient, master weight and moment once and writes the
master weight, both moments and the model copy (`optimizer/one_pass_adamw.py`; measured in
docs/design/optimizer_passes.md).

The state keeps the inner optimizer's layout (torch's or TE's), so checkpoints are interchangeable with megatron's
own step. Gradients are not written back: after the step they hold the unclipped values (megatron zeroes them before
the next backward). The pass covers megatron's Float16OptimizerWithFloat16Params over torch Adam/AdamW (no amsgrad,
maximize, capturable, differentiable or tensor lr) or over TE's FusedAdam as megatron builds it without the
precision-aware optimizer (fp32 moments, no master weights of its own, not capturable), with contiguous fp32 tensors
on a device Triton serves; anything else keeps megatron's path, clip multiply included.
"""

from __future__ import annotations

import torch

from megatron_muon.kernels.triton_math import supported
from megatron_muon.megatron import clip_deferral
from megatron_muon.optimizer.one_pass_adamw import OnePassAdamW
from megatron_muon.patches import replace_method


def install_master_adamw(optimizer) -> int:
    """Give every qualifying mixed-precision AdamW inside `optimizer` the one-pass step; returns how many were
    newly given it (a second call gives none)."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    installed = 0
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        if type(part) is Float16OptimizerWithFloat16Params and not hasattr(part, "one_pass_adamw") and _qualifies(part):
            _attach(part)
            installed += 1
    if installed:
        clip_deferral.install()
    return installed


def _attach(wrapper) -> OnePassAdamW:
    """Run the pass in place of the wrapper's inner step and master-to-model copy; claim its params for the clip."""
    one_pass = OnePassAdamW(wrapper.optimizer, model_copies_of(wrapper), group_step=_is_te_adam(wrapper.optimizer))
    clip_deferral.claim(wrapper, one_pass)
    original_step = wrapper.step_with_ready_grads

    def step_with_ready_grads():
        config = getattr(wrapper, "config", None)
        timers = getattr(config, "timers", None)
        if timers is not None:  # megatron's name for the inner step; the pass also does the master copy
            timers("optimizer-inner-step", log_level=1).start(barrier=config.barrier_with_L1_time)
        ran = one_pass.run()
        if timers is not None:
            timers("optimizer-inner-step").stop()
        if ran:
            return True
        one_pass.apply_pending()
        return original_step()

    replace_method(wrapper, "step_with_ready_grads", step_with_ready_grads)
    wrapper.one_pass_adamw = one_pass  # lives as long as the wrapper
    return one_pass


def model_copies_of(wrapper) -> dict[int, torch.Tensor]:
    """id(fp32 master weight) -> the 16-bit model parameter megatron's mixed-precision wrapper copies it into."""
    return {id(main): model for models, mains in zip(wrapper.float16_groups, wrapper.fp32_from_float16_groups)
            for model, main in zip(models, mains)}


_UNSUPPORTED_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable")


def te_fused_adam_class():
    """Transformer Engine's FusedAdam (what megatron-core builds for 'adam' when TE is installed), or None."""
    try:
        from transformer_engine.pytorch.optimizers import FusedAdam
    except Exception:  # noqa: BLE001 - absent, or present without its CUDA libraries: megatron builds torch's Adam
        return None
    return FusedAdam


def _is_te_adam(inner) -> bool:
    te_class = te_fused_adam_class()
    return te_class is not None and type(inner) is te_class


def te_adam_qualifies(inner) -> bool:
    """TE's FusedAdam computes what the pass computes when it keeps fp32 moments and no masters of its own (megatron's
    wrapper holds them) and takes a host learning rate: megatron's build without the precision-aware optimizer."""
    # an attribute this TE version lacks counts as the setting the pass does not cover
    return (getattr(inner, "master_weights", True) is False and getattr(inner, "capturable", True) is False
            and not getattr(inner, "use_decoupled_grad", True) and not getattr(inner, "store_param_remainders", False)
            and getattr(inner, "exp_avg_dtype", None) == torch.float32
            and getattr(inner, "exp_avg_sq_dtype", None) == torch.float32
            and hasattr(inner, "adam_w_mode") and callable(getattr(inner, "initialize_state", None)))


def _qualifies(wrapper) -> bool:
    inner = wrapper.optimizer
    if wrapper.is_stub_optimizer:
        return False
    torch_adam = type(inner) in (torch.optim.AdamW, torch.optim.Adam)
    if not torch_adam and not (_is_te_adam(inner) and te_adam_qualifies(inner)):
        return False
    if getattr(wrapper.config, "reuse_grad_buf_for_mxfp8_param_ag", False):
        return False
    groups = inner.param_groups
    if any(group.get(flag) for group in groups for flag in _UNSUPPORTED_FLAGS):
        return False
    if any(isinstance(group["lr"], torch.Tensor) for group in groups):
        return False
    params = [p for group in groups for p in group["params"]]
    return bool(params) and all(p.dtype == torch.float32 and p.is_contiguous() and supported(p.device) for p in params)
