"""Cost of orthogonalizing a batch of same-shape matrices, as the owner plan sees it.

The plan needs cost(shape, batch) = launch(shape) + batch × per_matrix(shape): FLOP-based on paper (or on CPU), or
fitted to a short timing profile on the real device (`profile.py`), which captures launch overheads and the
standard/Gram switch that FLOPs miss.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol

import numpy as np

from megatron_muon.kernels.coefficients import DEFAULT_COEFFICIENTS

Shape = tuple[int, int]


class CostModel(Protocol):
    """Cost of orthogonalizing `batch` matrices of `shape` together: launch(shape) + batch * per_matrix(shape)."""

    def launch_cost(self, shape: Shape) -> float: ...

    def matrix_cost(self, shape: Shape) -> float: ...


def newton_schulz_flops(shape: Shape, steps: int = 5, method: str = "auto", coefficients=DEFAULT_COEFFICIENTS) -> float:
    """FLOPs the orthogonalize engine spends on one matrix (megatron_muon.kernels.flops: the same method rule and
    the coefficient schedule's restarts)."""
    from megatron_muon.kernels.flops import flops

    return float(flops(shape[0], shape[1], method, steps, coefficients=coefficients))


@dataclass(frozen=True)
class AnalyticCost:
    """FLOP-based cost (CPU, or before a device profile exists): seconds at `flops_per_s`, plus a launch cost."""

    flops_per_s: float = 400e12
    launch_s: float = 50e-6
    steps: int = 5
    method: str = "auto"
    coefficients: str | tuple = DEFAULT_COEFFICIENTS  # a name or a tuple of (a, b, c): it sets the Gram restarts
    flops_fn: Callable[..., float] = newton_schulz_flops

    @classmethod
    def for_orthogonalizer(cls, orthogonalizer, **rates) -> AnalyticCost:
        """The cost of the iterations a `kernels.settings.Orthogonalizer` runs (steps, schedule restarts, method)."""
        return cls(steps=orthogonalizer.steps, method=orthogonalizer.method,
                   coefficients=orthogonalizer.coefficients, **rates)

    def launch_cost(self, shape: Shape) -> float:
        return self.launch_s

    def matrix_cost(self, shape: Shape) -> float:
        return self.flops_fn(shape, self.steps, self.method, self.coefficients) / self.flops_per_s


@dataclass(frozen=True)
class MeasuredCost:
    """Affine fit per shape of measured seconds {(rows, cols, batch): seconds}; unmeasured shapes use
    `fallback` scaled by the median measured/fallback ratio, so a partial profile still ranks shapes sensibly."""

    table: Mapping[tuple[int, int, int], float]
    fallback: CostModel = field(default_factory=AnalyticCost)

    def __post_init__(self):
        points: dict[Shape, list[tuple[int, float]]] = defaultdict(list)
        for (rows, cols, batch), seconds in self.table.items():
            if batch < 1 or seconds < 0:
                raise ValueError(f"measured cost ({rows},{cols},batch={batch}) = {seconds}: "
                                 "need batch >= 1, seconds >= 0")
            points[(rows, cols)].append((batch, seconds))
        fits, ratios = {}, []
        for shape, pts in points.items():
            batches = np.array([b for b, _ in pts], dtype=float)
            secs = np.array([s for _, s in pts], dtype=float)
            if len(set(batches)) >= 2:
                slope, intercept = np.polyfit(batches, secs, 1)
                slope, intercept = max(slope, 1e-12), max(intercept, 0.0)
            else:
                slope, intercept = float(secs.mean() / batches.mean()), 0.0
            fits[shape] = (float(intercept), float(slope))
            ratios.append(slope / max(self.fallback.matrix_cost(shape), 1e-30))
        object.__setattr__(self, "_fits", fits)
        object.__setattr__(self, "_scale", float(np.median(ratios)) if ratios else 1.0)

    def launch_cost(self, shape: Shape) -> float:
        fit = self._fits.get(shape)
        return fit[0] if fit else self.fallback.launch_cost(shape) * self._scale

    def matrix_cost(self, shape: Shape) -> float:
        fit = self._fits.get(shape)
        return fit[1] if fit else self.fallback.matrix_cost(shape) * self._scale


class CachedCost:
    """Per-shape memo of a cost model (planning asks for the same few shapes thousands of times)."""

    def __init__(self, inner: CostModel):
        self.inner, self._launch, self._matrix = inner, {}, {}

    def launch_cost(self, shape: Shape) -> float:
        if shape not in self._launch:
            self._launch[shape] = float(self.inner.launch_cost(shape))
        return self._launch[shape]

    def matrix_cost(self, shape: Shape) -> float:
        if shape not in self._matrix:
            self._matrix[shape] = float(self.inner.matrix_cost(shape))
        return self._matrix[shape]
