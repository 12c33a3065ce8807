"""Gradient accumulation into megatron's fp32 `main_grad` buffers in one vectorized pass.

Megatron's DDP backward hook adds each bf16 weight gradient into its fp32 `main_grad` with `Tensor.add_`. Mixed
dtypes send that through TensorIterator's non-vectorized path, about twice the memory floor
(docs/design/optimizer_passes.md). Autograd runs a parameter's post-accumulate-grad hooks before the hooks on its
gradient accumulator, where megatron's sits, so a hook installed here adds first, with a Triton kernel, and sets
`grad_added_to_main_grad`: the flag megatron already honours for kernels that accumulate into `main_grad` themselves
(Transformer Engine's wgrad fusion). Megatron's hook then skips its add and still drops `param.grad` and signals the
bucket; `zero_grad_buffer()` clears the flag every step.

`install_first_grad_overwrite` goes one step further: `zero_grad_buffer()` stops zeroing the buffers, and each
parameter's first gradient of a step overwrites its `main_grad` (a cast copy) instead of being added to zeros.
Parameters that got no gradient are zeroed just before their bucket group's reduction.
"""

from __future__ import annotations

import torch

from megatron_muon.kernels import grad_accumulate
from megatron_muon.patches import replace_method

# set by the overwriting zero_grad_buffer: main_grad still holds the last step's gradient
_STALE = "_megatron_muon_main_grad_stale"


def _accumulate_into_main_grad(param: torch.Tensor) -> None:
    if param.grad is None or getattr(param, "zero_out_wgrad", False):
        return  # nothing to add, or megatron's hook must overwrite: leave both to it
    stale = getattr(param, _STALE, False)
    if stale:
        setattr(param, _STALE, False)
    grad_accumulate.accumulate(param.main_grad, param.grad, overwrite=stale)
    param.grad_added_to_main_grad = True


_HOOKED = "_megatron_muon_main_grad_add"


def install_main_grad_add(ddp_model) -> int:
    """Hook every parameter megatron's DDP accumulates into a `main_grad`; returns how many were newly hooked
    (a second call hooks nothing: two hooks would add every gradient twice)."""
    hooked = 0
    for param in getattr(ddp_model, "params_with_grad", []):
        if getattr(param, _HOOKED, False):
            continue
        if param in ddp_model.param_to_bucket_group and getattr(param, "main_grad", None) is not None:
            param.register_post_accumulate_grad_hook(_accumulate_into_main_grad)
            setattr(param, _HOOKED, True)
            hooked += 1
    return hooked


_OVERWRITES = "_megatron_muon_first_grad_overwrites"


def install_first_grad_overwrite(ddp_model) -> bool:
    """Let each step's first gradient overwrite `main_grad` so that `zero_grad_buffer()` need not zero the buffers
    (one pass over them per step less, and a cast copy instead of an add). Needs `install_main_grad_add` on every
    parameter first. Returns whether it is (now) installed; it declines where something else writes `main_grad`:
    Transformer Engine's wgrad fusion or CUDA graphs, separate higher-precision main grads, MXFP8 gather buffers.

    Parameters without a gradient in a step are zeroed when their bucket group starts or finishes its reduction,
    through wrappers on those two methods. If anything replaces a wrapper later, every `zero_grad_buffer()` after
    that zeroes the buffers as megatron does.
    """
    if getattr(ddp_model, _OVERWRITES, False):
        return True
    if not first_grad_overwrite_possible(ddp_model):
        return False
    params = list(ddp_model.params_with_grad)
    buffers = ddp_model.buffers + ddp_model.expert_parallel_buffers
    groups = ddp_model.bucket_groups + ddp_model.expert_parallel_bucket_groups
    wrappers = [(group, name, _zeroing_gradless(group, getattr(group, name)))
                for group in groups for name in ("start_grad_sync", "finish_grad_sync")]
    for group, name, wrapper in wrappers:
        replace_method(group, name, wrapper)
    zero_as_megatron = ddp_model.zero_grad_buffer

    def zero_grad_buffer():
        if any(getattr(group, name) is not wrapper for group, name, wrapper in wrappers):
            for param in params:
                setattr(param, _STALE, False)
            return zero_as_megatron()
        for buffer in buffers:
            replace_method(buffer, "reset", _keep_grad_data)  # megatron's reset zeroes grad_data
        try:
            zero_as_megatron()
        finally:
            for buffer in buffers:
                del buffer.reset
        mark_first_grads_pending(params)

    replace_method(ddp_model, "zero_grad_buffer", zero_grad_buffer)
    setattr(ddp_model, _OVERWRITES, True)
    return True


def first_grad_overwrite_possible(ddp_model) -> bool:
    """Whether only autograd, through `install_main_grad_add`'s hook, writes this DDP's `main_grad` buffers (not
    Transformer Engine's wgrad fusion, CUDA graphs, separate higher-precision main grads or MXFP8 gather buffers)."""
    params = list(getattr(ddp_model, "params_with_grad", []))
    buffers = ddp_model.buffers + ddp_model.expert_parallel_buffers
    config, ddp_config = getattr(ddp_model, "config", None), ddp_model.ddp_config
    return bool(params) and all(getattr(p, _HOOKED, False) for p in params) \
        and not any(getattr(p, "zero_out_wgrad", False) for p in params) \
        and not getattr(config, "gradient_accumulation_fusion", False) \
        and getattr(config, "cuda_graph_impl", "none") == "none" \
        and not getattr(ddp_config, "reuse_grad_buf_for_mxfp8_param_ag", False) \
        and not any(buffer.extra_main_grads for buffer in buffers)


def mark_first_grads_pending(params) -> None:
    """The next gradient of each of `params` overwrites its `main_grad` (which still holds the last step's)."""
    for param in params:
        setattr(param, _STALE, True)


def zero_gradless(params) -> None:
    """Zero the `main_grad` of every parameter that got no gradient since `mark_first_grads_pending`."""
    for param in params:
        if getattr(param, _STALE, False):
            setattr(param, _STALE, False)
            param.main_grad.zero_()


def _keep_grad_data() -> None:
    """The buffer reset while first gradients overwrite: grad_data keeps last step's values until then."""


def _zeroing_gradless(group, inner):
    """`inner` (a bucket group's start/finish_grad_sync) after zeroing the group's gradless parameters."""

    def run(*args, **kwargs):
        zero_gradless(group.params)
        return inner(*args, **kwargs)

    return run
