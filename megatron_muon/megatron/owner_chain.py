"""The optimizer chain megatron's factory returns for the owner engine: [OwnerMuonOptimizer, DistributedOptimizer
(AdamW)]. Before the step clips, it shows the global gradient norm to the owners (whether their speculation holds);
under clipping it computes that norm before the step, on the device and by megatron's own arithmetic, so that
`backward_end` speculation carries the clip factor (`owner_optimizer`'s module docstring)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from megatron.core.optimizer.optimizer import ChainedOptimizer
from torch.profiler import record_function

from megatron_muon.megatron.clip_deferral import clip_factor
from megatron_muon.megatron.owner_optimizer import OwnerMuonOptimizer


class _SquaredNorm(NamedTuple):
    squares: torch.Tensor  # the sum of the chained optimizers' squared norms, on the device


class OwnerMuonChain(ChainedOptimizer):
    """megatron's ChainedOptimizer of [OwnerMuonOptimizer, DistributedOptimizer(AdamW)] that shows the global
    gradient norm to the Muon engines before it clips, and under clipping computes it before the step so that
    `backward_end` speculation carries the clip factor (module docstring)."""

    _early_norm = None  # this step's norm, computed in prepare_grads for get_grad_norm to return

    def _owners(self) -> list[OwnerMuonOptimizer]:
        return [child for child in self.chained_optimizers if isinstance(child, OwnerMuonOptimizer)]

    def _one_device_norm(self) -> bool:
        """Whether megatron can clip every parameter by one device norm: a tensor clip kernel exists (device norms,
        so computing them early does not block the host) and no parameter clips with a grad-norm group's own."""
        from megatron.core.optimizer import clip_grads
        from megatron.core.optimizer.optimizer import SEPARATE_GRAD_NORM_GROUPS

        return clip_grads.multi_tensor_scale_tensor_impl is not None \
            and not any(self.has_grad_norm_group(group) for group in SEPARATE_GRAD_NORM_GROUPS)

    def _clip_carriers(self) -> list[OwnerMuonOptimizer]:
        """The owners whose speculation can take the clip factor this step: `backward_end` with clipping, under
        one device norm."""
        owners = [owner for owner in self._owners()
                  if owner.newton_schulz_start == "backward_end" and owner.config.clip_grad > 0.0]
        return owners if owners and self._one_device_norm() else []

    def _norm_on_device(self) -> bool:
        """Whether the step's norm stays a device tensor: every owner reports a non-finite norm at the next step
        (`nonfinite_check`), under one device norm."""
        owners = self._owners()
        return bool(owners) and all(owner.nonfinite_check == "next_step" for owner in owners) \
            and self._one_device_norm()

    def _norm_and_clip_factor(self):
        """(what megatron's get_grad_norm returns, or the squared norm it takes the root of on the host; the clip
        factor for a given clip_grad, a one-element fp32 device tensor), by megatron's own arithmetic, nothing read
        on the host; None where some norm is not a device tensor. With the norm kept on the device
        (`_norm_on_device`) the host's root becomes the same double root on the device, rounded to the norms'
        dtype, and the clip that of megatron's tensor branch, as for a single device norm."""
        if len(self.chained_optimizers) == 1 or self.grads_states_parallel_group_is_shared():
            norm = super().get_grad_norm()  # one device norm, clipped with as a tensor
            return (norm, lambda clip: clip_factor(clip, norm)) if isinstance(norm, torch.Tensor) else None
        norms = [child.get_grad_norm() for child in self.chained_optimizers]
        if not all(isinstance(norm, torch.Tensor) for norm in norms):
            return None
        squares = 0  # megatron: math.sqrt(sum(norm**2 ...)) in double on the host, then clips by a Python float
        for norm in norms:
            squares = squares + norm**2
        if self._norm_on_device():
            rooted = squares.double().sqrt().to(squares.dtype)
            return rooted, lambda clip: clip_factor(clip, rooted)
        total = squares.double().sqrt()

        def factor(clip: float) -> torch.Tensor:
            coefficient = torch.full_like(total, clip) / (total + 1.0e-6)  # a true division, as Python's
            return torch.where(coefficient < 1.0, coefficient, 1.0).float().reshape(1)

        return _SquaredNorm(squares), factor

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        self._early_norm = None
        carriers = self._clip_carriers()
        for owner in carriers:
            owner.clip_factor_from_chain = True
        try:
            found_inf = super().prepare_grads()
        finally:
            for owner in carriers:
                owner.clip_factor_from_chain = False
        if carriers and not found_inf:
            with record_function("owner.grad_norm"):
                early = self._norm_and_clip_factor()
            if early is not None:
                self._early_norm = early[0]
            for owner in carriers:  # each with the clip megatron applies to its parameters (its own config's)
                owner.speculate_clipped(None if early is None else early[1](owner.config.clip_grad))
        return found_inf

    @torch.no_grad()
    def get_grad_norm(self):
        norm, self._early_norm = self._early_norm, None
        if norm is None and self._norm_on_device():
            early = self._norm_and_clip_factor()
            norm = None if early is None else early[0]
        if isinstance(norm, _SquaredNorm):
            norm = math.sqrt(float(norm.squares))
        elif norm is None:
            with record_function("owner.grad_norm"):
                norm = super().get_grad_norm()
        for child in self.chained_optimizers:
            if isinstance(child, OwnerMuonOptimizer):
                child.allow_speculation(norm, self.model_chunks)
        return norm

    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        """megatron's chained step with the owner engines last: the AdamW step runs on the step's stream while the
        owners' Newton–Schulz still finishes on the side stream."""
        if self.config.overlap_param_gather_with_optimizer_step or self._should_defer_mxfp8_param_sync():
            return super().step_with_ready_grads()
        success = True
        for optimizer in sorted(self.chained_optimizers, key=lambda o: isinstance(o, OwnerMuonOptimizer)):
            success &= optimizer.step_with_ready_grads()
        return success

    def load_state_dict(self, state_dict):
        from megatron.core.optimizer import distrib_optimizer

        states = [state_dict] if len(self.chained_optimizers) == 1 else [v for _, v in sorted(state_dict.items())]
        deferred = []
        for child, state in zip(self.chained_optimizers, states):
            if isinstance(child, distrib_optimizer.DistributedOptimizer) and not distrib_optimizer.HAVE_APEX_OR_TE \
                    and state.get("param_state_sharding_type") == "fully_reshardable" and "param_state" in state:
                deferred.append((child, state.pop("param_state")))
        super().load_state_dict(state_dict)
        for child, param_state in deferred:
            _load_fully_reshardable(child, param_state)


def _load_fully_reshardable(distributed_optimizer, param_state) -> None:
    """megatron's `load_parameter_state_from_fully_reshardable`, minus its per-parameter `step` lookup: with torch's
    Adam (no TE / Apex) megatron-core 0.19 puts a `step` tensor into every parameter's state and then expects one in
    the checkpoint, which never holds it (KeyError 'step'). The step count comes back through the param groups."""
    from collections import ChainMap

    index = -1
    for buffer_index, range_maps in enumerate(distributed_optimizer.gbuf_ranges):
        for range_maps_per_bucket in range_maps.values():
            ranges = ChainMap(*(range_map["param_map"] for range_map in range_maps_per_bucket))
            for model_param in distributed_optimizer.buffers[buffer_index].param_index_map:
                index += 1
                if model_param not in ranges:
                    continue
                span = ranges[model_param]["param"]
                group_index, group_order = distributed_optimizer.model_param_group_index_map[model_param]
                main = distributed_optimizer.optimizer.param_groups[group_index]["params"][group_order]
                state = distributed_optimizer.optimizer.state[main]
                for key, value in param_state[index].items():
                    if key != "step":
                        target = main if key in ("param", "fp32_param") else state[key]
                        target.data.copy_(value.flatten()[span.start : span.end])
