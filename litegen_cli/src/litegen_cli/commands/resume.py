"""`litegen resume --from CKPT [KEY=VALUE ...]`: continue a run from its checkpoint; the recipe
is rebuilt by `litegen_cli.resume`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from litegen_cli import render
from litegen_cli.arguments import OverridesArg
from litegen_cli.failures import EXIT_BAD_INPUT
from litegen_cli.launch_run import launch_run
from litegen_cli.preflight import check_before_spawn
from litegen_cli.recipe import RecipeError


def resume(
    checkpoint: Annotated[
        Path,
        typer.Option(
            "--from",
            help="A `step_<N>` run checkpoint, or the checkpoint_dir holding them (its latest).",
            show_default=False,
        ),
    ],
    overrides: OverridesArg = None,
    branch: Annotated[
        Path | None,
        typer.Option(
            "--branch",
            help="Continue in this new run folder (results and checkpoints); the checkpoint's "
            "own folder is left as it is.",
            show_default=False,
        ),
    ] = None,
    move_newer_aside: Annotated[
        bool,
        typer.Option(
            "--move-newer-aside",
            help="Resuming from an older step: move the newer checkpoints to "
            "<checkpoint_dir>.old-<time>, never deleted, and continue in the run's folder.",
        ),
    ] = False,
) -> None:
    """Continue a run from a checkpoint: its saved config, plus overrides, launched as before.

    The run goes on exactly where it stopped (same next batch, noise and losses), in the
    folder the checkpoint lives in (or the --branch folder); the fields the overrides change
    are printed first. A resume from a step older than the folder's newest is refused unless
    --branch or --move-newer-aside. See docs/resume.md.
    """
    from litegen_cli.resume import resume_recipe  # imports torch

    try:
        recipe, changes = resume_recipe(checkpoint, overrides or [], branch)
        check_before_spawn(recipe)
    except RecipeError as err:
        render.print_recipe_error(err)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    render.console.print(f"Resuming from {recipe.config.trainer.resume_run}")
    for line in changes or ["(none)"]:
        render.console.print(f"  changed: {line}", highlight=False, markup=False)
    # A branch starts a new run folder: it must not hold another run.
    launch_run(recipe, continuing=branch is None, move_newer_aside=move_newer_aside)
