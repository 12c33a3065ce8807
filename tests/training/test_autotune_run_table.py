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


@pytest.fixture(autouse=True)
def _no_shipped_tables(tmp_path_factory, monkeypatch):
    """The package's own tables stay out of these tests unless a test puts its own in their place."""
    monkeypatch.setattr(autotune_table, "SHIPPED_DIR", tmp_path_factory.mktemp("shipped"))


def _table_file(path, device="cpu", block=32, packages=None):
    config = {"BLOCK": block, "num_warps": {32: 2, 64: 4, 16: 1}[block], "num_ctas": 1, "num_stages": 3}
    table = {"format": autotune_table.FORMAT, "device": device, "triton": triton.__version__,
             "kernels": {"tests.kernels._autotuned:double": [{"key": list(KEY), "config": config}]}}
    if packages is not None:
        table["packages"] = packages
    path.write_text(json.dumps(table))
    return path


def test_auto_pins_the_table_an_earlier_run_left_in_its_directory(tmp_path):
    recipe = _recipe(tmp_path)
    assert autotune.tables_to_pin(recipe) == []  # a first run has none yet
    _table_file(tmp_path / autotune.TABLE_FILE)
    assert autotune.pin_run_table(recipe, on_gpu=False) is None  # no Triton kernels run on the CPU
    note = autotune.pin_run_table(recipe, on_gpu=True)  # the device here is "cpu", as the table says
    assert note == f"autotune table {tmp_path / autotune.TABLE_FILE}: 1 kernel choices pinned"
    assert _autotuned.double.cache[KEY] is _autotuned.CONFIGS[1]


def test_a_table_from_another_gpu_is_named_and_not_used(tmp_path):
    path = _table_file(tmp_path / "other.json", device="NVIDIA B200")
    note = autotune.pin_run_table(_recipe(tmp_path, str(path)), on_gpu=True)
    assert note.endswith("made on another GPU model or with other Triton/FLA versions, not used")
    assert not _autotuned.double.cache


def test_auto_pins_the_shipped_tables_first_and_the_runs_own_over_them(tmp_path):
    shipped = autotune_table.SHIPPED_DIR
    _table_file(shipped / "here.json", block=16)
    _table_file(shipped / "elsewhere.json", device="NVIDIA B200", block=64)
    recipe = _recipe(tmp_path)
    assert autotune.tables_to_pin(recipe) == [shipped / "elsewhere.json", shipped / "here.json"]
    note = autotune.pin_run_table(recipe, on_gpu=True)
    assert note == "shipped autotune table here.json: 1 kernel choices pinned"  # the other machine's: silent
    assert _autotuned.double.cache[KEY] is _autotuned.CONFIGS[0]  # BLOCK 16
    _table_file(tmp_path / autotune.TABLE_FILE, block=32)
    assert autotune.tables_to_pin(recipe)[-1] == tmp_path / autotune.TABLE_FILE
    autotune.pin_run_table(recipe, on_gpu=True)
    assert _autotuned.double.cache[KEY] is _autotuned.CONFIGS[1]  # the run's own choice wins
    assert autotune.tables_to_pin(_recipe(tmp_path, "none")) == []
    assert autotune.tables_to_pin(_recipe(tmp_path, str(shipped / "here.json"))) == [shipped / "here.json"]


def test_a_table_made_with_another_fla_version_is_not_used(tmp_path):
    path = _table_file(tmp_path / "t.json", packages={"fla-core": "0.0.1"})
    assert autotune_table.pin(path, device_name="cpu")["other_machine"] == 1 and not _autotuned.double.cache
    installed = autotune_table._package_versions(["fla-core"])
    assert autotune_table.pin(_table_file(tmp_path / "u.json", packages=installed), device_name="cpu")["pinned"] == 1


def test_the_first_step_writes_the_runs_table_on_gpus_unless_off(tmp_path):
    assert autotune.write_run_table(_recipe(tmp_path), on_gpu=False) is None
    assert autotune.write_run_table(_recipe(tmp_path, "none"), on_gpu=True) is None
    path = autotune.write_run_table(_recipe(tmp_path), on_gpu=True)
    written = json.loads(path.read_text())
    assert path == tmp_path / autotune.TABLE_FILE and written["format"] == autotune_table.FORMAT
    assert written["packages"] == autotune_table._package_versions(autotune_table.KERNEL_PACKAGES)


def test_tables_merge_every_kernel_and_key_once():
    def table(kernels):
        return {"format": autotune_table.FORMAT, "device": "GPU X", "triton": "3", "kernels": kernels}

    first = {"key": [1], "config": {"BLOCK": 16}}
    merged = autotune_table.merge([table({"m:a": [first]}),
                                   table({"m:a": [{"key": [1], "config": {"BLOCK": 64}}, {"key": [2], "config": {}}],
                                          "m:b": [first]})])
    assert merged["kernels"] == {"m:a": [first, {"key": [2], "config": {}}], "m:b": [first]}
    other_gpu = {**table({"m:c": [first]}), "device": "GPU Y"}
    assert autotune_table.merge([table({}), other_gpu])["kernels"] == {}


def _write_on_rank(rank, world_size, output_dir):
    """Each rank pretends its pipeline stage ran another key of the test kernel; the main rank writes the union."""
    _autotuned.double.cache.clear()
    _autotuned.double.cache[(1000 + rank, "torch.float32", "torch.float32")] = _autotuned.CONFIGS[rank]
    prefixes = autotune_table.MODULE_PREFIXES
    autotune_table.MODULE_PREFIXES = ("tests.kernels._autotuned",)  # the test kernel stands for ours and FLA's
    try:
        path = autotune.write_run_table(_recipe(output_dir), on_gpu=True, is_main=rank == 0)
    finally:
        autotune_table.MODULE_PREFIXES = prefixes
        _autotuned.double.cache.clear()
    return None if path is None else str(path)


def test_every_ranks_choices_reach_the_runs_table(rank_pool_2, tmp_path):
    assert rank_pool_2.run(_write_on_rank, str(tmp_path)) == [str(tmp_path / autotune.TABLE_FILE), None]
    entries = json.loads((tmp_path / autotune.TABLE_FILE).read_text())["kernels"]["tests.kernels._autotuned:double"]
    assert sorted(entry["key"][0] for entry in entries) == [1000, 1001]
