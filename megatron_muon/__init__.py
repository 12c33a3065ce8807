"""megatron_muon: fast Muon and compile-friendly Gated DeltaNet hybrids for Megatron-Core.

`register()` is the one entry point that wires the plugin into megatron-core; everything else is importable
on its own (the optimizer and kernels do not need megatron at all).
"""

import sys

__version__ = "0.1.0"

if sys.version_info < (3, 12):  # pragma: no cover - exercised by the version test in a subprocess
    raise ImportError(
        f"megatron_muon needs Python >= 3.12 (megatron-core 0.19 does too); this is Python "
        f"{sys.version_info.major}.{sys.version_info.minor}. Install Python 3.12 and reinstall with "
        f"`python3.12 -m pip install megatron-muon`."
    )

from megatron_muon.patches import installed_patches  # noqa: E402
from megatron_muon.version_check import SUPPORTED_MEGATRON_CORE, check_megatron_core  # noqa: E402

_registered = False


def register() -> None:
    """Register the plugin into megatron-core (idempotent).

    Checks the installed megatron-core version first so an unsupported install fails with one clear sentence
    instead of an AttributeError deep inside megatron.
    """
    global _registered
    if _registered:
        return
    check_megatron_core()
    from megatron_muon.megatron import register_into_megatron

    register_into_megatron()
    _registered = True


__all__ = ["__version__", "register", "installed_patches", "check_megatron_core", "SUPPORTED_MEGATRON_CORE"]
