"""The one list of replaced names (`megatron_muon.patches.PATCHES`) against what the plugin's setup really changes,
found by comparing every megatron and torch module and class attribute before and after each step
(`_patch_census.py`, in a fresh interpreter), and the methods the fast paths shadow on megatron's objects, seen by a
spy while they install and train (`_instance_census.py`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_muon.patches import PATCHES, installed_patches, replace_method, resolve

REGISTRY_ENTRY = "megatron.core.optimizer.emerging_optimizers._EMERGING_OPTIMIZERS['muon']"
# shadowed only while a step (or zero_grad_buffer) runs, so not in effect between steps
WITHIN_A_STEP = {"megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params._copy_main_params_to_model_params",
                 "megatron.core.distributed.param_and_grad_buffer._ParamAndGradBuffer.reset"}


@pytest.fixture(scope="module")
def census():
    result = subprocess.run([sys.executable, str(Path(__file__).with_name("_patch_census.py"))],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("patch", PATCHES, ids=[p.target for p in PATCHES])
def test_every_declared_target_exists_in_the_pinned_versions(patch):
    if patch.target == REGISTRY_ENTRY:
        from megatron.core.optimizer import emerging_optimizers

        assert isinstance(emerging_optimizers._EMERGING_OPTIMIZERS, dict)
        return
    resolve(patch.target)  # raises where the name does not exist (TE's slot is None without TE, but exists)
    assert patch.installer in ("register", "fast_paths", "launch", "cpu_mode") and patch.reason


def test_importing_the_package_replaces_nothing(census):
    assert census["import_changed"] == []


def test_register_replaces_exactly_what_installed_patches_lists(census):
    declared = {p.target: p.installer for p in PATCHES}
    step = census["register"]
    assert set(step["installed"]) == set(step["changed"]) | {REGISTRY_ENTRY}
    assert all(declared.get(target) == "register" for target in step["installed"])
    assert step["signature_mismatches"] == {}


def test_the_fast_paths_replace_exactly_their_declared_names(census):
    step = census["fast_paths"]
    process_wide = {p.target for p in PATCHES if p.installer == "fast_paths" and not p.per_instance}
    assert set(step["changed"]) == process_wide
    assert set(step["installed"]) == set(census["register"]["installed"]) | set(step["changed"])
    assert step["signature_mismatches"] == {}


def test_the_launcher_and_cpu_mode_replace_only_declared_names(census):
    declared = {p.target: p.installer for p in PATCHES}
    step = census["launch"]
    assert set(step["installed"]) == set(census["fast_paths"]["installed"]) | set(step["changed"])
    assert all(declared.get(target) in ("launch", "cpu_mode") for target in step["changed"])
    assert step["signature_mismatches"] == {}
    assert {t for t, i in declared.items() if i in ("launch", "cpu_mode")} <= set(step["changed"])  # none in vain


def test_installed_patches_reports_reasons_and_imports_nothing():
    before = set(sys.modules)
    for target, reason in installed_patches():
        assert target in {p.target for p in PATCHES} and reason
    assert set(sys.modules) == before


@pytest.fixture(scope="module")
def instance_census():
    pytest.importorskip("triton", reason="the fast paths run on CPU tensors only under Triton's interpreter")
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, str(Path(__file__).with_name("_instance_census.py"))], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "interpreter ok" in result.stdout, (result.stdout + result.stderr)[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-2])


def test_the_fast_paths_shadow_exactly_the_declared_methods_of_megatrons_objects(instance_census):
    """Every method the fast paths shadow on megatron's wrappers, DDP, bucket groups and buffers (seen by a spy on
    their classes, inside the training steps too) is declared per instance, and none is declared in vain."""
    adam, muon = instance_census["adam"], instance_census["muon"]
    assert adam["installed"]["one_pass_adamw"] == 1 and adam["overwrites"] and adam["hooked"] > 0
    assert muon["installed"]["muon_clip_in_momentum"] == 1 and muon["installed"]["muon_model_copy"] == 1
    declared = {p.target for p in PATCHES if p.per_instance}
    assert set(adam["shadowed"]) | set(muon["shadowed"]) == declared
    for run in (adam, muon):
        assert set(run["listed_after_install"]) & declared == set(run["shadowed"]) - WITHIN_A_STEP


def test_the_owner_engine_path_shadows_no_method_of_megatrons_objects(instance_census):
    """`--optimizer muon --use-distributed-optimizer` with every fast path: megatron's DDP, its bucket groups and
    the mixed-precision wrappers inside the owner engine keep their own methods (the engine is a class megatron
    builds, with its own hooks); the AdamW member's one-pass step does not apply to megatron's DistributedOptimizer."""
    owner = instance_census["dist_muon"]
    assert owner["optimizer"] == "OwnerMuonChain"
    assert owner["shadowed"] == [] and owner["overwrites"] == 0 and owner["hooked"] > 0
    assert owner["installed"]["muon_clip_in_momentum"] == owner["installed"]["muon_model_copy"] == 0


def test_an_undeclared_method_replacement_is_refused():
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    chained = ChainedOptimizer.__new__(ChainedOptimizer)
    with pytest.raises(AssertionError, match="not declared"):
        replace_method(chained, "step", lambda: None)
    assert "step" not in vars(chained)
