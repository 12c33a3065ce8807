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
    parser.add_argument("--load", default=None, help="directory to resume from (its latest checkpoint)")
    parser.add_argument("--output-dir", default=None, help="where the JSONL log and the plot go")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-muon", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    pretrain = commands.add_parser("pretrain", help="train a model from a recipe (torchrun/srun for several ranks)")
    _add_recipe_arguments(pretrain)
    check = commands.add_parser("validate", help="load and check a recipe, print it with its FLOPs per token")
    _add_recipe_arguments(check)
    check.add_argument("--world-size", type=int, default=None,
                       help="check the layout for this many ranks (default: tp x pp x dp of the recipe, else 1)")
    commands.add_parser("recipes", help="list the available recipes")
    report = commands.add_parser("report", help="recompute a run's MFU from its JSONL log and compare")
    report.add_argument("log", help="train_log.jsonl written by pretrain")
    return parser


def _structured_overrides(args: argparse.Namespace) -> dict[str, Any]:
    structured: dict[str, Any] = {}
    if args.data_path:
        structured.setdefault("data", {})["path"] = args.data_path
    for key in ("save", "load"):
        if getattr(args, key):
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

    rows = recheck_mfu(read_jsonl(log))
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


def _quiet_megatron() -> None:
    """megatron-core announces fallbacks and deprecations at import and build time; the CLI's own lines say what
    ran, so keep the console to errors from megatron."""
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core")
    warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex) (and Apex )?(is|are) not installed")
    logging.getLogger("megatron.core").setLevel(logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _quiet_megatron()
    if args.command == "report":
        return _report_command(args.log)
    if args.command == "recipes":
        for name, path in available_recipes().items():
            print(f"{name:24s} {path}")
        return 0
    try:
        if args.command == "validate":
            return _validate_command(args)
        return _pretrain_command(args)
    except RecipeError as error:
        return _fail(str(error))


if __name__ == "__main__":
    sys.exit(main())
