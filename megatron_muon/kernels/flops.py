"""FLOP accounting for the NS methods (2·m·n·k per product), used by the benchmark and the `auto` rule's notes."""

from __future__ import annotations

from collections.abc import Sequence

from megatron_muon.kernels.coefficients import DEFAULT_COEFFICIENTS


def _gemm(rows: int, cols: int, inner: int, symmetric: bool) -> int:
    full = 2 * rows * cols * inner
    return full // 2 if symmetric else full


def flops(
    m: int,
    n: int,
    method: str,
    steps: int = 5,
    batch: int = 1,
    *,
    restarts: Sequence[int] | None = None,
    coefficients=DEFAULT_COEFFICIENTS,
    symmetric: bool = False,
) -> int:
    """FLOPs of `method` ('standard' | 'gram' | 'auto') on `batch` matrices of shape m×n.

    Counts what the algorithm in newton_schulz.py executes, for the smaller side s and larger side l.
    symmetric=True counts symmetric products at half (what the lower-triangle Triton kernels do);
    the default counts full GEMMs, the usual basis for "effective" TFLOP/s.
    restarts default to `orthogonalize`'s for `coefficients` (`default_restarts`).
    """
    from megatron_muon.kernels.coefficients import resolve_coefficients
    from megatron_muon.kernels.newton_schulz import choose_method, default_restarts

    if method not in ("standard", "gram", "auto"):
        raise ValueError(f"unknown method {method!r}; valid: ('standard', 'gram', 'auto')")
    if min(m, n) < 0 or steps < 1 or batch < 0:
        raise ValueError(f"need m, n >= 0, steps >= 1, batch >= 0; got m={m}, n={n}, steps={steps}, batch={batch}")
    if restarts is None:
        restarts = default_restarts(resolve_coefficients(coefficients, steps))
    s, l = min(m, n), max(m, n)
    if method == "auto":
        method = choose_method(m, n)
    if method == "standard":
        per_step = _gemm(s, s, l, symmetric) + _gemm(s, s, s, symmetric) + _gemm(s, l, s, False)
        return batch * steps * per_step

    gram_of_x = _gemm(s, s, l, symmetric)  # R = X·Xᵀ
    apply_q = _gemm(s, l, s, False)  # X ← Q·X
    sym_cube = _gemm(s, s, s, symmetric)
    total = gram_of_x
    first = True  # Q starts as P itself: no product
    for i in range(steps):
        if i > 0 and i in restarts:
            total += apply_q + gram_of_x
            first = True
        total += sym_cube  # Z = b·R + c·R²
        if i + 1 < steps and (i + 1) not in restarts:
            total += 2 * sym_cube  # R ← P·R·P
        if not first:
            total += sym_cube  # Q ← Q·P
        first = False
    total += apply_q
    return batch * total
