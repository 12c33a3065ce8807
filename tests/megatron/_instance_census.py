"""Run under TRITON_INTERPRET=1 in a subprocess: which methods of megatron's objects the fast paths shadow.

A bf16 tiny GPT with megatron's DDP and its mixed-precision optimizer (AdamW, our Muon, then our Muon with the
distributed optimizer: the owner engine) gets every fast path
(`install_fast_paths`, and the gradient add and overwrite that it installs only on GPUs), then trains two steps.
Every attribute set on megatron's wrapper, DDP, bucket-group and buffer objects meanwhile is seen by a spy on their
classes' `__setattr__`, so replacements made only inside a step count too. Prints JSON: what was shadowed
(module.Class.method of the class that defines it), what `installed_patches()` listed after installing, and
"interpreter ok".
"""

import datetime
import inspect
import json
import os

import torch

from tests.interpreter import patch_for_numpy_2_5

patch_for_numpy_2_5()

from megatron_muon.testing.pool import free_port  # noqa: E402


def _defining_class(cls: type, name: str) -> str | None:
    for base in cls.__mro__:
        if name in vars(base) and callable(vars(base)[name]):
            return f"{base.__module__}.{base.__qualname__}.{name}"
    return None


def _spy_on(classes, seen: set):
    """Record (defining class).name for every callable set on instances of `classes` that shadows a method."""
    from megatron_muon.patches import _is_ours

    originals = {}
    for cls in classes:
        originals[cls] = vars(cls).get("__setattr__")
        setter = cls.__setattr__

        def spy(obj, name, value, _setter=setter, _cls=cls):
            if callable(value) and _is_ours(value) and not inspect.isclass(value):
                target = _defining_class(type(obj), name)
                if target is not None:
                    seen.add(target)
            _setter(obj, name, value)

        cls.__setattr__ = spy
    return originals


def _unspy(originals):
    for cls, original in originals.items():
        if original is None:
            del cls.__setattr__
        else:
            cls.__setattr__ = original


def _census(optimizer_name: str) -> dict:
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup, _ParamAndGradBuffer
    from megatron.core.optimizer.optimizer import ChainedOptimizer, Float16OptimizerWithFloat16Params

    from megatron_muon.megatron.fast_paths import install_fast_paths
    from megatron_muon.megatron.main_grad_add import install_first_grad_overwrite, install_main_grad_add
    from megatron_muon.patches import installed_patches
    from megatron_muon.testing.parallel import destroy_model_parallel, init_model_parallel
    from megatron_muon.testing.training import build_training_setup, train_step

    destroy_model_parallel()
    init_model_parallel(1, 1)
    torch.manual_seed(0)
    owner = optimizer_name == "dist_muon"  # the owner engine: muon with the distributed optimizer
    model, optimizer = build_training_setup(optimizer_name, bf16=True, lr=1e-2, clip_grad=0.05,
                                            ddp_overrides={"overlap_grad_reduce": True, "bucket_size": 6000}
                                            if owner else None)
    seen: set = set()
    originals = _spy_on([Float16OptimizerWithFloat16Params, ChainedOptimizer, DistributedDataParallel,
                         _ParamAndGradBucketGroup, _ParamAndGradBuffer], seen)
    try:
        installed = install_fast_paths(optimizer, [model])
        hooked = install_main_grad_add(model)  # install_fast_paths takes GPU chunks only; the hooks work on CPU
        # as install_fast_paths does on GPUs: the owner engine leaves DDP's zeroing and bucket syncs as they are
        overwrites = 0 if owner else install_first_grad_overwrite(model)
        listed = [target for target, _ in installed_patches()]
        losses = [float(train_step(model, optimizer, step)) for step in range(2)]
    finally:
        _unspy(originals)
    assert all(torch.isfinite(torch.tensor(losses))), losses
    return {"installed": installed, "hooked": hooked, "overwrites": overwrites, "shadowed": sorted(seen),
            "listed_after_install": listed, "optimizer": type(optimizer).__name__}


def main():
    import megatron_muon
    from megatron_muon._cpu import enable_cpu_mode

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    torch.distributed.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))
    enable_cpu_mode(nan_empty=True)
    megatron_muon.register()
    report = {name: _census(name) for name in ("adam", "muon", "dist_muon")}
    print(json.dumps(report))
    print("interpreter ok")


if __name__ == "__main__":
    main()
