"""The run's autotune table: pinned from the run's directory (or a given file) before the first step, written there
after it, on GPUs only, and nothing at all with `off`."""

import json

import pytest
import triton

from megatron_muon.kernels import autotune_table
from megatron_muon.training import autotune
from megatron_muon.training.recipes import load_recipe
from tests.kernels import _autotuned

KEY = (4096, "torch.bfloat16", "torch.bfloat16")


@pytest.fixture(autouse=True)
def _empty_cache():
    _autotuned.double.cache.clear()
    yield
    _autotuned.double.cache.clear()


def _recipe(tmp_path, setting="auto"):
    return load_recipe("tiny-cpu", [f"logging.output_dir={tmp_path}", f"training.autotune_table={setting}"])


def _table_file(path, device="cpu"):
    entry = {"key": list(KEY), "config": {"BLOCK": 32, "num_warps": 2, "num_ctas": 1, "num_stages": 3}}
    path.write_text(json.dumps({"format": autotune_table.FORMAT, "device": device, "triton": triton.__version__,
                                "kernels": {"tests.kernels._autotuned:double": [entry]}}))
    return path


def test_auto_pins_the_table_an_earlier_run_left_in_its_directory(tmp_path):
    recipe = _recipe(tmp_path)
    assert autotune.table_to_pin(recipe) is None  # a first run has none yet
    _table_file(tmp_path / autotune.TABLE_FILE)
    assert autotune.pin_run_table(recipe, on_gpu=False) is None  # no Triton kernels run on the CPU
    note = autotune.pin_run_table(recipe, on_gpu=True)  # the device here is "cpu", as the table says
    assert note == f"autotune table {tmp_path / autotune.TABLE_FILE}: 1 kernel choices pinned"
    assert _autotuned.double.cache[KEY] is _autotuned.CONFIGS[1]


def test_a_table_from_another_gpu_is_named_and_not_used(tmp_path):
    path = _table_file(tmp_path / "other.json", device="NVIDIA B200")
    note = autotune.pin_run_table(_recipe(tmp_path, str(path)), on_gpu=True)
    assert note.endswith("made on another GPU model or Triton version, not used") and not _autotuned.double.cache


def test_the_first_step_writes_the_runs_table_on_gpus_unless_off(tmp_path):
    assert autotune.write_run_table(_recipe(tmp_path), on_gpu=False) is None
    assert autotune.write_run_table(_recipe(tmp_path, "none"), on_gpu=True) is None
    assert autotune.table_to_pin(_recipe(tmp_path, "none")) is None
    path = autotune.write_run_table(_recipe(tmp_path), on_gpu=True)
    assert path == tmp_path / autotune.TABLE_FILE and json.loads(path.read_text())["format"] == autotune_table.FORMAT
