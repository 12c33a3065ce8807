"""Run as a script: which megatron / torch names each step of the plugin's setup replaces, as JSON on stdout.

Steps: `import megatron_muon` (and its packages), `register()`, the fast paths' process-wide part, the launcher's
megatron installs and CPU mode.
After each, every module attribute and class attribute of megatron and torch that is not the object it was before
and now holds one of the plugin's objects is reported, with `installed_patches()` at that point."""

import importlib
import inspect
import json
import sys


def _declared_modules():
    from megatron_muon.patches import PATCHES

    names = set()
    for patch in PATCHES:
        parts = patch.target.split("['")[0].split(".")
        for split in range(len(parts), 0, -1):
            try:
                importlib.import_module(".".join(parts[:split]))
                names.add(".".join(parts[:split]))
                break
            except ImportError:
                continue
    return names


def _snapshot():
    seen = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "torch" or name.startswith(("torch.", "megatron."))):
            continue
        try:
            members = dict(vars(module))
        except TypeError:
            continue
        for attribute, value in members.items():
            seen[f"{name}.{attribute}"] = value
            if inspect.isclass(value) and getattr(value, "__module__", None) == name:
                for class_attribute, member in list(vars(value).items()):
                    seen[f"{name}.{attribute}.{class_attribute}"] = member
    return seen


def _signature_mismatch(before, after):
    """Where a function replaced a function: the original's parameters the replacement cannot take by position."""
    if not (inspect.isfunction(getattr(before, "__func__", before)) and callable(after)):
        return None
    try:
        old, new = inspect.signature(before), inspect.signature(after)
    except (TypeError, ValueError):
        return None
    new_params = list(new.parameters.values())
    if any(p.kind == p.VAR_POSITIONAL for p in new_params):
        return None
    wanted = [p.name for p in old.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    taken = [p.name for p in new_params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return None if len(taken) >= len(wanted) else f"{old} -> {new}"


def main():
    import torch  # noqa: F401

    report = {}
    before = _snapshot()
    import megatron_muon
    import megatron_muon.kernels  # noqa: F401
    import megatron_muon.optimizer  # noqa: F401

    modules = _declared_modules()
    steps = [("import", lambda: None), ("register", megatron_muon.register)]

    def launch():
        from megatron_muon.megatron.fast_paths import install_after_every_optimizer_build
        from megatron_muon.megatron.owner_layout import use_owner_layout_in_megatron
        from megatron_muon import launch as launcher

        use_owner_layout_in_megatron()
        install_after_every_optimizer_build()
        launcher._use_prebuilt_dataset_helpers()
        launcher._enter_cpu_mode()

    def fast_paths():
        from megatron_muon.megatron import clip_deferral

        clip_deferral.install()  # what install_fast_paths does once a GPU optimizer takes the deferred clip

    steps.append(("fast_paths", fast_paths))
    steps.append(("launch", launch))
    report["declared_modules"] = sorted(modules)
    from megatron_muon.patches import _is_ours

    # torch changes some of its own names when its compiler loads; only what now holds the plugin's objects counts
    report["import_changed"] = sorted(k for k, v in _snapshot().items()
                                      if k in before and before[k] is not v and _is_ours(v))
    before = _snapshot()  # megatron's declared modules are imported now
    for name, step in steps[1:]:
        step()
        after = _snapshot()
        changed = sorted(k for k, v in after.items() if k in before and before[k] is not v and _is_ours(v))
        report[name] = {"changed": changed, "installed": [t for t, _ in megatron_muon.installed_patches()],
                        "signature_mismatches": {k: m for k in changed
                                                 if (m := _signature_mismatch(before[k], after[k]))}}
        before = after
    print(json.dumps(report))


if __name__ == "__main__":
    main()
