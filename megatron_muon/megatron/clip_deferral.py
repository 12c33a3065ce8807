"""megatron's gradient clip, deferred to optimizers that apply the factor as they read each gradient.

megatron clips by multiplying every fp32 gradient by min(1, max_norm / (norm + 1e-6)) before the optimizer step: a
read and a write of every gradient (docs/design/optimizer_passes.md has the cost). An
optimizer that reads each gradient once anyway (`master_adamw.OnePassAdamW`, our Muon's fused momentum pass) can
apply the factor in registers instead. `claim` registers such an optimizer (the owner: `.pending`, the factor
for its next step, and `.claimed`, the ids of its parameters) for a megatron mixed-precision wrapper;
`clip_grad_by_total_norm_fp32` then leaves the factor with the owner when a call covers exactly its parameters.
Anything else (a subset, as separate grad-norm groups clip; a second clip in the same step; decoupled grads)
multiplies as megatron does: factors commute, so a pending one still applies once.
"""

from __future__ import annotations

import importlib
import weakref

import torch

from megatron_muon.megatron.muon_wrappers import fused_muon_wrappers
from megatron_muon.patches import replace_method

_OWNER = "_megatron_muon_clip_owner"  # on each claimed parameter: a weakref to its owner
_CLIP_MODULES = ("megatron.core.optimizer.clip_grads", "megatron.core.optimizer.optimizer")
_original_clip = None


def claim(wrapper, owner) -> None:
    """Mark the owner's parameters, and clear its pending factor at the start of each of the wrapper's steps (a
    factor left by a skipped step never reaches the next one)."""
    handle = weakref.ref(owner)
    for group in owner.inner.param_groups:
        for param in group["params"]:
            setattr(param, _OWNER, handle)
    original_prepare = wrapper.prepare_grads

    def prepare_grads():
        owner.pending = None
        return original_prepare()

    replace_method(wrapper, "prepare_grads", prepare_grads)
    wrapper.clip_owner = owner  # lives as long as the wrapper


def install() -> None:
    """Route megatron's clip through `_clip_or_defer` (once per process)."""
    global _original_clip
    if _original_clip is not None:
        return
    for name in _CLIP_MODULES:
        module = importlib.import_module(name)
        _original_clip = _original_clip or module.clip_grad_by_total_norm_fp32
        module.clip_grad_by_total_norm_fp32 = _clip_or_defer


def _clip_or_defer(parameters, max_norm, total_norm, use_decoupled_grad: bool = False):
    """megatron's clip, except that a call covering exactly one owner's params leaves the factor with it."""
    owner = None if use_decoupled_grad else _sole_owner(parameters)
    if owner is None:
        return _original_clip(parameters, max_norm, total_norm, use_decoupled_grad)
    if isinstance(total_norm, torch.Tensor):
        owner.pending = clip_factor(max_norm, total_norm)
        return None
    factor = max_norm / (total_norm + 1.0e-6)
    if factor < 1.0:  # a host norm: as megatron, nothing to do when not clipped
        device = next(iter(owner.inner.param_groups[0]["params"])).device
        owner.pending = torch.tensor([factor], dtype=torch.float32, device=device)
    return None


def clip_factor(max_norm: float, total_norm: torch.Tensor) -> torch.Tensor:
    """megatron's clip coefficient for a device norm, min(1, max_norm / (norm + 1e-6)), as a one-element fp32
    tensor: the same operations as its `clip_grad_by_total_norm_fp32`, so the same bits."""
    return (max_norm / (total_norm + 1.0e-6)).reshape(1).float().clamp_max(1.0)


def _sole_owner(parameters):
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    with_grads = [p for p in params if p.grad is not None]
    handles = {getattr(p, _OWNER, None) for p in with_grads}
    if len(handles) != 1 or None in handles:
        return None
    owner = next(iter(handles))()
    # a second clip of the same step (or a subset, as separate grad-norm groups do) multiplies as megatron does:
    # factors commute, so the pending one still applies once
    if owner is None or owner.pending is not None or {id(p) for p in with_grads} != owner.claimed:
        return None
    return owner


class _MuonFactor:
    """The owner for a mixed-precision wrapper around our Muon: its pending factor is Muon's `pending_grad_factor`,
    which the fused momentum pass applies as it reads each gradient."""

    def __init__(self, muon):
        self.inner = muon
        self.claimed = frozenset(id(p) for group in muon.param_groups for p in group["params"])

    @property
    def pending(self):
        return self.inner.pending_grad_factor

    @pending.setter
    def pending(self, factor):
        self.inner.pending_grad_factor = factor


def install_for_muon(optimizer) -> int:
    """Defer the clip to every Muon (ours) inside megatron's mixed-precision wrappers whose momentum pass is fused
    on the parameters' device (elsewhere the deferred factor would be a separate multiply again); returns how many
    were newly deferred (a second call defers none)."""
    installed = 0
    for wrapper, muon in fused_muon_wrappers(optimizer):
        if getattr(wrapper, "clip_owner", None) is None:
            claim(wrapper, _MuonFactor(muon))
            installed += 1
    if installed:
        install()
    return installed
