"""fp64 oracles for orthogonalization: plain NS, Gram NS with restarts, the exact polar factor, and the scalar map.

Deliberately naive (one matrix at a time, float64, no fused ops) so that every fast path can be compared to them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_muon.kernels.coefficients import DEFAULT_COEFFICIENTS, resolve_coefficients


def _normalized_fp64(G: torch.Tensor, eps: float) -> tuple[torch.Tensor, bool]:
    """Promote to fp64, put the smaller side first, Frobenius-normalize (same convention as the fast paths)."""
    if G.ndim not in (2, 3):
        raise ValueError(f"expected a matrix [m, n] or a batch [b, m, n], got shape {tuple(G.shape)}")
    X = G.detach().to(torch.float64)
    transposed = X.size(-2) > X.size(-1)
    if transposed:
        X = X.mT
    norm = torch.linalg.matrix_norm(X, ord="fro", keepdim=True)
    return X / norm.clamp_min(eps), transposed


def newton_schulz_reference(
    G: torch.Tensor, steps: int = 5, coefficients=DEFAULT_COEFFICIENTS, eps: float = 1e-7
) -> torch.Tensor:
    """Standard NS in fp64: X ← a·X + (b·A + c·A²)·X with A = X·Xᵀ. Returns fp64, same shape as G."""
    schedule = resolve_coefficients(coefficients, steps)
    X, transposed = _normalized_fp64(G, eps)
    for a, b, c in schedule:
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if transposed else X


def gram_newton_schulz_reference(
    G: torch.Tensor,
    steps: int = 5,
    coefficients=DEFAULT_COEFFICIENTS,
    restarts: Sequence[int] = (2,),
    eps: float = 1e-7,
) -> torch.Tensor:
    """Gram NS in fp64: iterate R = X·Xᵀ and accumulate Q so that the result is Q·X₀.

    With polynomials P_k = a·I + b·R_k + c·R_k², X_{k+1} = P_k·X_k, so R_{k+1} = P_k·R_k·P_k and Q = Π P_k
    (all are polynomials in R, hence symmetric and commuting). A restart before iteration i sets X ← Q·X and
    recomputes R from it. In exact arithmetic this equals `newton_schulz_reference` for any restarts.
    """
    schedule = resolve_coefficients(coefficients, steps)
    X, transposed = _normalized_fp64(G, eps)
    eye = torch.eye(X.size(-2), dtype=X.dtype, device=X.device)
    R = X @ X.mT
    Q = eye.expand_as(R).clone()
    for i, (a, b, c) in enumerate(schedule):
        if i > 0 and i in restarts:
            X = Q @ X
            R = X @ X.mT
            Q = eye.expand_as(R).clone()
        P = a * eye + b * R + c * R @ R
        Q = Q @ P
        R = P @ R @ P
    X = Q @ X
    return X.mT if transposed else X


def polar_factor_svd(G: torch.Tensor) -> torch.Tensor:
    """The exact orthogonal polar factor U·Vᵀ of G (thin SVD, fp64): what NS approximates."""
    U, _, Vh = torch.linalg.svd(G.detach().to(torch.float64), full_matrices=False)
    return U @ Vh


def singular_value_map(sigma: torch.Tensor, steps: int = 5, coefficients=DEFAULT_COEFFICIENTS) -> torch.Tensor:
    """Where NS sends each normalized singular value: s ← a·s + b·s³ + c·s⁵ per iteration, in fp64."""
    s = sigma.to(torch.float64)
    for a, b, c in resolve_coefficients(coefficients, steps):
        s = a * s + b * s**3 + c * s**5
    return s
