"""Muon's per-step math as pure functions over lists and stacks of tensors.

The single-rank optimizer (`muon.py`) and the distributed owners both call these, so an update computed on an
owner rank is bit-identical to the single-process one. Nothing here knows about torch.optim or Megatron.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from megatron_muon.kernels import orthogonalize

# megatron-core's names (`spectral`, `shape_scaling`, `unit_rms_norm`) and torch.optim.Muon's (`original`,
# `match_rms_adamw`); `none` leaves the orthogonalized update unscaled.
SCALE_MODES = ("spectral", "shape_scaling", "unit_rms_norm", "original", "match_rms_adamw", "none")
WEIGHT_DECAY_MODES = ("decoupled", "independent", "l2")


def check_scale_mode(scale_mode: str) -> str:
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"unknown scale_mode {scale_mode!r}; valid choices: {SCALE_MODES}")
    return scale_mode


def lr_scale(shape: Sequence[int], scale_mode: str) -> float:
    """How much a unit-spectral-norm update of a [rows, cols] matrix is scaled before the learning rate.

    `spectral` = sqrt(max(rows, cols)) (Moonlight / megatron default), `shape_scaling` and `original`
    = sqrt(max(1, rows/cols)) (Keller Jordan), `unit_rms_norm` = sqrt(rows/cols) (Scion),
    `match_rms_adamw` = 0.2·sqrt(max(rows, cols)) (torch.optim.Muon's AdamW-RMS match).
    """
    rows, cols = int(shape[-2]), int(shape[-1])
    check_scale_mode(scale_mode)
    if scale_mode == "spectral":
        return math.sqrt(max(rows, cols))
    if scale_mode in ("shape_scaling", "original"):
        return math.sqrt(max(1.0, rows / cols))
    if scale_mode == "unit_rms_norm":
        return math.sqrt(rows / cols)
    if scale_mode == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return 1.0


def momentum_update_(
    grads: list[torch.Tensor], momentum_buffers: list[torch.Tensor], momentum: float, nesterov: bool
) -> list[torch.Tensor]:
    """EMA momentum in place (buf ← buf + (1-β)(g - buf)); returns the tensors to orthogonalize.

    Nesterov returns g + β(buf - g), as torch.optim.Muon and megatron-core do. Buffers may be kept in a narrower
    dtype than the gradients; the returned update is in the gradient dtype.
    """
    if not grads:
        return []
    same_dtype = all(g.dtype == b.dtype for g, b in zip(grads, momentum_buffers))
    grads_as_buf = grads if same_dtype else [g.to(b.dtype) for g, b in zip(grads, momentum_buffers)]
    torch._foreach_lerp_(momentum_buffers, grads_as_buf, 1.0 - momentum)
    bufs_as_grad = momentum_buffers if same_dtype else [b.to(g.dtype) for g, b in zip(grads, momentum_buffers)]
    if nesterov:
        return list(torch._foreach_lerp(grads, bufs_as_grad, momentum))
    return list(bufs_as_grad)


def momentum_buffers_update_(grads: list[torch.Tensor], momentum_buffers: list[torch.Tensor], momentum: float) -> None:
    """The EMA half of `momentum_update_`: buf ← buf + (1-β)(g - buf), foreach, in the buffers' dtype."""
    if not grads:
        return
    same_dtype = all(g.dtype == b.dtype for g, b in zip(grads, momentum_buffers))
    grads_as_buf = grads if same_dtype else [g.to(b.dtype) for g, b in zip(grads, momentum_buffers)]
    torch._foreach_lerp_(momentum_buffers, grads_as_buf, 1.0 - momentum)


def nesterov_into_(grad: torch.Tensor, buffer: torch.Tensor, out: torch.Tensor, momentum: float, nesterov: bool):
    """The update half of `momentum_update_`, written straight into `out` (a slot of the stacked NS input).

    Same math and rounding as `momentum_update_` followed by a copy into `out` (any dtype), without the
    intermediate update tensor: one pass reads gradient and buffer and writes the (narrower) stack.
    """
    buffer = buffer if buffer.dtype == grad.dtype else buffer.to(grad.dtype)
    if nesterov:
        torch.lerp(grad, buffer, momentum, out=out)
    else:
        out.copy_(buffer)


def stack_dtype(update_dtype: torch.dtype, compute_dtype: torch.dtype | None) -> torch.dtype:
    """dtype of the stacked Newton–Schulz input: bf16 for fp32 updates unless an fp32 iteration was asked for.

    The stack only feeds a normalization into the fp16/bf16 iteration, so storing it in bf16 (torch.optim.Muon's
    NS input dtype, full fp32 range) halves the bytes written and read; an explicit fp32 compute_dtype keeps fp32
    so that a near-exact iteration stays near-exact.
    """
    if update_dtype == torch.float32 and (compute_dtype is None or compute_dtype.itemsize < 4):
        return torch.bfloat16
    return update_dtype


def l2_regularized(grads: list[torch.Tensor], params: list[torch.Tensor], weight_decay: float) -> list[torch.Tensor]:
    """Classic L2 weight decay: g + λ·p (new tensors; the caller's gradients stay untouched)."""
    if weight_decay == 0.0 or not grads:
        return grads
    return list(torch._foreach_add(grads, [p.to(g.dtype) for p, g in zip(params, grads)], alpha=weight_decay))


def weight_decay_factor(*, lr: float, weight_decay: float, mode: str) -> float:
    """The parameters' multiplier: decoupled 1 - lr·λ, independent 1 - λ; 1 for `l2` (it acts on gradients)."""
    if mode not in WEIGHT_DECAY_MODES:
        raise ValueError(f"unknown weight_decay_mode {mode!r}; valid choices: {WEIGHT_DECAY_MODES}")
    if weight_decay == 0.0 or mode == "l2":
        return 1.0
    return 1.0 - (lr * weight_decay if mode == "decoupled" else weight_decay)


def apply_weight_decay_(params: list[torch.Tensor], *, lr: float, weight_decay: float, mode: str) -> None:
    """Shrink parameters in place: decoupled p ← p(1 - lr·λ), independent p ← p(1 - λ); `l2` acts on gradients."""
    factor = weight_decay_factor(lr=lr, weight_decay=weight_decay, mode=mode)
    if factor != 1.0 and params:
        torch._foreach_mul_(params, factor)


def orthogonal_update(
    stacked: torch.Tensor,
    *,
    ns_steps: int,
    coefficients,
    method: str = "auto",
    eps: float = 1e-7,
    compute_dtype: torch.dtype | None = None,
    out_dtype: torch.dtype | None = None,
    frobenius_norm: torch.Tensor | None = None,
) -> torch.Tensor:
    """Batched Newton–Schulz of a [b, m, n] (or [m, n]) stack of momentum updates; same shape, dtype `out_dtype`
    (default: the stack's); `frobenius_norm`: the stack's norms where the momentum pass summed them."""
    return orthogonalize(
        stacked, steps=ns_steps, coefficients=coefficients, method=method, eps=eps, compute_dtype=compute_dtype,
        out_dtype=out_dtype, frobenius_norm=frobenius_norm,
    )


def update_scale(shape: Sequence[int], scale_mode: str, extra_scale: float = 1.0) -> float:
    """The factor folded into the step size for a matrix of this (full, unsharded) shape."""
    return lr_scale(shape, scale_mode) * extra_scale


def scaled_orthogonal_update(
    stacked: torch.Tensor,
    *,
    ns_steps: int,
    coefficients,
    method: str = "auto",
    scale_mode: str = "spectral",
    extra_scale: float = 1.0,
    eps: float = 1e-7,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """orthogonal_update(stacked) · update_scale(shape): the materialized update before the learning rate.

    The optimizers fold the scale into `apply_updates_`'s alpha instead (one pass less over memory); this form is
    for callers that need the update itself.
    """
    ortho = orthogonal_update(
        stacked, ns_steps=ns_steps, coefficients=coefficients, method=method, eps=eps, compute_dtype=compute_dtype
    )
    return ortho.mul_(update_scale(stacked.shape, scale_mode, extra_scale))


def apply_updates_(targets: list[torch.Tensor], updates: list[torch.Tensor], *, lr: float, scale: float) -> None:
    """targets ← targets - lr·scale·updates (targets may be strided views into parameters).

    Updates in a narrower dtype (the fp16 NS result) are added per tensor with in-place type promotion, which
    computes in the target's precision exactly as a widened copy would, without materializing that copy.
    """
    if not targets:
        return
    if all(u.dtype == t.dtype for t, u in zip(targets, updates)):
        torch._foreach_add_(targets, updates, alpha=-lr * scale)
        return
    for target, update in zip(targets, updates):
        target.add_(update, alpha=-lr * scale)


# ---- fused projections: rows of a weight hold several matrices (QKV per query group, GDN in_proj sections) ----


def check_sections(rows: int, sections: Sequence[int], what: str = "parameter") -> int:
    """Number of interleaved repeats of `sections` in `rows`; raises when the rows do not divide."""
    total = sum(int(s) for s in sections)
    if total <= 0 or any(int(s) <= 0 for s in sections):
        raise ValueError(f"split sections of {what} must be positive row counts, got {list(sections)}")
    if rows % total != 0:
        raise ValueError(
            f"{what} has {rows} rows, not a multiple of its split sections {list(sections)} (sum {total}); "
            "fix qkv_split_shapes / the split sections, or turn fused splitting off (split_fused=False)"
        )
    return rows // total


def fused_part_views(matrix: torch.Tensor, sections: Sequence[int]) -> list[torch.Tensor]:
    """Views [..., groups, section, cols] of each part of a fused [..., rows, cols] weight.

    rows = groups·sum(sections), laid out group-major (megatron's QKV: per query group q, k, v; GDN in_proj:
    one group of q, k, v, z, beta, alpha). Views alias `matrix`, so they also serve as update targets.
    """
    rows, cols = matrix.shape[-2], matrix.shape[-1]
    groups = check_sections(rows, sections)
    grouped = matrix.reshape(*matrix.shape[:-2], groups, sum(sections), cols)
    return list(torch.split(grouped, [int(s) for s in sections], dim=-2))


def split_fused(matrix: torch.Tensor, sections: Sequence[int]) -> list[torch.Tensor]:
    """Each part of a fused [..., rows, cols] weight as a [..., groups·section, cols] matrix (copies if groups>1)."""
    return [part.reshape(*part.shape[:-3], -1, part.shape[-1]) for part in fused_part_views(matrix, sections)]


def merge_fused(parts: Sequence[torch.Tensor], sections: Sequence[int]) -> torch.Tensor:
    """Inverse of `split_fused`: reassemble the group-major [..., rows, cols] weight from its parts."""
    groups = check_sections(sum(p.shape[-2] for p in parts), sections)
    grouped = [p.reshape(*p.shape[:-2], groups, int(s), p.shape[-1]) for p, s in zip(parts, sections)]
    merged = torch.cat(grouped, dim=-2)
    return merged.reshape(*merged.shape[:-3], -1, merged.shape[-1])


def orthogonalize_fused(matrix: torch.Tensor, sections: Sequence[int], **orthogonal_update_kwargs) -> torch.Tensor:
    """Reference for the fused path: split, orthogonalize each part on its own, reassemble."""
    parts = [orthogonal_update(p, **orthogonal_update_kwargs) for p in split_fused(matrix, sections)]
    return merge_fused(parts, sections)


def first_non_finite(tensors: list[torch.Tensor]) -> int | None:
    """Index of the first tensor holding a NaN or Inf (one host sync for all of them), or None."""
    if not tensors:
        return None
    finite = torch.isfinite(torch.stack([n.float() for n in torch._foreach_norm(tensors, float("inf"))]))
    return None if bool(finite.all()) else int((~finite).nonzero()[0])
