"""What megatron builds for `--optimizer muon --use-distributed-optimizer` (and its deprecated alias `dist_muon`).

`OwnerMuonOptimizer` is megatron's `LayerWiseDistributedOptimizer` with our `WaveMuon` inside: DDP lays each Muon
matrix out whole in the data-parallel shard of its owner (`owner_layout`), its reduce-scatter lands each owner's
gradients in place, fp32 masters and momentum exist on the owner only, and DDP's parameter all-gather brings the
updated 16-bit matrices back (after the step, or bucket by bucket in the next forward with `overlap_param_gather`).
AdamW takes every other parameter on megatron's DistributedOptimizer.

With `overlap_grad_reduce`, each owner starts Newton–Schulz for a bucket as soon as that bucket's reduce-scatter has
landed, on a side stream while the backward continues (a hook on the parameters' gradient accumulators, after DDP's
own). That work assumes the step will not clip: `OwnerMuonChain.get_grad_norm` tells the engines whether the clip
factor is 1, and a clipped step recomputes (`WaveMuon`).
"""

from __future__ import annotations

import math

import torch
from megatron.core.optimizer.layer_wise_optimizer import (
    LayerWiseDistributedOptimizer,
    _bucket_is_managed_by_layer_wise_optimizer,
)
from megatron.core.optimizer.optimizer import ChainedOptimizer, FP32Optimizer

from megatron_muon.optimizer.wave_muon import WaveMuon


def _muon_bucket_groups(chunk) -> list:
    return [group for group in chunk.bucket_groups + chunk.expert_parallel_bucket_groups
            if group.buckets and _bucket_is_managed_by_layer_wise_optimizer(group.buckets[0], default_for_untagged=False)]


class OwnerMuonOptimizer(LayerWiseDistributedOptimizer):
    """Megatron's layer-wise distributed optimizer over owner-laid-out DDP buffers, Newton–Schulz in the backward.

    Args beyond megatron's: `overlap_newton_schulz` (default True) starts each bucket's Newton–Schulz once its
    gradients have been reduced; it takes effect where DDP reduces buckets during the backward
    (`overlap_grad_reduce`)."""

    def __init__(self, optimizers, config, pg_collection=None, init_state_fn_list=None, model_chunks=None,
                 overlap_newton_schulz: bool = True):
        if not config.bf16:  # megatron's layer-wise optimizer wraps bf16 only; fp32/fp64 get megatron's FP32 wrapper
            fns = init_state_fn_list or [None] * len(optimizers)
            optimizers = [FP32Optimizer(o, config, fn or (lambda *_: None)) for o, fn in zip(optimizers, fns)]
            init_state_fn_list = None
        super().__init__(optimizers, config, pg_collection, init_state_fn_list, model_chunks)
        self.overlap_newton_schulz = overlap_newton_schulz
        self.engines = [child.optimizer for child in self.chained_optimizers if isinstance(child.optimizer, WaveMuon)]
        self._stream = torch.cuda.Stream() if torch.cuda.is_available() and self._on_cuda() else None
        self._waves: list[tuple] = []  # per wave: (bucket group, [(engine, optimizer param, model param)])
        self._started: set[int] = set()
        self.wave_log: list[tuple[str, int]] = []  # ("reduced" | "speculated", wave) in order, for tests
        self._hooks = []
        self._install_waves(model_chunks or [])

    def _on_cuda(self) -> bool:
        return any(p.is_cuda for engine in self.engines for g in engine.param_groups for p in g["params"])

    def _optimizer_params(self) -> dict[int, tuple]:
        """id(model param) -> (engine, the parameter the engine updates: its fp32 master or itself)."""
        mapping = {}
        for child in self.chained_optimizers:
            engine = child.optimizer
            if not isinstance(engine, WaveMuon):
                continue
            for model_group, main_group in zip(getattr(child, "float16_groups", []),
                                               getattr(child, "fp32_from_float16_groups", [])):
                mapping.update({id(model): (engine, main) for model, main in zip(model_group, main_group)})
            for group in engine.param_groups:
                for param in group["params"]:
                    mapping.setdefault(id(param), (engine, param))
        return mapping

    def _install_waves(self, model_chunks) -> None:
        owned = self._optimizer_params()
        for chunk in model_chunks:
            for group in _muon_bucket_groups(chunk):
                wave = len(self._waves)
                members = []
                for bucket in group.buckets:
                    for model_param in bucket.params_list:
                        if id(model_param) in owned:
                            engine, param = owned[id(model_param)]
                            engine.wave_of[id(param)] = wave
                            members.append((engine, param, model_param))
                self._waves.append((group, members))
                for bucket in group.buckets:
                    for model_param in bucket.params_list:
                        accumulator = model_param.expand_as(model_param).grad_fn.next_functions[0][0]
                        self._hooks.append(accumulator.register_hook(self._wave_hook(wave)))

    def _wave_hook(self, wave: int):
        def hook(*_):
            group, members = self._waves[wave]
            if not self.overlap_newton_schulz or wave in self._started or group.grad_reduce_handle is None:
                return
            self._started.add(wave)
            self.wave_log.append(("reduced", wave))
            self._launch(wave, group.grad_reduce_handle, members)
        return hook

    def _launch(self, wave: int, handle, members) -> None:
        grads = {id(param): model_param.main_grad for _, param, model_param in members}
        engines = {id(engine): engine for engine, _, _ in members}.values()
        if self._stream is None:
            handle.wait()
            for engine in engines:
                engine.speculate(wave, lambda p: grads[id(p)])
        else:
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                handle.wait()
                for engine in engines:
                    engine.speculate(wave, lambda p: grads[id(p)])
        self.wave_log.append(("speculated", wave))

    @torch.no_grad()
    def prepare_grads(self) -> bool:
        if self._stream is not None:
            torch.cuda.current_stream().wait_stream(self._stream)
        self._started.clear()
        return super().prepare_grads()

    def allow_speculation(self, grad_norm) -> None:
        """Called with the step's global gradient norm: the speculative updates hold iff nothing is clipped."""
        clip = self.config.clip_grad
        norm = float(grad_norm)
        valid = clip <= 0.0 or (math.isfinite(norm) and clip / (norm + 1.0e-6) >= 1.0)
        for engine in self.engines:
            engine.speculation_valid = valid


class OwnerMuonChain(ChainedOptimizer):
    """megatron's ChainedOptimizer of [OwnerMuonOptimizer, DistributedOptimizer(AdamW)] that shows the global
    gradient norm to the Muon engines before it clips."""

    @torch.no_grad()
    def get_grad_norm(self):
        norm = super().get_grad_norm()
        for child in self.chained_optimizers:
            if isinstance(child, OwnerMuonOptimizer):
                child.allow_speculation(norm)
        return norm
