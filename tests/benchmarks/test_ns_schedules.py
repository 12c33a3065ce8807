"""The schedule comparison's measures (benchmarks/ns_schedules.py) on the polynomials themselves."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from ns_schedules import band, ill_conditioned, polar_gap, reach  # noqa: E402

from megatron_muon.kernels.coefficients import COEFFICIENT_SETS  # noqa: E402
from megatron_muon.kernels.reference import newton_schulz_reference, polar_factor_svd  # noqa: E402


@pytest.mark.parametrize("name", sorted(set(COEFFICIENT_SETS) - {"aol"}))
def test_a_fifth_step_reaches_deeper_and_lands_closer_to_the_polar_factor(name):
    assert reach(name, 5) < reach(name, 4)
    G = ill_conditioned(64, 160, 0)
    polar = polar_factor_svd(G)
    assert polar_gap(newton_schulz_reference(G, 5, name), polar) < polar_gap(newton_schulz_reference(G, 4, name), polar)


def test_megatrons_aol_schedule_reverses_the_largest_directions_of_a_frobenius_normalized_input():
    low, _ = band("aol", 4)
    assert low < -0.9 and band("simple", 5)[0] > 0.6
    u, v = torch.randn(48, dtype=torch.float64), torch.randn(96, dtype=torch.float64)
    G = torch.outer(u, v) + 1e-3 * torch.randn(48, 96, dtype=torch.float64)  # one direction holds the norm
    u, v = u / u.norm(), v / v.norm()
    assert float(u @ newton_schulz_reference(G, 4, "aol") @ v) < -0.9  # that direction comes out reversed
    assert float(u @ newton_schulz_reference(G, 5, "simple") @ v) > 0.6
