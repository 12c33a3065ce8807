"""The oracles agree with each other and with the exact polar factor."""

import torch

from megatron_muon.kernels.reference import (
    gram_newton_schulz_reference,
    newton_schulz_reference,
    polar_factor_svd,
    singular_value_map,
)


def _random(shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_gram_reference_equals_standard_reference_for_any_restarts():
    for seed, shape in enumerate([(24, 80), (80, 24), (3, 16, 40), (32, 32)]):
        G = _random(shape, seed)
        expected = newton_schulz_reference(G, coefficients="polar_express")
        for restarts in [(), (2,), (1, 3), (2, 4)]:
            got = gram_newton_schulz_reference(G, coefficients="polar_express", restarts=restarts)
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)


def test_reference_acts_on_singular_values_by_the_scalar_map():
    G = _random((20, 50), 7)
    U, S, Vh = torch.linalg.svd(G, full_matrices=False)
    Y = newton_schulz_reference(G, steps=5, coefficients="simple")
    expected = U @ torch.diag(singular_value_map(S / G.norm())) @ Vh
    torch.testing.assert_close(Y, expected, rtol=0, atol=1e-10)


def test_converges_to_the_polar_factor_with_a_convergent_schedule():
    # singular values in [0.1, 1]: 10 Polar Express steps reach the polar factor to ~1e-6.
    g = torch.Generator().manual_seed(3)
    U, _ = torch.linalg.qr(torch.randn(40, 12, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(12, 12, generator=g, dtype=torch.float64))
    G = (U * torch.linspace(0.1, 1.0, 12, dtype=torch.float64)) @ V.T
    Y = newton_schulz_reference(G, steps=10, coefficients="polar_express")
    torch.testing.assert_close(Y, polar_factor_svd(G), rtol=0, atol=1e-5)
    torch.testing.assert_close(polar_factor_svd(G), U @ V.T, rtol=0, atol=1e-10)
