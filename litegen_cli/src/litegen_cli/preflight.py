"""The checks a recipe passes in the CLI process, before any rank starts (torch-free): the run
plan (job shape, strategy rules) and the entry module's contract and ``check_inputs`` hook.

Every command that takes a recipe loads it through :func:`load_or_exit`, so `launch` and
`cache build` validate exactly like `inspect-config`; `resume` builds its recipe from the
checkpoint and calls :func:`check_before_spawn` on it.
"""

from __future__ import annotations

from pathlib import Path

import typer

from litegen_cli import render
from litegen_cli.entry_check import input_problems
from litegen_cli.failures import EXIT_BAD_INPUT
from litegen_cli.recipe import Recipe, RecipeError, load_recipe
from litegen_cli.run_shape import derive_run_shape


def load_or_exit(recipe_path: Path, overrides: list[str] | None) -> Recipe:
    """Load and plan-check a recipe; print every problem and exit 2 when it is unusable.

    Example::

        recipe = load_or_exit(Path("recipes/digits_dit.yaml"), ["max_steps=10"])
    """
    try:
        recipe = load_recipe(recipe_path, overrides or [])
        check_before_spawn(recipe)
    except RecipeError as err:
        render.print_recipe_error(err)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    return recipe


def check_before_spawn(recipe: Recipe) -> None:
    """The checks a loaded recipe passes before any rank starts: the run shape (job shape,
    strategy rules) and the entry's ``check_inputs(config)`` hook; RecipeError otherwise.

    Example::

        check_before_spawn(load_recipe(Path("recipe.yaml")))  # raises RecipeError
    """
    derive_run_shape(recipe)
    problems = input_problems(recipe.launch.entry, recipe.base_dir, recipe.config)
    if problems:
        raise RecipeError(problems)
