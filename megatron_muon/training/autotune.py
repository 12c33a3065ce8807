"""The run's autotune table (`kernels/autotune_table.py`): pinned before the first step, written after it.

`training.autotune_table`: "auto" (the default) pins `<output_dir>/autotune_table.json` when an earlier run left
one there, and writes this run's choices there after its first step (on GPUs: every rank's, merged), so a restart,
or a job on a node whose Triton caches are cold, compiles one config per kernel and key instead of timing them all.
A path pins that file (and still writes to the run's directory); "none" does neither.
"""

from __future__ import annotations

from pathlib import Path

from megatron_muon.training.config import Recipe

TABLE_FILE = "autotune_table.json"


def table_to_pin(recipe: Recipe) -> Path | None:
    setting = recipe.training.autotune_table
    if setting == "none":
        return None
    if setting == "auto":
        path = Path(recipe.output_dir) / TABLE_FILE
        return path if path.exists() else None
    return Path(setting)  # validated to exist (training.validation)


def pin_table(path: str | Path) -> dict[str, int]:
    """`autotune_table.pin` after our GDN backend has given FLA's autotuners the configs it adds."""
    from megatron_muon.kernels import autotune_table
    from megatron_muon.ops.fla_backend import prepare_autotuners

    prepare_autotuners()
    return autotune_table.pin(path)


def pin_run_table(recipe: Recipe, on_gpu: bool) -> str | None:
    """Pin the recipe's table; returns a console note, or None when there was nothing to pin."""
    path = table_to_pin(recipe)
    if path is None or not on_gpu:
        return None
    counts = pin_table(path)
    if counts["other_machine"]:
        return f"autotune table {path}: made on another GPU model or Triton version, not used"
    stale = f", {counts['stale']} no longer match their kernels" if counts["stale"] else ""
    return f"autotune table {path}: {counts['pinned']} kernel choices pinned{stale}"


def write_run_table(recipe: Recipe, on_gpu: bool, is_main: bool = True) -> Path | None:
    """After the first step: every rank's autotune choices (pipeline stages run different kernels), merged into
    the run's directory by the main rank. A collective where several ranks run: every rank calls it."""
    import torch.distributed as dist

    from megatron_muon.kernels import autotune_table

    if recipe.training.autotune_table == "none" or not on_gpu:
        return None
    table = autotune_table.record()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        tables = [None] * dist.get_world_size()
        dist.all_gather_object(tables, table)
        table = autotune_table.merge(tables)
    if not is_main:
        return None
    path = Path(recipe.output_dir) / TABLE_FILE
    autotune_table.write(path, table)
    return path
