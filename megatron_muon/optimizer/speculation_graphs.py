"""CUDA graphs of the waves' speculative Newton–Schulz.

A wave's speculation is the same sequence of kernels over the same tensors every step (DDP's gradient buffer, the
momentum buffers, the masters), launched from the backward's CPU thread while that thread also launches the
backward. Replaying it from a graph turns its hundreds of launches into one, so the backward is not delayed by them.
A wave runs eagerly once (its kernels compile and autotune), is captured the next time it comes with the same
inputs, and is replayed from then on; any change of inputs (other tensors, other hyperparameters) runs it eagerly
again and captures anew. A capture that fails turns graphs off with a warning; the eager path is always exact.
"""

from __future__ import annotations

import warnings
from typing import Callable, Hashable

import torch


def static_factor(slot: torch.Tensor | None, factor: torch.Tensor) -> torch.Tensor:
    """`factor` (one fp32 value) copied into `slot`, the one address captured graphs read it from; a new slot where
    there is none yet or it lives on another device."""
    if slot is None or slot.device != factor.device:
        slot = torch.empty(1, dtype=torch.float32, device=factor.device)
    slot.copy_(factor.reshape(1))
    return slot


class SpeculationGraphs:
    """Per wave: the inputs key of its last eager run, and its captured graph with the tensors the graph writes."""

    def __init__(self, label: str = "speculation"):
        self.label = label  # what the graphs hold, for the warning when a capture fails
        self._last_eager: dict[int, Hashable] = {}
        self._graphs: dict[int, tuple[Hashable, torch.cuda.CUDAGraph, object]] = {}
        # one memory pool for all waves (they replay one after another on one stream), owned here: a pool borrowed
        # from a captured graph dies with that graph's last reference, and capturing into a dead pool's id fails
        self._pool: torch.cuda.MemPool | None = None
        self.captures = 0
        self.replays = 0
        self.disabled: str | None = None  # why graphs are off (a capture failed), None while they are on

    def run(self, wave: int, key: Hashable, speculate: Callable[[], object]) -> object:
        """`speculate()`'s result for `wave`: replayed when a graph of the same key exists, captured (then replayed)
        when the previous eager run had the same key, else computed eagerly."""
        captured = self._graphs.get(wave)
        if captured is not None and captured[0] == key:
            captured[1].replay()
            self.replays += 1
            return captured[2]
        if self.disabled is not None or self._last_eager.get(wave) != key:
            self._graphs.pop(wave, None)
            self._last_eager[wave] = key
            return speculate()
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.MemPool()
        stream = torch.cuda.current_stream()
        if stream == torch.cuda.default_stream():  # no capture on the default stream: torch's own capture stream
            stream = None
        try:
            with torch.cuda.graph(graph, pool=self._pool.id, stream=stream, capture_error_mode="thread_local"):
                outputs = speculate()
        except Exception as error:  # noqa: BLE001 - any capture failure leaves the exact eager path
            self.disabled = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            warnings.warn(f"Newton–Schulz {self.label} runs without CUDA graphs: capturing wave {wave} failed "
                          f"({self.disabled}); results stay exact", RuntimeWarning, stacklevel=2)
            self._graphs.clear()
            return speculate()
        graph.replay()
        self._graphs[wave] = (key, graph, outputs)
        self.captures += 1
        return outputs
