"""Step times without synchronizing inside the training loop.

Megatron's loop never waits for the GPU between steps (bf16 gradient clipping keeps the norm on the device), so the
CPU queues the next step's batch upload, graph guards and launches while the GPU still runs the current one. A
timer that synchronized every step would expose that CPU work as GPU idle time. Here each step's start and the end
of its forward/backward are CUDA events on the current stream, read in one synchronization per log window.
"""

from __future__ import annotations

import time

import torch


class StepTimer:
    """Marks steps as the CPU issues them; `read()` returns (step seconds, optimizer seconds) per marked step.

    On a GPU a step lasts from its start event to the next step's start (the last one to the event `read()`
    records), i.e. the GPU timeline, idle gaps included; the optimizer part starts at the end of the
    forward/backward. On CPU, where nothing runs ahead, the wall clock.
    """

    def __init__(self, on_gpu: bool):
        self.on_gpu = on_gpu
        self._marks: list[tuple[object, object]] = []
        self._pending_start: object | None = None

    def _now(self):
        if not self.on_gpu:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start_step(self) -> None:
        assert self._pending_start is None, "end_forward_backward() was not called for the previous step"
        self._pending_start = self._now()

    def end_forward_backward(self) -> None:
        assert self._pending_start is not None, "start_step() first"
        self._marks.append((self._pending_start, self._now()))
        self._pending_start = None

    def read(self) -> list[tuple[float, float]]:
        """Wait for the marked steps to finish; their (step_s, optimizer_s), oldest first. Clears the marks."""
        assert self._pending_start is None, "read() inside a step"
        end = self._now()
        if self.on_gpu:
            end.synchronize()
        marks, self._marks = self._marks, []
        times = []
        for i, (start, forward_backward_end) in enumerate(marks):
            step_end = marks[i + 1][0] if i + 1 < len(marks) else end
            step_s = _seconds(start, step_end, self.on_gpu)
            times.append((step_s, _seconds(forward_backward_end, step_end, self.on_gpu)))
        return times


def _seconds(first, second, on_gpu: bool) -> float:
    return first.elapsed_time(second) / 1e3 if on_gpu else second - first
