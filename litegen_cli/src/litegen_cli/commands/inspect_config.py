"""`litegen inspect-config RECIPE [KEY=VALUE ...]`: the resolved recipe and its run shape,
checked torch-free; with --estimate, one step's peak memory (estimate.py)."""

from __future__ import annotations

import typer

from litegen_cli import render
from litegen_cli.arguments import OverridesArg, RecipeArg
from litegen_cli.estimate import DeviceGibOpt, EstimateOpt, print_estimate
from litegen_cli.preflight import load_or_exit
from litegen_cli.run_shape import derive_run_shape


def inspect_config(
    recipe: RecipeArg,
    overrides: OverridesArg = None,
    estimate: EstimateOpt = False,
    device_gib: DeviceGibOpt = None,
) -> None:
    """Print the resolved, validated recipe and the derived run shape; start nothing.

    Exits with code 2 and lists every problem when the recipe is invalid. --estimate adds one
    step's peak device memory, estimated on the meta device (docs/memory.md).
    """
    loaded = load_or_exit(recipe, overrides)
    render.console.print(render.config_tree(loaded))
    render.console.print(render.run_shape_table(derive_run_shape(loaded)))
    render.print_warnings(loaded.warnings)
    if estimate:
        raise typer.Exit(print_estimate(loaded, device_gib))
