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
