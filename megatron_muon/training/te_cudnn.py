"""Transformer Engine and torch must run one cuDNN.

TE loads cuDNN itself before its core library: from `CUDNN_HOME`/`CUDNN_PATH`/`CUDA_HOME` first, then by the bare
name `libcudnn.so`, which the loader resolves to a system copy when one is installed (torch's wheel ships only
`libcudnn.so.9`). cuDNN then opens its sub-libraries by name, through `LD_LIBRARY_PATH` before the system's. So a
system cuDNN older than torch's makes either torch refuse its cuDNN (TE imported first) or TE report the old version
and turn off its fused attention, whose unfused fallback runs out of memory at long context. Pointing both variables
at torch's copy, before Python starts, makes every load the same library.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch


def transformer_engine_usable() -> bool:
    """Whether TE's PyTorch modules import here (installed, with the CUDA libraries they load)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - absent, or present without its libraries: either way unusable here
        return False
    return True


def transformer_engine_compile_disabled() -> str | None:
    """TE's own reason why its modules run eager under torch.compile (each call a graph break), or None when its
    compiled path is on (or TE is not usable here). TE 2.20 needs torch's opaque constant types for that path, which
    torch 2.11 lacks."""
    if not transformer_engine_usable():
        return None
    import transformer_engine.pytorch.dynamo.custom_op  # noqa: F401 - registering its ops records the reason
    from transformer_engine.pytorch import utils

    return getattr(utils, "_compile_disabled_reason", None)


def torch_cudnn_dir() -> Path | None:
    """The `nvidia/cudnn` folder of the wheel torch loads its cuDNN from, or None (a system or source build)."""
    spec = importlib.util.find_spec("nvidia.cudnn")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations)))
    return folder if (folder / "lib").is_dir() else None


def loader_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The variables to export before starting Python so that TE and cuDNN load torch's cuDNN ({} when torch's
    cuDNN is not from a wheel: then there is one copy to find)."""
    environ = os.environ if environ is None else environ
    folder = torch_cudnn_dir()
    if folder is None:
        return {}
    lib = str(folder / "lib")
    paths = [p for p in environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    return {"CUDNN_HOME": str(folder), "LD_LIBRARY_PATH": os.pathsep.join([lib, *[p for p in paths if p != lib]])}


def cudnn_versions() -> tuple[tuple[int, int], tuple[int, int] | None]:
    """(torch's cuDNN, TE's cuDNN or None when TE is not importable), as (major, minor)."""
    encoded = torch.backends.cudnn.version() or 0
    torch_version = (encoded // 10000, encoded // 100 % 100) if encoded >= 9000 else (encoded // 1000, encoded // 100 % 10)
    try:
        from transformer_engine.pytorch.utils import get_cudnn_version
    except ImportError:
        return torch_version, None
    major, minor, _ = get_cudnn_version()
    return torch_version, (major, minor)


def check_same_cudnn() -> None:
    """Raise, naming the fix, when TE loaded a different cuDNN than torch (only meaningful with a GPU)."""
    torch_version, te_version = cudnn_versions()
    if te_version is None or te_version == torch_version:
        return
    exports = " ".join(f"{key}={value}" for key, value in loader_environment().items())
    fix = f"start Python after `export {exports}`" if exports else "point CUDNN_HOME and LD_LIBRARY_PATH at one cuDNN"
    raise RuntimeError(
        f"Transformer Engine loaded cuDNN {te_version[0]}.{te_version[1]} but torch runs "
        f"{torch_version[0]}.{torch_version[1]}, so TE turns off its fused attention: {fix} "
        "(`python -m megatron_muon.training.te_cudnn` prints the line for this machine)"
    )


def main() -> None:
    """Print the export line for this machine, then check the versions (python -m megatron_muon.training.te_cudnn)."""
    for key, value in loader_environment().items():
        print(f"export {key}={value}")
    torch_version, te_version = cudnn_versions()
    print(f"# cuDNN: torch {torch_version}, Transformer Engine {te_version}")
    if torch.cuda.is_available():
        check_same_cudnn()


if __name__ == "__main__":
    main()
