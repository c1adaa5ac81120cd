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
from litegen_cli.entry_check import input_problems
from litegen_cli.estimate import DeviceGibOpt, EstimateOpt, print_estimate
from litegen_cli.failures import EXIT_BAD_INPUT, EXIT_FAILED, LaunchFailed
from litegen_cli.plan import derive_plan
from litegen_cli.recipe import Recipe, RecipeError, load_recipe

app = typer.Typer(
    name="litegen",
    help="Launch and inspect LiteGen training recipes (YAML + an entry module) over torchrun.",
    no_args_is_help=True,
    # `-h` as well as `--help`, on every command and sub-command (Click inherits it).
    context_settings={"help_option_names": ["-h", "--help"]},
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

    Shared by every command that takes a recipe, so `launch` and `cache build` validate
    exactly like `inspect-config` (`resume` builds its recipe from the checkpoint instead).
    """
    try:
        recipe = load_recipe(recipe_path, overrides or [])
        check_before_spawn(recipe)
    except RecipeError as err:
        render.print_recipe_error(err)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    return recipe


def check_before_spawn(recipe: Recipe) -> None:
    """The checks a loaded recipe passes before any rank starts: the run plan (job shape,
    strategy rules) and the entry's ``check_inputs(config)`` hook; RecipeError otherwise."""
    derive_plan(recipe)
    problems = input_problems(recipe.launch.entry, recipe.base_dir, recipe.config)
    if problems:
        raise RecipeError(problems)


def run_launch(
    recipe: Recipe,
    *,
    overwrite: bool = False,
    continuing: bool | None = None,
    move_newer_aside: bool = False,
) -> None:
    """Own the run folder, run this node's ranks, and turn every failure into one message.

    The single launch path of `launch` and `resume`. ``continuing``: the run goes on from a
    checkpoint in its folder, so an earlier run there is expected (None: when the config
    resumes, by resume_run or auto_resume). ``move_newer_aside``: see claim_run_folder.
    Exit codes: 2 bad input, 1 a failed run, 128+N stopped by signal N (failures.py).
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


@app.command()
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
    run_launch(load_or_exit(recipe, overrides), overwrite=overwrite)


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
    run_launch(recipe, continuing=branch is None, move_newer_aside=move_newer_aside)


@app.command("inspect-config")
def inspect_config(
    recipe: RecipeArg,
    overrides: OverridesArg = None,
    estimate: EstimateOpt = False,
    device_gib: DeviceGibOpt = None,
) -> None:
    """Print the resolved, validated recipe and the derived run plan; start nothing.

    Exits with code 2 and lists every problem when the recipe is invalid. --estimate adds one
    step's peak device memory, estimated on the meta device (docs/memory.md).
    """
    loaded = load_or_exit(recipe, overrides)
    render.console.print(render.config_tree(loaded))
    render.console.print(render.plan_table(derive_plan(loaded)))
    render.print_warnings(loaded.warnings)
    if estimate:
        raise typer.Exit(print_estimate(loaded, device_gib))


@app.command("env")
def env() -> None:
    """Print the environment for a bug report, as Markdown to paste as it is.

    LiteGen's versions, Python, the OS, torch and how it was built (CUDA, cuDNN, NCCL), the
    GPUs and their driver, and the optional packages found.
    """
    from litegen_cli.env_report import environment_report  # imports torch

    typer.echo(environment_report())


@app.command("export")
def export(
    checkpoint: Annotated[
        Path,
        typer.Option(
            "--from",
            help="A `step_<N>` run checkpoint of a fine-tuning run, or the checkpoint_dir "
            "holding them (its latest).",
            show_default=False,
        ),
    ],
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="The folder to write (must not exist). Default: <checkpoint_dir>/exports/step_<N>.",
            show_default=False,
        ),
    ] = None,
    ema: Annotated[
        bool | None,
        typer.Option(
            "--ema/--no-ema",
            help="Export the EMA weights, or the model's. Default: the run's trainer.export_ema "
            "when the checkpoint holds an EMA.",
            show_default=False,
        ),
    ] = None,
    pipeline: Annotated[
        Path | None,
        typer.Option(
            "--pipeline",
            help="The pipeline folder the run fine-tuned, if it moved. Default: the run's "
            "finetune.pipeline.",
            show_default=False,
        ),
    ] = None,
    original: Annotated[
        bool,
        typer.Option(
            "--original",
            help="Full fine-tuning: also write the transformer as one safetensors file in the "
            "original model's key layout, <exp_name>.original.safetensors (ComfyUI's "
            "diffusion_models, from_single_file). LoRA runs always write "
            "<exp_name>.original.lora.safetensors where the family's layout is known.",
        ),
    ] = False,
) -> None:
    """Export a fine-tuning run checkpoint as the end of the run does, in this one process.

    Full fine-tuning: a pipeline folder that `DiffusionPipeline.from_pretrained` loads, its
    frozen components linked to the source folder's. LoRA:
    `<exp_name>[.ema].lora.safetensors` (`pipe.load_lora_weights`), the peft folder
    `<exp_name>[.ema].peft` and `<exp_name>[.ema].original.lora.safetensors` (ComfyUI). See
    docs/finetune.md.
    """
    from litegen.export import export_checkpoint  # imports torch

    try:
        written = export_checkpoint(checkpoint, out, ema=ema, pipeline=pipeline, original=original)
    except (ValueError, FileNotFoundError) as err:
        render.print_error("Cannot export", [str(err)])
        raise typer.Exit(EXIT_BAD_INPUT) from None
    render.console.print(f"[green]Exported[/] {written}", highlight=False)


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


def main() -> None:
    """Console-script entry point (`litegen`).

    Example::

        main()  # same as running `litegen --help`
    """
    app()


if __name__ == "__main__":
    main()
