"""`litegen launch RECIPE [KEY=VALUE ...]`: validate a recipe, then start its ranks on this node."""

from __future__ import annotations

from typing import Annotated

import typer

from litegen_cli.arguments import OverridesArg, RecipeArg
from litegen_cli.launch_run import launch_run
from litegen_cli.preflight import load_or_exit


def launch(
    recipe: RecipeArg,
    overrides: OverridesArg = None,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite",
            help="Start over in a results folder that holds another run: that run is moved "
            "aside to <folder>.old-<time>, never deleted.",
        ),
    ] = False,
) -> None:
    """Validate RECIPE, then start its ranks on this node with torchrun.

    Run the same command on every node of a multi-node job (or through `srun` on SLURM,
    where nnodes, node_rank, rdzv_id and the rendezvous host come from the job). A results
    folder that holds another run is refused: resume it, choose another folder, or --overwrite.
    """
    launch_run(load_or_exit(recipe, overrides), overwrite=overwrite)
