"""Newton–Schulz coefficient schedules: the one table every NS implementation in the package reads.

An NS iteration maps each singular value s of the (normalized) iterate through p(s) = a·s + b·s³ + c·s⁵.
A schedule is one (a, b, c) per iteration; names resolve to schedules here so the optimizer, the kernels,
the reference oracle and the benchmarks cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Sequence

Coefficient = tuple[float, float, float]

# Keller Jordan's quintic: maximizes the slope at zero; converges to ~U·S'·Vᵀ with S' in roughly [0.7, 1.2].
QUINTIC: Coefficient = (3.4445, -4.7750, 2.0315)

# Polar Express, degree 5 (Amsel, Persson, Musco, Gower 2025, arXiv:2505.16932, Algorithm 1): per-iteration
# minimax-optimal polynomials. Later iterations equal the last entry numerically.
_POLAR_EXPRESS_UNSCALED: tuple[Coefficient, ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
# The paper's safety factor: p(x/f)·... keeps slightly-above-one singular values (rounding) from overshooting.
# Applied to every polynomial but the last (which is already the convergent fixed-point polynomial).
POLAR_EXPRESS_SAFETY = 1.01
POLAR_EXPRESS: tuple[Coefficient, ...] = tuple(
    (a / POLAR_EXPRESS_SAFETY, b / POLAR_EXPRESS_SAFETY**3, c / POLAR_EXPRESS_SAFETY**5)
    for a, b, c in _POLAR_EXPRESS_UNSCALED[:-1]
) + (_POLAR_EXPRESS_UNSCALED[-1],)

# name -> schedule; a schedule shorter than the step count repeats its last entry.
COEFFICIENT_SETS: dict[str, tuple[Coefficient, ...]] = {
    "quintic": (QUINTIC,),
    "polar_express": POLAR_EXPRESS,
}


def _as_triple(value, where: str) -> Coefficient:
    try:
        triple = tuple(float(x) for x in value)
    except TypeError as err:
        raise TypeError(f"{where} must be a sequence of three numbers (a, b, c), got {value!r}") from err
    if len(triple) != 3:
        raise ValueError(f"{where} must have exactly three numbers (a, b, c) for p(s)=a·s+b·s³+c·s⁵, got {value!r}")
    return triple  # type: ignore[return-value]


def resolve_coefficients(coefficients: str | Sequence, steps: int) -> list[Coefficient]:
    """Return exactly `steps` (a, b, c) triples for a name, one triple, or a per-iteration list.

    A list shorter than `steps` repeats its last entry (how Polar Express defines later iterations); a list
    longer than `steps` is an error, because silently truncating a schedule changes the result.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int (number of Newton–Schulz iterations), got {steps!r}")
    if isinstance(coefficients, str):
        key = coefficients.lower()
        if key not in COEFFICIENT_SETS:
            raise ValueError(
                f"unknown coefficient set {coefficients!r}; valid names: {sorted(COEFFICIENT_SETS)}, "
                "or pass (a, b, c) / a list of (a, b, c) tuples"
            )
        schedule = list(COEFFICIENT_SETS[key])
    else:
        items = list(coefficients)
        if not items:
            raise ValueError("coefficients list is empty; pass a name like 'quintic' or at least one (a, b, c)")
        if all(isinstance(x, (int, float)) for x in items):
            schedule = [_as_triple(items, "coefficients")]
        else:
            schedule = [_as_triple(x, f"coefficients[{i}]") for i, x in enumerate(items)]
    if len(schedule) > steps and not isinstance(coefficients, str):
        raise ValueError(
            f"got {len(schedule)} coefficient triples for steps={steps}; pass steps={len(schedule)} "
            "or a schedule with at most `steps` entries"
        )
    schedule = schedule[:steps]
    return schedule + [schedule[-1]] * (steps - len(schedule))
