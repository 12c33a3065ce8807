"""Every megatron-core or torch name the plugin replaces, with why, in one list.

`import megatron_muon` replaces nothing. `register()` replaces the `register` entries; the GPU fast paths
(`megatron/fast_paths.install_fast_paths`, which the training CLI and the launcher call on the optimizers they
build) the `fast_paths` ones; `python -m megatron_muon.launch` (Megatron-LM scripts) adds the `launch` entries; CPU
mode (`--cpu-mode`, the tiny CPU job and the CPU tests) the `cpu_mode` ones. Entries marked `per_instance` replace a
method on individual objects megatron built (its mixed-precision wrappers, DDP and its buckets), never on the class,
and only through `replace_method`, which refuses an undeclared one. `installed_patches()` reports those in effect in
this process: a declared target whose current value (for a per-instance entry: on some live object) is the
plugin's. Megatron objects the plugin builds itself (its optimizers, layouts, specs) are classes megatron calls, not
replacements, and are not listed.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import weakref
from typing import NamedTuple

from megatron_muon.megatron.viewless import COMPILED_CALLERS


class Patch(NamedTuple):
    target: str  # dotted module path, then attributes; a trailing ['key'] names a registry entry
    reason: str
    installer: str  # "register" | "fast_paths" | "launch" | "cpu_mode"
    per_instance: bool = False  # a method shadowed on megatron's objects (module.Class.method), not replaced


_NORM = "without TE or Apex, megatron's fallback copies every per-tensor norm to the host; ours stays on the device"
_SCALE = "without TE or Apex, megatron scales and copies one tensor at a time; ours is one multi-tensor pass"
_TENSOR_SCALE = "without TE, megatron reads the clip factor on the host (a sync per step); ours keeps it on the device"
_CPU = "CPU mode: megatron-core calls CUDA unconditionally; on a machine without a GPU this makes the call a no-op"
_MIXED_PRECISION = "megatron.core.optimizer.optimizer.MixedPrecisionOptimizer"  # Float16OptimizerWithFloat16Params's
_BUFFERS = "megatron.core.distributed.param_and_grad_buffer"
_OVERWRITE = ("each step's first gradient overwrites DDP's fp32 gradient buffers (fast_paths.install_first_grad_"
              "overwrite), so they are not zeroed: ")

PATCHES: tuple[Patch, ...] = (
    Patch("megatron.core.optimizer.emerging_optimizers._EMERGING_OPTIMIZERS['muon']",
          "`--optimizer muon` builds this plugin's Muon (megatron's stays as 'mcore_muon')", "register"),
    Patch("megatron.core.optimizer._get_megatron_emerging_optimizer",
          "routes 'muon' with a distributed optimizer to the owner engine, fp16 to loss scaling; other names unchanged",
          "register"),
    *(Patch(f"{module}.make_viewless_tensor", "inside torch.compile'd layers megatron's viewless copy (a `.data` "
            "assignment) breaks the graph and crashes Inductor where a layer ends in a view (Transformer Engine's "
            "linears); there it returns the tensor itself, elsewhere megatron's function runs", "register")
      for module in COMPILED_CALLERS),
    Patch("megatron.core.optimizer.clip_grads.l2_norm_impl", _NORM, "register"),
    Patch("megatron.core.optimizer.clip_grads.multi_tensor_scale_impl", _SCALE, "register"),
    Patch("megatron.core.optimizer.optimizer.multi_tensor_scale_impl", _SCALE, "register"),
    Patch("megatron.core.optimizer.clip_grads.multi_tensor_scale_tensor_impl", _TENSOR_SCALE, "register"),
    *(Patch(f"megatron.core.optimizer.{module}.clip_grad_by_total_norm_fp32",
            "the clip factor stays pending for an optimizer that applies it inside its own pass (one-pass AdamW, "
            "Muon's momentum) instead of a multiply over every gradient; any other caller clips as megatron does",
            "fast_paths") for module in ("clip_grads", "optimizer")),
    Patch(f"{_MIXED_PRECISION}.step_with_ready_grads", "the one-pass AdamW (clip factor, update and bf16 model copy in "
          "one pass) or our Muon writing the model copies replaces megatron's separate passes; megatron's step where "
          "the pass declines", "fast_paths", per_instance=True),
    Patch(f"{_MIXED_PRECISION}.prepare_grads", "a clip factor left pending by a skipped step is dropped before the next "
          "step's gradients are prepared", "fast_paths", per_instance=True),
    Patch("megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params._copy_main_params_to_model_params", "no copy for a step whose model copies our Muon's "
          "update pass already wrote (shadowed inside that step only)", "fast_paths", per_instance=True),
    *(Patch(f"{_BUFFERS}._ParamAndGradBucketGroup.{name}", _OVERWRITE + "the group's parameters without a gradient "
            "are zeroed before its reduction", "fast_paths", per_instance=True)
      for name in ("start_grad_sync", "finish_grad_sync")),
    Patch("megatron.core.distributed.distributed_data_parallel.DistributedDataParallel.zero_grad_buffer",
          _OVERWRITE + "the buffers keep last step's values until then", "fast_paths", per_instance=True),
    Patch(f"{_BUFFERS}._ParamAndGradBuffer.reset", _OVERWRITE + "megatron's reset would zero them (shadowed while "
          "zero_grad_buffer runs only)", "fast_paths", per_instance=True),
    Patch("megatron.core.optimizer.layer_wise_optimizer.LayerWiseDistributedOptimizer.compute_full_param_layout",
          "Megatron-LM wraps DDP through it for `--optimizer muon --use-distributed-optimizer`: the owner layout",
          "launch"),
    Patch("megatron.training.models.dist_utils._ddp_wrap",
          "Megatron-LM's config-container model builder (pretrain_gpt.py's path) lacks the layer-wise DDP wiring its "
          "get_model path has; for `--optimizer muon --use-distributed-optimizer` it now runs megatron's own "
          "wrap_model_chunks_with_ddp (the owner layout), everything else megatron's _ddp_wrap", "launch"),
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


_shadowed: dict[str, weakref.WeakSet] = {}  # per-instance target -> the objects it was installed on


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@functools.cache
def _per_instance_target(cls: type, name: str) -> str | None:
    """The declared per-instance target for `name` on instances of `cls` (some patches are set on every step)."""
    declared = {p.target for p in PATCHES if p.per_instance}
    return next((f"{_class_path(base)}.{name}" for base in cls.__mro__
                 if f"{_class_path(base)}.{name}" in declared), None)


def replace_method(obj, name: str, replacement) -> None:
    """Shadow method `name` on one megatron object with `replacement`, as a declared per-instance patch of a class
    in its MRO; `del obj.<name>` undoes it."""
    target = _per_instance_target(type(obj), name)
    assert target is not None, f"{_class_path(type(obj))}.{name} is not declared in megatron_muon.patches.PATCHES"
    setattr(obj, name, replacement)
    _shadowed.setdefault(target, weakref.WeakSet()).add(obj)


def _in_effect(patch: Patch) -> bool:
    if patch.per_instance:
        name = patch.target.rsplit(".", 1)[1]
        return any(_is_ours(vars(obj).get(name)) for obj in list(_shadowed.get(patch.target, ())))
    try:
        value = resolve(patch.target, import_modules=False)
    except (ImportError, AttributeError, KeyError):
        return False
    return _is_ours(value)


def installed_patches() -> list[tuple[str, str]]:
    """(dotted target, reason) of every declared replacement in effect in this process."""
    return [(patch.target, patch.reason) for patch in PATCHES if _in_effect(patch)]
