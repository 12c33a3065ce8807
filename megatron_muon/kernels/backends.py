"""Which op backend (`ops.TorchOps` or the Triton `symmetric.TritonOps`) a Newton–Schulz call runs on.

Kept apart from `ops.py` so the kernels import the interface and the interface never imports the kernels.
"""

from __future__ import annotations


import torch

from megatron_muon.kernels.ops import TorchOps
from megatron_muon.kernels.triton_math import INTERPRETING


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
    if backend == "triton" and device.type != "cuda" and not INTERPRETING:
        raise ValueError(
            "backend='triton' needs a CUDA tensor (or TRITON_INTERPRET=1 for CPU debugging); use backend='torch'"
        )
    from megatron_muon.kernels.symmetric import TritonOps

    return TritonOps

