"""Run megatron's torch-AdamW fallback with torch's fused kernel.

Without Transformer Engine or Apex, megatron-core 0.19.2 builds `torch.optim.AdamW` (or `Adam`) with default
arguments, i.e. the multi-tensor `foreach` path, several times slower than `fused=True`
(docs/design/optimizer_passes.md). The fused kernel computes the same update (torch tests both paths against each
other), so switching an already-built optimizer's param groups to it is safe wherever torch supports fused Adam for
the parameters' device and dtype.
"""

from __future__ import annotations

import torch


def _inner_optimizers(optimizer):
    """The torch optimizers inside megatron's wrappers (ChainedOptimizer, mixed-precision and layer-wise ones)."""
    for part in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(part, "optimizer", part)
        if hasattr(inner, "chained_optimizers"):
            yield from _inner_optimizers(inner)
        else:
            yield inner


def _fused_supported(params) -> bool:
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    devices = _get_fused_kernels_supported_devices()
    return all(p.device.type in devices and torch.is_floating_point(p) and not p.is_sparse for p in params)


def use_fused_torch_adam(optimizer, devices: tuple[str, ...] = ("cuda",)) -> int:
    """Switch every plain torch Adam/AdamW inside `optimizer` whose parameters live on `devices` to the fused kernel.

    Returns the number of param groups switched. Groups that torch cannot fuse (unsupported device or dtype,
    `capturable`/`differentiable` set, or a subclass with its own step) are left as they are.
    """
    switched = 0
    for inner in _inner_optimizers(optimizer):
        if type(inner) not in (torch.optim.AdamW, torch.optim.Adam):
            continue
        switched_here = 0
        for group in inner.param_groups:
            params = group["params"]
            if (group.get("fused") or group.get("capturable") or group.get("differentiable") or not params
                    or any(p.device.type not in devices for p in params) or not _fused_supported(params)):
                continue
            group["fused"], group["foreach"] = True, False
            switched_here += 1
        switched += switched_here
        if switched_here:
            inner.defaults["fused"], inner.defaults["foreach"] = True, False
            inner._step_supports_amp_scaling = True  # what torch's constructor sets for fused=True
    return switched
