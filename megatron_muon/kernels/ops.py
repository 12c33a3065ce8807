"""The tiny op interface the NS algorithms are written against, and the plain-torch backend.

Two products cover every NS variant, and one pass prepares its input:
- `sym_mm(A, B, C, alpha, beta) = alpha·A·Bᵀ + beta·C` when the result is known to be symmetric (X·Xᵀ, and
  products of commuting symmetric matrices such as R·R, Q·Z). A fast backend computes only the lower triangle.
- `mm(A, X, C, alpha, beta) = alpha·A·X + beta·C`, a general batched product.
- `scaled_copy(X, norm, out)`: out = X / norm per batch element, in out's dtype and layout, zero-padded.
All operands are batched `[b, rows, cols]`. Backends are interchangeable: the algorithms never look inside.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def sm_count(device_index: int | None) -> int:
    """The device's streaming multiprocessors: the kernel backends launch one persistent program per SM."""
    return torch.cuda.get_device_properties(device_index or 0).multi_processor_count


class TorchOps:
    """cuBLAS / CPU BLAS via baddbmm: the portable backend and the baseline the Triton one is tested against."""

    name = "torch"

    @staticmethod
    def sym_mm(A, B, C=None, alpha: float = 1.0, beta: float = 0.0) -> torch.Tensor:
        if C is None or beta == 0.0:
            out = torch.bmm(A, B.mT)
            return out if alpha == 1.0 else out.mul_(alpha)
        return torch.baddbmm(C, A, B.mT, beta=beta, alpha=alpha)

    @staticmethod
    def mm(A, X, C=None, alpha: float = 1.0, beta: float = 0.0) -> torch.Tensor:
        if C is None or beta == 0.0:
            out = torch.bmm(A, X)
            return out if alpha == 1.0 else out.mul_(alpha)
        return torch.baddbmm(C, A, X, beta=beta, alpha=alpha)

    @staticmethod
    def scaled_copy(X, norm, out) -> torch.Tensor:
        """out[..., :n] = X / norm in out's dtype, out[..., n:] = 0 (NS's normalized, padded input)."""
        n = X.size(-1)
        torch.div(X, norm, out=out[..., :n])
        if out.size(-1) > n:
            out[..., n:].zero_()
        return out
