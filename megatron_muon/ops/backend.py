"""Which implementation the GDN ops run on CUDA tensors: chosen once at first use, reported, never known-wrong.

- ``fla-triton``: FLA's Triton kernels, where they are correct (not Hopper, or Triton >= 3.7.1).
- ``fla-tilelang``: FLA with its TileLang backward (FLA routes the gated ``chunk_bwd_dqkwg`` to TileLang on Hopper);
  chosen when TileLang is there. On Hopper with Triton 3.4 - 3.7.0, where Triton miscompiles that backward (FLA
  issue #640), ``fla-triton`` is still correct for dense equal-length batches because our own kernel
  (``ops/dqkwg.py``) replaces the miscompiled one where ``dqkwg.qualifies``; packed sequences and other shapes need
  TileLang there, and FLA raises and says so (before any gradient is applied).
- ``torch``: the pure-torch chunked implementation; always used for CPU tensors, on CUDA only when asked for.
Under the FLA backends, FlashQLA (where installed) takes the bf16 K = V = 128 chunk-op calls: ``ops/gdn_flashqla.py``.

``MEGATRON_MUON_GDN_BACKEND`` (auto | fla-triton | fla-tilelang | torch) or ``set_backend`` overrides the automatic
choice; an override that would run a known-wrong kernel raises instead. Forcing ``fla-triton`` where TileLang is
installed also needs ``FLA_TILELANG=0`` in the job's environment (FLA reads it at every call; the plugin writes no
environment), and says so. The choice is a process-wide constant read
inside the ops' kernels, so it never becomes a guard in a compiled graph.
"""

import functools
import logging
import os
from dataclasses import dataclass
from importlib import metadata

import torch
from packaging.version import Version

from megatron_muon.ops.kernel_choice import KERNELS_ENV_VAR, gdn_kernels

BACKENDS = ("fla-triton", "fla-tilelang", "torch")
BACKEND_ENV_VAR = "MEGATRON_MUON_GDN_BACKEND"
_FIXED_TRITON = Version("3.7.1")
_BROKEN_TRITON_FROM = Version("3.4.0")
_FLA_PIN = '"flash-linear-attention>=0.6,<0.7" "fla-core>=0.6,<0.7"'

_logger = logging.getLogger(__name__)
_selected: str | None = None
_requested: str | None = None


@dataclass(frozen=True)
class Hardware:
    """What the backend choice depends on, read once per process."""

    cuda: bool
    capability: tuple[int, int] | None
    device_name: str | None
    triton_version: Version | None

    @property
    def hopper(self) -> bool:
        return self.capability is not None and self.capability[0] == 9

    @property
    def fla_triton_correct(self) -> bool:
        """False exactly where FLA refuses its gated Triton backward (Hopper, 3.4.0 <= Triton < 3.7.1)."""
        if not self.hopper or self.triton_version is None:
            return True
        release = Version(self.triton_version.base_version)
        return not (_BROKEN_TRITON_FROM <= release < _FIXED_TRITON)


@functools.cache
def hardware() -> Hardware:
    """Device capability and Triton version, read once and treated as constants afterwards."""
    if not torch.cuda.is_available():
        return Hardware(False, None, None, None)
    try:
        triton_version = Version(metadata.version("triton"))
    except metadata.PackageNotFoundError:
        triton_version = None
    device = torch.cuda.current_device()
    return Hardware(True, torch.cuda.get_device_capability(device), torch.cuda.get_device_name(device), triton_version)


def set_backend(name: str | None) -> None:
    """Force a backend for this process (``None`` or "auto" = automatic); takes effect at the next op call."""
    global _requested, _selected
    _requested = None if name in (None, "auto") else _validated(name, "set_backend")
    _selected = None


def selected_backend() -> str:
    """The backend CUDA tensors use (chosen now if no op has run yet); "torch" on a machine without CUDA."""
    global _selected
    if _selected is None:
        _selected = _choose(hardware())
        _logger.info("megatron_muon GDN ops: using the %s backend", _selected)
    return _selected


def backend_for(tensor: torch.Tensor) -> str:
    """The backend for an op whose inputs live on ``tensor``'s device."""
    return "torch" if tensor.device.type != "cuda" else selected_backend()


