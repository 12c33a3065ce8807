"""Versions of the packages a benchmark result depends on, written next to every number."""

from __future__ import annotations

from importlib import metadata

import torch

PACKAGES = ("triton", "megatron-core", "fla-core", "tilelang")


def package_versions() -> dict[str, str]:
    found = {"torch": torch.__version__}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    if torch.cuda.is_available():
        found["cudnn"] = str(torch.backends.cudnn.version())
    return found
