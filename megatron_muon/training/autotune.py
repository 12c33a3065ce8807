"""The run's autotune tables (`kernels/autotune_table.py`): pinned before the first step, the run's written after it.

`training.autotune_table`: "auto" (the default) pins the tables that come with the package (choices measured for
the reference recipes, used only on the GPU model and versions that made them) and then
`<output_dir>/autotune_table.json` when an earlier run left one there (its choices win), and writes this run's
choices there after its first step (on GPUs: every rank's, merged), so a restart, or a job on a node whose Triton
caches are cold, compiles one config per kernel and key instead of timing them all. A path pins that file only (and
still writes to the run's directory); "none" does neither.
"""

from __future__ import annotations

from pathlib import Path

from megatron_muon.training.config import Recipe

TABLE_FILE = "autotune_table.json"


def tables_to_pin(recipe: Recipe) -> list[Path]:
    """In pinning order: a later table's choice replaces an earlier one's for the same kernel and key."""
    from megatron_muon.kernels.autotune_table import shipped_tables

    setting = recipe.training.autotune_table
    if setting == "none":
        return []
    if setting == "auto":
        path = Path(recipe.output_dir) / TABLE_FILE
        return shipped_tables() + ([path] if path.exists() else [])
    return [Path(setting)]  # validated to exist (training.validation)


def pin_table(path: str | Path) -> dict[str, int]:
    """`autotune_table.pin` after our GDN backend has given FLA's autotuners the configs it adds."""
    from megatron_muon.kernels import autotune_table
    from megatron_muon.ops.fla_backend import prepare_autotuners

    prepare_autotuners()
    return autotune_table.pin(path)


def pin_run_table(recipe: Recipe, on_gpu: bool) -> str | None:
    """Pin the recipe's tables; returns a console note, or None when nothing was pinned or refused. A shipped table
    made elsewhere is left out silently (it only serves its own machine)."""
    from megatron_muon.kernels.autotune_table import SHIPPED_DIR

    if not on_gpu:
        return None
    notes = []
    for path in tables_to_pin(recipe):
        counts = pin_table(path)
        shipped = path.parent == SHIPPED_DIR
        if counts["other_machine"]:
            if not shipped:
                notes.append(f"autotune table {path}: made on another GPU model or with other Triton/FLA versions, "
                             "not used")
            continue
        stale = f", {counts['stale']} no longer match their kernels" if counts["stale"] else ""
        name = f"shipped autotune table {path.name}" if shipped else f"autotune table {path}"
        notes.append(f"{name}: {counts['pinned']} kernel choices pinned{stale}")
    return "; ".join(notes) or None


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
