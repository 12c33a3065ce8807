"""Autotune tables: the choices recorded from the autotuners' caches, pinned back into them by kernel and key, only
configs of the kernel's own list, only on the GPU model and Triton version that made them."""

import json
from pathlib import Path

import pytest
import triton

from megatron_muon.kernels import autotune_table
from tests.interpreter import run_under_interpreter
from tests.kernels import _autotuned

PREFIXES = ("tests.kernels._autotuned",)
KEY = (4096, "torch.bfloat16", "torch.bfloat16")


@pytest.fixture(autouse=True)
def _empty_caches():
    for tuner in (_autotuned.double, _autotuned.triple.fn):
        tuner.cache.clear()
    yield
    for tuner in (_autotuned.double, _autotuned.triple.fn):
        tuner.cache.clear()


def test_every_autotuned_kernel_is_found_once_under_heuristics_too():
    assert autotune_table.autotuners(PREFIXES) == {"tests.kernels._autotuned:double": _autotuned.double,
                                                   "tests.kernels._autotuned:triple": _autotuned.triple.fn}


def test_recorded_choices_pin_back_to_the_same_configs(tmp_path):
    _autotuned.double.cache[KEY] = _autotuned.CONFIGS[2]
    _autotuned.triple.fn.cache[KEY] = _autotuned.CONFIGS[0]
    path = tmp_path / "table.json"
    assert autotune_table.write(path, device_name="GPU X", prefixes=PREFIXES) == 2
    written = json.loads(path.read_text())
    assert written["device"] == "GPU X" and written["triton"] == triton.__version__
    assert written["kernels"]["tests.kernels._autotuned:double"] == [
        {"key": list(KEY), "config": {"BLOCK": 64, "num_warps": 4, "num_ctas": 1, "num_stages": 3}}]
    for tuner in (_autotuned.double, _autotuned.triple.fn):
        tuner.cache.clear()
    assert autotune_table.pin(path, device_name="GPU X") == {"pinned": 2, "stale": 0, "other_machine": 0}
    assert _autotuned.double.cache == {KEY: _autotuned.CONFIGS[2]}  # the kernel's own config object
    assert _autotuned.triple.fn.cache[KEY] is _autotuned.CONFIGS[0]


def test_another_gpu_or_triton_pins_nothing():
    _autotuned.double.cache[KEY] = _autotuned.CONFIGS[1]
    table = autotune_table.record(device_name="GPU X", prefixes=PREFIXES)
    _autotuned.double.cache.clear()
    assert autotune_table.pin(table, device_name="GPU Y") == {"pinned": 0, "stale": 0, "other_machine": 1}
    assert autotune_table.pin({**table, "triton": "0.0.1"}, device_name="GPU X")["other_machine"] == 1
    assert not _autotuned.double.cache


def test_a_config_or_kernel_no_longer_there_is_skipped():
    entry = {"key": list(KEY), "config": {"BLOCK": 128, "num_warps": 8, "num_ctas": 1, "num_stages": 3}}
    table = {"format": autotune_table.FORMAT, "device": "GPU X", "triton": triton.__version__,
             "kernels": {"tests.kernels._autotuned:double": [entry], "tests.kernels._autotuned:gone": [entry],
                         "tests.kernels._no_such_module:double": [entry]}}
    assert autotune_table.pin(table, device_name="GPU X") == {"pinned": 0, "stale": 3, "other_machine": 0}
    assert not _autotuned.double.cache


def test_keys_that_are_not_plain_values_are_not_recorded():
    _autotuned.double.cache[(4096, object())] = _autotuned.CONFIGS[0]
    assert autotune_table.record(device_name="GPU X", prefixes=PREFIXES)["kernels"] == {}


def test_a_table_of_another_format_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="write it again"):
        autotune_table.pin({"format": 0, "device": "GPU X", "triton": "3", "kernels": {}})


def test_a_pinned_key_runs_without_timing_under_the_interpreter():
    run_under_interpreter(Path(__file__).with_name("_autotune_table_interpret_check.py"))


def test_the_shipped_tables_name_this_packages_kernels_and_configs_of_their_own_lists():
    """Each table that comes with the package is well formed, ships in the wheel (pyproject's package data), and
    every choice is a config of its kernel's own list in the installed FLA and ours, so none would be stale."""
    import tomllib

    from megatron_muon.ops.fla_backend import prepare_autotuners

    tables = autotune_table.shipped_tables()
    assert tables, "the package ships the reference recipe's table"
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["megatron_muon.kernels"]
    root = autotune_table.SHIPPED_DIR.parent
    assert {path for glob in globs for path in root.glob(glob)} == set(tables)
    prepare_autotuners()
    for path in tables:
        table = json.loads(path.read_text())
        assert table["format"] == autotune_table.FORMAT and table["device"] and table["triton"]
        assert set(table["packages"]) == set(autotune_table.KERNEL_PACKAGES)
        for name, entries in table["kernels"].items():
            assert name.startswith(autotune_table.MODULE_PREFIXES), name
            if name.startswith("fla.") and table["packages"] != autotune_table._package_versions(table["packages"]):
                continue  # another FLA (or none: CPU CI): its lists may differ, and pin() leaves the table out
            tuner = autotune_table._find(name)
            assert tuner is not None, f"{path.name}: {name} is not an autotuned kernel here"
            own = [json.dumps(autotune_table._config_fields(c), sort_keys=True) for c in tuner.configs]
            for entry in entries:
                assert json.dumps(entry["config"], sort_keys=True) in own, (path.name, name, entry)
