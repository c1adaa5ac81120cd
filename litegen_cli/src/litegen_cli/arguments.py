"""The command-line arguments shared by the commands that take a recipe: the recipe file and
the overrides after it (`litegen launch RECIPE [KEY=VALUE ...]`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

RecipeArg = Annotated[
    Path,
    typer.Argument(
        help="YAML recipe: a `launch:` section beside the MainConfig and your own fields.",
        metavar="RECIPE",
        show_default=False,
    ),
]
OverridesArg = Annotated[
    list[str] | None,
    typer.Argument(
        help="Dotted overrides applied before validation, values read as YAML: "
        "max_steps=100 optimization.parallel.strategy=fsdp1 launch.nproc_per_node=2.",
        metavar="KEY=VALUE",
        show_default=False,
    ),
]
