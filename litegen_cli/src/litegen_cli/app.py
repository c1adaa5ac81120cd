"""The `litegen` command. Commands only: each parses its options, then calls one shared
function (recipe loading, planning, launching) and turns errors into short messages.

torch is never imported at module load: `litegen --help` and `inspect-config` stay fast,
and `launch` imports the launcher (and with it torch) only when it runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from litegen_cli import render
from litegen_cli.plan import derive_plan
from litegen_cli.recipe import Recipe, RecipeError, load_recipe

EXIT_BAD_INPUT = 2
EXIT_RUN_FAILED = 1

app = typer.Typer(
    name="litegen",
    help="Launch and inspect LiteGen training recipes (YAML + an entry module) over torchrun.",
    no_args_is_help=True,
    # Errors are printed as panels by the commands; a crash must not dump locals.
    pretty_exceptions_show_locals=False,
    rich_markup_mode="markdown",
    epilog="Examples: litegen inspect-config recipes/digits_dit.yaml max_steps=10 | "
    "litegen launch recipes/digits_dit.yaml launch.nproc_per_node=2",
)

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


def _print_version(value: bool) -> None:
    if value:
        from litegen_cli.env_report import version_lines

        typer.echo("\n".join(version_lines()))
        raise typer.Exit()


@app.callback()
def options(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_print_version,
            is_eager=True,
            help="Print the litegen-core and litegen-cli versions and exit.",
        ),
    ] = False,
) -> None:
    """The options before the command (the app's help is the Typer's ``help``)."""


def load_or_exit(recipe_path: Path, overrides: list[str] | None) -> Recipe:
    """Load and plan-check a recipe; print every problem and exit 2 when it is unusable.

    Shared by every command that takes a recipe, so `launch` (and a future `resume`)
    validate exactly like `inspect-config`.
    """
    try:
        recipe = load_recipe(recipe_path, overrides or [])
        derive_plan(recipe)
    except RecipeError as err:
        render.print_recipe_error(err)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    return recipe


def run_launch(recipe: Recipe) -> None:
    """Run one node of the job; print a short summary and exit 1 when a rank fails.

    The single launch path: a `resume` command would load its recipe, set the resume
    fields and call this too.
    """
    from litegen_cli.launcher import LaunchFailed, launch  # imports torch lazily

    try:
        resolved = launch(recipe)
    except RecipeError as err:
        render.print_recipe_error(err)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    except LaunchFailed as err:
        lines = [f"rank {f.rank}: exit code {f.exitcode}: {f.message}" for f in err.failures]
        if err.failures:
            lines.append("The rank tracebacks are printed above, in the ranks' own output.")
        render.print_error("Training failed", [err.summary, *lines])
        raise typer.Exit(err.exit_code) from None
    except OSError as err:  # e.g. the results dir is not writable
        render.print_error("Cannot start the run", [f"{type(err).__name__}: {err}"])
        raise typer.Exit(EXIT_RUN_FAILED) from None
    render.console.print(f"[green]Done.[/] Resolved recipe: {resolved}")


@app.command()
def launch(recipe: RecipeArg, overrides: OverridesArg = None) -> None:
    """Validate RECIPE, then start its ranks on this node with torchrun.

    Run the same command on every node of a multi-node job (or through `srun` on SLURM,
    where nnodes, node_rank, rdzv_id and the rendezvous host come from the job).
    """
    run_launch(load_or_exit(recipe, overrides))


@app.command()
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
) -> None:
    """Continue a run from a checkpoint: its saved config, plus overrides, launched as before.

    The run goes on exactly where it stopped (same next batch, noise and losses); the fields
    the overrides change are printed first. See docs/resume.md.
    """
    from litegen_cli.resume import resume_recipe  # imports torch

    try:
        recipe, changes = resume_recipe(checkpoint, overrides or [])
        derive_plan(recipe)
    except RecipeError as err:
        render.print_recipe_error(err)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    render.console.print(f"Resuming from {recipe.config.trainer.resume_run}")
    for line in changes or ["(none)"]:
        render.console.print(f"  changed: {line}", highlight=False, markup=False)
    run_launch(recipe)


@app.command("inspect-config")
def inspect_config(recipe: RecipeArg, overrides: OverridesArg = None) -> None:
    """Print the resolved, validated recipe and the derived run plan; start nothing.

    Exits with code 2 and lists every problem when the recipe is invalid.
    """
    loaded = load_or_exit(recipe, overrides)
    render.console.print(render.config_tree(loaded))
    render.console.print(render.plan_table(derive_plan(loaded)))


@app.command("env")
def env() -> None:
    """Print the environment for a bug report, as Markdown to paste as it is.

    LiteGen's versions, Python, the OS, torch and how it was built (CUDA, cuDNN, NCCL), the
    GPUs and their driver, and the optional packages found.
    """
    from litegen_cli.env_report import environment_report  # imports torch

    typer.echo(environment_report())


cache_app = typer.Typer(
    help="Tensor caches (VAE latents, text embeddings) of a recipe.", no_args_is_help=True
)
app.add_typer(cache_app, name="cache")


@cache_app.command("build")
def cache_build(
    recipe: RecipeArg,
    overrides: OverridesArg = None,
    batch_size: Annotated[
        int, typer.Option("--batch-size", min=1, help="Samples per encode_fn call.")
    ] = 64,
) -> None:
    """Fill RECIPE's tensor cache ahead of training, in this one process.

    The entry module defines build_cache(config) returning (cache, dataset, encode_fn[, keys]);
    every sample the cache lacks is encoded, then hits, misses and bytes are printed.
    """
    from litegen_cli.cache_build import build_recipe_cache, report_table  # imports torch

    loaded = load_or_exit(recipe, overrides)
    try:
        report = build_recipe_cache(loaded, batch_size=batch_size)
    except ValueError as err:
        render.print_error("Cannot build the cache", [str(err)])
        raise typer.Exit(EXIT_BAD_INPUT) from None
    render.console.print(report_table(report))


def main() -> None:
    """Console-script entry point (`litegen`).

    >>> main()  # doctest: +SKIP  (same as running `litegen --help`)
    """
    app()


if __name__ == "__main__":
    main()
