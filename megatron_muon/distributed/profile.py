"""A short startup profile of Newton–Schulz on the real device: the measured cost table the owner plan balances.

FLOP counts rank shapes well on paper but miss what dominates on a GPU for small matrices (launches, the Gram vs
standard switch, tensor-core tile effects). Timing each shape at two batch sizes gives the affine cost
(launch + batch × per-matrix) that `plan.MeasuredCost` fits.
"""

from __future__ import annotations

import time
from typing import Iterable

import torch

from megatron_muon.distributed.plan import MeasuredCost, Shape
from megatron_muon.kernels.coefficients import DEFAULT_COEFFICIENTS
from megatron_muon.optimizer import muon_math


def _timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of `fn()` after one warm-up call (CUDA events on GPU, wall clock elsewhere)."""
    fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - begin)
    return sorted(samples)[len(samples) // 2]


def profile_cost_table(
    shapes: Iterable[Shape],
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    batches: tuple[int, ...] = (1, 4),
    repeats: int = 3,
    **ns_settings,
) -> dict[tuple[int, int, int], float]:
    """{(rows, cols, batch): seconds} of one batched orthogonalize per distinct shape and batch size.

    `ns_settings` are `muon_math.orthogonal_update` arguments (ns_steps, coefficients, method, compute_dtype)."""
    if len(set(batches)) < 2 or min(batches) < 1:
        raise ValueError("batches needs two or more distinct sizes >= 1 to fit launch + per-matrix cost, "
                         f"got {batches}")
    device = torch.device(device) if device is not None else torch.device("cpu")
    settings = dict(ns_steps=5, coefficients=DEFAULT_COEFFICIENTS)
    settings.update(ns_settings)
    generator = torch.Generator(device=device).manual_seed(0)
    table = {}
    for rows, cols in sorted(set(shapes)):
        for batch in batches:
            stack = torch.randn(batch, rows, cols, device=device, dtype=dtype, generator=generator)
            table[(rows, cols, batch)] = _timed(lambda: muon_math.orthogonal_update(stack, **settings), device, repeats)
    return table


def profiled_cost(shapes: Iterable[Shape], **kwargs) -> MeasuredCost:
    """`MeasuredCost` from a fresh `profile_cost_table` run."""
    return MeasuredCost(profile_cost_table(shapes, **kwargs))
