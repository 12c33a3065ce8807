"""Which checkpoint a run resumes from, whether it can be read, and what it changes about the run.

As in Megatron-LM, `--load` pointing at a directory that holds no checkpoint yet (first run of `--save X --load X`)
starts from scratch. A checkpoint that cannot be read is found before any rank starts loading it (every referenced
file present and long enough), so the run ends with one sentence on every rank instead of one rank failing inside a
collective load.
"""

from __future__ import annotations

from pathlib import Path

from megatron_muon.megatron.checkpointing import is_complete_checkpoint
from megatron_muon.training.config import RecipeError

TRACKER_FILE = "latest_checkpointed_iteration.txt"


class CheckpointError(RecipeError):
    """A checkpoint that cannot be used; the message is one sentence naming what to do."""


def iteration_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"iter_{step:07d}"


def saved_iterations(root: str | Path) -> list[int]:
    """Iterations with a directory under root, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        if child.is_dir() and child.name.startswith("iter_") and child.name[5:].isdigit():
            found.append(int(child.name[5:]))
    return sorted(found, reverse=True)


def latest_iteration(root: str | Path) -> int | None:
    """The iteration the tracker file names (None without one)."""
    tracker = Path(root) / TRACKER_FILE
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise CheckpointError(f"{tracker} does not hold an iteration number ({text[:40]!r}); remove it or choose an "
                              "iteration with --load-iteration N")
    return int(text)


def problem(directory: Path) -> str | None:
    """Why `directory` cannot be loaded, as a clause naming the file; None when every file it needs is there."""
    from torch.distributed.checkpoint import FileSystemReader

    if not directory.is_dir():
        return f"{directory} does not exist"
    if not is_complete_checkpoint(directory):
        return f"{directory} was not finished (no completion marker)"
    try:
        metadata = FileSystemReader(str(directory)).read_metadata()
    except Exception as error:  # a truncated or missing .metadata: pickle, EOF or OS errors alike
        return f"{directory / '.metadata'} cannot be read ({type(error).__name__})"
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        path = directory / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size < size:
            return f"{path} is truncated ({path.stat().st_size} of {size} bytes)"
    return None


def _newest_intact(root: Path, below: int | None = None) -> int | None:
    for step in saved_iterations(root):
        if (below is None or step < below) and problem(iteration_dir(root, step)) is None:
            return step
    return None


def choose_iteration(root: str | Path, requested: int | None = None) -> int | None:
    """The iteration to resume from (None: nothing saved there yet, start from scratch); raises CheckpointError
    for one that cannot be read, naming the file and the newest intact iteration."""
    root = Path(root)
    saved = saved_iterations(root)
    if requested is not None:
        if requested not in saved:
            listed = ", ".join(map(str, saved[:8])) or "none"
            raise CheckpointError(f"iteration {requested} is not in {root} (saved iterations: {listed}); choose one "
                                  "of them with --load-iteration")
        step = requested
    else:
        step = latest_iteration(root)
        if step is None:
            if saved:
                raise CheckpointError(f"{root} holds iterations {', '.join(map(str, saved[:8]))} but no {TRACKER_FILE}"
                                      "; choose one with --load-iteration N")
            return None
    reason = problem(iteration_dir(root, step))
    if reason is None:
        return step
    fallback = _newest_intact(root, below=step)
    hint = (f"the newest intact one is iteration {fallback}: resume from it with --load-iteration {fallback}"
            if fallback is not None else "no older iteration there is intact; start from scratch without --load")
    raise CheckpointError(f"iteration {step} in {root} cannot be loaded: {reason}; {hint}")


SCHEDULE_KEYS = {"max_lr": "lr", "min_lr": "min_lr", "lr_warmup_steps": "lr_warmup_iters",
                 "lr_decay_steps": "lr_decay_iters", "lr_decay_style": "lr_decay_style"}


def schedule_of(scheduler) -> dict:
    """The LR-schedule settings a megatron OptimizerParamScheduler holds (what its state dict saves)."""
    return {attribute: getattr(scheduler, attribute) for attribute in SCHEDULE_KEYS}


def schedule_changes(recipe_schedule: dict, saved: dict) -> list[str]:
    """Where the checkpoint's LR schedule differs from the recipe's ("optimizer.lr 0.005 (checkpoint) vs 0.01")."""
    changes = []
    for attribute, key in SCHEDULE_KEYS.items():
        mine, theirs = recipe_schedule.get(attribute), saved.get(attribute)
        if theirs is not None and mine != theirs:
            changes.append(f"optimizer.{key} {theirs} (checkpoint) vs {mine} (recipe)")
    return changes


def saved_schedule(root: str | Path, step: int) -> dict:
    """The LR-schedule state iteration `step` was saved with (read before any model or optimizer exists)."""
    from megatron.core import dist_checkpointing

    return dict(dist_checkpointing.load_common_state_dict(str(iteration_dir(root, step))).get("scheduler", {}))


def remap_group_lrs(state, old: dict, new: dict) -> None:
    """In a loaded optimizer state, give param groups the new max_lr/min_lr where they hold the old ones: megatron
    matches saved param groups to the current ones by those values, so a changed lr would not find its group."""
    if isinstance(state, dict):
        for group in state.get("param_groups", []) if isinstance(state.get("param_groups"), list) else []:
            for key in ("max_lr", "min_lr"):
                if isinstance(group, dict) and key in group and group[key] == old[key]:
                    group[key] = new[key]
        for value in state.values():
            remap_group_lrs(value, old, new)
    elif isinstance(state, (list, tuple)):
        for value in state:
            remap_group_lrs(value, old, new)
