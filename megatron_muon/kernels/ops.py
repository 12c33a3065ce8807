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


def triton_supported(device: torch.device) -> bool:
    """The Triton symmetric kernels are tuned and tested on sm80 (A100) and sm90 (H100/H200) only."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability(device)[0] in (8, 9)


BACKENDS = ("auto", "torch", "triton")


def select_ops(device: torch.device, backend: str = "auto"):
    """Pick the op backend: Triton on supported GPUs for 'auto', torch everywhere else."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid: {BACKENDS}")
    if backend == "torch" or (backend == "auto" and not triton_supported(device)):
        return TorchOps
    if backend == "triton" and device.type != "cuda" and not _interpreting():
        raise ValueError(
            "backend='triton' needs a CUDA tensor (or TRITON_INTERPRET=1 for CPU debugging); use backend='torch'"
        )
    from megatron_muon.kernels.symmetric import TritonOps

    return TritonOps


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"
