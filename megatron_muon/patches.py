"""Every megatron-core or torch name the plugin replaces, with why, in one list.

`import megatron_muon` replaces nothing. `register()` replaces the `register` entries; the GPU fast paths
(`megatron/fast_paths.install_fast_paths`, which the training CLI and the launcher call on the optimizers they
build) the `fast_paths` ones; `python -m megatron_muon.launch` (Megatron-LM scripts) adds the `launch` entries; CPU
mode (`--cpu-mode`, the tiny CPU job and the CPU tests) the `cpu_mode` ones. `installed_patches()` reports those in
effect in this process: a declared target whose current value is the plugin's. Megatron objects the plugin builds
itself (its optimizers, layouts, specs) are classes megatron calls, not replacements, and are not listed.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import NamedTuple


class Patch(NamedTuple):
    target: str  # dotted module path, then attributes; a trailing ['key'] names a registry entry
    reason: str
    installer: str  # "register" | "fast_paths" | "launch" | "cpu_mode"


_NORM = "without TE or Apex, megatron's fallback copies every per-tensor norm to the host; ours stays on the device"
_SCALE = "without TE or Apex, megatron scales and copies one tensor at a time; ours is one multi-tensor pass"
_TENSOR_SCALE = "without TE, megatron reads the clip factor on the host (a sync per step); ours keeps it on the device"
_CPU = "CPU mode: megatron-core calls CUDA unconditionally; on a machine without a GPU this makes the call a no-op"

PATCHES: tuple[Patch, ...] = (
    Patch("megatron.core.optimizer.emerging_optimizers._EMERGING_OPTIMIZERS['muon']",
          "`--optimizer muon` builds this plugin's Muon (megatron's stays as 'mcore_muon')", "register"),
    Patch("megatron.core.optimizer._get_megatron_emerging_optimizer",
          "routes 'muon' with a distributed optimizer to the owner engine, fp16 to loss scaling; other names unchanged",
          "register"),
    Patch("megatron.core.optimizer.clip_grads.l2_norm_impl", _NORM, "register"),
    Patch("megatron.core.optimizer.clip_grads.multi_tensor_scale_impl", _SCALE, "register"),
    Patch("megatron.core.optimizer.optimizer.multi_tensor_scale_impl", _SCALE, "register"),
    Patch("megatron.core.optimizer.clip_grads.multi_tensor_scale_tensor_impl", _TENSOR_SCALE, "register"),
    *(Patch(f"megatron.core.optimizer.{module}.clip_grad_by_total_norm_fp32",
            "the clip factor stays pending for an optimizer that applies it inside its own pass (one-pass AdamW, "
            "Muon's momentum) instead of a multiply over every gradient; any other caller clips as megatron does",
            "fast_paths") for module in ("clip_grads", "optimizer")),
    Patch("megatron.core.optimizer.layer_wise_optimizer.LayerWiseDistributedOptimizer.compute_full_param_layout",
          "Megatron-LM wraps DDP through it for `--optimizer muon --use-distributed-optimizer`: the owner layout",
          "launch"),
    Patch("megatron.core.optimizer.get_megatron_optimizer",
          "every optimizer a Megatron-LM script builds gets the plugin's GPU fast paths (`--no-fast-paths` keeps it)",
          "launch"),
    Patch("megatron.training.training.get_megatron_optimizer", "the same name as Megatron-LM's training loop holds it",
          "launch"),
    Patch("megatron.core.datasets.utils.compile_helpers",
          "the wheel ships the dataset helpers compiled but not their Makefile, which Megatron-LM runs", "launch"),
    *(Patch(f"torch.cuda.{name}", _CPU, "cpu_mode") for name in (
        "current_device", "set_device", "synchronize", "current_stream", "default_stream", "Stream", "Event",
        "stream", "device", "empty_cache", "memory_allocated", "max_memory_allocated", "memory_reserved",
        "reset_peak_memory_stats", "nvtx.range_push", "nvtx.range_pop", "manual_seed_all", "manual_seed",
        "get_rng_state", "set_rng_state", "random.get_rng_state", "random.set_rng_state")),
    Patch("torch.nn.modules.module.Module.cuda", _CPU, "cpu_mode"),
    Patch("megatron.core.tensor_parallel.random._set_cuda_rng_state", "CPU mode: megatron's RNG tracker on the CPU "
          "generator", "cpu_mode"),
    Patch("megatron.core.tensor_parallel.random._get_cuda_rng_state", "CPU mode: megatron's RNG tracker on the CPU "
          "generator", "cpu_mode"),
    *(Patch(f"torch.cuda.{name}", "CPU mode for Megatron-LM scripts, which assert a GPU", "launch")
      for name in ("is_available", "device_count", "is_current_stream_capturing")),
    Patch("torch.accelerator.current_device_index", "CPU mode for Megatron-LM scripts (pinned data-loader memory)",
          "launch"),
)


def resolve(target: str, import_modules: bool = True):
    """The object a target names now (KeyError / AttributeError / ImportError when it does not exist); with
    `import_modules=False` only modules already imported count (a patch is only in effect in those)."""
    key = None
    if target.endswith("']"):
        target, key = target[:-2].split("['")
    parts = target.split(".")
    for split in range(len(parts), 0, -1):
        name = ".".join(parts[:split])
        try:
            value = importlib.import_module(name) if import_modules else sys.modules[name]
        except (ImportError, KeyError):
            continue
        for attribute in parts[split:]:
            value = getattr(value, attribute)
        return value if key is None else value[key]
    raise ImportError(f"no module in {target!r}")


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _is_ours(value) -> bool:
    """Defined in this package: by its code's file (wrappers copy megatron's __module__), else by its module."""
    value = getattr(value, "__func__", value)  # staticmethod / classmethod
    value = getattr(value, "optimizer_cls", value)  # a registry entry: what it builds
    code = getattr(value, "__code__", None)
    if code is not None:
        return os.path.abspath(code.co_filename).startswith(_PACKAGE_DIR + os.sep)
    module = getattr(value, "__module__", None) or ""
    return module == "megatron_muon" or module.startswith("megatron_muon.")


def installed_patches() -> list[tuple[str, str]]:
    """(dotted target, reason) of every declared replacement in effect in this process."""
    installed = []
    for patch in PATCHES:
        try:
            value = resolve(patch.target, import_modules=False)
        except (ImportError, AttributeError, KeyError):
            continue
        if _is_ours(value):
            installed.append((patch.target, patch.reason))
    return installed
