"""Orthogonalization engine: batched standard and Gram Newton–Schulz with Triton symmetric kernels.

`orthogonalize(G, steps=5, coefficients="simple", method="auto")` is the entry point; `reference` holds the fp64
oracles, `coefficients` the one table of NS schedules, `flops` the FLOP accounting. The algorithms
themselves (`newton_schulz.newton_schulz`, `newton_schulz.gram_newton_schulz`) take any op backend from `ops`.
"""

from megatron_muon.kernels import coefficients, reference
from megatron_muon.kernels.coefficients import COEFFICIENT_SETS, resolve_coefficients
from megatron_muon.kernels.flops import flops
from megatron_muon.kernels.newton_schulz import GRAM_MIN_ASPECT, choose_method, orthogonalize

__all__ = [
    "orthogonalize",
    "flops",
    "resolve_coefficients",
    "COEFFICIENT_SETS",
    "GRAM_MIN_ASPECT",
    "choose_method",
    "coefficients",
    "reference",
]