def _validated(name: str, where: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{where}: unknown GDN backend {name!r}; use one of auto, {', '.join(BACKENDS)}.")
    return name


def _choose(hw: Hardware) -> str:
    requested = _requested or os.environ.get(BACKEND_ENV_VAR, "auto").strip().lower() or "auto"
    if requested != "auto":
        _validated(requested, BACKEND_ENV_VAR)
    if requested == "torch":
        return "torch"
    if not hw.cuda:
        if requested != "auto":
            raise ValueError(f"{BACKEND_ENV_VAR}={requested} needs a CUDA GPU; unset it to use the torch backend.")
        return "torch"
    _require_fla(hw)
    tilelang = _fla_will_use_tilelang()
    if requested == "fla-tilelang" or (requested == "auto" and tilelang):
        if not tilelang:
            raise RuntimeError(_tilelang_missing_message(hw))
        return "fla-tilelang"
    if not hw.fla_triton_correct:
        from megatron_muon.ops.dqkwg import COVERAGE

        if gdn_kernels().output_grads != "ours":
            raise RuntimeError(
                f"FLA's Triton GDN backward is known to be wrong on {hw.device_name} (Hopper) with Triton "
                f"{hw.triton_version} (fixed in Triton 3.7.1; FLA issue #640), and the GDN kernel choice "
                f"({KERNELS_ENV_VAR} or model.gdn_kernels: {gdn_kernels()}) keeps it in place of ours. Choose \"ours\" "
                "or \"triton\", or " + _tilelang_missing_message(hw)
            )
        _logger.warning(
            "megatron_muon GDN ops: FLA's Triton backward miscompiles one kernel on %s with Triton %s (FLA issue "
            "#640); ours replaces it for %s. Packed sequences (cu_seqlens) and other shapes still need TileLang "
            "(`pip install tilelang==0.1.15`) or Triton >= 3.7.1; FLA stops them with that message.",
            hw.device_name, hw.triton_version, COVERAGE)
    if tilelang:  # FLA would route the backward to TileLang on its own (it reads FLA_TILELANG at every call)
        raise ValueError(
            "The fla-triton GDN backend was requested, but FLA sends its gated backward to TileLang whenever TileLang is "
            "installed; set FLA_TILELANG=0 in the job's environment as well (FLA reads it itself), or ask for "
            "auto / fla-tilelang."
        )
    return "fla-triton"


def _tilelang_missing_message(hw: Hardware) -> str:
    return (
        "Install TileLang and a CUDA toolkit so FLA can JIT it (`pip install tilelang==0.1.15`, with nvcc on PATH or "
        "CUDA_HOME set), or upgrade to Triton >= 3.7.1; "
        f"or set {BACKEND_ENV_VAR}=torch to run the slow pure-torch GDN on the GPU."
        + ("" if hw.hopper else " (TileLang is only needed on Hopper GPUs.)")
    )


def _require_fla(hw: Hardware) -> None:
    try:
        version = Version(metadata.version("fla-core"))
    except metadata.PackageNotFoundError:
        version = None
    if version is None or not (Version("0.6") <= Version(version.base_version) < Version("0.7")):
        found = "not installed" if version is None else f"version {version}"
        extra = "" if hw.fla_triton_correct else " tilelang==0.1.15"
        raise RuntimeError(
            f"The fast GDN backend needs flash-linear-attention 0.6.x (fla-core is {found}). Install it with "
            f"`pip install {_FLA_PIN}{extra}`, or set {BACKEND_ENV_VAR}=torch to run the slow pure-torch GDN."
        )


def fla_own_backward_refusal() -> str | None:
    """Why FLA's own GDN chunk op (what megatron-core's GatedDeltaNet calls directly, without our kernels) stops in
    its first backward here, or None where it runs: Hopper with 3.4 <= Triton < 3.7.1 and no TileLang."""
    hw = hardware()
    if hw.fla_triton_correct or _fla_will_use_tilelang():
        return None
    return (f"FLA's own gated GDN backward refuses {hw.device_name} with Triton {hw.triton_version} (FLA issue "
            "#640): " + _tilelang_missing_message(hw))


def _fla_will_use_tilelang() -> bool:
    """Whether FLA's own dispatch sends the gated chunk_bwd_dqkwg to TileLang (package + nvcc + FLA's switch)."""
    from fla.ops.common.backends import CommonTileLangBackend

    backend = CommonTileLangBackend()
    return bool(CommonTileLangBackend.is_available() and backend.is_enabled())
