"""Batched standard and Gram Newton–Schulz, written once over the op interface in `ops.py`.

`orthogonalize` is the public entry: it puts the smaller side first, Frobenius-normalizes in fp32, picks the
method (`auto` rule below) and the backend (Triton on sm80/sm90, torch elsewhere), and returns the input dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_muon.kernels.coefficients import DEFAULT_COEFFICIENTS, Coefficient, resolve_coefficients
from megatron_muon.kernels.backends import select_ops

METHODS = ("standard", "gram", "auto")

# `auto` rule, measured on one H200 (docs/design/newton_schulz.md). For stacks as Muon builds them (24 × 2048 × n,
# 36 × 1536 × n) Gram ties standard NS when square and is faster from aspect 1.125 on, the more so the longer the
# long side; stacks of 6 × 2048 gain from 1.25, so the rule starts there. Short side 1024 (too little m×m work to
# fill the GPU) gains only past 2.5, so it stays at 2.5. (Stacks of 6-8 small matrices are host-bound, not ranked.)
GRAM_MIN_ASPECT = 1.25
GRAM_MIN_ASPECT_SHORT_SIDE = 1536
GRAM_MIN_ASPECT_SMALL = 2.5

# Iteration dtypes. Standard NS keeps X bounded (singular values <= ~1.2, entries far above fp16's subnormals), so
# fp16 costs the same as bf16 (Muon's convention) and is several times more accurate against the fp64 iteration
# than torch.optim.Muon's bf16 on the reference shapes (docs/design/newton_schulz.md). Gram NS
# iterates on X·Xᵀ, which squares the condition number: fp16's 3 extra mantissa bits keep small eigenvalues
# resolved, and the values stay far inside fp16's range (R <= ~1.5, Q <= ~50 between restarts).
STANDARD_DTYPE = torch.float16
GRAM_DTYPE = torch.float16

# Restart schedule. Each R ← P·R·P update in fp16 multiplies the rounding error of R's small eigenvalues by about
# a² (the iteration's slope at zero), so the error grows with the updates between restarts, and errors in the last
# iterations are not corrected by later ones. Measured on CPU (fp16 iteration; singular values 1e-6..1, rank-
# deficient, spiked and Gaussian inputs; max |output singular values - fp64 iteration's|): a restart before every
# second iteration from the 2nd, (2, 4, 6, ...), so that R is at most one update old when used, keeps the error
# small for 3-8 steps with every coefficient set in the package and in megatron's table (the old fixed (2, 4) blew
# up at 7-8 steps). When the first two iterations amplify gently (a₀²·a₁² <= GENTLE_START_GAIN: Keller's quintic,
# 141), the first R may be two updates old: at an odd step count that saves a restart, (3, 5, ...), at a similar
# error. On the H200's reference set (5 steps) that is faster than (2, 4) at the same relative error against the
# fp64 iteration. Steeper starts blow up that way (megatron's "quintic" 260, Polar Express 1100, CANS 1255); "aol"
# (192) ends further off. The last R must stay at most one update old for every schedule (two updates old, the
# error grows on spiked inputs). No restart blows up. The errors and times: docs/design/newton_schulz.md.
GENTLE_START_GAIN = 150.0


def default_restarts(schedule: Sequence[Coefficient]) -> tuple[int, ...]:
    """The measured restart schedule for this coefficient schedule (see GENTLE_START_GAIN)."""
    steps = len(schedule)
    gain = 1.0
    for a, _, _ in schedule[:2]:
        gain *= a * a
    first = 3 if gain <= GENTLE_START_GAIN and steps % 2 == 1 and steps >= 5 else 2
    return tuple(range(first, steps, 2))


LONG_SIDE_ALIGNMENT = 64


def newton_schulz(X: torch.Tensor, schedule: Sequence[Coefficient], ops) -> torch.Tensor:
    """Standard NS on a normalized batch X [b, m, n] with m <= n: X ← a·X + (b·A + c·A²)·X, A = X·Xᵀ."""
    for a, b, c in schedule:
        A = ops.sym_mm(X, X)
        B = ops.sym_mm(A, A, A, alpha=c, beta=b)
        X = ops.mm(B, X, X, beta=a)
    return X


def gram_newton_schulz(
    X: torch.Tensor,
    schedule: Sequence[Coefficient],
    ops,
    restarts: Sequence[int] | None = None,
    transpose_output: bool = False,
    observe_gram=None,
) -> torch.Tensor:
    """Gram NS on a normalized batch X [b, m, n], m <= n: iterate the m×m Gram matrix R, apply Q once at the end.

    Per iteration Z = b·R + c·R², P = a·I + Z, Q ← Q·P, R ← P·R·P (all symmetric and commuting, so every product
    is a `sym_mm`). Rounding lets small eigenvalues of R drift negative, and R·P(R)² amplifies them each step;
    a restart (X ← Q·X, R ← X·Xᵀ) before the iterations in `restarts` (default: `default_restarts(schedule)`)
    resets that error to one rounding.
    Returns Q·X [b, m, n], or (Q·X)ᵀ = Xᵀ·Q [b, n, m] directly when `transpose_output`.
    `observe_gram(R)` is called on every Gram iterate R (diagnostics: its eigenvalues must stay >= 0).
    """
    steps = len(schedule)
    restarts = default_restarts(schedule) if restarts is None else tuple(restarts)
    R = ops.sym_mm(X, X)
    Q = None
    for i, (a, b, c) in enumerate(schedule):
        if i > 0 and i in restarts:
            X = ops.mm(Q, X)
            R = ops.sym_mm(X, X)
            Q = None
        if observe_gram is not None:
            observe_gram(R)
        Z = ops.sym_mm(R, R, R, alpha=c, beta=b)
        if i + 1 < steps and (i + 1) not in restarts:
            RP = ops.sym_mm(R, Z, R, beta=a)  # R·P = a·R + R·Z
            R = ops.sym_mm(Z, RP, RP, beta=a)  # P·R·P = a·RP + Z·RP
        if Q is None:
            Q = Z
            Q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            Q = ops.sym_mm(Q, Z, Q, beta=a)  # Q·P = a·Q + Q·Z
    if transpose_output:
        return ops.mm(X.mT, Q)
    return ops.mm(Q, X)


def _normalized_padded(X: torch.Tensor, eps: float, work_dtype: torch.dtype, ops,
                       norm: torch.Tensor | None = None) -> torch.Tensor:
    """X / ‖X‖_F in `work_dtype`, the long side zero-padded to a multiple of LONG_SIDE_ALIGNMENT, in one pass.

    The norm is reduced in fp32 (fp64 for fp64 input) straight from the input dtype and the division writes the
    rounded result into the (padded) work buffer, so no fp32 copy of the batch is ever materialized: on the
    reference set this saves ~24 bytes of traffic per element over "upcast, divide, downcast, pad". Zero columns
    leave X·Xᵀ, every iterate's other columns and the result unchanged (they stay zero), and they make rows
    128-byte aligned: 9228-wide fp16 rows otherwise force slow unaligned GEMM paths (measured on the H200 for the
    GDN in_proj shape, in torch.optim.Muon too: docs/design/newton_schulz.md). On the GPU the
    division and padding are one Triton pass (`kernels/scaled_copy.py`). `norm` ([b] fp32): the norms, where the
    caller already has them.
    """
    n = X.size(-1)
    if norm is None:
        norm_dtype = torch.promote_types(X.dtype, torch.float32)  # fp32, or fp64 for an fp64 iteration
        norm = torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True, dtype=norm_dtype)
    norm = norm.reshape(X.size(0), 1, 1).clamp_min(eps)
    padded = -(-n // LONG_SIDE_ALIGNMENT) * LONG_SIDE_ALIGNMENT
    shape = (*X.shape[:-1], padded)
    return ops.scaled_copy(X, norm, X.new_empty(shape, dtype=work_dtype))


def choose_method(m: int, n: int) -> str:
    """The measured `auto` rule (see GRAM_MIN_ASPECT)."""
    small, large = min(m, n), max(m, n)
    if small == 0:
        return "standard"
    threshold = GRAM_MIN_ASPECT if small >= GRAM_MIN_ASPECT_SHORT_SIDE else GRAM_MIN_ASPECT_SMALL
    return "gram" if large >= threshold * small else "standard"


def work_dtype(G: torch.Tensor, method: str = "auto", compute_dtype: torch.dtype | None = None) -> torch.dtype:
    """The iteration dtype `orthogonalize` uses for G (also the cheapest `out_dtype`)."""
    m, n = G.shape[-2:]
    chosen = choose_method(m, n) if method == "auto" else method
    return compute_dtype or (GRAM_DTYPE if chosen == "gram" else STANDARD_DTYPE)


def _check_inputs(G: torch.Tensor, method: str, eps: float, restarts) -> None:
    if not isinstance(G, torch.Tensor):
        raise TypeError(f"orthogonalize expects a torch.Tensor, got {type(G).__name__}")
    if G.ndim not in (2, 3):
        raise ValueError(
            f"orthogonalize expects [m, n] or a stacked batch [b, m, n], got shape {tuple(G.shape)}; "
            "reshape higher-rank parameters (e.g. conv weights) to 2-D first"
        )
    if not G.is_floating_point():
        raise TypeError(f"orthogonalize needs a floating-point tensor, got {G.dtype}; cast with .float()")
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; valid: {METHODS}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0 (guards the Frobenius normalization), got {eps}")
    if any(isinstance(r, bool) or not isinstance(r, int) for r in restarts):
        raise TypeError(f"restarts must be iteration indices (ints), got {restarts!r}")


def orthogonalize(
    G: torch.Tensor,
    steps: int = 5,
    coefficients=DEFAULT_COEFFICIENTS,
    method: str = "auto",
    eps: float = 1e-7,
    *,
    restarts: Sequence[int] | None = None,
    backend: str = "auto",
    compute_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
    frobenius_norm: torch.Tensor | None = None,
) -> torch.Tensor:
    """Approximate the polar factor U·Vᵀ of G ([m, n] or [b, m, n]) with Newton–Schulz; same shape and dtype.

    method: 'standard', 'gram' (iterate on the smaller-side Gram matrix; restarts before the iterations listed in
    `restarts`, default `default_restarts`: before the 4th for Keller's 5-step quintic, every second iteration from
    the 3rd for steeper schedules), or 'auto' (Gram when the aspect ratio makes it faster, see
    `choose_method`). backend: 'auto' (Triton symmetric kernels on sm80/sm90 GPUs, torch elsewhere), 'torch' or
    'triton'. compute_dtype overrides the iteration dtype (fp16; fp32 for a near-exact iteration on CPU).
    out_dtype: the result dtype (default G's). A caller that only adds the result to parameters passes the
    iteration dtype (`work_dtype(G, method)`) and saves widening the whole batch: in-place adds upcast on the fly.
    frobenius_norm: ‖G‖_F per matrix (fp32, one value per matrix), where the caller has summed it while writing G
    (the Muon step's momentum pass does): saves the normalization's reduction pass.
    """
    schedule = resolve_coefficients(coefficients, steps)
    restarts = default_restarts(schedule) if restarts is None else tuple(restarts)
    _check_inputs(G, method, eps, restarts)
    if frobenius_norm is not None and (frobenius_norm.numel() != (G.size(0) if G.ndim == 3 else 1)
                                       or frobenius_norm.dtype != torch.float32):
        raise ValueError(f"frobenius_norm must hold one fp32 value per matrix of G {tuple(G.shape)}, got "
                         f"{frobenius_norm.dtype} {tuple(frobenius_norm.shape)}; omit it to have it computed")
    if G.numel() == 0:
        return torch.zeros_like(G, dtype=out_dtype or G.dtype)
    X = G if G.ndim == 3 else G.unsqueeze(0)
    transposed = X.size(-2) > X.size(-1)
    if transposed:
        X = X.mT
    m, n = X.shape[-2:]
    chosen = choose_method(m, n) if method == "auto" else method
    ops = select_ops(X.device, backend)
    X = _normalized_padded(X, eps, work_dtype(X, chosen, compute_dtype), ops, frobenius_norm)
    if chosen == "gram":
        Y = gram_newton_schulz(X, schedule, ops, restarts=restarts, transpose_output=transposed)
        Y = Y[:, :n, :] if transposed else Y[:, :, :n]
    else:
        Y = newton_schulz(X, schedule, ops)[:, :, :n]
        if transposed:
            Y = Y.mT
    Y = _cast(Y, out_dtype or G.dtype, ops)
    return Y.squeeze(0) if G.ndim == 2 else Y


def _cast(Y: torch.Tensor, dtype: torch.dtype, ops) -> torch.Tensor:
    """Y in `dtype`. torch's casting copy takes its non-vectorized path, well below the copy bandwidth on the H200
    (docs/design/newton_schulz.md); the input pass's kernel with a unit norm rounds the same in one coalesced pass
    (x / 1 is exact)."""
    if Y.dtype == dtype:
        return Y
    one = torch.ones(Y.size(0), 1, 1, dtype=torch.float32, device=Y.device)
    return ops.scaled_copy(Y, one, Y.new_empty(Y.shape, dtype=dtype))
