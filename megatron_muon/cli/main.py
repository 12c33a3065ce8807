"""`megatron-muon`: pretrain from a YAML recipe on megatron-core, list and check recipes.

A mistake in the recipe, the overrides or the launch layout ends with one sentence on stderr and exit code 2,
before any process group, directory or file exists.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import warnings
from typing import Any

from megatron_muon.training.config import Recipe, RecipeError
from megatron_muon.training.distributed import launched_rank, launched_world_size
from megatron_muon.training.recipes import available_recipes, load_recipe
from megatron_muon.training.validation import validate

EXIT_USAGE = 2


def _add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", default="tiny-cpu", help="recipe name (examples/recipes/NAME.yaml) or YAML path")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one recipe value, e.g. --set optimizer.name=adam (repeatable)")
    parser.add_argument("--data-path", nargs="+", default=None, metavar="PREFIX",
                        help="Megatron indexed dataset prefix(es) or a weighted blend 'w1 p1 w2 p2'; default: mock")
    parser.add_argument("--save", default=None, help="directory to write dist checkpoints to")
    parser.add_argument("--load", default=None,
                        help="directory to resume from (its latest finished checkpoint; none there yet: from scratch)")
    parser.add_argument("--load-iteration", type=int, default=None, metavar="N",
                        help="resume from iteration N of --load instead of the latest")
    parser.add_argument("--output-dir", default=None, help="where the JSONL log and the plot go")


KEYS_HINT = ("recipe keys: `megatron-muon keys` lists every SECTION.KEY with its default; recipes: `megatron-muon "
             "recipes`; docs: README.md and docs/ in the repository")

# Megatron-LM flags people type out of habit, and the recipe key that means the same here.
MEGATRON_FLAGS = {
    "--optimizer": "optimizer.name", "--lr": "optimizer.lr", "--min-lr": "optimizer.min_lr",
    "--train-iters": "training.train_iters", "--micro-batch-size": "training.micro_batch_size",
    "--global-batch-size": "training.global_batch_size", "--seq-length": "model.seq_length",
    "--tensor-model-parallel-size": "parallel.tensor_model_parallel_size",
    "--pipeline-model-parallel-size": "parallel.pipeline_model_parallel_size",
    "--use-distributed-optimizer": "parallel.use_distributed_optimizer", "--bf16": "training.precision",
    "--clip-grad": "optimizer.clip_grad", "--weight-decay": "optimizer.weight_decay",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-muon", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    pretrain = commands.add_parser("pretrain", help="train a model from a recipe (torchrun/srun for several ranks)",
                                   epilog=KEYS_HINT)
    _add_recipe_arguments(pretrain)
    check = commands.add_parser("validate", help="load and check a recipe, print it with its FLOPs per token")
    _add_recipe_arguments(check)
    check.add_argument("--world-size", type=int, default=None,
                       help="check the layout for this many ranks (default: tp x pp x dp of the recipe, else 1)")
    commands.add_parser("recipes", help="list the available recipes")
    commands.add_parser("keys", help="list every recipe key (SECTION.KEY) with its type and default")
    report = commands.add_parser("report", help="recompute a run's MFU from its JSONL log and compare")
    report.add_argument("log", help="train_log.jsonl written by pretrain")
    from megatron_muon.cli.prepare_data import add_parser as add_prepare_data

    add_prepare_data(commands)
    return parser


def _structured_overrides(args: argparse.Namespace) -> dict[str, Any]:
    structured: dict[str, Any] = {}
    if args.data_path:
        structured.setdefault("data", {})["path"] = args.data_path
    for key in ("save", "load", "load_iteration"):
        if getattr(args, key, None) is not None:
            structured.setdefault("checkpoint", {})[key] = getattr(args, key)
    if args.output_dir:
        structured.setdefault("logging", {})["output_dir"] = args.output_dir
    return structured


def _check_optimizer_name(name: str) -> None:
    """After register(): the name must be one megatron-core (with our plugin) can build."""
    import megatron_muon
    from megatron.core.optimizer.emerging_optimizers import _EMERGING_OPTIMIZERS

    megatron_muon.register()
    known = {"adam", "sgd", *_EMERGING_OPTIMIZERS, *(f"dist_{n}" for n in _EMERGING_OPTIMIZERS)}
    if name not in known:
        import difflib

        nearest = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f"did you mean '{nearest[0]}'? " if nearest else ""
        raise RecipeError(f"unknown optimizer.name '{name}'; {hint}choose one of {', '.join(sorted(known))}.")


def intended_world_size(recipe: Recipe) -> int | None:
    """tp x pp x dp when the recipe states its data-parallel size, else None."""
    par = recipe.parallel
    if par.data_parallel_size is None:
        return None
    return par.tensor_model_parallel_size * par.pipeline_model_parallel_size * par.data_parallel_size


def load_and_validate(args: argparse.Namespace, world_size: int | None) -> Recipe:
    """world_size None: the size the recipe states (validate) or 1."""
    from megatron_muon.training.model import spec_backend

    recipe = load_recipe(args.recipe, args.overrides, _structured_overrides(args))
    validate(recipe, world_size or intended_world_size(recipe) or 1)
    spec_backend(recipe)
    return recipe


def _fail(message: str) -> int:
    if launched_rank() == 0:
        print(f"megatron-muon: error: {message}", file=sys.stderr)
    return EXIT_USAGE


CPU_PARAMETER_LIMIT = 200_000_000


def _check_fits_this_machine(recipe: Recipe) -> None:
    """A GPU-sized recipe on a machine without a GPU is refused in seconds instead of after minutes of setup."""
    import torch

    from megatron_muon.metrics.flops import parameter_count
    from megatron_muon.training.validation import model_shape

    if torch.cuda.is_available():
        return
    count = parameter_count(model_shape(recipe))
    if count > CPU_PARAMETER_LIMIT:
        raise RecipeError(f"recipe '{recipe.name}' is a {count / 1e9:.2f}B-parameter model sized for GPUs and this "
                          "machine has none; on CPU use --recipe tiny-cpu (or a recipe under "
                          f"{CPU_PARAMETER_LIMIT // 1_000_000}M parameters)")


def _validate_command(args: argparse.Namespace) -> int:
    from megatron_muon.metrics import flops_breakdown_per_token
    from megatron_muon.training.validation import model_shape

    recipe = load_and_validate(args, args.world_size)
    breakdown = flops_breakdown_per_token(model_shape(recipe))
    print(json.dumps({"recipe": recipe.to_dict(), "train_flops_per_token": breakdown}, indent=2))
    return 0


def _pretrain_command(args: argparse.Namespace) -> int:
    from megatron_muon.training.distributed import init_distributed, shutdown_distributed
    from megatron_muon.training.loop import pretrain

    recipe = load_and_validate(args, launched_world_size())
    _check_optimizer_name(recipe.optimizer.name)
    _check_fits_this_machine(recipe)
    ctx = init_distributed(recipe.parallel.tensor_model_parallel_size, recipe.parallel.pipeline_model_parallel_size,
                           recipe.training.torch_compile)
    try:
        summary = pretrain(recipe, ctx)
    finally:
        shutdown_distributed()
    if ctx.is_main and summary["stopped_by_signal"]:
        print(f"stopped by SIGTERM after {summary['steps']} steps; checkpoint in {recipe.checkpoint.save}"
              if recipe.checkpoint.save else f"stopped by SIGTERM after {summary['steps']} steps (no --save given)")
    if ctx.is_main:
        print(f"done: loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f} in {summary['steps']} steps "
              f"({summary['seconds']:.1f} s); log {summary['log']}" + (f", plot {summary['plot']}" if "plot" in summary
                                                                          else ""))
    return 0


def _report_command(log: str) -> int:
    from megatron_muon.training.report import read_jsonl, recheck_mfu

    try:
        rows = recheck_mfu(read_jsonl(log))
    except FileNotFoundError:
        return _fail(f"no log at {log}; pass the train_log.jsonl a pretrain run wrote (in its output_dir)")
    except (ValueError, KeyError, IndexError, TypeError) as error:
        return _fail(f"{log} is not a pretrain log megatron-muon can read ({type(error).__name__}: "
                     f"{str(error)[:80]}); pass the train_log.jsonl a pretrain run wrote")
    print(f"{'step':>6} {'tokens/s':>12} {'MFU logged':>11} {'MFU by hand':>12} {'all-SDPA logged':>16} "
          f"{'all-SDPA by hand':>17}")

    def pct(value):
        return "n/a" if value is None else f"{100 * value:.2f}%"

    for r in rows:
        print(f"{r['step']:>6} {r['tokens_per_s']:>12,.0f} {pct(r['mfu_logged']):>11} {pct(r['mfu_by_hand']):>12} "
              f"{pct(r['mfu_all_sdpa_logged']):>16} {pct(r['mfu_all_sdpa_by_hand']):>17}")
    if rows:
        print(f"FLOPs/token (fwd+bwd, from the recipe): {rows[0]['flops_per_token']:.4e}")
    return 0


def quiet_megatron() -> None:
    """megatron-core announces fallbacks and deprecations at import and build time; the CLI's own lines say what
    ran, so keep the console to errors from megatron."""
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core")
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed")
    logging.getLogger("megatron.core").setLevel(logging.ERROR)


def _keys_command() -> int:
    from megatron_muon.training.config import recipe_keys

    for key, kind, default in recipe_keys():
        print(f"{key:44s} {kind:16s} {default!r}")
    return 0


def _unknown_arguments(unknown: list[str]) -> int:
    """Megatron-LM habits get the recipe key that means the same; anything else argparse's own sentence."""
    for flag in unknown:
        name = flag.split("=", 1)[0]
        if name in MEGATRON_FLAGS:
            return _fail(f"{name} is a Megatron-LM flag; here recipe values are set with --set, e.g. --set "
                         f"{MEGATRON_FLAGS[name]}=VALUE ({KEYS_HINT}); Megatron-LM scripts themselves run through "
                         "`python -m megatron_muon.launch pretrain_gpt.py ...`")
    return _fail(f"unrecognized arguments: {' '.join(unknown)}; see `megatron-muon pretrain --help`")


def main(argv: list[str] | None = None) -> int:
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:
        return _unknown_arguments(unknown)
    quiet_megatron()
    if args.command == "report":
        return _report_command(args.log)
    if args.command == "recipes":
        for name, path in available_recipes().items():
            print(f"{name:24s} {path}")
        return 0
    if args.command == "keys":
        return _keys_command()
    try:
        if args.command == "prepare-data":
            from megatron_muon.cli.prepare_data import run as prepare_data

            return prepare_data(args)
        if args.command == "validate":
            return _validate_command(args)
        return _pretrain_command(args)
    except RecipeError as error:  # also CheckpointError and DataError: one sentence naming the fix
        return _fail(str(error))


if __name__ == "__main__":
    sys.exit(main())
