"""When the owner engine reports a non-finite gradient norm (`muon_nonfinite_check`, recipe
`optimizer.muon_nonfinite_check`).

`before_update`: the host reads the step's norm before anything is updated, and a non-finite norm stops the step on
every rank with no state changed, naming the first parameter whose gradient holds it. That read waits for the whole
backward, so the host queues the step only after the GPU has finished it.

`next_step`: where nothing in the update depends on the norm's value (no clipping, or a clip factor the speculation
already carries), the norm stays on the device and travels to the host without blocking; the first step that
starts after it has arrived (or a checkpoint save, which waits for it) reads it and raises if it was non-finite.
The host then queues the whole step while the backward still runs, as megatron's distributed AdamW does (whose step
has no such check at all); the price is that a NaN step has been applied when it is reported.

`auto` (default): `next_step` where megatron's DDP checks every bucket's gradient for NaN and Inf before reducing it
(`check_for_nan_in_grad`, on by default in Megatron-LM's `pretrain_*.py`): that check already stops a non-finite
gradient in the backward, before the optimizer, so a second host read would only cost time; the next-step report
stays as the backstop for a sum that overflows in the reduction. `before_update` everywhere else.
"""

from __future__ import annotations

import math

import torch

NONFINITE_CHECKS = ("auto", "before_update", "next_step")
DEFAULT_NONFINITE_CHECK = "auto"


def check_nonfinite_choice(choice: str) -> str:
    if choice not in NONFINITE_CHECKS:
        raise ValueError(f"unknown non-finite check {choice!r} (muon_nonfinite_check, the recipe's "
                         f"optimizer.muon_nonfinite_check); valid choices: {NONFINITE_CHECKS}")
    return choice


def resolve_nonfinite_check(choice: str, model_chunks) -> str:
    """`auto` made concrete for these DDP-wrapped chunks (module docstring); other choices as given."""
    if check_nonfinite_choice(choice) != "auto":
        return choice
    configs = [getattr(chunk, "ddp_config", None) for chunk in model_chunks]
    checked = bool(configs) and all(getattr(config, "check_for_nan_in_grad", False) for config in configs)
    return "next_step" if checked else "before_update"


class PendingNorm:
    """One step's gradient norm on its way to the host: copied without blocking, read once it has arrived."""

    def __init__(self, norm: torch.Tensor):
        norm = norm.detach().reshape(1)
        if norm.is_cuda:
            self._host = torch.empty(1, dtype=norm.dtype, pin_memory=True)
            self._host.copy_(norm, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host, self._ready = norm.clone(), None

    def arrived(self) -> bool:
        return self._ready is None or self._ready.query()

    def value(self) -> float:
        if self._ready is not None:
            self._ready.synchronize()
        return float(self._host[0])


def raise_if_a_norm_was_non_finite(pending: list[PendingNorm], wait: bool) -> list[PendingNorm]:
    """The `next_step` report over the norms that have arrived (all of them with `wait`): every rank holds the same
    norms, so every rank raises. Returns those still on their way."""
    due = [wait or p.arrived() for p in pending]  # asked once per norm: one that arrives meanwhile waits its turn
    for norm, now in zip(pending, due):
        if now:
            _raise_if_non_finite(norm.value())
    return [norm for norm, now in zip(pending, due) if not now]


def _raise_if_non_finite(norm: float) -> None:
    if not math.isfinite(norm):
        raise ValueError(
            f"non-finite gradient norm ({norm}) at an earlier optimizer step: with the norm checked by the next step "
            "(muon_nonfinite_check next_step, or auto under megatron's check_for_nan_in_grad) that step's update was "
            "applied before its norm was read, so parameters and optimizer state may hold NaN "
            "or Inf. Resume from the last checkpoint (lower the learning rate or skip that batch); "
            "muon_nonfinite_check=before_update stops such a step before any state changes and names the parameter."
        )
