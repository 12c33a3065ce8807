"""fp16 loss scaling for the Muon chain, which megatron-core's emerging-optimizer factory refuses to build.

The chain is built as for bf16, then every mixed-precision member gets one shared scaler. Members must unscale with
the same scale the loss was multiplied by, and the scale must move once per step on the OR of every member's
found-inf (separate scalers per member drift apart as soon as one member alone sees an overflow).
"""

from __future__ import annotations

import copy

import torch


def _mixed_precision_members(optimizer) -> list:
    from megatron.core.optimizer.optimizer import ChainedOptimizer, MixedPrecisionOptimizer

    if isinstance(optimizer, ChainedOptimizer):
        members = []
        for child in optimizer.chained_optimizers:
            members += _mixed_precision_members(child)
        return members
    return [optimizer] if isinstance(optimizer, MixedPrecisionOptimizer) else []


def _make_scaler(config):
    from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler

    if config.loss_scale:
        return ConstantGradScaler(config.loss_scale)
    return DynamicGradScaler(
        initial_scale=config.initial_loss_scale,
        min_scale=config.min_loss_scale,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=config.loss_scale_window,
        hysteresis=config.hysteresis,
    )


class SharedStepGradScaler:
    """One scaler for `members` optimizers: `update` takes effect once all members reported this step."""

    def __init__(self, inner, members: int):
        self.inner = inner
        self.members = members
        self._reported = 0
        self._found_inf = False

    @property
    def scale(self):
        return self.inner.scale

    @property
    def inv_scale(self):
        return self.inner.inv_scale

    def update(self, found_inf: bool) -> None:
        self._found_inf |= bool(found_inf)
        self._reported += 1
        if self._reported == self.members:
            self.inner.update(self._found_inf)
            self._reported, self._found_inf = 0, False

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.inner.load_state_dict(state_dict)


def bf16_twin(config):
    """A copy of an fp16 OptimizerConfig that megatron's emerging-optimizer factory accepts."""
    twin = copy.copy(config)
    twin.fp16, twin.bf16 = False, True
    return twin


def attach_fp16_loss_scaling(optimizer, config):
    """Turn a chain built from `bf16_twin(config)` into an fp16 chain with one shared loss scaler."""
    members = _mixed_precision_members(optimizer)
    if not members:
        raise ValueError("fp16 Muon needs mixed-precision optimizers in the chain; build it with fp16 params")
    scaler = SharedStepGradScaler(_make_scaler(config), len(members))
    for member in members:
        device = scaler.scale.device
        member.grad_scaler = scaler
        member.found_inf = torch.zeros(1, dtype=torch.float, device=device)
        member.config = config
    _set_config(optimizer, config)
    return optimizer


def _set_config(optimizer, config) -> None:
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    optimizer.config = config
    if isinstance(optimizer, ChainedOptimizer):
        for child in optimizer.chained_optimizers:
            _set_config(child, config)
