"""The momentum stacks built on a side stream while Newton–Schulz runs on the current one.

Building a bucket's stack (momentum EMA, Nesterov blend, the 16-bit NS input) is bandwidth-bound; Newton–Schulz is
GEMM-bound. Issued on one stream they run one after the other; here every stack is issued up front on a side stream
and each bucket's NS waits only for its own stack, so the GPU can fill the GEMMs' idle bandwidth and wave tails with
the next stacks. The kernels and their inputs are the ones of the sequential order, so results are bit-identical.
Works inside a CUDA-graph capture (the side stream forks from and joins the capturing stream).
"""

from __future__ import annotations

from typing import Callable

import torch

_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device, shared by every optimizer (their steps run one after another)."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[device]


def overlapped(count: int, build: Callable[[int], torch.Tensor],
               consume: Callable[[int, torch.Tensor], object], device: torch.device) -> list:
    """`[consume(i, build(i)) for i in range(count)]`, every `build` on the side stream of `device` ahead of the
    `consume` calls on the current stream; the current stream waits for the side stream before returning."""
    if device.type != "cuda" or count < 2:
        return [consume(i, build(i)) for i in range(count)]
    main = torch.cuda.current_stream(device)
    side = side_stream(device)
    side.wait_stream(main)  # gradients and momentum buffers are ready on the current stream
    stacks: list[torch.Tensor] = []
    ready: list[torch.cuda.Event] = []
    with torch.cuda.stream(side):
        for i in range(count):
            stacks.append(build(i))
            event = torch.cuda.Event()
            event.record(side)
            ready.append(event)
    results = []
    for i, (stacked, event) in enumerate(zip(stacks, ready)):
        main.wait_event(event)
        stacked.record_stream(main)  # allocated on the side stream, read (and freed) on this one
        results.append(consume(i, stacked))
    main.wait_stream(side)  # join: nothing the side stream issued outlives the step
    return results

