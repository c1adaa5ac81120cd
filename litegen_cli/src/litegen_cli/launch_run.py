"""Launching a checked recipe on this node: the one launch path of `litegen launch` and
`litegen resume`.

The run folder is claimed first (run_folder.py), then the launcher starts this node's ranks
(launcher.py, which imports torch, so only once the folder is ours), and every failure becomes
one message and an exit code: 2 bad input, 1 a failed run, 128+N stopped by signal N
(failures.py).
"""

from __future__ import annotations

from pathlib import Path

import typer

from litegen_cli import render
from litegen_cli.failures import EXIT_BAD_INPUT, EXIT_FAILED, LaunchFailed
from litegen_cli.recipe import Recipe, RecipeError


def launch_run(
    recipe: Recipe,
    *,
    overwrite: bool = False,
    continuing: bool | None = None,
    move_newer_aside: bool = False,
) -> None:
    """Own the run folder, run this node's ranks, and turn every failure into one message.

    ``continuing``: the run goes on from a checkpoint in its folder, so an earlier run there
    is expected (None: when the config resumes, by resume_run or auto_resume).
    ``move_newer_aside``: see claim_run_folder. Ends in ``typer.Exit`` on a failure.

    Example::

        launch_run(load_or_exit(Path("recipes/digits_dit.yaml"), []), overwrite=True)
    """
    from litegen_cli.run_folder import RunFolderError, claim_run_folder

    render.print_warnings(recipe.warnings)
    config = recipe.config
    if continuing is None:
        continuing = bool(config.auto_resume or config.trainer.resume_run)
    resumes = config.trainer.resume_run
    try:
        with claim_run_folder(
            config,
            node_rank=recipe.launch.node_rank,
            overwrite=overwrite,
            continuing=continuing,
            resumes=Path(resumes) if resumes else None,
            move_newer_aside=move_newer_aside,
        ) as notes:
            for note in notes:
                render.console.print(note, highlight=False, markup=False)
            from litegen_cli.launcher import launch  # imports torch, once the folder is ours

            resolved = launch(recipe)
    except RunFolderError as err:
        render.print_error(err.title, err.lines)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    except RecipeError as err:
        render.print_recipe_error(err)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    except LaunchFailed as err:
        render.report_failure(err, render.resume_hint(config.get_checkpoint_dir()))
        raise typer.Exit(err.exit_code) from None
    except OSError as err:  # e.g. the results dir is not writable
        render.print_error("Cannot start the run", [f"{type(err).__name__}: {err}"])
        raise typer.Exit(EXIT_FAILED) from None
    render.console.print(f"[green]Done.[/] Resolved recipe: {resolved}")
