"""The autotuners' choices as a file: written after a run, pinned before the next one's first call.

A cold start compiles and times every config of every autotuned Triton kernel (FLA's GDN kernels, ours) for every
shape key before the first step can finish; Triton's cache keeps the compiled binaries and, where a kernel asks for
it, the choices, but only on the machine that made them. A table of the choices (kernel, key, config) lets another
process (a restarted job, another node) pin each key's winner into the autotuner's own cache, so that a cold start
compiles one config per key and times none. A choice is only ever pinned to a config of the kernel's own list (a
stale entry is skipped) and only on the GPU model, Triton version and FLA version that made it.

Tables of the reference recipes measured on the reference GPUs come with the package (`shipped_tables`), so that a
first run there also starts without timing every config.
"""

from __future__ import annotations

import importlib
import json
import logging
import sys
from pathlib import Path

FORMAT = 1
# modules whose autotuned kernels the table covers: ours and FLA's
MODULE_PREFIXES = ("megatron_muon.", "fla.")
# packages whose kernels' config lists and keys a table depends on, beside Triton's
KERNEL_PACKAGES = ("fla-core",)
SHIPPED_DIR = Path(__file__).with_name("autotune_tables")

_logger = logging.getLogger(__name__)


def _autotuner_inside(obj):
    """The triton Autotuner that `obj` is or wraps (heuristics(autotune(jit)) and the like), else None."""
    from triton.runtime.autotuner import Autotuner

    for _ in range(4):
        if isinstance(obj, Autotuner):
            return obj
        obj = getattr(obj, "fn", None)
        if obj is None:
            return None
    return None


def autotuners(prefixes: tuple[str, ...] | None = None) -> dict[str, object]:
    """'module:attribute' -> Autotuner for every autotuned kernel in the loaded modules whose names start with one
    of `prefixes`, named where its function is defined (one name however many modules import it)."""
    found, prefixes = {}, prefixes or MODULE_PREFIXES
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith(prefixes):
            continue
        for attribute, value in list(vars(module).items()):
            tuner = _autotuner_inside(value)
            if tuner is not None and tuner.base_fn.__module__ == module_name:
                found.setdefault(f"{module_name}:{attribute}", tuner)
    return found


def _config_fields(config) -> dict:
    return {k: v for k, v in config.all_kwargs().items() if k != "ir_override"}


def _device_and_triton(device_name: str | None) -> tuple[str, str]:
    import torch
    import triton

    if device_name is None:
        device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return device_name, triton.__version__


def _package_versions(names) -> dict[str, str | None]:
    from importlib import metadata

    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def shipped_tables() -> list[Path]:
    """The tables that come with the package; `pin` uses each only where it was made."""
    return sorted(SHIPPED_DIR.glob("*.json"))


def _plain(key: tuple) -> bool:
    return all(isinstance(part, (int, float, str, bool)) or part is None for part in key)


def record(device_name: str | None = None, prefixes: tuple[str, ...] | None = None) -> dict:
    """The choices every loaded autotuner has made so far in this process (keys of plain values: ints, strings)."""
    device, triton_version = _device_and_triton(device_name)
    kernels = {}
    for name, tuner in sorted(autotuners(prefixes).items()):
        entries = [{"key": list(key), "config": _config_fields(config)} for key, config in tuner.cache.items()
                   if _plain(key)]
        if entries:
            kernels[name] = entries
    return {"format": FORMAT, "device": device, "triton": triton_version,
            "packages": _package_versions(KERNEL_PACKAGES), "kernels": kernels}


def merge(tables: list[dict]) -> dict:
    """One table holding every (kernel, key) choice of `tables` (each rank's, say: pipeline stages run different
    kernels); where two hold the same key, the first one's choice; tables of another GPU model or Triton version
    than the first are left out (a table describes one)."""
    merged = {**tables[0], "kernels": {}}
    for table in tables:
        if (table["device"], table["triton"]) != (merged["device"], merged["triton"]):
            continue
        for name, entries in table["kernels"].items():
            known = merged["kernels"].setdefault(name, [])
            keys = {json.dumps(entry["key"]) for entry in known}
            known.extend(entry for entry in entries if json.dumps(entry["key"]) not in keys)
    return merged


def write(path: str | Path, table: dict | None = None, device_name: str | None = None,
          prefixes: tuple[str, ...] | None = None) -> int:
    """Write `table` (default: this process's choices) to `path` as JSON; returns how many choices it holds."""
    table = table if table is not None else record(device_name, prefixes)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    return sum(len(entries) for entries in table["kernels"].values())


def pin(table: dict | str | Path, device_name: str | None = None) -> dict[str, int]:
    """Put each choice of `table` (a dict, or the path of a written one) into its autotuner's cache, importing the
    kernel's module where needed. Returns counts: 'pinned', 'stale' (kernel gone or config no longer in its list)
    and 'other_machine' (every entry, when the table was made on another GPU model or with another Triton, or
    another version of a package in its `packages`)."""
    if not isinstance(table, dict):
        table = json.loads(Path(table).read_text())
    if table.get("format") != FORMAT:
        raise ValueError(f"autotune table format {table.get('format')!r}, expected {FORMAT}: write it again with "
                         "this version (megatron_muon.kernels.autotune_table.write)")
    total = sum(len(entries) for entries in table["kernels"].values())
    counts = {"pinned": 0, "stale": 0, "other_machine": 0}
    here = _device_and_triton(device_name)
    packages = table.get("packages", {})
    if (table["device"], table["triton"]) != here or _package_versions(packages) != packages:
        counts["other_machine"] = total
        _logger.info("autotune table from %s / Triton %s / %s not used here (%s / Triton %s)", table["device"],
                     table["triton"], packages, *here)
        return counts
    for name, entries in table["kernels"].items():
        tuner = _find(name)
        by_fields = {} if tuner is None else {json.dumps(_config_fields(c), sort_keys=True): c for c in tuner.configs}
        for entry in entries:
            config = by_fields.get(json.dumps(entry["config"], sort_keys=True))
            if config is None:
                counts["stale"] += 1
                continue
            tuner.cache[tuple(entry["key"])] = config
            counts["pinned"] += 1
    return counts


def _find(name: str):
    module_name, attribute = name.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    return _autotuner_inside(getattr(module, attribute, None))
