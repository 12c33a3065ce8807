"""Triton kernel for NS's input normalization: out[b] = X[b] / norm[b], cast to out's dtype, zero-padded.

Newton–Schulz starts from X / ‖X‖_F in fp16, with the smaller side first and the long side padded to a 64-column
multiple. torch does that as `torch.div(X, norm, out=padded[..., :n])`: the inputs mix dtypes (bf16/fp32 in, fp16
out), so TensorIterator takes its non-vectorized dynamic-cast path, and for a tall matrix X is a transposed view, read
across rows. In the hybrid-1.5B's Muon step on the H200 that pass took several times what moving its bytes needs.
This kernel loads tiles along whichever axis of X is contiguous, converts the layout on chip, stores rows
contiguously and writes the padding zeros in the same pass, near the H200's copy bandwidth
(docs/design/newton_schulz.md). The division is IEEE-rounded; torch's CUDA
division is not always, so the two results rarely differ, by one fp16 step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N = 64, 64
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _scaled_copy_kernel(
    X, norm, out, M, N, N_OUT,
    stride_xb, stride_xm, stride_xn, stride_ob, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n, batch = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)[:, None]
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)[None, :]
    x = tl.load(X + batch * stride_xb + rows * stride_xm + cols * stride_xn, mask=(rows < M) & (cols < N), other=0.0)
    scaled = tl.fdiv(x.to(tl.float32), tl.load(norm + batch), ieee_rounding=True)
    tl.store(out + batch * stride_ob + rows * stride_om + cols * stride_on, scaled.to(out.dtype.element_ty),
             mask=(rows < M) & (cols < N_OUT))


def scaled_copy(X: torch.Tensor, norm: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[b, :, :n] = X[b] / norm[b] in out's dtype and out[b, :, n:] = 0, for X [b, m, n] of any strides,
    norm [b, 1, 1] fp32 and out [b, m, n_out >= n]."""
    batch, m, n = X.shape
    if out.shape[:2] != (batch, m) or out.shape[2] < n:
        raise ValueError(f"out must be [b, m, >= n] for X of shape {tuple(X.shape)}, got {tuple(out.shape)}")
    if norm.numel() != batch or norm.dtype != torch.float32:
        raise ValueError(f"norm must hold one fp32 value per batch element ({batch}), got {tuple(norm.shape)}")
    if out.numel() == 0:
        return out
    n_out = out.shape[2]
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n_out, BLOCK_N), batch)
    _scaled_copy_kernel[grid](
        X, norm.reshape(batch).contiguous(), out, m, n, n_out, *X.stride(), *out.stride(),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=4,
    )  # fmt: skip
    return out

