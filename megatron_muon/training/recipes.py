"""Find and load YAML recipes by name (examples/recipes/NAME.yaml) or path, following `extends:` chains."""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any

import yaml

from megatron_muon.training.config import Recipe, RecipeError, deep_merge, parse_overrides, recipe_from_dict

RECIPES_ENV = "MEGATRON_MUON_RECIPES"


def recipe_dirs() -> list[Path]:
    """Where recipe names are looked up: $MEGATRON_MUON_RECIPES, ./examples/recipes, then the source checkout's."""
    dirs = [Path(p) for p in os.environ.get(RECIPES_ENV, "").split(os.pathsep) if p]
    dirs += [Path.cwd() / "examples" / "recipes", Path(__file__).resolve().parents[2] / "examples" / "recipes"]
    unique: list[Path] = []
    for d in dirs:
        if d.is_dir() and d.resolve() not in [u.resolve() for u in unique]:
            unique.append(d)
    return unique


def available_recipes() -> dict[str, Path]:
    """Recipe name -> file, first directory wins."""
    found: dict[str, Path] = {}
    for d in recipe_dirs():
        for path in sorted(d.glob("*.yaml")):
            found.setdefault(path.stem, path)
    return found


def resolve_recipe_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or os.sep in name_or_path:
        if not path.is_file():
            raise RecipeError(f"recipe file '{name_or_path}' does not exist; "
                              "pass an existing YAML file or a recipe name.")
        return path
    recipes = available_recipes()
    if name_or_path in recipes:
        return recipes[name_or_path]
    nearest = difflib.get_close_matches(name_or_path, list(recipes), n=1, cutoff=0.4)
    hint = f"did you mean '{nearest[0]}'? " if nearest else ""
    raise RecipeError(
        f"unknown recipe '{name_or_path}'; {hint}available recipes: {', '.join(recipes) or 'none found'} "
        f"(or pass a path to a YAML file)."
    )


def load_raw(path: Path, _chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The recipe's YAML as a dict, with its `extends:` base merged underneath."""
    if path.resolve() in _chain:
        chain = " -> ".join(str(p) for p in _chain)
        raise RecipeError(f"recipe '{path}' extends itself through {chain}; break the cycle.")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        first_line = str(error).splitlines()[0]
        raise RecipeError(f"recipe '{path}' is not valid YAML ({first_line}); fix the syntax.") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"recipe '{path}' must be a YAML mapping of sections (model:, training:, ...).")
    base_name = raw.get("extends")
    if base_name:
        base_path = path.parent / f"{base_name}.yaml"
        if not base_path.is_file():
            base_path = resolve_recipe_path(str(base_name))
        base = load_raw(base_path, _chain + (path.resolve(),))
        base.pop("description", None)
        base.pop("name", None)
        raw = deep_merge(base, raw)
    raw.setdefault("name", path.stem)
    return raw


def load_recipe(name_or_path: str, overrides: list[str] | None = None,
                structured: dict[str, Any] | None = None) -> Recipe:
    """Load a recipe by name or path, then apply `section.key=value` overrides and structured ones (CLI flags)."""
    path = resolve_recipe_path(name_or_path)
    raw = load_raw(path)
    raw.pop("extends", None)
    recipe_from_dict(raw, where=str(path))  # report unknown keys against the file before overrides
    if overrides:
        raw = deep_merge(raw, parse_overrides(overrides))
    if structured:
        raw = deep_merge(raw, structured)
    return recipe_from_dict(raw, where=str(path))
