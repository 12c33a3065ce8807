"""What the Hopper kernels written in Gluon share: the import of Triton's experimental Gluon API (from the version
they are written against) and a switch per kernel that turns it off, with one warning, when this Triton's Gluon
front end rejects it. Gluon's API can change between Triton releases; callers then fall back to Triton kernels.
"""

from __future__ import annotations

import functools
import warnings

import torch
from packaging.version import Version

try:
    import triton
except ImportError:  # the GDN ops import this module and must still work (on their torch backend) without Triton
    triton = None

# The Gluon API the kernels are written against (list-form `warp_specialize`, `warpgroup_mma_wait(deps=...)`)
FIRST_TRITON = Version("3.6")
# What a Gluon front end that does not match a kernel raises while compiling it (before anything runs)
FRONTEND_ERRORS = (TypeError, AttributeError, NotImplementedError) + ((triton.CompilationError, ) if triton else ())

gluon = gl = fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = TensorDescriptor = None
if triton is not None and Version(triton.__version__).release >= FIRST_TRITON.release:
    try:
        from triton.experimental import gluon
        from triton.experimental.gluon import language as gl
        from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                      warpgroup_mma, warpgroup_mma_wait)
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    except ImportError:  # a build without Gluon: every caller keeps its Triton kernel
        gluon = None


SM90_SHARED_MEMORY_PER_BLOCK = 227 * 1024  # bytes one block may use on an H100 / H200 (the kernels' tile budgets)


@functools.cache
def is_hopper(device_index: int) -> bool:
    """sm90 exactly: the kernels use wgmma."""
    return torch.cuda.get_device_capability(device_index) == (9, 0)


class KernelSwitch:
    """On while Gluon is importable, until `disable` records why a compile failed (then off for the process)."""

    def __init__(self, kernel: str):
        self.kernel = kernel
        self.why: list[str] = []

    def available(self) -> bool:
        return gluon is not None and not self.why

    def disable(self, error: Exception) -> None:
        if not self.why:
            self.why.append(f"{type(error).__name__}: {error}")
            warnings.warn(f"the {self.kernel} failed to compile with Triton {getattr(triton, '__version__', '?')} "
                          f"({self.why[0][:300]}); using the Triton kernel instead", stacklevel=3)
