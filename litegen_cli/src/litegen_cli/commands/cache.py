"""`litegen cache build RECIPE [KEY=VALUE ...]`: the `cache` group and its `build` command;
cache_build.py fills the cache, in this process or on ranks."""

from __future__ import annotations

from typing import Annotated

import typer

from litegen_cli import render
from litegen_cli.arguments import OverridesArg, RecipeArg
from litegen_cli.failures import EXIT_BAD_INPUT, LaunchFailed
from litegen_cli.preflight import load_or_exit

cache = typer.Typer(
    help="Tensor caches (VAE latents, text embeddings) of a recipe.", no_args_is_help=True
)


@cache.command("build")
def build(
    recipe: RecipeArg,
    overrides: OverridesArg = None,
    batch_size: Annotated[
        int, typer.Option("--batch-size", min=1, help="Samples per encode_fn call.")
    ] = 64,
    nproc: Annotated[
        int | None,
        typer.Option(
            "--nproc",
            min=1,
            help="Ranks that share the encoding on this node, started as `launch` starts them "
            "(one GPU each under runtime.device cuda). Default: the recipe's "
            "launch.nproc_per_node; 1 encodes in this process.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Fill RECIPE's tensor cache ahead of training, its samples shared among the ranks.

    The entry module defines build_cache(config) returning (cache, dataset, encode_fn[, keys]);
    every sample the cache lacks is encoded, then hits, misses and bytes (all ranks) are printed.
    A build stopped midway keeps what it encoded: run it again to encode only the rest.
    """
    from litegen_cli.cache_build import (  # imports torch
        build_cache_on_ranks,
        build_recipe_cache,
        report_table,
    )

    loaded = load_or_exit(recipe, overrides)
    ranks = nproc or loaded.launch.nproc_per_node
    try:
        if ranks == 1:
            report = build_recipe_cache(loaded, batch_size=batch_size)
        else:
            report = build_cache_on_ranks(loaded, ranks, batch_size=batch_size)
    except ValueError as err:
        render.print_error("Cannot build the cache", [str(err)])
        raise typer.Exit(EXIT_BAD_INPUT) from None
    except LaunchFailed as err:
        again = "Run the same command again: what was cached is kept, the rest is encoded."
        render.report_failure(err, again, title="Cache build failed")
        raise typer.Exit(err.exit_code) from None
    render.console.print(report_table(report))
