"""The part of a Muon step between the gradients and the updates, replayed from one CUDA graph.

Building the momentum stacks and running Newton–Schulz reads the same tensors every step (megatron's gradient
buffers, the momentum buffers, the masters) under settings that rarely change; only the learning rate changes every
step, and the updates that read it stay eager. With `Muon(graph_newton_schulz=True)` that part runs eagerly once,
is captured the next time the same tensors and settings come, and is replayed from then on (`SpeculationGraphs`:
any change runs eagerly and captures anew; a failed capture turns graphs off with a warning; replay runs the same
kernels on the same tensors, so results are bit-identical). A pending clip factor reaches the graph through one
tensor of its own, copied into before each replay.
"""

from __future__ import annotations

from typing import Callable

import torch

from megatron_muon.optimizer.speculation_graphs import SpeculationGraphs, static_factor


class StepGraphs:
    """One graph per optimizer for its step's stacks and Newton–Schulz; `settings`: the group keys it bakes in."""

    def __init__(self, settings: tuple[str, ...], freeze: Callable[[object], object]):
        self.settings, self.freeze = settings, freeze  # freeze: a hashable form of a group setting
        self.graphs = SpeculationGraphs(label="step")
        self._factor: torch.Tensor | None = None

    @staticmethod
    def graphable(optimizer, plan, sources, fused: bool) -> bool:
        """CUDA, the fused elementwise passes (the momentum EMA inside the graph), no tensor-parallel bucket and no
        l2 group (its regularized gradients are new tensors each step)."""
        return (fused and all(source.grad.is_cuda for source in sources)
                and all(bucket.tp_group is None for bucket in plan.buckets)
                and all(group["weight_decay_mode"] != "l2" for group in optimizer.param_groups)
                and not torch.cuda.is_current_stream_capturing())

    def key(self, optimizer, plan, sources, factor) -> tuple:
        """What the captured step depends on: the tensors it reads and writes (by address), the plan and every
        setting it bakes in (not lr or weight decay: the eager updates read those)."""
        settings = tuple(tuple(self.freeze(group[k]) for k in self.settings) for group in optimizer.param_groups)
        tensors = tuple((source.grad.data_ptr(), source.buffer.data_ptr(), source.ema_pending,
                         plan.params[index].data_ptr()) for index, source in enumerate(sources))
        buckets = tuple((bucket.shape, tuple(bucket.items)) for bucket in plan.buckets)
        return buckets, tensors, settings, optimizer.compute_dtype, factor is not None

    def run(self, optimizer, plan, sources, factor, compute: Callable[[torch.Tensor | None], object]) -> object:
        """`compute(factor)`'s result, from the graph when one of the same key exists."""
        if factor is not None:
            factor = self._factor = static_factor(self._factor, factor)
        return self.graphs.run(0, self.key(optimizer, plan, sources, factor), lambda: compute(factor))
