"""The one list of replaced names (`megatron_muon.patches.PATCHES`) against what the plugin's setup really changes,
found by comparing every megatron and torch module and class attribute before and after each step
(`_patch_census.py`, in a fresh interpreter)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_muon.patches import PATCHES, installed_patches, resolve

REGISTRY_ENTRY = "megatron.core.optimizer.emerging_optimizers._EMERGING_OPTIMIZERS['muon']"


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
    declared = {p.target: p.installer for p in PATCHES}
    step = census["fast_paths"]
    assert set(step["changed"]) == {t for t, i in declared.items() if i == "fast_paths"}
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
