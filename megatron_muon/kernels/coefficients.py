"""Newton–Schulz coefficient schedules: the one table every NS implementation in the package reads.

An NS iteration maps each singular value s of the (normalized) iterate through p(s) = a·s + b·s³ + c·s⁵.
A schedule is one (a, b, c) per iteration. The names are megatron-core's `muon_coefficient_type` names with
megatron-core's numbers (emerging-optimizers 0.3), so `orthogonalize(coefficients=NAME)`, `Muon(coefficients=NAME)`
and `--muon-coefficient-type NAME` run the same iterations: "simple" is Keller Jordan's (3.4445, −4.775, 2.0315),
torch.optim.Muon's schedule; "quintic" is a different, steeper five-step schedule.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

Coefficient = tuple[float, float, float]

# Keller Jordan's quintic: maximizes the slope at zero; converges to ~U·S'·Vᵀ with S' in roughly [0.7, 1.2].
SIMPLE: Coefficient = (3.4445, -4.7750, 2.0315)


class CoefficientSet(NamedTuple):
    """A named schedule and how it continues past its length: "cycle" restarts it, "repeat_last" holds its last
    entry (megatron-core's rule per name)."""

    schedule: tuple[Coefficient, ...]
    continuation: str


COEFFICIENT_SETS: dict[str, CoefficientSet] = {
    "simple": CoefficientSet((SIMPLE,), "cycle"),
    # Leloy Kun's per-step optimization (modded-nanogpt's medium speed run).
    "quintic": CoefficientSet(((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                               (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012)), "cycle"),
    # Polar Express (arXiv:2505.16932, Algorithm 1), its 1.01 safety factor folded in; the last entry is the
    # convergent fixed-point polynomial.
    "polar_express": CoefficientSet(((8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184), (3.9096, -2.8234, 0.5250),
                                     (3.2856, -2.4153, 0.4853), (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                                     (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750)), "repeat_last"),
    # CANS (arXiv:2506.10935): Remez polynomials on adaptive intervals.
    "cans": CoefficientSet(((8.4703, -25.1081, 18.6293), (4.1828, -3.1087, 0.5806), (3.9619, -2.9541, 0.5630),
                            (3.2866, -2.4647, 0.5074), (2.2737, -1.6447, 0.4162)), "repeat_last"),
    # flash-newton-schulz's schedule for AOL-preconditioned inputs.
    "aol": CoefficientSet(((4.0098, -7.0585, 2.4635), (3.4585, -5.5479, 2.5959), (2.7573, -3.2939, 1.4254),
                           (2.7215, -3.0494, 1.3169)), "cycle"),
    # DeepSeek-V4: eight of Keller's steps, then two steps of the cubic-like fixed-point polynomial.
    "deepseekv4": CoefficientSet((SIMPLE,) * 8 + ((2.0, -1.5, 0.5),) * 2, "repeat_last"),
}
# Names whose numbers assume an input other than the Frobenius-normalized one every schedule here gets.
UNSAFE_AFTER_FROBENIUS = {
    "aol": "made for AOL-rescaled inputs; after Frobenius normalization its first polynomial maps a singular value of "
           "1 to -0.585, so the directions holding most of the update come out reversed "
           "(benchmarks/results/ns_schedules.md). Use 'simple' (the default) or 'polar_express'",
}
DEFAULT_COEFFICIENTS = "simple"  # torch.optim.Muon's schedule; megatron's OptimizerConfig defaults to "quintic"


def warn_if_unsafe(coefficients) -> None:
    """Warn once per call site when a schedule is known to misbehave on the inputs this package gives it."""
    if isinstance(coefficients, str) and coefficients.lower() in UNSAFE_AFTER_FROBENIUS:
        import warnings

        warnings.warn(f"Newton–Schulz coefficients {coefficients!r}: {UNSAFE_AFTER_FROBENIUS[coefficients.lower()]}",
                      UserWarning, stacklevel=3)


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

    A name continues as megatron-core continues it (`CoefficientSet.continuation`). A list shorter than `steps`
    repeats its last entry (how Polar Express defines later iterations); a list longer than `steps` is an error,
    because silently truncating a schedule changes the result.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int (number of Newton–Schulz iterations), got {steps!r}")
    if isinstance(coefficients, str):
        key = coefficients.lower()
        if key not in COEFFICIENT_SETS:
            raise ValueError(
                f"unknown coefficient set {coefficients!r}; valid names (megatron-core's muon_coefficient_type): "
                f"{sorted(COEFFICIENT_SETS)}, or pass (a, b, c) / a list of (a, b, c) tuples"
            )
        named = COEFFICIENT_SETS[key]
        if named.continuation == "cycle":
            return [named.schedule[i % len(named.schedule)] for i in range(steps)]
        schedule = list(named.schedule)
    else:
        items = list(coefficients)
        if not items:
            raise ValueError("coefficients list is empty; pass a name like 'simple' or at least one (a, b, c)")
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
