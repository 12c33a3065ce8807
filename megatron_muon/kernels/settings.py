"""One value for how Newton–Schulz runs, so that Muon, the owner engine and the owner plan's cost model mean the same
iterations: built (and checked) once, then handed to each."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_muon.kernels.coefficients import DEFAULT_COEFFICIENTS, resolve_coefficients
from megatron_muon.kernels.newton_schulz import METHODS


@dataclass(frozen=True)
class Orthogonalizer:
    """Newton–Schulz settings: `steps` iterations of the `coefficients` schedule (a megatron-core name, one (a, b, c)
    triple or a per-iteration list), `method` "standard", "gram" or "auto" (per shape), `eps` of the normalization,
    `compute_dtype` the iteration dtype (None: the kernel's choice per method). The op backend follows the device."""

    steps: int = 5
    coefficients: str | tuple = DEFAULT_COEFFICIENTS
    method: str = "auto"
    eps: float = 1e-7
    compute_dtype: torch.dtype | None = None

    def __post_init__(self):
        if isinstance(self.coefficients, list):  # keep the value hashable: schedules arrive as lists of lists
            object.__setattr__(self, "coefficients", tuple(
                tuple(c) if isinstance(c, (list, tuple)) else c for c in self.coefficients))
        resolve_coefficients(self.coefficients, self.steps)  # raises naming the valid names / the step count
        if self.method not in METHODS:
            raise ValueError(f"unknown Newton–Schulz method {self.method!r}; valid choices: {METHODS}")
        if not self.eps > 0:
            raise ValueError(f"Newton–Schulz eps must be > 0, got {self.eps}")

    @property
    def schedule(self) -> list[tuple[float, float, float]]:
        """Exactly `steps` (a, b, c) triples."""
        return resolve_coefficients(self.coefficients, self.steps)

    def muon_kwargs(self) -> dict:
        """The keyword arguments `Muon` (and the owner engine's `WaveMuon`) take for these settings."""
        return dict(ns_steps=self.steps, coefficients=self.coefficients, method=self.method, eps=self.eps,
                    compute_dtype=self.compute_dtype)
